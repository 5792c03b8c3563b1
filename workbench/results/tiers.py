"""The committed host-link measurements (``python -m workbench bench tiers``, ``data/results/tiers-*.json``) as plain
tables: the bandwidth map (block size x blocks per batch -> fraction of the pinned bandwidth, per copy path and
direction), the cost of a transfer beside a decode kernel and the share of a prefetch hidden behind decode.

Pure functions of a loaded run (no plotly, no widgets): notebook 05 plots them, ``tests/test_tier_panels.py`` checks
them against the committed files. ``workbench/bench/tiers.py`` documents the row schema:

- ``link`` rows: ``path`` (``dma``: gathered into one staging buffer + one copy; ``dma_per_block``: one
  ``cudaMemcpyAsync`` per block; ``sm``: the block-move kernel on pinned memory), ``direction`` (``d2h`` / ``h2d``),
  ``block_bytes``, ``blocks`` (per batch), ``gbps``, ``frac`` (of ``pinned_gbps`` of the same run, device time from a
  CUDA graph) and ``frac_eager`` (with the host's launches);
- ``beside`` rows: a W1 decode alone and with transfers on a side stream (``slowdown``, ``frac_beside``);
- ``overlap`` rows: a prefetch issued beside 20 decode steps (``hidden``, ``decode_slowdown``);
- ``check`` and ``disk`` rows: the tiered cache's bit-exact round trips and the disk pool's bandwidth.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from workbench.results import run_files

PATTERN = "tiers-*.json"
#: link paths of the benchmark, with what each does
PATHS = {"dma": "gathered batch + one copy (copy engine)", "dma_per_block": "one copy per block",
         "sm": "SM copy kernel on pinned memory"}
DIRECTIONS = {"d2h": "device -> host (swap out)", "h2d": "host -> device (swap in, prefetch)"}
VALUES = ("frac", "frac_eager", "gbps")
H200 = {"gpu": "NVIDIA H200", "quick": lambda q: not q}  # full runs on the H200 (``--quick`` runs left out)


def runs(results_dir: Path | str | None = None, where: Mapping | None = None) -> list[dict]:
    """The committed runs (default: full H200 runs in ``data/results``), oldest first: each ``{"path", "info",
    "rows"}`` (:func:`workbench.results.run_files.load_runs`), ``info`` holding ``pinned_gbps`` and
    ``pageable_gbps``."""
    return run_files.load_runs(PATTERN, results_dir, H200 if where is None else where)


def latest(results_dir: Path | str | None = None, where: Mapping | None = None) -> dict | None:
    """The newest of :func:`runs`, or None when there is none."""
    found = runs(results_dir, where)
    return found[-1] if found else None


run_name = run_files.run_name  # the run's file name: what the notebook quotes


def pinned(run: Mapping) -> dict[str, float]:
    """The run's own reference bandwidths, GB/s: one 256 MiB pinned copy each way (the denominator of every
    ``frac``) and a pageable one: ``{"h2d", "d2h", "pageable_h2d", "pageable_d2h"}``."""
    info = run["info"]
    pin, page = info.get("pinned_gbps") or {}, info.get("pageable_gbps") or {}
    if not {"h2d", "d2h"} <= pin.keys():
        raise ValueError(f"run {run_name(run)} has no pinned_gbps (h2d, d2h)")
    return {"h2d": float(pin["h2d"]), "d2h": float(pin["d2h"]),
            **{f"pageable_{d}": float(page[d]) for d in ("h2d", "d2h") if d in page}}


def section(run: Mapping, name: str) -> list[dict]:
    """The run's rows of one section (``link``, ``beside``, ``overlap``, ``check``, ``disk``), in file order."""
    return [r for r in run["rows"] if r.get("section") == name]


@dataclass(frozen=True)
class BandwidthMap:
    """One path and direction of the link section on a grid.

    Attributes:
        path, direction, value: what the grid holds (``value``: ``frac``, ``frac_eager`` or ``gbps``).
        block_bytes: the columns, ascending (4 KiB .. 2 MiB).
        blocks: the rows, ascending (blocks per batch, 1 .. 256).
        z: ``z[i][j]`` = the value for ``blocks[i]`` blocks of ``block_bytes[j]`` (None where not measured).
        gbps: the same grid in GB/s.
        pinned_gbps: the run's pinned bandwidth in this direction (what ``frac`` divides by).
        source: the run's file name.
    """

    path: str
    direction: str
    value: str
    block_bytes: tuple[int, ...]
    blocks: tuple[int, ...]
    z: tuple[tuple[float | None, ...], ...]
    gbps: tuple[tuple[float | None, ...], ...]
    pinned_gbps: float
    source: str

    def at(self, block_bytes: int, blocks: int) -> float | None:
        """The value for ``blocks`` blocks of ``block_bytes`` (None where not measured)."""
        return self.z[self.blocks.index(blocks)][self.block_bytes.index(block_bytes)]


