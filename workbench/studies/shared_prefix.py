"""The shared-prefix studies: notebook 08 (shared prefix), one shared-prefix batch and what each decode path reads
and is predicted to take, and the memory parallel sampling and beam search save by sharing blocks (vLLM Figure 15).
``SCENARIO`` and ``FORKS`` are both the panels' controls (``workbench.ui.shared_prefix_panels``) and the sweeps.
``scenario``'s times are the fitted H200 cost model's (``kernels/tuning/shared_prefix.json``, committed), not timed
here; ``forks`` runs the block-sharing model of ``workbench.sim.forks`` on the committed trace presets."""

from __future__ import annotations

from workbench.shared_prefix import scenarios
from workbench.shared_prefix.cost import CostModel
from workbench.shared_prefix.decode import cost_model
from workbench.sim import forks, forks_report
from workbench.studies.base import Param, Study

PREFIXES = (128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)
SHARERS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
SUFFIXES = (16, 64, 128, 256, 512, 1024, 2048)
GQAS = {"32 q / 8 kv heads": (32, 8), "32 q / 32 kv (MHA)": (32, 32), "32 q / 4 kv": (32, 4)}
FORK_TOKENS = 256  # each fork group shares 256 more tokens (a nested tree), as the panel draws it
P_TOPS = (0.0, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0)
ALL_PROGRAMS = 1 << 30  # program_reads lists every program (the panel draws the first 24)


def scenario(prefix: int, sharers: int, suffix: int, gqa: str, rows_per_tile: int, groups: int, model: CostModel
             ) -> scenarios.Scenario:
    """``shared_prefix.scenarios.scenario`` of the controls: ``groups`` is cut to ``sharers`` (with more than one, each
    fork group shares 256 more tokens); ``model`` chooses the path and predicts the times."""
    hq, hkv = GQAS[gqa]
    groups = min(groups, sharers)
    return scenarios.scenario(prefix, sharers, suffix, num_q_heads=hq, num_kv_heads=hkv, rows_per_tile=rows_per_tile,
                          groups=groups, fork=FORK_TOKENS if groups > 1 else 0, model=model)


def scenario_point(prefix: int, sharers: int, suffix: int, gqa: str, rows_per_tile: int, groups: int,
                   timing: str) -> dict:
    """:func:`scenario` under the H200's fitted cost model (``timing``: CUDA-graph or eager fit): the bytes a step
    reads and the predicted time of plain paged decode and the cascade, the path the selector takes, and the programs
    and block reads of each path (``scenarios.program_reads``, one kv head)."""
    model = cost_model("NVIDIA H200", timing)
    sc = scenario(prefix, sharers, suffix, gqa, rows_per_tile, groups, model)
    b = sc.choice.bytes
    plain, cascade = (scenarios.program_reads(sc, path, ALL_PROGRAMS) for path in ("plain", "shared"))
    return {"path": sc.choice.path, "cascade_chosen": sc.choice.path == "shared", "predicted_speedup": sc.speedup,
            "plain_us": sc.choice.plain_us, "cascade_us": sc.choice.cascade_us, "plain_mb": b["plain"] / 1e6,
            "cascade_mb": b["cascade"] / 1e6, "shared_mb": b["shared"] / 1e6, "suffix_mb": b["suffix"] / 1e6,
            "bytes_ratio": b["plain"] / b["cascade"] if b["cascade"] else 1.0, "sequences": len(sc.lens),
            "fork_groups": min(groups, sharers), "blocks": sc.num_blocks, "shared_runs": len(sc.runs),
            "segments": len(sc.choice.segments), "programs_plain": len(plain), "programs_cascade": len(cascade),
            "block_reads_plain": sum(len(p["blocks"]) for p in plain),
            "block_reads_cascade": sum(len(p["blocks"]) for p in cascade), "model_source": model.source}


def draw_scenario(result: dict):
    """The scenario panel's figure (``shared_prefix_figures.scenario_figure``): sc, plain, shared, title, model."""
    from workbench.figures import shared_prefix as shared_prefix_figures  # plotly: optional, imported to draw

    return shared_prefix_figures.scenario_figure(result["sc"], result["plain"], result["shared"], result["title"],
                                                 result["model"])


# every column's label and unit on the panels' axes (workbench.studies.base.Column)
STEP_MB = "MB a step, one layer"
SCENARIO_COLUMNS = {
    "prefix": ("shared prefix", "tokens"), "sharers": ("sequences sharing the prefix",),
    "suffix": ("private suffix", "tokens"), "gqa": ("query / kv heads",), "rows_per_tile": ("tile rows",),
    "groups": ("fork groups",), "timing": ("cost model timing",),
    "predicted_speedup": ("predicted speedup of the cascade",), "plain_mb": ("plain decode reads", STEP_MB),
    "cascade_mb": ("cascade reads", STEP_MB), "shared_mb": ("cascade: shared tiles read", STEP_MB),
    "suffix_mb": ("cascade: suffixes read", STEP_MB), "plain_us": ("plain decode, predicted", "µs"),
    "cascade_us": ("cascade, predicted", "µs"), "cascade_chosen": ("selector takes the cascade",),
    "bytes_ratio": ("bytes read: plain / cascade",), "sequences": ("sequences",), "fork_groups": ("fork groups",),
    "blocks": ("blocks",), "shared_runs": ("shared runs",), "segments": ("cascade segments",),
    "programs_plain": ("programs, plain decode",), "programs_cascade": ("programs, cascade",),
    "block_reads_plain": ("block reads, plain decode (one kv head)",),
    "block_reads_cascade": ("block reads, cascade (one kv head)",),
}

