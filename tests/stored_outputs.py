"""A notebook's checked outputs against its stored ones, as ``pytest --nbval-lax`` compares them, for a notebook that
ran elsewhere: the browser test's Run All in JupyterLab (``tests/browser``). `make test` so runs every notebook once,
not once under nbval and again in the browser (each run was ~100 s of a 2-core machine).

nbval's rules, with its own functions: a code cell is checked when a comment line says ``# NBVAL_CHECK_OUTPUT`` or its
tags hold ``nbval-check-output`` (and ``nbval-ignore-output`` or ``# NBVAL_IGNORE_OUTPUT`` does not take it back); a
checked cell that ran when stored must show the stored outputs: streams merged by name (``coalesce_streams``), then
every output key and mime type but those nbval skips (metadata, execution counts, widget views, images), in order per
key, each string sanitized on both sides with ``notebooks/sanitize.cfg``'s patterns. A stored cell that never ran must
hold no outputs. Cells that are not checked only have to run (the browser test: without an error or a warning).
``pytest --nbval-lax ... notebooks/NN_*.ipynb`` (docs/notebooks.md) still checks one notebook on its own.
"""

from __future__ import annotations

import copy
import re
from collections import defaultdict
from pathlib import Path

from nbval.plugin import (
    coalesce_streams,
    find_comment_markers,
    find_metadata_tags,
    get_sanitize_patterns,
    transform_streams_for_comparison,
)

SANITIZE = get_sanitize_patterns((Path(__file__).resolve().parents[1] / "notebooks" / "sanitize.cfg").read_text())
# nbval's skip_compare without nbdime
SKIP = ("metadata", "traceback", "prompt_number", "output_type", "name", "execution_count",
        "application/vnd.jupyter.widget-view+json", "image/png", "image/jpeg")
UNSUPPORTED = ("skip", "check_exception")  # NBVAL_SKIP (nbval never runs it), NBVAL_RAISES_EXCEPTION: Run All runs it


def options(cell) -> dict:
    """nbval's options of a code cell under ``--nbval-lax``: its tags, then its comment markers."""
    opts = dict(find_metadata_tags(cell.metadata))
    opts.update(find_comment_markers(cell.source))
    return opts


def sanitize(value):
    if not isinstance(value, str):
        return value
    for regex, replace in SANITIZE:
        value = re.sub(regex, replace, value)
    return value


def _by_key(outputs) -> dict[str, list]:
    """nbval's form for comparing: every kept key of every output (a data dict's mime types flattened in), its values
    in output order."""
    out = defaultdict(list)
    for o in transform_streams_for_comparison(coalesce_streams(copy.deepcopy(list(outputs)))):
        for key, value in o.items():
            if key == "data":
                for mime, v in value.items():
                    if mime not in SKIP:
                        out[mime].append(sanitize(v))
            elif key not in SKIP:
                out[key].append(sanitize(value))
    return out


def differences(stored, ran) -> list[str]:
    """What nbval would fail on: ``stored`` and ``ran`` are nbformat v4 notebooks of the same cells (``ran``: the
    outputs of a run). Empty when every checked cell shows its stored outputs."""
    code = [c for c in stored.cells if c.cell_type == "code"]
    done = [c for c in ran.cells if c.cell_type == "code"]
    if [c.source for c in code] != [c.source for c in done]:
        raise ValueError("ran must be a run of the stored notebook: their code cells differ")
    found = []
    for i, (cell, got) in enumerate(zip(code, done, strict=True)):
        opts = options(cell)
        bad = [o for o in UNSUPPORTED if opts.get(o)]
        if bad:
            raise ValueError(f"code cell {i}: nbval's {bad} markers are not checked after a Run All")
        if cell.execution_count is None:
            if cell.outputs:
                found.append(f"code cell {i}: unrun reference cell has outputs")
            continue
        if not opts.get("check"):
            continue
        want, have = _by_key(cell.outputs), _by_key(got.outputs)
        if set(want) != set(have):
            found.append(f"code cell {i}: output fields {sorted(have)}, stored {sorted(want)}")
            continue
        for key, values in want.items():
            if len(values) != len(have[key]):
                found.append(f"code cell {i}: {len(have[key])} outputs of {key!r}, stored {len(values)}")
            for a, b in zip(values, have[key], strict=False):
                if a != b:
                    lines = [f"    stored: {x}\n    ran:    {y}" for x, y in
                             zip(str(a).splitlines(), str(b).splitlines(), strict=False) if x != y]
                    shown = "\n".join(lines[:5] or [f"    {a!r}\n    {b!r}"])
                    found.append(f"code cell {i} ({key}) differs:\n{shown}")
                    break
    return found
