"""Timing, copy bandwidth and result files shared by every benchmark.

Speed figures are ratios measured in one run: a kernel's achieved bandwidth over the
device-to-device copy bandwidth measured by :func:`copy_bandwidth_gbps` in the same
process, or one implementation's time over a peer's. Results are tidy rows (one per
measurement) written with their metadata by :func:`write_results`.

Where results go: a run writes to :data:`DEFAULT_OUT` (``results/`` at the top of the checkout,
ignored by git) unless ``--out DIR`` names another folder; the committed results the notebooks
plot live in :data:`RESULTS` (``data/results/``) and are written there only by ``--out data/results``.
Notebooks pick committed runs by their metadata (:func:`load_results` with ``where=``).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import torch

from workbench.core.argtypes import ensure_writable_dir
from workbench.provenance import machine_meta  # noqa: F401  (re-exported: every benchmark stamps its rows)

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "data" / "results"  # committed results (what the notebooks plot); loaders read here
DEFAULT_OUT = ROOT / "results"  # where a run writes unless --out says otherwise (git-ignored)


def time_us(fn: Callable[[], object], warmup_ms: float = 25, rep_ms: float = 200) -> float:
    """Median time of one call in microseconds (device events through triton's do_bench)."""
    import triton.testing  # here: triton adds 0.2 s to this module's import; the loaders and result files skip it

    return 1e3 * triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median")


def time_us_graph(fn: Callable[[], object], calls_per_graph: int = 10, rep_ms: float = 200) -> float:
    """Median time of one call replayed from a CUDA graph (launch gaps removed), in microseconds."""
    import triton.testing  # here: as in time_us

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm up (compile, autotune) outside the capture
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls_per_graph):
            fn()
    torch.cuda.synchronize()
    return 1e3 * triton.testing.do_bench(graph.replay, warmup=25, rep=rep_ms, return_mode="median") / calls_per_graph