SCENARIO = Study(
    "scenario", "a shared-prefix batch: bytes and predicted time of plain decode and the cascade, and the pick", (
        Param("prefix", "int", 1024, choices=PREFIXES, grid=(128, 1024, 8192, 32768), help="shared prefix tokens",
              label="shared prefix"),
        Param("sharers", "int", 8, choices=SHARERS, grid=(1, 4, 16, 64), label="sharers"),
        Param("suffix", "int", 128, choices=SUFFIXES, help="private tokens a sequence", label="private suffix"),
        Param("gqa", "str", "32 q / 8 kv heads", choices=tuple(GQAS), help="query / kv heads", label="heads",
              widget="dropdown"),
        Param("rows_per_tile", "int", 64, choices=(16, 32, 64, 128), help="the cascade's shared tile rows",
              label="tile rows"),
        Param("groups", "int", 1, choices=(1, 2, 4, 8), help="fork groups (at most sharers), each 256 tokens more",
              label="fork groups"),
        Param("timing", "str", "graph", choices=("graph", "eager"), help="cost model fitted on CUDA graphs or eager",
              label="model", labels={"graph": "CUDA graph", "eager": "eager"})),
    scenario_point, notebook="08_shared_prefix", panel="scenario_panel", x="prefix", color="sharers",
    y=("predicted_speedup", "plain_mb", "cascade_mb", "plain_us", "cascade_us", "cascade_chosen"),
    columns=SCENARIO_COLUMNS, controls=("prefix", "sharers", "suffix", "gqa", "rows_per_tile", "groups", "timing"),
    enabled={"groups": lambda sharers, **_: sharers > 1}, draw=draw_scenario)


def forks_point(trace: str, mode: str, p_top: float, n: int, requests: int) -> dict:
    """``sim.forks.lifetime_saving`` of one trace, mode and width over the first ``requests`` requests (percent): a bar
    of the forks panel, and the paper's range for the trace and mode (``forks_report.PAPER``); ``p_top`` only counts for
    beam search."""
    saving = 100 * forks.lifetime_saving(trace, mode, n, p_top=p_top, requests=requests)
    low, high = forks_report.PAPER[(trace, mode)]
    return {"saving_pct": saving, "paper_low_pct": low, "paper_high_pct": high,
            "in_paper_range": low <= saving <= high}


def draw_forks(result: dict):
    """The forks panel's figure (``shared_prefix_figures.forks_figure``): rows (one per width), paper, title."""
    from workbench.figures import shared_prefix as shared_prefix_figures  # plotly: optional, imported to draw

    return shared_prefix_figures.forks_figure(result["rows"], result["paper"], result["title"])


FORKS_COLUMNS = {
    "trace": ("trace",), "mode": ("mode",), "p_top": ("beam: chance a child follows the best beam",),
    "n": ("samples or beam width",), "requests": ("requests",),
    "saving_pct": ("memory saved by sharing", "%"), "paper_low_pct": ("vLLM paper, low end", "%"),
    "paper_high_pct": ("vLLM paper, high end", "%"), "in_paper_range": ("within the paper's range",),
}

FORKS = Study(
    "forks", "memory saved by block sharing in parallel sampling and beam search, against the vLLM paper", (
        Param("trace", "str", "alpaca", choices=("alpaca", "sharegpt"), grid=("alpaca", "sharegpt"), label="trace",
              labels={"alpaca": "Alpaca-like", "sharegpt": "ShareGPT-like"}, widget="dropdown"),
        Param("mode", "str", "parallel", choices=("parallel", "beam"), grid=("parallel", "beam"), label="mode",
              labels={"parallel": "parallel sampling", "beam": "beam search"}),
        Param("p_top", "float", forks.DEFAULT_P_TOP, choices=P_TOPS, label="beam p_top",
              help="beam: the chance a child follows the best beam"),
        Param("n", "int", 2, choices=forks.WIDTHS, grid=forks.WIDTHS, help="samples or beam width"),
        Param("requests", "int", 200, minimum=1, maximum=100000, help="the first requests of the trace")),
    forks_point, notebook="08_shared_prefix", panel="forks_panel", x="n", color="mode",
    y=("saving_pct", "paper_low_pct", "paper_high_pct"), columns=FORKS_COLUMNS, controls=("trace", "mode", "p_top"),
    enabled={"p_top": lambda mode, **_: mode == "beam"}, draw=draw_forks)
STUDIES = (SCENARIO, FORKS)