def _check(path: str, direction: str, value: str) -> None:
    if path not in PATHS:
        raise ValueError(f"path must be one of {list(PATHS)}, got {path!r}")
    if direction not in DIRECTIONS:
        raise ValueError(f"direction must be one of {list(DIRECTIONS)}, got {direction!r}")
    if value not in VALUES:
        raise ValueError(f"value must be one of {VALUES}, got {value!r}")


def bandwidth_map(run: Mapping, path: str = "dma", direction: str = "h2d", value: str = "frac") -> BandwidthMap:
    """The grid block size x blocks per batch of one path and direction (see :class:`BandwidthMap`)."""
    _check(path, direction, value)
    rows = [r for r in section(run, "link") if r["path"] == path and r["direction"] == direction]
    if not rows:
        raise ValueError(f"run {run_name(run)} has no link rows for path {path!r}, direction {direction!r}")
    sizes = tuple(sorted({int(r["block_bytes"]) for r in rows}))
    counts = tuple(sorted({int(r["blocks"]) for r in rows}))
    by = {(int(r["blocks"]), int(r["block_bytes"])): r for r in rows}
    grid = lambda key: tuple(tuple(float(by[(n, b)][key]) if (n, b) in by else None for b in sizes)
                             for n in counts)
    return BandwidthMap(path, direction, value, sizes, counts, grid(value), grid("gbps"), pinned(run)[direction],
                        run_name(run))


def batch_curves(run: Mapping, block_bytes: int, direction: str = "h2d", value: str = "frac") -> dict[str, list]:
    """At one block size, every path's value by blocks per batch: ``{path: [(blocks, value), ...]}`` (ascending)."""
    out = {}
    for path in PATHS:
        m = bandwidth_map(run, path, direction, value)
        if block_bytes not in m.block_bytes:
            raise ValueError(f"block_bytes must be one of the measured sizes {list(m.block_bytes)}, "
                             f"got {block_bytes!r}")
        j = m.block_bytes.index(block_bytes)
        out[path] = [(n, m.z[i][j]) for i, n in enumerate(m.blocks) if m.z[i][j] is not None]
    return out


def link_value(run: Mapping, path: str, direction: str, block_bytes: int, blocks: int, value: str = "frac") -> float:
    """One cell of the map (a ValueError when it was not measured)."""
    m = bandwidth_map(run, path, direction, value)
    got = m.at(block_bytes, blocks) if block_bytes in m.block_bytes and blocks in m.blocks else None
    if got is None:
        raise ValueError(f"run {run_name(run)}: no {path} {direction} row for {blocks} x {block_bytes} B")
    return got


def batching_summary(run: Mapping, block_bytes: int = 32 << 10, batches: Sequence[int] = (64, 256)) -> dict:
    """What batching buys at one block size: per direction and path (``dma_per_block``, ``dma``, ``sm``) the fraction
    of the pinned bandwidth a batch of each of ``batches`` blocks reached: ``{direction: {path: {n: frac}}}``."""
    return {d: {p: {n: link_value(run, p, d, block_bytes, n) for n in batches} for p in PATHS} for d in DIRECTIONS}


def _variant(path: str, programs: int | None, overlap: bool = False) -> str:
    if path == "dma":
        if programs is None:
            return "DMA (copy engine)"
        return f"DMA, gather on {programs} programs" if overlap else f"DMA, {programs} programs"
    return "SM copy, full grid" if programs is None else f"SM copy, {programs} programs"


def beside_rows(run: Mapping) -> list[dict]:
    """A decode beside a stream of transfers, per transfer variant (file order): ``{"label", "path", "programs",
    "decode_alone_us", "decode_beside_us", "slowdown" (fraction), "transfer_gbps" (kept beside the decode),
    "frac_beside" (of pinned d2h)}``."""
    return [{"label": _variant(r["path"], r["sm_programs"]), "path": r["path"], "programs": r["sm_programs"],
             "decode_alone_us": r["decode_alone_us"], "decode_beside_us": r["decode_beside_us"],
             "slowdown": r["slowdown"], "transfer_gbps": r["transfer_beside_gbps"], "frac_beside": r["frac_beside"]}
            for r in section(run, "beside")]


