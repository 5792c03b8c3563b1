"""Covering designs for parametrized tests: every pair of values meets in some case, not every combination.

Under the Triton interpreter a kernel test's time is its cases times their programs, and a full cartesian product of
layouts x block sizes x dtypes x ... mostly repeats pairs it has already checked. Two helpers, both deterministic (no
random choice: the same cases in the same order on every run, so a failure names the same test id):

- :func:`pairwise` builds cases from axes (name -> values): every value of every axis appears, and every pair of
  values of two axes appears together in at least one case (greedy, AETG-style: each new case takes the values that
  meet the most pairs not met yet; ties go to the earlier value).
- :func:`cover` picks from hand-made candidate cases (a list of dicts, e.g. a product of a layout with configurations
  chosen for their edge cases) the fewest it needs so that every pair of values present among the candidates is still
  met, and every value of the ``each`` keys (e.g. a configuration's name) keeps at least one case.

Values are told apart by ``repr`` (torch dtypes, enums and dicts work as values).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from itertools import combinations


def _pairs_of(row: Mapping, keys: Sequence[str]) -> set[tuple]:
    return {(a, repr(row[a]), b, repr(row[b])) for a, b in combinations(keys, 2)}


def pairwise(axes: Mapping[str, Sequence], allowed: Callable[[dict], bool] | None = None) -> list[dict]:
    """Cases (dicts with every axis) in which each pair of values of two axes meets at least once.

    Args:
        axes: name -> the values of that axis (at least one each), in the order ties are broken.
        allowed: a predicate on a (partial or whole) case; a pair no allowed case can hold is not required.

    Returns:
        The cases, in the order they were built.
    """
    names = list(axes)
    values = {n: list(v) for n, v in axes.items()}
    if any(not v for v in values.values()):
        raise ValueError("every axis needs at least one value")
    ok = allowed or (lambda _case: True)
    index = {n: k for k, n in enumerate(names)}
    singles = [(a, i) for a in names for i in range(len(values[a])) if ok({a: values[a][i]})]
    pairs = [(a, i, b, j) for a, b in combinations(names, 2) for i in range(len(values[a]))
             for j in range(len(values[b])) if ok({a: values[a][i], b: values[b][j]})]
    uncovered = set(singles) | set(pairs)
    cases: list[dict] = []
    while uncovered:
        seed = next((p for p in pairs if p in uncovered), None) or next(s for s in singles if s in uncovered)
        chosen: dict[str, int] = dict(zip(seed[::2], seed[1::2], strict=True))
        for n in names:
            if n in chosen:
                continue
            best, best_gain = None, -1
            for i in range(len(values[n])):
                if not ok({**{k: values[k][v] for k, v in chosen.items()}, n: values[n][i]}):
                    continue
                met = [(m, chosen[m], n, i) if index[m] < index[n] else (n, i, m, chosen[m]) for m in chosen]
                gain = ((n, i) in uncovered) + sum(p in uncovered for p in met)
                if gain > best_gain:
                    best, best_gain = i, gain
            if best is None:
                raise ValueError(f"no allowed value of {n!r} completes the case {chosen}")
            chosen[n] = best
        uncovered -= {(a, chosen[a]) for a in names} | {(a, chosen[a], b, chosen[b]) for a, b in combinations(names, 2)}
        cases.append({n: values[n][chosen[n]] for n in names})
    return cases


def cover(candidates: Iterable[Mapping], keys: Sequence[str] | None = None, each: Sequence[str] = ()) -> list[dict]:
    """The fewest candidates (greedy set cover, in their first-seen order) that still meet every pair of values of
    ``keys`` that some candidate holds, and every value of each ``each`` key.

    Args:
        candidates: cases as dicts (a key missing from a case counts as the value None).
        keys: the axes whose pairs must meet (default: every key of the candidates except those in ``each``).
        each: keys each of whose values keeps at least one case (a configuration's name or index).

    Returns:
        The chosen candidates, in the order they appear among ``candidates``.
    """
    rows = [dict(c) for c in candidates]
    if keys is None:
        keys = list(dict.fromkeys(k for r in rows for k in r if k not in each))
    full = [{k: r.get(k) for k in (*keys, *each)} for r in rows]
    need = [_pairs_of(r, keys) | {(k, repr(r[k])) for k in each} for r in full]
    uncovered = set().union(*need) if need else set()
    chosen: list[int] = []
    while uncovered:
        gains = [len(n & uncovered) if i not in chosen else -1 for i, n in enumerate(need)]
        best = max(range(len(rows)), key=lambda i: (gains[i], -i))
        chosen.append(best)
        uncovered -= need[best]
    for i in reversed(list(chosen)):  # then drop any case the others already cover (the last chosen first)
        rest = set().union(*(need[j] for j in chosen if j != i))
        if need[i] <= rest:
            chosen.remove(i)
    return [rows[i] for i in sorted(chosen)]
