"""A checked notebook output shows only digits that are the same on every CPU (docs/notebooks.md).

Another CPU sums in another order, so every float the notebooks compute here can move by a few units in the last
place; what a checked output shows must not. This file runs the cells behind the checked outputs of the notebooks
that compute on tensors (their own sources, in order, in this process) with every float tensor they start from
jittered by 2**-22 relative (about two fp32 ulps, a random sign per element; 1e-9 for float64): each random draw
(``torch.randn``) and each loaded capture (``workbench.model.capture.load``). Every checked output must still equal
the stored one, both sanitized as nbval sanitizes them (notebooks/sanitize.cfg). On the machine that stored the
outputs this checks the jitter; on any other it also checks the machine.

A figure that moves has digits that are noise: round it where it is produced (``workbench.publish.notebook.sig``) or
show the bound it meets (``workbench.publish.notebook.Bound``). Notebook 06 (the real model: token ids and block counts,
slow) and the notebooks that compute only with Python numbers or read committed results are not run here.
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import io
import linecache
import re
from pathlib import Path

import nbformat
import pytest
import torch
from nbval.plugin import get_sanitize_patterns

import workbench
from workbench.model import capture
from workbench.publish import notebook

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = ROOT / "notebooks"
SANITIZE = get_sanitize_patterns((NOTEBOOKS / "sanitize.cfg").read_text())
REL = 2.0**-22  # about two fp32 ulps: more than two CPUs' sums differ by
SEED = 0

# The cells each notebook runs, in notebook order, named by a line of their source (robust to cells moving).
RUNS = {
    "03_dtypes_and_quantization": ["import numpy as np", "LAYERS, TOKENS =", "error_study.bytes_table(",
                                   "synthetic.synthetic_kv(", "error_study.evaluate_all(",
                                   "error_study.kivi_comparison(",
                                   "h200_decode_run()", "quant_speed.speed_rows(", 'conclusions("03'],
    "05_prefetch_and_tiers": ["from workbench.tiers import", "PROMPT, STEPS =", "access.pattern_traces(",
                              "pc.swap_recompute_curves(", "tier_studies.formats_table(", 'conclusions("05'],
    "07_compression": ["from workbench.compress import", "BUDGETS =", "CAPS = capture.load()",
                       "study.score_settings(", "evict.pool_study(", "real_recall_rows(", "measured.model_rows(",
                       "measured.ratio_summary(", 'conclusions("07'],
    "08_shared_prefix": ["from workbench.shared_prefix import", "PREFIX, SHARERS, SUFFIX =", "RUNS = measured.runs()",
                         "random_batch(TABLES", 'conclusions("08'],
    "09_write_your_own_kernel": ["from workbench import conformance", "LEVEL =", "def my_decode(",
                                 'conformance.register("decode", "mine"', 'conformance.check("mine"',
                                 "print(report.summary())"],
}
pytestmark = [pytest.mark.kernels,  # 08 and 09 launch kernels; on a GPU they are skipped, as nbval's notebooks are
              pytest.mark.skipif(not workbench.is_interpreted(),
                                 reason="the stored outputs are the CPU's (SMOKE sizes, the Triton interpreter)")]


def jitter(t, gen: torch.Generator):
    """``t * (1 +- REL)``, a random sign per element, cast back to ``t``'s dtype (other values as they are)."""
    if not (isinstance(t, torch.Tensor) and t.is_floating_point()):
        return t
    rel = 1e-9 if t.dtype == torch.float64 else REL
    sign = torch.randint(0, 2, t.shape, generator=gen).to(torch.float64).mul_(2).sub_(1)
    return (t.detach().cpu().double() * (1 + rel * sign)).to(t.dtype).to(t.device)


def sanitize(text: str) -> str:
    for regex, replace in SANITIZE:
        text = re.sub(regex, replace, text)
    return text


def checked(cell) -> bool:
    return "NBVAL_CHECK_OUTPUT" in cell.source or "nbval-check-output" in cell.metadata.get("tags", [])


def stored(cell) -> dict:
    """What nbval compares of a stored cell: its stdout, and each mime type of what it displayed."""
    out = {"stdout": "".join(o.text for o in cell.outputs if o.output_type == "stream" and o.name == "stdout")}
    for o in cell.outputs:
        for mime, value in o.get("data", {}).items():
            if not mime.startswith(("image/", "application/vnd.jupyter.widget")):
                out[mime] = value
    return out


