"""How long a transfer takes on a link: host link (PCIe, both directions, two copy paths) and the disk.

A :class:`LinkModel` holds measured points ``(bytes of one transfer, achieved GB/s)`` per ``(path, direction)``
and interpolates between them in log-log space (clamped at both ends), so a small transfer pays what the
link really charges small transfers, not ``bytes / peak``. Paths:

- ``"dma"``: a batch of scattered blocks through the copy engine: gathered into one staging buffer, then one
  ``cudaMemcpyAsync`` (the mover's path); fast for large batches;
- ``"copy"``: one ``cudaMemcpyAsync`` of contiguous bytes (a block copied on its own): slow below ~28 KiB (vLLM
  measured 4-7 GB/s for 4-24 KiB pages);
- ``"sm"``: a copy kernel whose threads read/write pinned host memory directly (no staging, many blocks in
  one launch; it takes SMs from the compute beside it);
- ``"disk"``: the disk pool (``workbench.tiers.disk``), ``"write"`` / ``"read"``.

Directions: ``"d2h"`` (swap out), ``"h2d"`` (swap in), and for the disk ``"write"`` / ``"read"``.

:meth:`LinkModel.default` uses the H200 figures in ``../shared/DESIGN.md`` section 4 (pinned ~54.5 GB/s
each way; one 8 KB copy 0.5 GB/s, 512 KB ~36 GB/s, 2 MB ~50 GB/s) and an assumed NVMe disk;
:meth:`LinkModel.from_results` reads a ``bench tiers`` run from ``data/results`` (what the notebooks use).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

PATHS = ("dma", "copy", "sm", "disk")
DIRECTIONS = {"dma": ("d2h", "h2d"), "copy": ("d2h", "h2d"), "sm": ("d2h", "h2d"), "disk": ("write", "read")}

# (bytes of one copy, GB/s): DESIGN.md section 4 for the copy engine; the SM path assumed flat near the link's
# peak above a few blocks (vLLM's reason to use it for small pages); an NVMe disk (~3 GB/s, ~100 us a request).
_H200_DMA = ((4 << 10, 0.25), (8 << 10, 0.5), (512 << 10, 36.0), (2 << 20, 50.0), (64 << 20, 54.5))
_H200_SM = ((4 << 10, 2.0), (64 << 10, 20.0), (1 << 20, 45.0), (64 << 20, 50.0))
_NVME = ((4 << 10, 0.04), (1 << 20, 2.5), (64 << 20, 3.0))


@dataclass(frozen=True)
class LinkModel:
    """Measured (or assumed) bandwidth curves: ``points[(path, direction)]`` = ``((bytes, GB/s), ...)``.

    Attributes:
        points: per ``(path, direction)``, ascending transfer sizes with the GB/s one transfer of that size reached.
        peak_gbps: the pinned host-link bandwidth (one large copy) the curves are fractions of.
        source: where the numbers came from (a results file, or ``"DESIGN.md section 4 (H200)"``).
    """

    points: Mapping[tuple[str, str], tuple[tuple[int, float], ...]]
    peak_gbps: float = 54.5
    source: str = "DESIGN.md section 4 (H200)"
    meta: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for key, pts in self.points.items():
            if key[0] not in PATHS or key[1] not in DIRECTIONS[key[0]]:
                raise ValueError(f"points key must be (path, direction) from {DIRECTIONS}, got {key!r}")
            if not pts or any(b <= 0 or g <= 0 for b, g in pts) or list(pts) != sorted(pts):
                raise ValueError(f"points[{key!r}] must be ascending (bytes > 0, GB/s > 0) pairs, got {pts!r}")

    @classmethod
    def default(cls) -> LinkModel:
        """The H200 figures of DESIGN.md section 4 (copy engine), an assumed SM-copy curve and NVMe disk."""
        pts = {}
        for d in ("d2h", "h2d"):
            pts[("dma", d)] = pts[("copy", d)] = _H200_DMA
            pts[("sm", d)] = _H200_SM
        pts[("disk", "write")] = pts[("disk", "read")] = _NVME
        return cls(pts)

    @classmethod
    def from_results(cls, path: Path | str) -> LinkModel:
        """A model from a ``bench tiers`` result file: its ``link`` rows and its measured ``pinned_gbps``.

        A point is the best bandwidth a row reached for one transfer of that many bytes: a gathered batch
        (``dma``), a single block's own copy (``copy``, from the ``dma_per_block`` rows of one block) and the SM
        copy of a batch (``sm``). Curves the file lacks (the disk) come from :meth:`default`."""
        doc = json.loads(Path(path).read_text())
        base = cls.default()
        best: dict[tuple[str, str], dict[int, float]] = {}
        for row in doc.get("rows", []):
            if row.get("section") != "link":
                continue
            p = row["path"]
            if p == "dma_per_block":
                if row["blocks"] != 1:
                    continue
                p = "copy"
            curve = best.setdefault((p, row["direction"]), {})
            b = int(row["bytes"])
            curve[b] = max(float(row["gbps"]), curve.get(b, 0.0))
        merged = dict(base.points)
        merged.update({key: tuple(sorted(c.items())) for key, c in best.items()})
        pinned = doc.get("pinned_gbps") or {}
        peak = float(pinned.get("h2d", base.peak_gbps))
        return cls(merged, peak, source=str(Path(path).name), meta=dict(doc.get("meta", {})))

    def gbps(self, nbytes: int, path: str = "dma", direction: str = "h2d") -> float:
        """The bandwidth one transfer of ``nbytes`` reaches (log-log interpolation, clamped at the ends)."""
        pts = self._curve(path, direction)
        if isinstance(nbytes, bool) or not isinstance(nbytes, (int, float)) or not nbytes > 0:
            raise ValueError(f"nbytes must be a number > 0, got {nbytes!r}")
        if nbytes <= pts[0][0]:
            return pts[0][1]
        if nbytes >= pts[-1][0]:
            return pts[-1][1]
        for (b0, g0), (b1, g1) in zip(pts, pts[1:], strict=False):
            if b0 <= nbytes <= b1:
                t = (math.log(nbytes) - math.log(b0)) / (math.log(b1) - math.log(b0))
                return math.exp(math.log(g0) + t * (math.log(g1) - math.log(g0)))
        raise AssertionError("unreachable")

    def seconds(self, nbytes: int, path: str = "dma", direction: str = "h2d", transfers: int = 1) -> float:
        """Time of ``transfers`` transfers of ``nbytes`` each, one after another (0 for no bytes)."""
        if isinstance(transfers, bool) or not isinstance(transfers, int) or transfers < 0:
            raise ValueError(f"transfers must be an int >= 0, got {transfers!r}")
        if isinstance(nbytes, bool) or not isinstance(nbytes, (int, float)) or not nbytes >= 0:
            raise ValueError(f"nbytes must be a number >= 0, got {nbytes!r}")
        if nbytes == 0 or transfers == 0:
            return 0.0
        return transfers * nbytes / (self.gbps(nbytes, path, direction) * 1e9)

    def batch_seconds(self, block_bytes: int, blocks: int, path: str = "dma", direction: str = "h2d",
                      batched: bool = True) -> float:
        """Time to move ``blocks`` blocks of ``block_bytes``: one transfer of them all (``batched``, the staging
        buffer or one SM-copy launch) or one transfer per block (``path="dma"`` then means a ``copy`` each)."""
        if isinstance(block_bytes, bool) or not isinstance(block_bytes, int) or block_bytes < 1:
            raise ValueError(f"block_bytes must be an int >= 1, got {block_bytes!r}")
        if isinstance(blocks, bool) or not isinstance(blocks, int) or blocks < 0:
            raise ValueError(f"blocks must be an int >= 0, got {blocks!r}")
        if not isinstance(batched, bool):
            raise ValueError(f"batched must be a bool, got {batched!r}")
        if blocks == 0:
            return 0.0
        if batched:
            return self.seconds(block_bytes * blocks, path, direction)
        if path == "dma" and ("copy", direction) in self.points:
            path = "copy"
        return self.seconds(block_bytes, path, direction, transfers=blocks)

    def _curve(self, path: str, direction: str) -> Sequence[tuple[int, float]]:
        if path not in PATHS:
            raise ValueError(f"path must be one of {PATHS}, got {path!r}")
        if direction not in DIRECTIONS[path]:
            raise ValueError(f"direction for path {path!r} must be one of {DIRECTIONS[path]}, got {direction!r}")
        try:
            return self.points[(path, direction)]
        except KeyError:
            raise ValueError(f"this link model has no curve for ({path!r}, {direction!r})") from None


def latest_link_model(results_dir: Path | str | None = None) -> LinkModel:
    """The newest committed ``tiers-h200-*.json`` run as a :class:`LinkModel`, else :meth:`LinkModel.default`."""
    if results_dir is not None and not isinstance(results_dir, (str, Path)):
        raise ValueError(f"results_dir must be None or a directory path, got {type(results_dir).__name__}")
    d = Path(results_dir) if results_dir else Path(__file__).resolve().parents[2] / "data" / "results"
    runs = sorted(d.glob("tiers-*.json"))
    return LinkModel.from_results(runs[-1]) if runs else LinkModel.default()
