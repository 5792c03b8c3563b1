"""How long preemption takes: swapping a request's KV blocks over the host link vs prefilling its tokens again.

The simulator (``workbench.sim.engine``) counts preemptions, recomputed tokens and swapped bytes but gives them
no duration. This module does, with two cost models:

- **swap** (:func:`swap_seconds`): a preempted request of ``tokens`` tokens holds ``ceil(tokens / block_size)``
  blocks of ``block_size * bytes_per_token`` bytes; swapping it moves them device -> host at preemption and
  host -> device at re-admission. ``batched=True`` moves each direction as one transfer (a staging buffer or
  one SM-copy launch); ``batched=False`` as one transfer per block, as vLLM's original per-block swap did
  (``cudaMemcpyAsync`` per block). A transfer takes what :class:`workbench.tiers.link.LinkModel` says a
  transfer of that size takes, so small copies pay the link's small-copy bandwidth (an 8 KiB copy-engine
  copy reaches ~0.5 GB/s on the H200, a 2 MiB one ~50 GB/s). Full blocks move, including the partly filled
  last one.
- **recompute** (:func:`recompute_seconds`): the request's prompt and generated tokens are prefilled again,
  :class:`PrefillModel`: ``fixed_s + n_tokens / tokens_per_s``.

The vLLM paper (SOSP'23, Figure 19(a)) found recompute cheaper than swap for small blocks (many small PCIe
copies) and swap competitive for large ones; :func:`block_size_curve` redoes that microbenchmark with our link
curves and prefill model, and :func:`compare_preemption` runs the simulator both ways on one trace.

Assumptions (all of them parameters):

- preemption time is not overlapped with decoding: it adds to the run's wall time (vLLM's scheduler swaps and
  recomputes inside the iteration that needs it);
- each swap-out, swap-in and recompute is its own event: no batching of several requests' swaps into one
  transfer, no sharing of one prefill pass between several recomputed requests (an upper bound for both);
- prefill time is linear in tokens (attention's quadratic term is ~8% of a 7B model's FLOPs at 2k tokens);
- host memory for swapped blocks is unlimited (vLLM caps its swap space);
- the simulator's memory behaviour is the same in both modes (``workbench.sim.engine``), so the two runs of
  :func:`compare_preemption` have the same steps and preemptions; only the time differs;
- the engine has no per-step time model (its ``step_s`` only places arrivals), so the decode time of a run is
  ``steps * step_s`` with ``step_s`` a parameter, and ``total_s = steps * step_s + preemption seconds``.

Defaults: :class:`PrefillModel` (LLaMA-7B on an H100/H200-class GPU, see its docstring), the link curves of
:func:`workbench.tiers.link.latest_link_model` (committed H200 runs, else DESIGN.md section 4), ``step_s`` =
:data:`DEFAULT_STEP_S`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from workbench.core.kv_spec import model as model_spec
from workbench.sim import engine
from workbench.sim import strategies as st
from workbench.sim.budget import PARAMS_B, Budget
from workbench.sim.traces import Trace
from workbench.tiers.link import DIRECTIONS, PATHS, LinkModel, latest_link_model

# LLaMA-7B (6.74e9 parameters) on an H100/H200-class GPU: an assumption in the 10k-20k tokens/s range usually
# quoted for 7B-class prefill. The compute roofline (2 * 6.74e9 = 13.5 GFLOP a token at 989 TFLOP/s dense bf16)
# would be ~73k tokens/s, so 15k tokens/s is ~20% of peak (attention, kernel and scheduling overheads).
DEFAULT_PREFILL_TOKENS_PER_S = 15_000.0
# The floor of any forward pass: reading the 13.5 GB of fp16 LLaMA-7B weights once at the H200's ~4.8 TB/s.
DEFAULT_PREFILL_FIXED_S = 0.003
# Assumed decode iteration of a 7B-13B model at a full batch on an H200: the weights (13.5-26 GB) plus the KV
# pool read once at ~4.8 TB/s HBM is ~5-10 ms.
DEFAULT_STEP_S = 0.01
_REF_PARAMS_B = PARAMS_B["llama-7b"]


@dataclass(frozen=True)
class PrefillModel:
    """Time to prefill ``n`` tokens of one request on the GPU: ``fixed_s + n / tokens_per_s`` (0 for no tokens).

    Defaults: LLaMA-7B on an H100/H200-class GPU, assumed (not measured here): ``tokens_per_s`` = 15,000
    (the 10k-20k tokens/s range quoted for 7B-class prefill; ~20% of the bf16 compute roofline), ``fixed_s`` =
    3 ms (one read of the 13.5 GB of weights at ~4.8 TB/s, the floor of a forward pass). Linear in tokens:
    attention's quadratic term is left out (~8% of the FLOPs of a 7B model at 2k tokens).

    Attributes:
        tokens_per_s: prefill throughput of the GPU on this model, tokens per second.
        fixed_s: seconds every prefill pays regardless of length.
        source: where the figures come from.
    """

    tokens_per_s: float = DEFAULT_PREFILL_TOKENS_PER_S
    fixed_s: float = DEFAULT_PREFILL_FIXED_S
    source: str = "assumed: LLaMA-7B on an H100/H200-class GPU"

    def __post_init__(self) -> None:
        if not _is_real(self.tokens_per_s) or not self.tokens_per_s > 0 or math.isinf(self.tokens_per_s):
            raise ValueError(f"tokens_per_s must be a finite number > 0, got {self.tokens_per_s!r}")
        if not _is_real(self.fixed_s) or not 0 <= self.fixed_s < math.inf:
            raise ValueError(f"fixed_s must be a finite number >= 0, got {self.fixed_s!r}")

    @classmethod
    def for_model(cls, model: str, tokens_per_s_7b: float = DEFAULT_PREFILL_TOKENS_PER_S,
                  fixed_s_7b: float = DEFAULT_PREFILL_FIXED_S) -> PrefillModel:
        """The 7B figures scaled by parameter count (``workbench.sim.budget.PARAMS_B``): a compute-bound prefill
        is proportional to parameters (throughput divided, the weight-read floor multiplied)."""
        if model not in PARAMS_B:
            raise ValueError(f"model must be one of {sorted(PARAMS_B)}, got {model!r}")
        r = PARAMS_B[model] / _REF_PARAMS_B
        return cls(tokens_per_s_7b / r, fixed_s_7b * r, f"7B figures scaled to {model} ({PARAMS_B[model]:g}B)")

    def seconds(self, n_tokens: int) -> float:
        """``fixed_s + n_tokens / tokens_per_s``; 0 for ``n_tokens == 0`` (nothing to prefill, no pass)."""
        _check_int("n_tokens", n_tokens, 0)
        return 0.0 if n_tokens == 0 else self.fixed_s + n_tokens / self.tokens_per_s


def model_bytes_per_token(model: str = "llama-7b", kv_dtype: str = "fp16") -> int:
    """K and V of one token across all layers of a known model (``workbench.core.kv_spec.MODELS``): LLaMA-7B fp16 is
    ``2 * 32 layers * 4096 * 2 bytes`` = 512 KiB."""
    return int(model_spec(model).bytes_per_token(kv_dtype))


def per_layer_transfers(model: str = "llama-7b") -> int:
    """Transfers per block when the cache is one K and one V tensor per layer (vLLM's layout): ``2 * layers``.
    Pass it as ``transfers_per_block`` to model vLLM's original swap, one copy per layer, K/V and block."""
    return 2 * model_spec(model).num_layers


def swap_seconds(tokens: int, bytes_per_token: int, block_size: int, link: LinkModel, path: str = "dma",
                 batched: bool = True, *, transfers_per_block: int = 1) -> float:
    """Time to swap one preempted request of ``tokens`` tokens out (device -> host) and back in (host -> device).

    Its ``ceil(tokens / block_size)`` blocks of ``block_size * bytes_per_token`` bytes move in each direction as
    one transfer (``batched``) or one transfer per block (vLLM's original per-block swap); with
    ``transfers_per_block = k`` a block is ``k`` transfers of ``block_bytes / k`` bytes (vLLM's per-layer K/V
    tensors: :func:`per_layer_transfers`). ``path``: ``"dma"`` (copy engine), ``"sm"`` (copy kernel) or
    ``"disk"`` (write then read). 0 for no tokens.
    """
    out_dir, in_dir = _check_swap(bytes_per_token, block_size, link, path, batched, transfers_per_block)
    _check_int("tokens", tokens, 0)
    return sum(_leg(tokens, bytes_per_token, block_size, link, path, d, batched, transfers_per_block)
               for d in (out_dir, in_dir))


def recompute_seconds(tokens: int, prefill: PrefillModel | None = None) -> float:
    """Time to recompute one preempted request: prefill its ``tokens`` (prompt + generated) tokens again."""
    _check_int("tokens", tokens, 0)
    return _prefill(prefill).seconds(tokens)


def preemption_overhead(result: engine.Result, link: LinkModel | None = None, prefill: PrefillModel | None = None,
                        *, block_size: int | None = None, bytes_per_token: int | None = None, path: str = "dma",
                        batched: bool = True, transfers_per_block: int = 1) -> dict:
    """Total preemption time of a simulator run both ways: what swap would cost, what recompute would cost.

    The run's events are the same in both modes (``Result.preempted_tokens``: tokens each preempted request
    held, swapped out; ``Result.resumed_tokens``: tokens each re-admitted one brought back, swapped in or
    prefilled again), so one run prices both. Each event is priced alone (:func:`swap_seconds`'s legs,
    :func:`recompute_seconds`).

    Args:
        result: a :func:`workbench.sim.run` result (of either preemption mode).
        link: host-link curves (default :func:`workbench.tiers.link.latest_link_model`).
        prefill: compute model (default :meth:`PrefillModel.for_model` of the budget's model, else
            :class:`PrefillModel`).
        block_size: tokens per block (default the run's ``Result.block_size``; required for contiguous and
            adaptive strategies, which have none: pass e.g. the request length cap for one transfer a request).
        bytes_per_token: default the run's ``budget.bytes_per_token``.
        path, batched, transfers_per_block: as in :func:`swap_seconds`.

    Returns:
        ``{"preemption" (the run's mode), "preemptions", "swap_outs", "swap_ins", "swap_blocks" (both ways),
        "swap_bytes" (moved both ways, whole blocks), "swap_token_bytes" (token states only, both ways: the
        engine's ``swapped_bytes`` in a swap run), "swap_out_s", "swap_in_s", "swap_s", "recomputes",
        "recompute_tokens", "recompute_s", "actual_s" (the run's own mode), "faster" ("swap" or "recompute")}``.
    """
    if not isinstance(result, engine.Result):
        raise ValueError(f"result must be a workbench.sim.engine.Result, got {type(result).__name__}")
    if result.preempted_tokens is None or result.resumed_tokens is None:
        raise ValueError("result has no per-event preemption counters (preempted_tokens / resumed_tokens)")
    bs = result.block_size if block_size is None else block_size
    if bs is None:
        raise ValueError(f"block_size is required: strategy {result.strategy!r} has no single block size")
    bpt = result.budget.bytes_per_token if bytes_per_token is None else bytes_per_token
    link = latest_link_model() if link is None else link
    prefill = _default_prefill(result.budget) if prefill is None else _prefill(prefill)
    out_dir, in_dir = _check_swap(bpt, bs, link, path, batched, transfers_per_block)

    def legs(tokens: np.ndarray, direction: str) -> float:
        counts = np.unique(tokens, return_counts=True)  # many events share a length: price each length once
        return sum(int(c) * _leg(int(t), bpt, bs, link, path, direction, batched, transfers_per_block)
                   for t, c in zip(*counts, strict=True))

    out_t, in_t = result.preempted_tokens, result.resumed_tokens
    out_s, in_s = legs(out_t, out_dir), legs(in_t, in_dir)
    blocks = int((-(-out_t // bs)).sum() + (-(-in_t // bs)).sum())
    counts = np.unique(in_t, return_counts=True)
    rec_s = sum(int(c) * prefill.seconds(int(t)) for t, c in zip(*counts, strict=True))
    swap_s = out_s + in_s
    return {
        "preemption": result.preemption, "preemptions": result.preemptions,
        "swap_outs": int(out_t.size), "swap_ins": int(in_t.size), "swap_blocks": blocks,
        "swap_bytes": blocks * bs * bpt, "swap_token_bytes": int(out_t.sum() + in_t.sum()) * bpt,
        "swap_out_s": out_s, "swap_in_s": in_s, "swap_s": swap_s,
        "recomputes": int(in_t.size), "recompute_tokens": int(in_t.sum()), "recompute_s": rec_s,
        "actual_s": swap_s if result.preemption == "swap" else rec_s,
        "faster": "swap" if swap_s < rec_s else "recompute",
    }


def block_size_curve(block_sizes: Iterable[int], tokens: int, bytes_per_token: int,
                     link: LinkModel | None = None, prefill: PrefillModel | None = None, *, path: str = "dma",
                     transfers_per_block: int = 1) -> list[dict]:
    """The vLLM paper's Figure 19(a)-style microbenchmark: swap vs recompute latency of one request of ``tokens``
    tokens as a function of block size.

    Per-block swap is slow for small blocks (small copies reach a fraction of the link's bandwidth), batched
    swap is flat (one large transfer each way; only the last block's rounding changes with block size),
    recompute does not depend on block size. With whole blocks as one copy each (``transfers_per_block=1``) a
    LLaMA-7B block is >= 512 KiB, which the H200's copy engine already moves at ~36 GB/s; vLLM's per-layer
    K/V tensors (``transfers_per_block=per_layer_transfers("llama-7b")``, 64 copies of 8 KiB per token of
    block size) make the small-block copies slow enough for recompute to win below ~32 tokens per block.

    Args:
        block_sizes: tokens per block, e.g. ``(1, 2, 4, ..., 256)``.
        tokens: the request's tokens (prompt + generated at preemption).
        bytes_per_token: K and V of one token (:func:`model_bytes_per_token`; LLaMA-7B fp16: 512 KiB).
        link: default :func:`workbench.tiers.link.latest_link_model`.
        prefill: default :class:`PrefillModel`.
        path, transfers_per_block: as in :func:`swap_seconds`.

    Returns:
        One row per block size: ``{"block_size", "blocks", "block_bytes", "transfer_bytes" (one per-block
        transfer), "swap_per_block_s", "swap_batched_s", "recompute_s", "per_block_vs_recompute"
        (swap_per_block_s / recompute_s), "faster" (of per-block swap and recompute)}``.
    """
    sizes = list(block_sizes) if not isinstance(block_sizes, (str, bytes)) else None
    if not sizes:
        raise ValueError(f"block_sizes must be a non-empty sequence of ints >= 1, got {block_sizes!r}")
    for b in sizes:
        _check_int("block_sizes", b, 1)
    _check_int("tokens", tokens, 1)
    link = latest_link_model() if link is None else link
    prefill = _prefill(prefill)
    rec = recompute_seconds(tokens, prefill)
    rows = []
    for b in sizes:
        kw = {"transfers_per_block": transfers_per_block}
        per = swap_seconds(tokens, bytes_per_token, b, link, path, False, **kw)
        bat = swap_seconds(tokens, bytes_per_token, b, link, path, True, **kw)
        rows.append({"block_size": b, "blocks": -(-tokens // b), "block_bytes": b * bytes_per_token,
                     "transfer_bytes": b * bytes_per_token // transfers_per_block,
                     "swap_per_block_s": per, "swap_batched_s": bat, "recompute_s": rec,
                     "per_block_vs_recompute": per / rec, "faster": "swap" if per < rec else "recompute"})
    return rows


#: tokens per block of the swap-or-recompute tables (the vLLM paper's Figure 19(a) range)
BLOCK_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
#: what a table row of :func:`curve_table` shows, by the column of :func:`block_size_curve` it comes from
CURVE_TIMES = {"swap_per_block_s": "swap, copy by copy", "swap_batched_s": "swap, batched", "recompute_s": "recompute"}


def swap_recompute_curves(models: Iterable[str], tokens: int, link: LinkModel | None = None,
                          block_sizes: Iterable[int] = BLOCK_SIZES, path: str = "dma") -> list[dict]:
    """:func:`block_size_curve` of each model, its blocks moved as vLLM's per-layer K and V copies
    (``copies="layer"``, :func:`per_layer_transfers` copies a block) and as one copy a block (``"block"``), each
    with its own :meth:`PrefillModel.for_model`: the curve's rows led by ``model``, ``copies`` and
    ``transfers_per_block``."""
    sizes = list(block_sizes)
    rows = []
    for model in models:
        bpt, prefill = model_bytes_per_token(model), PrefillModel.for_model(model)
        for copies, k in (("layer", per_layer_transfers(model)), ("block", 1)):
            rows += [{"model": model, "copies": copies, "transfers_per_block": k, **r}
                     for r in block_size_curve(sizes, tokens, bpt, link, prefill, path=path, transfers_per_block=k)]
    return rows


def curve_table(rows: Iterable[dict]) -> list[dict]:
    """:func:`swap_recompute_curves`' rows turned on their side for a table: per model and copies one row per time
    of :data:`CURVE_TIMES` (milliseconds) and one saying which is ``faster`` (``swap`` / ``reco``mpute), keyed
    ``{model, copies, time, "<block size>": value}``; ``copies`` reads ``64 x 8 KiB`` (per-layer copies a token of
    block) or ``whole block``."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["model"], r["copies"], r["transfers_per_block"]), []).append(r)
    out = []
    for (model, copies, k), curve in groups.items():
        label = f"{k} x {model_bytes_per_token(model) // k / 1024:g} KiB" if copies == "layer" else "whole block"
        for key, name in CURVE_TIMES.items():
            out.append({"model": model, "copies": label, "time": name,
                        **{str(r["block_size"]): 1e3 * r[key] for r in curve}})
        out.append({"model": model, "copies": label, "time": "faster",
                    **{str(r["block_size"]): r["faster"][:4] for r in curve}})
    return out


def crossover(rows: Iterable[dict], model: str = "llama-7b", copies: str = "layer") -> int | None:
    """The smallest block size from which the other of per-block swap and recompute is faster than at the
    smallest block, in :func:`swap_recompute_curves`' rows of ``model`` and ``copies``; None when one of them wins
    at every block size."""
    curve = sorted((r for r in rows if r["model"] == model and r["copies"] == copies), key=lambda r: r["block_size"])
    if not curve:
        raise ValueError(f"rows hold no curve of model {model!r} with copies {copies!r}")
    return next((r["block_size"] for r in curve if r["faster"] != curve[0]["faster"]), None)


def compare_preemption(trace: Trace, strategy: str | st.Strategy = "vllm", budget: Budget | None = None,
                       link: LinkModel | None = None, prefill: PrefillModel | None = None, *,
                       step_s: float = DEFAULT_STEP_S, timed_arrivals: bool = False, block_size: int | None = None,
                       path: str = "dma", batched: bool = True, transfers_per_block: int = 1, max_batch: int = 256,
                       max_steps: int | None = None) -> dict:
    """Run the simulator on ``trace`` with preemption by swap and by recompute, and time both.

    The engine has no per-step time model, so each run's time is ``total_s = steps * step_s + preemption_s``
    (``step_s`` assumed, :data:`DEFAULT_STEP_S`; preemption not overlapped with decoding). ``timed_arrivals``
    also passes ``step_s`` to the engine to place arrivals in time (default: all queued at step 0, saturated).

    Args:
        trace, strategy, budget, max_batch, max_steps: as in :func:`workbench.sim.run` (default budget: its).
        link, prefill, block_size, path, batched, transfers_per_block: as in :func:`preemption_overhead`.
        step_s: seconds per decode step.
        timed_arrivals: place arrivals at ``arrival_s // step_s``.

    Returns:
        ``{"swap": row, "recompute": row, "faster", "recompute_over_swap" (total_s ratio), "assumptions"}``, a
        row: ``{"preemption", "preemptions", "swapped_bytes", "swap_bytes_moved", "recomputed_tokens",
        "preemption_s", "steps", "completed", "decode_s", "total_s", "overhead_pct" (preemption_s / total_s)}``.
    """
    if not _is_real(step_s) or not 0 < step_s < math.inf:
        raise ValueError(f"step_s must be a finite number > 0, got {step_s!r}")
    if not isinstance(timed_arrivals, bool):
        raise ValueError(f"timed_arrivals must be a bool, got {timed_arrivals!r}")
    link = latest_link_model() if link is None else link
    out: dict = {}
    pf = None if prefill is None else _prefill(prefill)
    for mode in ("swap", "recompute"):
        res = engine.run(trace, strategy, budget, preemption=mode, max_batch=max_batch, max_steps=max_steps,
                         step_s=step_s if timed_arrivals else None)
        pf = _default_prefill(res.budget) if pf is None else pf
        ov = preemption_overhead(res, link, pf, block_size=block_size, path=path, batched=batched,
                                 transfers_per_block=transfers_per_block)
        decode_s = res.steps * step_s
        total = decode_s + ov["actual_s"]
        out[mode] = {"preemption": mode, "preemptions": res.preemptions, "swapped_bytes": res.swapped_bytes,
                     "swap_bytes_moved": ov["swap_bytes"] if mode == "swap" else 0,
                     "recomputed_tokens": res.recomputed_tokens, "preemption_s": ov["actual_s"],
                     "steps": res.steps, "completed": res.completed, "decode_s": decode_s, "total_s": total,
                     "overhead_pct": 100 * ov["actual_s"] / total if total else 0.0}
    s, r = out["swap"]["total_s"], out["recompute"]["total_s"]
    out["faster"] = "swap" if s < r else "recompute"
    out["recompute_over_swap"] = r / s if s else float("nan")
    out["assumptions"] = {
        "step_s": step_s, "total_s": "steps * step_s + preemption_s (no per-step time model in the engine)",
        "link": link.source, "path": path, "batched": batched, "transfers_per_block": transfers_per_block,
        "prefill": {"tokens_per_s": pf.tokens_per_s, "fixed_s": pf.fixed_s, "source": pf.source},
    }
    return out


# ---------------------------------------------------------------------------------------------- helpers


def _leg(tokens: int, bpt: int, bs: int, link: LinkModel, path: str, direction: str, batched: bool,
         k: int) -> float:
    """One direction of one request's swap (arguments already checked)."""
    if tokens == 0:
        return 0.0
    blocks = -(-tokens // bs)
    if batched:
        return link.batch_seconds(bs * bpt, blocks, path, direction, batched=True)
    return link.batch_seconds(bs * bpt // k, blocks * k, path, direction, batched=False)


def _check_swap(bpt, bs, link, path, batched, k) -> tuple[str, str]:
    _check_int("bytes_per_token", bpt, 1)
    _check_int("block_size", bs, 1)
    _check_int("transfers_per_block", k, 1)
    if not isinstance(link, LinkModel):
        raise ValueError(f"link must be a workbench.tiers.link.LinkModel, got {type(link).__name__}")
    if path not in PATHS:
        raise ValueError(f"path must be one of {PATHS}, got {path!r}")
    if not isinstance(batched, bool):
        raise ValueError(f"batched must be a bool, got {batched!r}")
    if (bs * bpt) % k:
        raise ValueError(f"transfers_per_block ({k}) must divide the block's bytes ({bs * bpt})")
    out_dir, in_dir = DIRECTIONS[path]
    for d in (out_dir, in_dir):
        if (path, d) not in link.points:
            raise ValueError(f"link has no curve for path {path!r}, direction {d!r}")
    return out_dir, in_dir


def _check_int(name: str, v, lo: int) -> None:
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < lo:
        raise ValueError(f"{name} must be an int >= {lo}, got {v!r}")


def _is_real(v) -> bool:
    return isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, bool) and not math.isnan(v)


def _prefill(p: PrefillModel | None) -> PrefillModel:
    if p is None:
        return PrefillModel()
    if not isinstance(p, PrefillModel):
        raise ValueError(f"prefill must be a PrefillModel, got {type(p).__name__}")
    return p


def _default_prefill(budget: Budget) -> PrefillModel:
    return PrefillModel.for_model(budget.model) if budget.model in PARAMS_B else PrefillModel()