def run_cell(source: str, name: str, ns: dict) -> dict:
    """Execute ``source`` in ``ns`` as a notebook cell: its stdout, and its last expression's mime bundle."""
    linecache.cache[name] = (len(source), None, source.splitlines(True), name)  # triton.jit reads its source
    tree = ast.parse(source)
    last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
    buf, out = io.StringIO(), {}
    with contextlib.redirect_stdout(buf):
        exec(compile(tree, name, "exec"), ns)
        value = eval(compile(ast.Expression(last.value), name, "eval"), ns) if last else None
    out["stdout"] = buf.getvalue()
    if value is not None:
        out.update(value._repr_mimebundle_() if hasattr(value, "_repr_mimebundle_") else {"text/plain": repr(value)})
    return out


def cells_to_run(stem: str) -> list:
    book = nbformat.read(NOTEBOOKS / f"{stem}.ipynb", as_version=4)
    code = [c for c in book.cells if c.cell_type == "code"]
    picked = []
    for needle in RUNS[stem]:
        hits = [i for i, c in enumerate(code) if needle in c.source]
        assert len(hits) == 1, f"{stem}: {len(hits)} code cells contain {needle!r}, expected one (update RUNS)"
        picked.append((hits[0], needle))
    return [(needle, i, code[i]) for i, needle in sorted(picked)]


@pytest.fixture(scope="module")
def jittered_runs():
    """Each notebook of :data:`RUNS` run once, jittered: ``{stem: (namespace, {needle: (code cell index, cell,
    outputs)})}``."""
    mp = pytest.MonkeyPatch()
    gen = torch.Generator().manual_seed(SEED)
    randn, load = torch.randn, capture.load

    def randn_jittered(*args, **kwargs):
        return jitter(randn(*args, **kwargs), gen)

    def load_jittered(*args, **kwargs):
        return [dataclasses.replace(c, **{f.name: jitter(getattr(c, f.name), gen) for f in dataclasses.fields(c)})
                for c in load(*args, **kwargs)]

    threads = torch.get_num_threads()
    mp.setattr(torch, "randn", randn_jittered)
    mp.setattr(capture, "load", load_jittered)
    mp.setattr(notebook, "SMOKE", True)  # the stored outputs' sizes
    mp.chdir(NOTEBOOKS)  # where nbval's kernel runs
    results = {}
    try:
        for stem in RUNS:
            ns = {"__name__": "__main__"}
            results[stem] = (ns, {needle: (i, cell, run_cell(cell.source, f"<{stem} cell {i}>", ns))
                                  for needle, i, cell in cells_to_run(stem)})
    finally:
        mp.undo()
        torch.set_num_threads(threads)  # 03 and 07 set one thread
        from workbench import conformance

        if "mine" in conformance.names("decode"):
            conformance.unregister("decode", "mine")  # 09 registers its kernel
    return results


CASES = [pytest.param(stem, needle, id=f"{stem[:2]}-{re.sub(r'[^a-z0-9]+', '_', needle.lower()).strip('_')[:28]}")
         for stem in RUNS for needle, _, cell in cells_to_run(stem) if checked(cell)]


@pytest.mark.parametrize("stem, needle", CASES)
def test_checked_output_survives_float_noise(jittered_runs, stem, needle):
    i, cell, got = jittered_runs[stem][1][needle]
    want = stored(cell)
    assert set(got) >= set(want), f"{stem} cell {i}: shows {sorted(got)}, stored {sorted(want)}"
    for mime, value in want.items():
        a, b = (sanitize(v) if isinstance(v, str) else v for v in (value, got[mime]))
        if a != b:
            diff = [f"  stored: {x}\n  jitter: {y}" for x, y in zip(str(a).splitlines(), str(b).splitlines(),
                                                                      strict=False) if x != y]
            pytest.fail(f"{stem} cell {i} ({mime}) moved under 2**-22 relative noise: a figure shows digits that "
                        "are float noise (docs/notebooks.md)\n" + "\n".join(diff[:10] or [f"  {a!r}\n  {b!r}"]))


def test_09_worst_fp16_error_is_its_bound(jittered_runs):
    """Notebook 09's conclusions quote the check's worst fp16 error as its bound; their cell also needs the broken
    kernels' checks (a minute on a CPU), so the number is recomputed from the jittered report here."""
    ns = jittered_runs["09_write_your_own_kernel"][0]
    worst = ns["report"].worst_by("kv_format")["fp16"][0]
    book = nbformat.read(NOTEBOOKS / "09_write_your_own_kernel.ipynb", as_version=4)
    cell = next(c for c in book.cells if c.cell_type == "code" and 'conclusions("09' in c.source)
    assert 'Bound(report.worst_by("kv_format")["fp16"][0])' in cell.source
    assert stored(cell)[notebook.KEY_NUMBERS_MIME]["numbers"]["mine: worst fp16 error"] == str(notebook.Bound(worst))
