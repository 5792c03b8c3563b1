"""The model runner's decode paths in the committed ``python -m workbench bench model_decode`` runs
(``data/results/model-decode-*.json``): its ``cascade`` rows (greedy samples forked from one prompt, decoded through
``PagedKV(shared_prefix=...)`` off / auto / shared) and its ``quest`` rows (one long prompt at a few batch sizes, the
full cache against ``QuestKV`` at a few page budgets), one configuration a row, as the tables notebooks 08 and 07
print. ``workbench/bench/model_decode_paths.py`` documents the rows.

These rows time the runner, not the kernels: it launches every layer eagerly from Python, so at SmolLM2-135M's size a
step is bound by the host, and a path that adds launches to save GPU time can lose here while it wins in the
kernel benchmarks (``bench shared_prefix``, ``bench quest``). The tables keep that visible: each row's tokens/s
against the plain path's beside one layer's attention time alone and its share of the step.

Pure functions of a loaded run (``{"path", "info", "rows"}`` from :func:`workbench.results.run_files.load_runs`): no
plotly, no widgets; ``workbench.figures.model.decode_paths`` draws them.
"""

from __future__ import annotations

import math
import textwrap
from collections.abc import Mapping
from pathlib import Path

from workbench.results import run_files

PATTERN = "model-decode-*.json"
SECTIONS = ("cascade", "quest")  # the sections of ``bench model_decode`` this module reads
#: what each ``shared_prefix`` mode of the cascade rows does (the first is the reference)
MODES = {"off": "plain paged decode", "auto": "the selector's pick", "shared": "the cascade on shared blocks"}
#: which files count: every run but ``--smoke`` ones (tiny shapes on a CPU, ``"mode": "smoke"``)
WHERE = {"mode": lambda mode: mode != "smoke"}
LINE_CHARS = 105  # a printed line that fits a notebook's output area at 1280 px


def _section(section: str) -> str:
    if section not in SECTIONS:
        raise ValueError(f"section must be one of {list(SECTIONS)}, got {section!r}")
    return section


def runs(section: str, results_dir: Path | str | None = None, where: Mapping | None = None) -> list[dict]:
    """The committed runs (default folder ``data/results``, ``--smoke`` runs left out unless ``where`` says
    otherwise) that hold rows of ``section``, oldest first. A run of other sections only (``--sections decode``)
    is not one of them."""
    _section(section)
    found = run_files.load_runs(PATTERN, results_dir, WHERE if where is None else where)
    return [r for r in found if any(row.get("section") == section for row in r["rows"])]


def latest(section: str, results_dir: Path | str | None = None, where: Mapping | None = None) -> dict:
    """The newest of :func:`runs`; ``ValueError`` naming ``section`` when it is not one of :data:`SECTIONS` or no
    run holds its rows."""
    found = runs(section, results_dir, where)
    if not found:
        folder = run_files.RESULTS if results_dir is None else results_dir
        raise ValueError(f"section {section!r}: no bench model_decode run in {folder} has its rows; run `python -m "
                         f"workbench bench model_decode --sections {section} --out data/results` on a GPU")
    return found[-1]


run_name = run_files.run_name  # the run's file name: what the notebook quotes


def section_rows(run: Mapping, section: str) -> list[dict]:
    """The run's rows of ``section``, in file order."""
    _section(section)
    return [r for r in run["rows"] if r.get("section") == section]


def label(row: Mapping) -> str:
    """A row's configuration in a few words: the cascade's mode (``off``, ``auto``, ``shared``), or ``full`` /
    ``quest 64`` (Quest's page budget) after the batch size (``batch 4, quest 64``)."""
    if row.get("section") == "cascade":
        return row["shared_prefix"]
    kv = "full" if row["kv"] == "full" else f"quest {row['page_budget']}"
    return f"batch {row['batch']}, {kv}"


def speedup(row: Mapping) -> float:
    """Tokens/s against the reference of the row's section (plain paged decode; the full cache at the same batch)."""
    return row["speedup_vs_plain"] if row.get("section") == "cascade" else row["speedup_vs_full"]


def speedups(run: Mapping, section: str) -> dict[str, float]:
    """``{label: speedup}`` for every configuration of ``section`` (:func:`label`, :func:`speedup`)."""
    return {label(r): speedup(r) for r in section_rows(run, section)}