def copy_bandwidth_gbps(nbytes: int = 2 << 30) -> float:
    """Device-to-device copy bandwidth in GB/s, bytes read plus bytes written (the ceiling we report against)."""
    src = torch.empty(nbytes // 2, dtype=torch.float16, device="cuda").normal_()
    dst = torch.empty_like(src)
    t = time_us(lambda: dst.copy_(src))
    return 2 * nbytes / (t * 1e-6) / 1e9


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64; NaN anywhere gives inf."""
    out, ref = out.double(), ref.double()
    if not torch.isfinite(out).all():
        return float("inf")
    return float((out - ref).norm() / ref.norm().clamp_min(1e-30))


def write_results(
    bench: str, rows: Sequence[dict], meta: dict[str, str], out_dir: Path | None = None, extra: dict | None = None
) -> Path:
    """Write ``{"meta": ..., "rows": [...]}`` as ``<bench>-<gpu>-<YYYYMMDDTHHMMSS>.json`` in ``out_dir``
    (default :data:`DEFAULT_OUT`); every row carries the meta columns.

    The file is created exclusively: another run in the same second gets ``-2``, ``-3``, ... before
    ``.json`` instead of overwriting an earlier one. The same run (``meta["run"]``, from
    :func:`machine_meta`) writing again, to checkpoint its progress, rewrites its own file.
    """
    out_dir = ensure_writable_dir(DEFAULT_OUT if out_dir is None else out_dir)
    gpu = meta["gpu"].replace("NVIDIA ", "").replace(" ", "-").lower()
    stamp = meta["date"].replace(":", "").replace("-", "")[:15]
    keep = ("gpu", "torch", "triton", "commit", "date")
    tidy = [{**row, **{k: meta[k] for k in keep}} for row in rows]
    text = json.dumps({"meta": meta, **(extra or {}), "rows": tidy}, indent=1) + "\n"
    key = (bench, str(out_dir.resolve()), meta.get("run"))
    own = _WRITTEN.get(key) if meta.get("run") else None
    if own is not None and own.is_file():
        own.write_text(text)
        return own
    for n in range(1, 10_000):
        path = out_dir / f"{bench}-{gpu}-{stamp}{'' if n == 1 else f'-{n}'}.json"
        try:
            with open(path, "x") as f:
                f.write(text)
        except FileExistsError:
            continue
        _WRITTEN[key] = path
        return path
    raise FileExistsError(f"no free file name for {bench}-{gpu}-{stamp} in {out_dir}")


_WRITTEN: dict[tuple, Path] = {}  # (bench, folder, run id) -> the file this process wrote for that run


def run_info(doc: Mapping) -> dict:
    """A result file's metadata: its ``meta`` plus the other top-level fields (``mode``, ``smoke``, ...)."""
    return {**doc.get("meta", {}), **{k: v for k, v in doc.items() if k not in ("meta", "rows")}}


def matches(info: Mapping, where: Mapping | None) -> bool:
    """Whether metadata ``info`` satisfies every condition of ``where``.

    Each value of ``where`` is a callable (a predicate on the field, which gets None when the field is
    missing), a list/tuple/set of accepted values, or one value the field must equal.
    """
    for key, want in (where or {}).items():
        have = info.get(key)
        if callable(want):
            if not want(have):
                return False
        elif isinstance(want, (list, tuple, set, frozenset)):
            if have not in want:
                return False
        elif have != want:
            return False
    return True


def load_runs(pattern: str, results_dir: Path | str | None = None, where: Mapping | None = None) -> list[dict]:
    """The result files matching ``pattern`` whose metadata (:func:`run_info`) :func:`matches` ``where``,
    oldest first (by their ``date``, then name): each ``{"path", "info", "rows"}``."""
    runs = []
    for path in Path(results_dir or RESULTS).glob(pattern):
        doc = json.loads(path.read_text())
        info = run_info(doc)
        if matches(info, where):
            runs.append({"path": path, "info": info, "rows": doc["rows"]})
    return sorted(runs, key=lambda r: (str(r["info"].get("date", "")), r["path"].name))


def load_results(pattern: str, results_dir: Path | str | None = None, where: Mapping | None = None,
                 latest: bool = False) -> list[dict]:
    """All rows of the result files matching ``pattern`` (default folder :data:`RESULTS`), oldest file first.

    Args:
        pattern: file glob inside ``results_dir``.
        results_dir: default ``data/results`` (the committed results).
        where: keep only files whose metadata matches (see :func:`matches`), e.g.
            ``{"gpu": "NVIDIA H200", "mode": "full"}``.
        latest: only the newest of the matching files.
    """
    runs = load_runs(pattern, results_dir, where)
    if latest:
        runs = runs[-1:]
    return [row for run in runs for row in run["rows"]]


def pick(rows: Sequence[Mapping], **where) -> Mapping:
    """The last of ``rows`` whose columns satisfy every condition of ``where`` (as :func:`matches`): with the rows
    of several runs, oldest first, the newest run's. ``ValueError`` naming the conditions when none does."""
    found = [r for r in rows if matches(r, where)]
    if not found:
        raise ValueError(f"where: no row matches {where} (of {len(rows)} rows)")
    return found[-1]


def print_table(rows: Sequence[dict], columns: Sequence[str], headers: Mapping[str, str] | None = None) -> None:
    """A plain fixed-width table of ``columns`` (floats with 3 significant digits).

    ``headers`` maps a column to a shorter title, so a wide table fits a notebook's output area.
    """

    def fmt(v):
        return f"{v:.3g}" if isinstance(v, float) else str(v)

    titles = [(headers or {}).get(c, c) for c in columns]
    cells = [[fmt(r.get(c, "")) for c in columns] for r in rows]
    widths = [max(len(t), *(len(row[i]) for row in cells)) if cells else len(t) for i, t in enumerate(titles)]
    print("  ".join(t.rjust(w) for t, w in zip(titles, widths, strict=True)))
    for row in cells:
        print("  ".join(v.rjust(w) for v, w in zip(row, widths, strict=True)))
