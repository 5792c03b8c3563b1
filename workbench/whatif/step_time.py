"""How long one serving step takes, built from a :class:`~workbench.whatif.profile.GpuProfile`: a list of parts,
each with its seconds and the source of the number it came from (the "why" of a what-if).

    sm = StepModel(profile, cfg, scheme="int4/token")
    parts = sm.decode(batch=16, context_tokens=16 * 767)     # [Part("weights", s, source), ...]
    step_seconds(parts)

A decode step of ``batch`` sequences holding ``context_tokens`` in all:

- ``weights``: the linear layers' weights read once (``weight_bytes`` a parameter) at the profile's weight-read
  fraction of copy bandwidth, or their FLOPs at the tensor-core peak when the batch makes them compute-bound;
- ``attention``: every layer's stored K/V (the scheme's bytes per token, scales counted) read by paged decode at
  the scheme's measured fraction of copy bandwidth;
- ``write``: the new tokens' K/V quantized on write at the scheme's measured write fraction;
- ``overhead``: the kernels' floors, ``layer_us`` a layer (every kernel of a layer at batch 1: fitted to the real
  model's CUDA-graph step, see :func:`fit_layer_overhead`, until a profile run measures it).

A prefill of ``tokens`` (after ``context`` cached ones) is compute-bound: FLOPs at ``peak_tflops x prefill_mfu``
(assumed until measured), never faster than reading the weights once, plus the same overhead.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

from workbench import quant
from workbench.model.config import LlamaConfig
from workbench.whatif import models
from workbench.whatif.profile import RESULTS, GpuProfile, Measured


@dataclass(frozen=True)
class Part:
    """One part of a step: its name, seconds and where the number came from."""

    name: str
    seconds: float
    source: str


def step_seconds(parts: list[Part]) -> float:
    return sum(p.seconds for p in parts)


@dataclass(frozen=True)
class StepModel:
    """See the module docstring. ``frac`` picks the decode fraction: ``"median"``, ``"min"`` or ``"max"`` of the
    measured workloads (the sensitivity study varies it)."""

    profile: GpuProfile
    cfg: LlamaConfig
    scheme: str = "fp16"
    weight_bytes: float = 2.0
    frac: str = "median"

    def __post_init__(self) -> None:
        quant.get(self.scheme)  # a known scheme (ValueError naming it)
        self.profile.decode_frac(self.scheme)  # ... that the profile measured
        if self.frac not in ("median", "min", "max"):
            raise ValueError(f"frac must be 'median', 'min' or 'max', got {self.frac!r}")
        if not self.weight_bytes > 0:
            raise ValueError(f"weight_bytes must be > 0, got {self.weight_bytes!r}")

    @property
    def kv_bytes_per_token(self) -> float:
        """K and V of one token in every layer, as ``scheme`` stores it (scales counted)."""
        c = self.cfg
        return quant.get(self.scheme).bytes_per_token(c.num_key_value_heads, c.head_dim) * c.num_hidden_layers

    @property
    def weights_bytes(self) -> float:
        return models.linear_params(self.cfg) * self.weight_bytes

    def _overhead(self) -> Part:
        lu = self.profile.launch_us
        return Part("overhead", self.cfg.num_hidden_layers * lu.value * 1e-6,
                    f"{self.cfg.num_hidden_layers} layers x {lu.value:.1f} us ({lu.source})")

    def decode(self, batch: int, context_tokens: int) -> list[Part]:
        _check_count("batch", batch, 1)
        _check_count("context_tokens", context_tokens, 0)
        p, copy = self.profile, self.profile.copy_gbps.value * 1e9
        mem = self.weights_bytes / (p.gemv_frac.value * copy)
        flops = 2.0 * models.linear_params(self.cfg) * batch
        compute = flops / (p.peak_tflops.value * 1e12)
        weights = Part("weights", max(mem, compute),
                       f"{self.weights_bytes / 1e6:.0f} MB at {p.gemv_frac.value:.2f} of copy bandwidth "
                       f"({p.copy_gbps.source}; {p.gemv_frac.source})" if mem >= compute else
                       f"{flops / 1e9:.0f} GFLOP at {p.peak_tflops.value:.0f} TFLOP/s ({p.peak_tflops.source})")
        med, lo, hi, src = p.decode_frac(self.scheme)
        f = {"median": med, "min": lo, "max": hi}[self.frac]
        kv = context_tokens * self.kv_bytes_per_token
        attention = Part("attention", kv / (f * copy), f"{kv / 1e6:.1f} MB of K/V at {f:.2f} of copy bandwidth ({src})")
        wf, wsrc = p.write_frac(self.scheme)
        new = batch * self.kv_bytes_per_token
        write = Part("write", new / (wf * copy), f"{new / 1e3:.0f} KB written at {wf:.2f} ({wsrc})")
        parts = [weights, attention, write, self._overhead()]
        su = self.profile.seq_us
        if su.value and batch > 1:  # an eager runner's per-sequence host work (none under a graph)
            parts.append(Part("host per sequence", (batch - 1) * su.value * 1e-6,
                              f"{batch - 1} sequences past the first x {su.value:.0f} us ({su.source})"))
        return parts

    def prefill(self, tokens: int, context: int = 0) -> list[Part]:
        """A prefill of ``tokens`` new tokens after ``context`` cached ones (one sequence, or a chunk)."""
        _check_count("tokens", tokens, 1)
        _check_count("context", context, 0)
        p = self.profile
        mean_ctx = context + (tokens - 1) / 2  # each new token attends to the cache and the tokens before it
        flops = models.flops_per_token(self.cfg, int(mean_ctx)) * tokens
        rate = p.peak_tflops.value * p.prefill_mfu.value * 1e12
        floor = self.weights_bytes / (p.gemv_frac.value * p.copy_gbps.value * 1e9)
        t = max(flops / rate, floor)
        src = (f"{flops / 1e12:.2f} TFLOP at {p.peak_tflops.value:.0f} x {p.prefill_mfu.value:.2f} "
               f"({p.peak_tflops.source}; {p.prefill_mfu.source})")
        parts = [Part("prefill", t, src), self._overhead()]
        pu = self.profile.prefill_us
        if pu.value:
            parts.append(Part("host per prefill", pu.value * 1e-6, f"{pu.value / 1e3:.1f} ms ({pu.source})"))
        return parts


    # ---- the same sums without their sources: what the simulator calls every step ----------------------------
    def decode_seconds(self, batch: int, context_tokens: int) -> float:
        """``step_seconds(self.decode(batch, context_tokens))``, fast (no checks, no sources)."""
        k = self._coefficients
        return max(k[0], k[1] * batch) + k[2] * context_tokens + k[3] * batch + k[4] + k[7] * (batch - 1)

    def prefill_seconds(self, tokens: int, context: int = 0) -> float:
        """``step_seconds(self.prefill(tokens, context))``, fast."""
        k = self._coefficients
        c = self.cfg
        mean_ctx = int(context + (tokens - 1) / 2)
        flops = (2.0 * k[5] + 4 * c.num_attention_heads * c.head_dim * mean_ctx * c.num_hidden_layers) * tokens
        return max(flops * k[6], k[0]) + k[4] + k[8]

    @property
    def _coefficients(self) -> tuple[float, ...]:
        cached = self.__dict__.get("_k")
        if cached is None:
            p, copy = self.profile, self.profile.copy_gbps.value * 1e9
            lin = models.linear_params(self.cfg)
            wf = p.write_frac(self.scheme)[0]
            med, lo, hi, _ = p.decode_frac(self.scheme)
            f = {"median": med, "min": lo, "max": hi}[self.frac]
            cached = (self.weights_bytes / (p.gemv_frac.value * copy), 2.0 * lin / (p.peak_tflops.value * 1e12),
                      self.kv_bytes_per_token / (f * copy), self.kv_bytes_per_token / (wf * copy),
                      self.cfg.num_hidden_layers * p.launch_us.value * 1e-6, lin,
                      1.0 / (p.peak_tflops.value * p.prefill_mfu.value * 1e12), p.seq_us.value * 1e-6,
                      p.prefill_us.value * 1e-6)
            object.__setattr__(self, "_k", cached)
        return cached


def decode_run(folder: Path | str, gpu: str) -> Path | None:
    """The newest ``bench model_decode`` run of ``gpu`` in ``folder`` that has decode rows (a run of the sections
    ``cascade`` or ``quest`` alone has none), or None."""
    for path in sorted(Path(folder).glob(f"model-decode-{gpu}-*.json"), reverse=True):
        if any(r.get("section") == "decode" for r in json.loads(path.read_text()).get("rows", [])):
            return path
    return None


def fit_layer_overhead(profile: GpuProfile, cfg: LlamaConfig, run: Path | str | None = None,
                       batch: int = 1, column: str = "compiled_replay_ms") -> GpuProfile:
    """``profile`` with ``launch_us`` (a layer's kernels' floors) fitted to the real model's measured CUDA-graph
    decode step at ``batch`` (``bench model_decode``, its ``column``): what the step's weights, attention and
    write do not explain, spread over the layers. Only that batch is used; the others validate."""
    if run is None:
        run = decode_run(RESULTS, profile.name)
        if run is None:
            raise ValueError(f"no model-decode-{profile.name}-*.json with decode rows under {RESULTS} to fit the "
                             f"overhead to")
    path = Path(run)
    doc = json.loads(Path(path).read_text())
    row = next((r for r in doc["rows"] if r.get("section") == "decode" and r.get("batch") == batch), None)
    if row is None or column not in row:
        raise ValueError(f"{Path(path).name} has no decode row at batch {batch} with {column!r}")
    fitted = fit_layer_overhead_to(profile, cfg, row[column], batch, batch * int(row["context_end"]),
                                   f"{Path(path).name} batch {batch} {column}")
    return replace(fitted, files=(*profile.files, Path(path).name))


def fit_layer_overhead_to(profile: GpuProfile, cfg: LlamaConfig, step_ms: float, batch: int, context_tokens: int,
                          source: str) -> GpuProfile:
    """``profile`` with ``launch_us`` fitted to one measured decode step of ``step_ms`` at ``batch`` sequences holding
    ``context_tokens`` in all (what the step's weights, attention and write do not explain, spread over the layers);
    ``source`` says where the step was measured. :func:`fit_layer_overhead` takes the step from a committed run; a
    replay measures its own runner's on the machine it runs on (``workbench.whatif.replay.calibrate``)."""
    if isinstance(step_ms, bool) or not isinstance(step_ms, (int, float)) or not step_ms > 0:
        raise ValueError(f"step_ms must be a number > 0 (milliseconds), got {step_ms!r}")
    _check_count("batch", batch, 1)
    _check_count("context_tokens", context_tokens, 0)
    base = StepModel(profile.with_launch(Measured(0.0, "fitted")), cfg, "fp16", weight_bytes=2.0)
    rest = step_seconds(base.decode(batch, context_tokens))
    per_layer = max(0.0, (step_ms * 1e-3 - rest) / cfg.num_hidden_layers) * 1e6
    return replace(profile, launch_us=Measured(per_layer, f"fitted: {source} {step_ms:.3f} ms"))


def fit_host_to(profile: GpuProfile, cfg: LlamaConfig, calibration: dict, source: str) -> GpuProfile:
    """``profile`` fitted to an eager runner's own times (``workbench.whatif.replay.calibrate``): ``launch_us`` to its
    step at batch 1 (:func:`fit_layer_overhead_to`), ``seq_us`` to what its step at ``wide`` sequences takes beyond
    the model's (spread over the sequences past the first), ``prefill_us`` to what its prefill of ``prompt`` tokens
    takes beyond the model's. ``source`` says where the times were measured."""
    missing = {"step_ms", "context", "prompt", "prefill_ms", "step_wide_ms", "wide"} - set(calibration)
    if missing:
        raise ValueError(f"calibration must hold calibrate's times, missing {sorted(missing)}")
    ctx, wide = int(calibration["context"]), int(calibration["wide"])
    _check_count("wide", wide, 2)
    prof = fit_layer_overhead_to(profile, cfg, calibration["step_ms"], 1, ctx, f"{source}: step at batch 1")
    model = StepModel(prof, cfg, "fp16")
    extra = calibration["step_wide_ms"] * 1e-3 - model.decode_seconds(wide, wide * ctx)
    seq = max(0.0, extra / (wide - 1)) * 1e6
    prefill = max(0.0, calibration["prefill_ms"] * 1e-3 - model.prefill_seconds(int(calibration["prompt"]))) * 1e6
    return replace(prof, seq_us=Measured(seq, f"fitted: {source}: step of {wide} sequences "
                                              f"{calibration['step_wide_ms']:.2f} ms"),
                   prefill_us=Measured(prefill, f"fitted: {source}: prefill of {calibration['prompt']} tokens "
                                                f"{calibration['prefill_ms']:.2f} ms"))


def _check_count(name: str, v, lo: int) -> None:
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        raise ValueError(f"{name} must be an int >= {lo}, got {v!r}")
