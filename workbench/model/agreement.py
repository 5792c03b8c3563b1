"""A quantized cache's greedy run of a prompt against the fp16 cache's: the tokens they agree on, where they
diverge, how far the log-probs drift before that, and what each stores per token (notebook 06's agreement panel
and the ``agreement`` sweep).

    ref = greedy(model, tokens, 16, "fp16")
    agreement_result(model, tok, tokens, 16, "int4/token", ref)   # equal, first_divergence, max_drift, bytes, ...
"""

from __future__ import annotations

from collections.abc import Sequence

from workbench import quant
from workbench.model import quality
from workbench.model.inspect import Recorded, common_prefix, record


def compare_greedy(ref_tokens: Sequence[int], ref_logprobs: Sequence[float], tokens: Sequence[int],
                   logprobs: Sequence[float]) -> dict:
    """Two greedy runs of one prompt (fp16 cache ``ref_*``, another cache): ``equal`` (leading tokens equal),
    ``first_divergence`` (the first differing position, None when all are equal), ``drift`` (per position before
    it: the other run's log-prob of the same token minus fp16's) and ``max_drift`` (its largest magnitude)."""
    if len(ref_tokens) != len(ref_logprobs) or len(tokens) != len(logprobs):
        raise ValueError(f"each run needs one log-prob per token, got {len(ref_tokens)} tokens / "
                         f"{len(ref_logprobs)} log-probs and {len(tokens)} / {len(logprobs)}")
    equal = common_prefix([int(t) for t in ref_tokens], [int(t) for t in tokens])
    n = min(len(ref_tokens), len(tokens))
    drift = [float(logprobs[i]) - float(ref_logprobs[i]) for i in range(equal)]
    return {"equal": equal, "first_divergence": None if equal == n and len(ref_tokens) == len(tokens) else equal,
            "drift": drift, "max_drift": max((abs(d) for d in drift), default=0.0)}


def page_tokens_for(scheme, page_tokens: int = 16) -> int:
    """``page_tokens``, raised to a multiple of the key group for schemes whose key groups span tokens (KIVI's
    per-channel keys: 32 tokens)."""
    s = quant.resolve(scheme)
    if page_tokens % s.write_group:
        return -(-page_tokens // s.write_group) * s.write_group
    return page_tokens


def calibration_sample(model, tok):
    """Every layer's K/V over the calibration text ``workbench.model.quality`` uses (the Gettysburg address):
    static schemes' scales are set on another text than the one they store, as a server fixes them ahead."""
    return quality.capture_kv(model, tok.encode(quality.load_text([quality.CALIBRATION_TEXT])))


def greedy(model, tokens: Sequence[int], new_tokens: int, scheme: str, ops: str | None = None,
           calibration=None, prefilled=None) -> Recorded:
    """A greedy run of one prompt through a cache of ``scheme``; a static scheme's scales (one pair for all
    layers) come from ``calibration`` (:func:`calibration_sample`). ``prefilled``: the prompt's prefill
    (``workbench.model.quality.prefill_all``), made here when None; the run keeps it (``Recorded.prefilled``), so
    another scheme's run of the same prompt starts from it: prefill attends over fresh K/V, the same under every
    cache, and on a CPU it is most of a short run's time."""
    tokens = [int(t) for t in tokens]
    pre = prefilled if prefilled is not None else quality.prefill_all(model, [tokens])[0]
    k_scale = v_scale = None
    if quant.get(scheme).needs_static_scales:
        if calibration is None:
            raise ValueError(f"calibration must be given for {scheme}, whose scales are static "
                             f"(calibration_sample(model, tok))")
        k_scale, v_scale = quality.static_scales(scheme, calibration)
    return record(model, [tokens], new_tokens, kv_dtype=scheme, page_tokens=page_tokens_for(scheme), ops=ops,
                  k_scale=k_scale, v_scale=v_scale, prefilled=[pre])


def agreement_result(model, tok, tokens: Sequence[int], new_tokens: int, scheme: str, ref=None,
                     ops: str | None = None, calibration=None) -> dict:
    """What ``workbench.figures.model.agreement`` draws: ``scheme``'s greedy run of ``tokens`` against fp16's
    (``ref``: an fp16 :class:`Recorded` of the same prompt, computed when None; ``calibration``:
    :func:`calibration_sample`, computed when a static scheme needs it)."""
    ref = ref if ref is not None else greedy(model, tokens, new_tokens, "fp16", ops)
    s = quant.get(scheme)
    if s.needs_static_scales and calibration is None:
        calibration = calibration_sample(model, tok)
    pre = (ref.prefilled or [None])[0]  # the reference's prefill, when it is of these tokens
    run = greedy(model, tokens, new_tokens, scheme, ops, calibration,
                 pre if pre is not None and list(pre.tokens) == [int(t) for t in tokens] else None)
    a, b = ref.generation, run.generation
    cmp = compare_greedy(a.tokens[(0, 0)], a.logprobs[(0, 0)], b.tokens[(0, 0)], b.logprobs[(0, 0)])
    cfg = model.config
    stored = s.bytes_per_token(cfg.num_key_value_heads, cfg.head_dim, context=len(tokens) + new_tokens)
    total = len(tokens) + new_tokens - 1  # the last chosen token is never fed back
    q = run.quantized_tokens.get((0, 0), total)
    scales = s.scales_label()
    if s.needs_static_scales:
        scales += " (static: calibrated on the Gettysburg address, one pair for all layers)"
    note = f"{len(tokens)} prompt tokens, {new_tokens} new; {s.name}: {scales}"
    if q < total:
        note += f"; {q} of the {total} cached tokens quantized, the newest {total - q} still fp16"
    return {"scheme": s.name, "tokens": b.tokens[(0, 0)], "ref_tokens": a.tokens[(0, 0)],
            "pieces": [tok.token(t) for t in b.tokens[(0, 0)]], "ref_pieces": [tok.token(t) for t in a.tokens[(0, 0)]],
            "logprobs": b.logprobs[(0, 0)], "ref_logprobs": a.logprobs[(0, 0)], "new_tokens": new_tokens,
            "ref_bytes": quant.get("fp16").bytes_per_token(cfg.num_key_value_heads, cfg.head_dim),
            "bytes": stored, "quantized_tokens": q, "cached_tokens": total, "note": note, **cmp}


def agreement_results(model, tok, tokens: Sequence[int], new_tokens: int, schemes: Sequence[str], ref,
                      ops: str | None = None, calibration=None, prompt: str = "") -> dict:
    """:func:`agreement_result` of each scheme on one prompt against its fp16 run ``ref``, keyed
    ``(scheme, prompt)`` as ``agreement_panel(results=...)`` takes them."""
    return {(scheme, prompt): agreement_result(model, tok, tokens, new_tokens, scheme, ref, ops, calibration)
            for scheme in schemes}


def format_agreement(results: dict) -> str:
    """One line per :func:`agreement_result`: the scheme, its bytes per token and layer, leading tokens equal and
    the first divergence (None: none)."""
    return "\n".join(f"{r['scheme']:16s} {r['bytes']:4.0f} B/token/layer: {r['equal']} of {r['new_tokens']} tokens "
                     f"equal, first divergence {r['first_divergence']}" for r in results.values())
