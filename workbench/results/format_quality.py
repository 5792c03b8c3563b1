"""The quality cost of a tier format, from the committed real-model runs (``python -m workbench bench
model_quality``, ``data/results/model-quality-*.json``): SmolLM2-135M's agreement, KL and perplexity change
against the fp16 cache, per format.

Two kinds of row answer it. A *tier* row measured what the issue asks for: a prefix demoted to a tier in the
format and promoted back, then decoded; such a row names its format in ``host_format`` (``TieredCache``'s
argument), or is a row of section ``tier`` named by its ``scheme``. Until a run with tier rows is committed, the
*scheme* row of the same name stands in: the whole cache stored in that scheme, every decode step reading it,
which is not the same experiment (a tier's prefix is rounded once, and KIVI's rows keep the newest 128 tokens in
fp16, where a tier quantizes whole blocks). :func:`quality_costs` takes the newest full run with tier rows, else
the newest full run's scheme rows, and says which (``kind``, ``source``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from workbench.results import run_files

PATTERN = "model-quality-*.json"
FULL = {"mode": "full"}  # --smoke runs are left out
KINDS = {"tier": "a prefix demoted to the tier in the format and promoted back",
         "scheme": "the whole cache stored in the scheme (a stand-in for the tier: no tier rows committed yet)"}


@dataclass(frozen=True)
class Quality:
    """One format's quality against the fp16 cache: greedy ``agreement`` (share of new tokens equal), ``mean_kl``
    (KL(fp16 || format) of the next-token distributions, teacher-forced) and ``ppl_change`` (perplexity over
    fp16's, minus 1)."""

    agreement: float
    mean_kl: float
    ppl_change: float


@dataclass(frozen=True)
class QualityTable:
    """``by_format``: format name -> :class:`Quality`; ``kind``: ``"tier"`` or ``"scheme"`` (:data:`KINDS`);
    ``source``: the run's file name (``""`` with no run)."""

    by_format: Mapping[str, Quality]
    kind: str
    source: str

    def get(self, fmt: str) -> Quality | None:
        return self.by_format.get(fmt)

    def describe(self) -> str:
        """Where the numbers come from, in words (what a figure's subtitle and the notebook say)."""
        if not self.source:
            return "no committed model_quality run"
        what = "tier rows" if self.kind == "tier" else "per-scheme rows as a stand-in"
        return f"{what}, {self.source}"


def tier_format_of(row: Mapping) -> str | None:
    """The format a tier row's prefix went through, or None for a scheme row."""
    if row.get("host_format"):
        return str(row["host_format"])
    if row.get("section") == "tier" and row.get("scheme"):
        return str(row["scheme"])
    return None


def _quality(row: Mapping) -> Quality:
    return Quality(float(row["agreement"]), float(row["mean_kl"]),
                   float(row["perplexity"]) / float(row["ref_perplexity"]) - 1.0)


def costs_of_run(run: Mapping, kind: str) -> dict[str, Quality]:
    """A loaded run's rows of ``kind`` (``tier`` or ``scheme``) by format; the first row of a name wins (a static
    scheme's second row, scales per layer, is not a tier format's)."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {sorted(KINDS)}, got {kind!r}")
    out: dict[str, Quality] = {}
    for row in run["rows"]:
        name = tier_format_of(row) if kind == "tier" else (None if tier_format_of(row) else row.get("scheme"))
        if name and name not in out:
            out[name] = _quality(row)
    return out


def quality_costs(results_dir: Path | str | None = None, where: Mapping | None = None) -> QualityTable:
    """The newest committed full run with tier rows, else the newest full run's scheme rows (default folder
    ``data/results``; ``where``: other metadata conditions, :func:`workbench.results.run_files.matches`)."""
    if results_dir is not None and not isinstance(results_dir, (str, Path)):
        raise ValueError(f"results_dir must be None or a directory path, got {type(results_dir).__name__}")
    runs = run_files.load_runs(PATTERN, results_dir, FULL if where is None else where)
    for run in reversed(runs):
        tier = costs_of_run(run, "tier")
        if tier:
            return QualityTable(tier, "tier", run["path"].name)
    if not runs:
        return QualityTable({}, "scheme", "")
    return QualityTable(costs_of_run(runs[-1], "scheme"), "scheme", runs[-1]["path"].name)