def overlap_rows(run: Mapping) -> list[dict]:
    """A prefetch issued beside 20 decode steps, per mover variant (file order): ``{"label", "path", "programs",
    "compute_us", "transfer_us", "both_us", "hidden" (share of the transfer time hidden), "decode_slowdown",
    "transfer_gbps", "bytes"}``."""
    return [{"label": _variant(r["path"], r["programs"], overlap=True), "path": r["path"], "programs": r["programs"],
             "compute_us": r["compute_us"], "transfer_us": r["transfer_us"], "both_us": r["both_us"],
             "hidden": r["hidden"], "decode_slowdown": r["decode_slowdown"], "transfer_gbps": r["transfer_gbps"],
             "bytes": r["block_bytes"] * r["batch"] * r["batches"]} for r in section(run, "overlap")]


def check_summary(run: Mapping) -> dict:
    """The tiered cache's checks on the GPU and the disk pool: ``{"checks", "ok", "kv_dtypes", "paths",
    "disk_write_gbps", "disk_read_gbps"}``."""
    checks, disk = section(run, "check"), section(run, "disk")
    return {"checks": len(checks), "ok": sum(bool(r["ok"]) for r in checks),
            "kv_dtypes": sorted({r["kv_dtype"] for r in checks}), "paths": sorted({r["path"] for r in checks}),
            "disk_write_gbps": disk[0]["write_gbps"] if disk else None,
            "disk_read_gbps": disk[0]["read_gbps"] if disk else None}


def run_stamp(run: Mapping) -> str:
    """The run's time stamp from its file name (``tiers-h200-20261201T205651.json`` -> ``20261201T205651``)."""
    return Path(run["path"]).stem.rsplit("-", 1)[-1]


def by_run(runs: Sequence[Mapping], rows_of: Callable[[Mapping], list[dict]]) -> list[dict]:
    """``rows_of(run)`` of every run (oldest first) in one table, each row led by ``run`` (:func:`run_stamp`):
    ``by_run(runs, beside_rows)``."""
    return [{"run": run_stamp(run), **r} for run in runs for r in rows_of(run)]


def pinned_rows(runs: Sequence[Mapping]) -> list[dict]:
    """Per run its GPU, commit and reference bandwidths (:func:`pinned`, GB/s): ``{run (file name), gpu, commit,
    h2d, d2h, pageable_h2d, pageable_d2h}``."""
    return [{"run": run_name(run), "gpu": run["info"].get("gpu"), "commit": run["info"].get("commit"), **pinned(run)}
            for run in runs]


def batching_rows(runs: Sequence[Mapping], block_bytes: int = 32 << 10, batches: Sequence[int] = (64, 256)
                  ) -> list[dict]:
    """:func:`batching_summary` of every run as table rows: per run and direction ``{run, dir, <path>_<n>}`` (the
    fraction of the pinned bandwidth ``n`` blocks of ``block_bytes`` reached on ``path``)."""
    return [{"run": run_stamp(run), "dir": d, **{f"{p}_{n}": fracs[n] for p, fracs in paths.items() for n in batches}}
            for run in runs for d, paths in batching_summary(run, block_bytes, batches).items()]


def single_copy_rows(run: Mapping, value: str = "frac") -> list[dict]:
    """One block in one copy (``dma_per_block``, a batch of 1) by block size, both directions: ``{kib, h2d, d2h}``
    (``value``: ``frac`` of the pinned bandwidth by default), smallest block first."""
    maps = {d: bandwidth_map(run, "dma_per_block", d, value) for d in ("h2d", "d2h")}
    sizes = maps["h2d"].block_bytes
    return [{"kib": b >> 10 if b % 1024 == 0 else b / 1024,
             **{d: m.at(b, 1) if 1 in m.blocks and b in m.block_bytes else None for d, m in maps.items()}}
            for b in sizes]


def eager_rows(run: Mapping, direction: str = "h2d", block_bytes: int = 32 << 10, blocks: int = 64) -> list[dict]:
    """Per path one batch of ``blocks`` x ``block_bytes``: device time (``frac``, a CUDA graph) against the host's
    launches counted (``frac_eager``), both as fractions of the pinned bandwidth: ``{path, frac, frac_eager}``."""
    return [{"path": p, **{v: link_value(run, p, direction, block_bytes, blocks, v) for v in ("frac", "frac_eager")}}
            for p in PATHS]


def beside_overlap_series(runs: Sequence[Mapping]) -> tuple[list[list[dict]], list[list[dict]], list[str]]:
    """What ``workbench.figures.tiers.beside_overlap`` draws: per run (oldest first) its :func:`beside_rows`,
    its :func:`overlap_rows` and its file name."""
    return [beside_rows(r) for r in runs], [overlap_rows(r) for r in runs], [run_name(r) for r in runs]


def spread(values: Sequence[float]) -> float:
    """``max / min - 1`` of positive values (0 for one value): how far repeated runs differ."""
    vals = [float(v) for v in values]
    if not vals or min(vals) <= 0:
        raise ValueError(f"values must be positive numbers, got {values!r}")
    return max(vals) / min(vals) - 1
