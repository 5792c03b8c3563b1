"""The conformance cases of each op, for what an implementation claims.

Axes (decode): layouts x block sizes 1..256 x head_dim 64/80/128 x (kv heads, GQA group) x every format the
implementation claims x block-stride padding (none, 3 elements: misaligned, 64) x lengths (a ragged batch with an
empty and a one-token sequence; whole blocks, no tail; a single token). Three levels:

- ``smoke``: every pair of values of a reduced set of axes (about a dozen cases: a notebook's run on a CPU);
- ``pairwise``: every pair of values of all axes meets in some case (:func:`workbench.conformance.pairwise.pairwise`),
  about 60-80 cases: the default, minutes under the Triton interpreter;
- ``full``: ``pairwise`` plus every layout x block size x head dim x format (the other axes rotating), several
  hundred cases: for a GPU.

A case the implementation does not claim is never built: :func:`cases_for` draws the level's cases from the values it
claims (pairs among them all covered), and :func:`unsupported_cases` lists the level's cases of an implementation that
claims everything which this one does not, with the reason (the report's "unsupported by the adapter"). Seeds are the
case's position, so a level always yields the same cases.
"""

from __future__ import annotations

import dataclasses
import functools
from itertools import product

from workbench.conformance import suite_formats
from workbench.conformance.implementations import Impl
from workbench.conformance.pairwise import pairwise
from workbench.conformance.problems import Case, row_alignment

LEVELS = ("smoke", "pairwise", "full")

BLOCK_SIZES = (1, 8, 16, 24, 32, 64, 128, 256)
HEAD_DIMS = (64, 80, 128)
HEADS = ((2, 1), (2, 4), (1, 8), (3, 2))  # (kv heads, q heads per kv head): MHA, GQA, MQA, GQA on 3 heads
PADS = (0, 3, 64)


def decode_lens(pattern: str, block_size: int, shared: int = 0) -> tuple[int, ...]:
    """Context lengths of a pattern: ``ragged`` (an empty and a one-token sequence among them), ``whole`` (whole
    blocks, no tail), ``one`` (a single one-token sequence); with ``shared`` blocks in front of every sequence."""
    base = shared * block_size
    if pattern == "ragged":
        return (base + 37, base, base + 1, base + 150) if shared else (37, 0, 1, 150)
    if pattern == "whole":
        return (base + 2 * block_size, base + block_size, base) if shared else (2 * block_size, block_size)
    if pattern == "one":
        return (base + 1,) * (3 if shared else 1)
    raise ValueError(f"lens pattern must be ragged, whole or one, got {pattern!r}")


def _claimed(values, claimed) -> list:
    return [v for v in values if claimed is None or v in claimed]


def _decode_axes(impl: Impl, level: str) -> dict:
    fmts = [f for f in suite_formats.SUITE_FORMATS if f in impl.formats]
    axes = {"layout": list(impl.layouts), "block_size": _claimed(BLOCK_SIZES, impl.block_sizes),
            "head_dim": _claimed(HEAD_DIMS, impl.head_dims),
            "heads": [h for h in HEADS if impl.groups is None or h[1] in impl.groups], "kv_format": fmts,
            "pad": list(PADS), "lens": ["ragged", "whole", "one"]}
    if level == "smoke":
        axes.update(block_size=[b for b in axes["block_size"] if b in (1, 16, 24, 128)] or axes["block_size"][:2],
                    head_dim=[d for d in axes["head_dim"] if d in (64, 80)] or axes["head_dim"][:1],
                    heads=[h for h in ((2, 4), (1, 1)) if impl.groups is None or h[1] in impl.groups]
                    or axes["heads"][:1], pad=[0, 3], lens=["ragged", "whole"])
    if impl.op == "shared_prefix":
        axes["lens"] = ["ragged", "whole"]
        axes["shared"] = [1, 3]
        axes["block_size"] = [b for b in axes["block_size"] if b <= 64] or axes["block_size"]
    return axes


def _decode_case(impl: Impl, c: dict, seed: int) -> Case:
    hkv, group = c["heads"]
    shared = c.get("shared", 0)
    return Case(impl.op, c["layout"], c["block_size"], c["head_dim"], hkv, group, c["kv_format"],
                decode_lens(c["lens"], c["block_size"], shared), c["pad"], seed, shared=shared)


def _write_axes(impl: Impl, level: str) -> dict:
    fmts = [f for f in suite_formats.WRITE_FORMATS if f in impl.formats]
    axes = {"layout": list(impl.layouts), "block_size": _claimed((1, 8, 16, 24, 64, 256), impl.block_sizes),
            "head_dim": _claimed(HEAD_DIMS, impl.head_dims), "num_kv_heads": [1, 2, 3], "kv_format": fmts,
            "pad": list(PADS), "tokens": [0, 1, 37]}
    if level == "smoke":
        axes.update(block_size=axes["block_size"][:3], head_dim=axes["head_dim"][:2], pad=[0, 3], tokens=[1, 37])
    return axes


