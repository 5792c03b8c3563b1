"""A GPU's profile for the what-if: the measured numbers a serving step's time is built from, each with the file it
came from (or ``assumed: ...`` / ``fitted: ...`` where nothing measured it yet).

    prof = GpuProfile.from_results()          # the newest committed H200 runs under data/results
    prof.decode_gbps("int4/token", 1 << 30)   # (GB/s, source): paged decode reading 1 GiB of K/V a call
    prof.copy_gbps.value, prof.copy_gbps.source

What a profile holds and where each comes from:

- ``copy_gbps``: device-to-device copy bandwidth, measured in the same run as the decode rows (the denominator
  of every fraction).
- ``decode``: per K/V scheme, the fraction of copy bandwidth paged decode reads its stored bytes at, one point per
  workload of ``bench quant_decode`` (W1-W5, CUDA-graph times). The workloads read the same ~0.5-1 GiB in
  different shapes (batch 8-256, context 512-32k, GQA and MHA), so the model uses their median, and their
  spread is the input's run-to-run range for the sensitivity study. Below that size a call costs at least its
  floor (``launch_us``).
- ``write``: per scheme, the fraction of copy bandwidth of quantize-on-write (32k tokens, same run).
- ``link``: the host link's curves (``workbench.tiers.link.LinkModel`` of the newest ``bench tiers`` run).
- ``launch_us``: what one small kernel costs inside a CUDA graph (its floor). No run measures it alone yet, so it
  is fitted to the real model's decode step at batch 1 (``bench model_decode``) and says so; batch 16 and 64 of
  that run then validate the model. ``python -m workbench profile`` (GPU) makes that run on another GPU, where the
  floor is fitted the same way.
- ``seq_us``, ``prefill_us``: host time an eager runner spends per sequence of a decode step (its tables, slots and
  tokens built in Python) and per prefill beyond the launches: none for a graph-replayed step; fitted to the
  runner's own eager steps at two batch sizes and its prefill where a replay predicts that runner
  (``workbench.whatif.replay.calibrate``).
- ``gemv_frac``: the fraction of copy bandwidth a decode step's weight reads reach; ``peak_tflops`` and
  ``prefill_mfu`` for compute-bound prefill; ``hbm_gib``. Not measured here: assumed, named as such.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path

from workbench.core.workloads import WORKLOADS
from workbench.quant.names import REFERENCE
from workbench.results import run_files
from workbench.tiers.link import LinkModel, latest_link_model

RESULTS = run_files.RESULTS


@dataclass(frozen=True)
class Measured:
    """One number of a profile and where it came from (a results file, ``assumed: ...`` or ``fitted: ...``)."""

    value: float
    source: str

    @property
    def measured(self) -> bool:
        return not self.source.startswith(("assumed", "fitted"))


@dataclass(frozen=True)
class GpuProfile:
    """See the module docstring. ``decode[scheme]`` = ``((workload, fraction), ...)``."""

    name: str
    copy_gbps: Measured
    decode: dict[str, tuple[tuple[str, float], ...]]
    decode_source: str
    write: dict[str, float]
    link: LinkModel
    launch_us: Measured
    gemv_frac: Measured = Measured(0.8, "assumed: weight reads of a decode step at 0.8 of copy bandwidth")
    peak_tflops: Measured = Measured(989.0, "assumed: H200 dense fp16/bf16 tensor-core peak (datasheet)")
    prefill_mfu: Measured = Measured(0.5, "assumed: prefill at half the tensor-core peak")
    hbm_gib: Measured = Measured(141.0, "assumed: H200 HBM3e capacity (datasheet)")
    seq_us: Measured = Measured(0.0, "assumed: none (a graph step's host time is flat in the batch)")
    prefill_us: Measured = Measured(0.0, "assumed: none (a prefill's host time is its launches)")
    files: tuple[str, ...] = field(default=())

    @classmethod
    def from_results(cls, results_dir: Path | str | None = None, name: str = "h200") -> GpuProfile:
        """The profile of the newest committed runs in ``results_dir`` (default ``data/results``) of GPU ``name``: the
        newest ``bench quant_decode`` run of every scheme with the ``--schemes`` runs after it, or, where a folder has
        only runs of some schemes (``python -m workbench profile`` times the profile's schemes alone), the newest."""
        d = Path(results_dir) if results_dir is not None else RESULTS
        pattern = f"quant-decode-{name}-*.json"
        run, updates = run_files.latest_with_updates(pattern, d)
        if run is None:
            runs = run_files.load_runs(pattern, d)
            run, updates = (runs[-1] if runs else None), []
        if run is None:
            raise ValueError(f"no {pattern} under {d}: a profile needs a committed run of that benchmark")
        quant = run["path"]
        copy = float(run["info"]["copy_gbps"])
        decode, write = {}, {}
        for i, (rows, run_copy) in enumerate([(run["rows"], copy)] + [(u["rows"], float(u["info"]["copy_gbps"]))
                                                                     for u in updates]):
            for r in rows:  # a later --schemes run's rows replace the full run's (each over its own copy rate)
                if r["section"] == "decode" and r.get("variant") == "heuristic" and r.get("time_us_graph"):
                    if i and r["scheme"] == REFERENCE:
                        continue
                    frac = r["bytes"] / (r["time_us_graph"] * 1e-6) / (run_copy * 1e9)
                    decode.setdefault(r["scheme"], {})[r["workload"]] = frac
                elif r["section"] == "write" and r.get("bw_fraction"):
                    write[r["scheme"]] = float(r["bw_fraction"])
        files = [quant.name, *(u["path"].name for u in updates)]
        link = latest_link_model(d)
        if link.source not in files:
            files.append(link.source)
        prof = cls(name, Measured(copy, quant.name), {s: tuple(sorted(p.items())) for s, p in decode.items()},
                   quant.name, write, link, Measured(3.0, "assumed: one kernel in a CUDA graph"), files=tuple(files))
        return prof

    def with_launch(self, launch_us: Measured) -> GpuProfile:
        return replace(self, launch_us=launch_us)

    @property
    def schemes(self) -> tuple[str, ...]:
        return tuple(self.decode)

    def decode_frac(self, scheme: str) -> tuple[float, float, float, str]:
        """``(median, min, max, source)`` of the fraction of copy bandwidth paged decode of ``scheme`` reads its
        stored K/V at, over the workloads of the run."""
        if scheme not in self.decode:
            raise ValueError(f"scheme must be one of the profile's decode schemes {sorted(self.decode)}, "
                             f"got {scheme!r}")
        fr = sorted(f for _, f in self.decode[scheme])
        mid = fr[len(fr) // 2] if len(fr) % 2 else (fr[len(fr) // 2 - 1] + fr[len(fr) // 2]) / 2
        keys = ",".join(w for w, _ in self.decode[scheme])
        return mid, fr[0], fr[-1], f"{self.decode_source}: {scheme} decode, median of {keys}"

    def write_frac(self, scheme: str) -> tuple[float, str]:
        """Quantize-on-write's fraction of copy bandwidth for ``scheme`` (the nearest measured family if the run
        did not time this scheme: its storage, else fp16's)."""
        if scheme in self.write:
            return self.write[scheme], f"{self.decode_source}: {scheme} write at 32k tokens"
        stem = scheme.split("/")[0]
        near = next((s for s in self.write if s.split("/")[0] == stem), "fp16")
        return self.write.get(near, 0.9), f"{self.decode_source}: {near} write (nearest to {scheme})"


def workload_points() -> dict[str, tuple[int, int]]:
    """``{W1: (batch, context), ...}``: what the decode points' sizes mean."""
    return {w.key: (w.batch, w.context) for w in WORKLOADS}