def sig3(value: float) -> str:
    """``value`` to 3 significant figures, in plain digits (``263``, ``23.4``, ``1230``: never ``1.23e+03``)."""
    x = float(f"{value:.3g}")
    if x == 0 or not math.isfinite(x):
        return f"{x:g}"
    return f"{x:.{max(2 - math.floor(math.log10(abs(x))), 0)}f}"


def paths_text(paths: Mapping[str, int]) -> str:
    """How the (step, layer) attends of a row went, compactly: ``plain 7650`` or ``plain 7000, shared 650``."""
    return ", ".join(f"{name} {count}" for name, count in paths.items())


def _table(head: list[str], cells: list[list[str]], left: int, text: tuple[int, ...] = ()) -> list[str]:
    """Columns two spaces apart, right-aligned but the first ``left`` ones and the columns ``text``."""
    widths = [max(len(h), *(len(c[i]) for c in cells)) for i, h in enumerate(head)]

    def line(values):
        return "  ".join(v.ljust(w) if i < left or i in text else v.rjust(w)
                         for i, (v, w) in enumerate(zip(values, widths, strict=True))).rstrip()

    return [line(head), *(line(c) for c in cells)]


def _wrapped(text: str) -> list[str]:
    return textwrap.wrap(text, LINE_CHARS, break_long_words=False, break_on_hyphens=False)


def format_rows(run: Mapping, section: str) -> str:
    """The section's configurations as a table for a notebook's checked output, every line under
    :data:`LINE_CHARS` characters: a first line naming the file and the GPU, one describing the workload, a row a
    configuration (tokens/s to 3 significant figures, the step in ms to 0.1, speedup and agreement to 0.01, one
    layer's ``kv.attend`` alone in µs and the share of the step all layers of it take), then what the run notes."""
    rows = section_rows(run, section)
    if not rows:
        raise ValueError(f"section {section!r}: run {run_name(run)} has no such rows")
    info = run["info"]
    first = rows[0]
    lines = [f"{run_name(run)} ({info.get('gpu', 'GPU unknown')}), the eager runner:"]
    if section == "cascade":
        lines += _wrapped(f"{first['samples']} greedy samples forked from one {first['prompt']}-token prompt, "
                          f"{first['timed_steps']} timed steps, random fp16 weights")
        head = ["shared_prefix", "tokens/s", "ms/step", "vs plain", "paths", "attend µs", "share", "same tokens",
                "agree"]
        cells = [[r["shared_prefix"], sig3(r["tokens_per_s"]), f"{r['step_ms']:.1f}", f"{r['speedup_vs_plain']:.2f}",
                  paths_text(r["paths"]), sig3(r["attend_us"]), f"{r['attend_share']:.2f}",
                  "yes" if r["tokens_equal_plain"] else "no", f"{r['agree_overall']:.2f}"] for r in rows]
        lines += _table(head, cells, left=1, text=(4,))
        lines += _wrapped("; ".join(f"{k}: {v}" for k, v in MODES.items()))
    else:
        lines += _wrapped(f"one {first['prompt']}-token prompt (copies of it at batch > 1), {first['page_tokens']}"
                          f"-token pages, {first['timed_steps']} timed steps, random fp16 weights")
        head = ["batch", "kv", "pages", "tokens/s", "ms/step", "vs full", "paths", "attend µs", "share",
                "agree to div.", "agree"]
        cells = [[str(r["batch"]), r["kv"], "-" if r["page_budget"] is None else str(r["page_budget"]),
                  sig3(r["tokens_per_s"]), f"{r['step_ms']:.1f}", f"{r['speedup_vs_full']:.2f}",
                  paths_text(r["paths"]), sig3(r["attend_us"]), f"{r['attend_share']:.2f}",
                  f"{r['agree_to_divergence']:.2f}", f"{r['agree_overall']:.2f}"] for r in rows]
        lines += _table(head, cells, left=2, text=(6,))
        if info.get("rope_positions"):
            lines += _wrapped(f"RoPE table extended to {info['rope_positions']} positions (past the trained ones; "
                              "random weights: timing only)")
    lines += _wrapped("attend µs: one layer's kv.attend alone; share: all layers of it over the step time")
    lines += _wrapped("agree: the tokens equal to the reference's, position by position"
                      + ("; to div.: before the first divergence" if section == "quest" else ""))
    for note in dict.fromkeys(r["note"] for r in rows if r.get("note")):
        lines += _wrapped(f"note: {note}")
    return "\n".join(lines)