def _copy_axes(level: str) -> dict:
    # every cast and the static formats of one code each (fp8, int8): a copy moves bytes, not values
    axes = {"kv_format": [f for f in suite_formats.WRITE_FORMATS if f != "fp8_e5m2/head"], "layers": [1, 3],
            "block": [(1, 1, 64), (16, 2, 80), (64, 1, 128)], "pad": [0, 3], "pairs": [0, 1, 5]}
    if level == "smoke":
        axes.update(kv_format=["fp16", "fp8_e4m3/head"], pairs=[1, 5])
    return axes


def _allowed(case: dict) -> bool:
    # scales kept in the blocks must stay aligned: their pools are padded by whole 16 bytes only
    return not (case.get("kv_format") in suite_formats.IN_BLOCKS and case.get("pad", 0) % 16)


def _aligned(impl: Impl, axes: dict):
    """The predicate of the cases whose rows meet ``impl.row_align``, on a partial case too: it passes when some
    claimed value of each missing axis completes it aligned (so the covering never starts a case it cannot finish)."""
    if impl.row_align <= 1 or impl.op == "copy":
        return _allowed
    keys = ("layout", "block_size", "head_dim", "heads" if "heads" in axes else "num_kv_heads", "kv_format", "pad")
    memo: dict = {}

    def ok(c: dict) -> bool:
        if not _allowed(c):
            return False
        known = tuple(c.get(k) for k in keys)
        if known not in memo:
            memo[known] = any(
                _allowed({"kv_format": f, "pad": p})
                and _row_align(impl.op, lay, bs, d, h[0] if isinstance(h, tuple) else h, f, p) >= impl.row_align
                for lay, bs, d, h, f, p in product(*([c[k]] if k in c else axes[k] for k in keys)))
        return memo[known]
    return ok


@functools.lru_cache(maxsize=8192)
def _row_align(op, layout, block_size, head_dim, num_kv_heads, kv_format, pad) -> int:
    return row_alignment(Case(op, layout, block_size, head_dim, num_kv_heads, 1, kv_format, (1,), pad))


def cases_for(impl: Impl, level: str = "pairwise") -> list[Case]:
    """The cases of ``impl``'s op that it claims, at ``level`` (see the module docstring)."""
    if level not in LEVELS:
        raise ValueError(f"level must be one of {LEVELS}, got {level!r}")
    if impl.op == "copy":
        rows = pairwise(_copy_axes(level))
        return [Case("copy", "nhd", bs, d, h, 1, c["kv_format"], (), c["pad"], i + 1, layers=c["layers"],
                     pairs=c["pairs"]) for i, c in enumerate(rows) for bs, h, d in [c["block"]]]
    axes = _write_axes(impl, level) if impl.op == "write" else _decode_axes(impl, level)
    if any(not v for v in axes.values()):
        empty = [k for k, v in axes.items() if not v]
        raise ValueError(f"implementation {impl.name!r} claims nothing the suite tests along {empty}: {impl.claims()}")
    allowed = _aligned(impl, axes)
    try:
        rows = pairwise(axes, allowed)
    except ValueError as e:
        raise ValueError(f"implementation {impl.name!r}: its claims leave a case no value completes ({e}): "
                         f"{impl.claims()}") from None
    if level == "full":
        seen = {(r["layout"], r["block_size"], r["head_dim"], r["kv_format"]) for r in rows}
        rest = {k: v for k, v in axes.items() if k not in ("layout", "block_size", "head_dim", "kv_format")}
        for n, key in enumerate(product(axes["layout"], axes["block_size"], axes["head_dim"], axes["kv_format"])):
            row = {**dict(zip(("layout", "block_size", "head_dim", "kv_format"), key, strict=True)),
                   **{k: v[n % len(v)] for k, v in rest.items()}}
            if key not in seen:
                fits = [r for r in (row, {**row, "pad": 0}) if allowed(r)]
                rows += fits[:1]
    if impl.op == "write":
        return [Case("write", c["layout"], c["block_size"], c["head_dim"], c["num_kv_heads"], 1, c["kv_format"],
                     (c["tokens"],), c["pad"], i + 1) for i, c in enumerate(rows)]
    return [_decode_case(impl, c, i + 1) for i, c in enumerate(rows)]


def unsupported_cases(impl: Impl, level: str = "pairwise") -> list[tuple[Case, str]]:
    """The cases of ``level`` that an implementation of ``impl``'s op claiming everything would run and ``impl``
    does not claim, each with the reason (:meth:`Impl.unsupported`): what the report lists as unsupported by the
    adapter, counted apart from its failures."""
    if impl.op == "copy":
        return []
    every = dataclasses.replace(impl, layouts=("nhd", "hnd", "vllm"), block_sizes=None, head_dims=None, groups=None,
                                row_align=1, formats=tuple(suite_formats.WRITE_FORMATS if impl.op == "write"
                                                           else suite_formats.SUITE_FORMATS))
    return [(c, why) for c in cases_for(every, level) if (why := impl.unsupported(c))]
