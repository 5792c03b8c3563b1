"""The why of a what-if step, as rows: each part's milliseconds and share, what it rests on (measured, fitted,
assumed) and the result files it came from, read off the part's source words (``workbench.whatif.step_time.Part``)."""

from __future__ import annotations

import re

_FILE = re.compile(r"[\w.-]+\.json")


def files_of(source: str) -> list[str]:
    """The result files a source names (``quant-decode-h200-....json``), in order, once each."""
    return list(dict.fromkeys(_FILE.findall(source)))


def kind_of(source: str) -> str:
    """``measured``, ``fitted``, ``assumed`` or a mix (``measured + assumed``) of what a source says it rests on: a
    result file outside a ``fitted: ...`` clause is measured."""
    clauses = re.split(r"[;(]", source)
    kinds = [k for k, hit in (("measured", any(_FILE.search(c) and "fitted" not in c and "assumed" not in c
                                               for c in clauses)),
                              ("fitted", "fitted" in source), ("assumed", "assumed" in source)) if hit]
    return " + ".join(kinds) or "given"


def why_table(out: dict, step: str = "decode") -> list[dict]:
    """One row a part of ``out["why"][step]`` (``decode`` or ``prefill``): ``part``, ``ms``, ``share`` of the step,
    ``kind`` (:func:`kind_of`), ``files`` (the result files it came from, joined) and ``source`` (the words)."""
    if step not in ("decode", "prefill"):
        raise ValueError(f"step must be 'decode' or 'prefill', got {step!r}")
    parts = out["why"][step]
    total = sum(p["seconds"] for p in parts)
    return [{"part": p["name"], "ms": p["seconds"] * 1e3, "share": p["seconds"] / total if total else 0.0,
             "kind": kind_of(p["source"]), "files": ", ".join(files_of(p["source"])) or "-", "source": p["source"]}
            for p in parts]


def bench_of(source: str) -> str:
    """A source with each result file named by its benchmark: ``quant-decode-h200-2026...json`` -> ``quant-decode``."""
    return _FILE.sub(lambda m: re.sub(r"-[^-]+-\d{8}T\d+\.json$", "", m.group()), source)
