"""The error study of K/V quantization schemes against fp32: metrics, per-layer rows, the Pareto front.

Every function takes plain tensors, so K/V (and queries) captured from a real model can replace the synthetic
ones (:mod:`workbench.quant.synthetic`). Shapes: keys and values ``[layers, tokens, kv_heads, head_dim]``, queries
``[layers, queries, kv_heads * group, head_dim]`` (grouped-query attention: query head ``i`` reads kv head
``i // group``), all fp32. The attention is one decode step per query: each query attends to every cached token
(no causal mask).

Cost: every scheme of the registry on 6 layers x 512 tokens x 3 heads x 64 with 64 queries takes about a second
on one CPU core. The tensors are small (~100k values), so on a shared CPU ``torch.set_num_threads(1)`` is much
faster than two threads waiting for each other (20x measured on a busy 2-core machine).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import torch

from . import SCHEMES, get
from .families import Scheme
from .names import STUDY_FAMILIES as FAMILIES
from .names import STUDY_GROUP_FAMILIES as GROUP_FAMILIES
from .names import STUDY_SCALED_FAMILIES as SCALED_FAMILIES
from .synthetic import apply_rope

# ---- metrics -----------------------------------------------------------------------------------------------------


def reconstruction_error(x: torch.Tensor, x_hat: torch.Tensor) -> float:
    """``||x_hat - x||_F / ||x||_F``, the norms accumulated in float64 (0 for identical tensors; ``inf`` if
    ``x_hat`` is not finite).

    Args:
        x, x_hat: tensors of one shape.
    """
    if x.shape != x_hat.shape:
        raise ValueError(f"x and x_hat must have one shape, got {tuple(x.shape)} and {tuple(x_hat.shape)}")
    xf = x.float()
    diff = float(torch.linalg.vector_norm(x_hat.float() - xf, dtype=torch.float64))
    if not math.isfinite(diff):
        return math.inf
    return diff / max(float(torch.linalg.vector_norm(xf, dtype=torch.float64)), 1e-300)


def _grouped(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """q ``[..., Tq, H * G, D]`` -> ``[..., Tq, H, G, D]`` fp32 (query head ``i`` reads kv head ``i // G``)."""
    Hq, H = q.shape[-2], k.shape[-2]
    if Hq % H or q.shape[-1] != k.shape[-1] or q.shape[:-3] != k.shape[:-3]:
        raise ValueError(f"q [..., queries, heads * group, D] and k [..., tokens, heads, D] do not match: "
                         f"{tuple(q.shape)}, {tuple(k.shape)}")
    return q.float().reshape(*q.shape[:-2], H, Hq // H, q.shape[-1])


def _scores(qg: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """``q k^T / sqrt(D)``, fp32 ``[..., H, G, Tq, T]`` from grouped ``qg`` ``[..., Tq, H, G, D]``."""
    return torch.einsum("...qhgd,...thd->...hgqt", qg, k.float()) / math.sqrt(qg.shape[-1])


def _attend(p: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """``p v``: ``[..., H, G, Tq, T]`` probabilities and ``[..., T, H, D]`` values -> ``[..., Tq, H, G, D]``."""
    return torch.einsum("...hgqt,...thd->...qhgd", p, v.float())


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """``softmax(q k^T / sqrt(D)) v`` in fp32, with GQA.

    Args:
        q: ``[..., queries, kv_heads * group, D]``.
        k, v: ``[..., tokens, kv_heads, D]``.

    Returns:
        ``[..., queries, kv_heads * group, D]`` fp32.
    """
    out = _attend(attention_weights(q, k), v)
    return out.reshape(*out.shape[:-3], -1, out.shape[-1])


def attention_weights(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Attention probabilities ``[..., kv_heads, group, queries, tokens]`` fp32 (shapes as :func:`attention`)."""
    return _scores(_grouped(q, k), k).softmax(dim=-1)


def attention_error(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_hat: torch.Tensor,
                    v_hat: torch.Tensor) -> float:
    """Relative Frobenius error of the attention output read from ``k_hat``, ``v_hat`` against ``k``, ``v``
    (computed in fp32: its own rounding, ~1e-7, is far below any scheme's error).

    Args:
        q: ``[..., queries, kv_heads * group, D]``.
        k, v, k_hat, v_hat: ``[..., tokens, kv_heads, D]``.
    """
    return reconstruction_error(attention(q, k, v), attention(q, k_hat, v_hat))


def _topk_mask(s: torch.Tensor, n: int) -> torch.Tensor:
    return torch.zeros_like(s, dtype=torch.bool).scatter_(-1, s.topk(n, dim=-1, sorted=False).indices, True)


def topk_agreement(q: torch.Tensor, k: torch.Tensor, k_hat: torch.Tensor, top_k: int = 8) -> float:
    """Share of each query's true top-``top_k`` attention positions that the scores against ``k_hat`` also rank
    in their top ``top_k``, averaged over queries and heads (1: every position recovered).

    Args:
        q: ``[..., queries, kv_heads * group, D]``.
        k, k_hat: ``[..., tokens, kv_heads, D]``.
        top_k: positions compared (at most the number of tokens).
    """
    if top_k < 1:
        raise ValueError(f"top_k must be >= 1, got {top_k}")
    qg = _grouped(q, k)
    s, s_hat = _scores(qg, k), _scores(qg, k_hat)
    n = min(top_k, s.shape[-1])
    return float((_topk_mask(s, n) & _topk_mask(s_hat, n)).sum(dim=-1).double().mean() / n)


class _Reference:
    """One layer's fp32 attention, computed once and compared with every scheme's (what :func:`evaluate_all`
    shares between schemes; the numbers are those of :func:`attention_error` and :func:`topk_agreement`)."""

    def __init__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, top_k: int):
        if top_k < 1:
            raise ValueError(f"top_k must be >= 1, got {top_k}")
        self.qg, self.k, self.v = _grouped(q, k), k.float(), v.float()
        s = _scores(self.qg, self.k)
        self.n = min(top_k, s.shape[-1])
        self.out = _attend(s.softmax(dim=-1), self.v)
        self.top = _topk_mask(s, self.n)

    def compare(self, k_hat: torch.Tensor, v_hat: torch.Tensor) -> tuple[float, float]:
        """(attention error, top-k agreement) of ``k_hat``, ``v_hat``."""
        s = _scores(self.qg, k_hat)
        err = reconstruction_error(self.out, _attend(s.softmax(dim=-1), v_hat))
        return err, float((self.top & _topk_mask(s, self.n)).sum(dim=-1).double().mean() / self.n)


# ---- the study ---------------------------------------------------------------------------------------------------


def _check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    if k.dim() != 4 or v.shape != k.shape:
        raise ValueError(f"k and v must be [layers, tokens, kv_heads, head_dim] of one shape, got "
                         f"{tuple(k.shape)} and {tuple(v.shape)}")
    if q.dim() != 4 or q.shape[0] != k.shape[0] or q.shape[-1] != k.shape[-1] or q.shape[2] % k.shape[2]:
        raise ValueError(f"q must be [layers, queries, kv_heads * group, head_dim] matching k "
                         f"{tuple(k.shape)}, got {tuple(q.shape)}")


def evaluate(scheme: Scheme | str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
             top_k: int = 8) -> list[dict]:
    """One row per layer: what ``scheme`` stores and the errors attention reads.

    Keys go through ``scheme.roundtrip(k_layer, "k")``, values ``"v"``; static schemes (tensor / head scales)
    calibrate on the same layer's data.

    Args:
        scheme: a :class:`Scheme` or a name for ``workbench.quant.get``.
        q: ``[layers, queries, kv_heads * group, head_dim]`` (in the space attention uses: post-RoPE).
        k, v: ``[layers, tokens, kv_heads, head_dim]``.
        top_k: positions compared by :func:`topk_agreement`.

    Returns:
        Rows ``{scheme, title, family, layer, bytes_per_token, quantized_tokens, k_err, v_err, attn_err, topk}``;
        ``bytes_per_token`` is one layer's K and V (``scheme.bytes_per_token(heads, head_dim, context=tokens)``),
        ``family`` the name before the ``/``.
    """
    return evaluate_all([scheme], q, k, v, top_k=top_k)


def evaluate_all(schemes: Iterable[Scheme | str] | None, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                 top_k: int = 8) -> list[dict]:
    """:func:`evaluate` for each scheme (default: every scheme of ``workbench.quant.SCHEMES``), rows concatenated
    (scheme by scheme; the fp32 attention of each layer is computed once). A labelled variant of a registered scheme
    (``bench quant_decode``'s ``int4/token@head``: ``quant.one_group_a_head``) is named by its label, as the
    benchmark names its rows."""
    _check_qkv(q, k, v)
    L, T, H, D = k.shape
    chosen = [get(s) for s in (SCHEMES.values() if schemes is None else schemes)]
    refs = [_Reference(q[layer], k[layer], v[layer], top_k) for layer in range(L)]
    rows = []
    for s in chosen:
        bpt, tq = s.bytes_per_token(H, D, context=T), s.quantized_tokens(T)
        for layer, ref in enumerate(refs):
            k_hat, v_hat = s.roundtrip(ref.k, "k"), s.roundtrip(ref.v, "v")
            attn_err, topk = ref.compare(k_hat, v_hat)
            rows.append({"scheme": s.label or s.name, "title": s.title(), "family": s.name.split("/")[0],
                         "layer": layer, "bytes_per_token": bpt, "quantized_tokens": tq,
                         "k_err": reconstruction_error(ref.k, k_hat), "v_err": reconstruction_error(ref.v, v_hat),
                         "attn_err": attn_err, "topk": topk})
    return rows


def summarize(rows: Sequence[dict]) -> list[dict]:
    """One row per scheme (in first-seen order): the per-layer errors averaged over layers, plus the worst
    layer's attention error (``attn_err_max``)."""
    by: dict[str, list[dict]] = {}
    for r in rows:
        by.setdefault(r["title"], []).append(r)
    out = []
    for rs in by.values():
        n = len(rs)
        out.append({**{c: rs[0][c] for c in ("scheme", "title", "family", "bytes_per_token", "quantized_tokens")},
                    "layers": n, **{c: sum(r[c] for r in rs) / n for c in ("k_err", "v_err", "attn_err", "topk")},
                    "attn_err_max": max(r["attn_err"] for r in rs)})
    return out


def pareto_front(rows: Sequence[dict], x: str = "bytes_per_token", y: str = "attn_err") -> list[dict]:
    """The rows no other row dominates (another row as small or smaller in both ``x`` and ``y`` and smaller in
    one), sorted by ``x``: the schemes worth their bytes."""
    front = [r for r in rows if not any(o[x] <= r[x] and o[y] <= r[y] and (o[x] < r[x] or o[y] < r[y])
                                        for o in rows)]
    return sorted(front, key=lambda r: (r[x], r[y]))


def kivi_comparison(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None = None, *,
                    bits: Sequence[int] = (2, 4), group: int = 32, positions: torch.Tensor | None = None,
                    rope_base: float = 10000.0, top_k: int = 8) -> list[dict]:
    """KIVI's finding tested: per-channel keys (``key_mode="channel"``) against per-token keys (``"token"``),
    on keys quantized before RoPE (RoPE applied to the dequantized keys, as KVQuant does) and after it.

    Both modes use groups of ``group`` (tokens for per-channel keys, channels for per-token keys) and
    ``residual=0``, so only the key mode differs; values stay exact so the attention error is the keys'.
    Attention is computed as the model does, on post-RoPE keys.

    Args:
        q: ``[layers, queries, kv_heads * group, head_dim]``, post-RoPE (the space attention uses).
        k: ``[layers, tokens, kv_heads, head_dim]`` **pre-RoPE** keys.
        v: values like ``k`` (default: random normal; they only weight the attention output).
        bits: the widths compared (each of 2, 4).
        group: tokens / channels per group.
        positions: ``[tokens]`` for RoPE (default ``0 .. tokens - 1``).
        rope_base: RoPE's base.
        top_k: positions compared by :func:`topk_agreement`.

    Returns:
        Rows ``{bits, keys ("pre-RoPE" / "post-RoPE"), key_mode, scheme, k_err, attn_err, topk}``, each averaged
        over layers. :func:`kivi_summary` turns them into ratios.
    """
    if v is None:
        v = torch.randn(k.shape, generator=torch.Generator().manual_seed(0))
    _check_qkv(q, k, v)
    k_post = apply_rope(k, positions, rope_base)
    refs = [_Reference(q[layer], k_post[layer], v[layer], top_k) for layer in range(k.shape[0])]
    rows = []
    for b in bits:
        if b not in (2, 4):
            raise ValueError(f"bits must be 2 or 4, got {b}")
        for mode in ("channel", "token"):
            s = get(f"int{b}/kivi", group=group, value_group=min(group, k.shape[-1]), residual=0, key_mode=mode)
            for keys in ("pre-RoPE", "post-RoPE"):
                errs = []
                for layer, ref in enumerate(refs):
                    if keys == "pre-RoPE":
                        k_hat = apply_rope(s.roundtrip(k[layer].float(), "k"), positions, rope_base)
                    else:
                        k_hat = s.roundtrip(ref.k, "k")
                    errs.append((reconstruction_error(ref.k, k_hat), *ref.compare(k_hat, ref.v)))
                n = len(errs)
                rows.append({"bits": b, "keys": keys, "key_mode": mode, "scheme": s.title(),
                             "k_err": sum(e[0] for e in errs) / n, "attn_err": sum(e[1] for e in errs) / n,
                             "topk": sum(e[2] for e in errs) / n})
    return rows


def kivi_summary(rows: Sequence[dict]) -> list[dict]:
    """From :func:`kivi_comparison`'s rows: per (bits, keys), the attention errors of both key modes and
    ``ratio = token / channel`` (> 1: per-channel keys win, as KIVI found)."""
    out = []
    for (b, keys) in dict.fromkeys((r["bits"], r["keys"]) for r in rows):
        m = {r["key_mode"]: r for r in rows if r["bits"] == b and r["keys"] == keys}
        ch, tok = m["channel"]["attn_err"], m["token"]["attn_err"]
        out.append({"bits": b, "keys": keys, "channel": ch, "token": tok, "ratio": tok / ch if ch else math.inf,
                    "topk_channel": m["channel"]["topk"], "topk_token": m["token"]["topk"]})
    return out


# ---- statistics of the data (what makes them hard to quantize) ---------------------------------------------------


def data_stats(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, outlier_channels: int = 4) -> dict:
    """Statistics quantization is sensitive to, per the data (real or synthetic):

    - ``outlier_ratio``: mean |k| of each head's ``outlier_channels`` largest channels over its median channel's;
    - ``sink_mass``: mean attention probability on token 0; ``max_other_mass``: the largest on any other token;
    - ``top1_mass``: mean probability of each query's most attended token (peaked attention: near 1);
    - ``value_rms``: ``[layers]`` RMS of the values (grows with depth in real models).

    Shapes as :func:`evaluate`.
    """
    _check_qkv(q, k, v)
    a = k.float().abs().mean(dim=1)  # [L, H, D]
    srt = a.sort(dim=-1, descending=True).values
    ratio = srt[..., :outlier_channels].mean(dim=-1) / srt[..., a.shape[-1] // 2] if outlier_channels else None
    p = attention_weights(q, k)  # [L, H, G, Tq, T]
    per_token = p.mean(dim=(0, 1, 2, 3))
    return {"outlier_ratio": float(ratio.mean()) if ratio is not None else 1.0,
            "sink_mass": float(per_token[0]), "max_other_mass": float(per_token[1:].max()),
            "top1_mass": float(p.amax(dim=-1).mean()),
            "value_rms": [float(x) for x in v.float().pow(2).mean(dim=(1, 2, 3)).sqrt()]}


# ---- one scheme from a family and its knobs (the notebook's panel) ------------------------------------------------

# The families a reader picks from (FAMILIES), and which knobs apply to each (SCALED_FAMILIES: tensor / head /
# token scales; GROUP_FAMILIES: KIVI's group size, residual, key mode): workbench.quant.names, imported above.


def scheme_for(family: str, granularity: str = "tensor", group: int = 32, residual: int = 128,
               key_mode: str = "channel", head_dim: int = 64) -> Scheme:
    """The scheme of ``family`` with the knobs that apply to it (the others are ignored).

    ``granularity`` (``tensor`` / ``head`` / ``token``) picks the scales of fp8 and int8; int8_asym is per
    token. For int4 / int2, ``group`` is KIVI's G: tokens per key group with per-channel keys, and channels per
    value group (and per key group with per-token keys), capped at the largest power of two dividing
    ``head_dim`` (a group cannot span two heads); ``residual`` newest tokens stay fp16.
    """
    if family not in FAMILIES:
        raise ValueError(f"family must be one of {list(FAMILIES)}, got {family!r}")
    if family in SCALED_FAMILIES:
        return get(f"{family}/{granularity}")
    if family in GROUP_FAMILIES:
        return get(f"{family}/kivi", group=group, value_group=min(group, head_dim & -head_dim), residual=residual,
                   key_mode=key_mode)
    return get("int8_asym/token" if family == "int8_asym" else family)


# ---- tables of the notebook (plain rows for ``run_files.print_table``) ----------------------------------------------


def bytes_table(num_kv_heads: int, head_dim: int, context: int | None = None,
                schemes: Iterable[str] | None = None) -> list[dict]:
    """What one token's K and V take in one layer, per scheme of the registry (or ``schemes``, by name): rows
    ``{scheme, bits, granularity, bytes_per_token (long-context limit), vs_fp32, at_context}`` with the bytes in
    whole bytes; ``at_context`` counts the fp16 residual of a ``context``-token sequence (``None``: the limit)."""
    fp32 = get("fp32").bytes_per_token(num_kv_heads, head_dim)
    rows = []
    for name in SCHEMES if schemes is None else schemes:
        s = get(name)
        long = s.bytes_per_token(num_kv_heads, head_dim)
        rows.append({"scheme": s.name, "bits": s.bits, "granularity": s.granularity, "bytes_per_token": round(long),
                     "vs_fp32": long / fp32, "at_context": round(s.bytes_per_token(num_kv_heads, head_dim, context))})
    return rows


def byte_ratios(num_kv_heads: int, head_dim: int) -> dict[str, float]:
    """The byte claims of the seed, measured: ``fp16_vs_fp32`` (fp16 over fp32), ``fp8_vs_fp16`` (fp8 with static
    scales over fp16) and ``token_scale_cost`` (what per-token fp32 scales add to fp8's bytes, a fraction)."""
    def b(name: str) -> float:
        return get(name).bytes_per_token(num_kv_heads, head_dim)

    return {"fp16_vs_fp32": b("fp16") / b("fp32"), "fp8_vs_fp16": b("fp8_e4m3/tensor") / b("fp16"),
            "token_scale_cost": b("fp8_e4m3/token") / b("fp8_e4m3/tensor") - 1}


def data_stats_rows(q: torch.Tensor, keys: dict[str, torch.Tensor], v: torch.Tensor) -> list[dict]:
    """:func:`data_stats` of the same queries and values against each of ``keys`` (label -> keys, e.g. pre- and
    post-RoPE): one row per label, ``{keys, outlier_ratio, sink_mass, max_other_mass, top1_mass, value_rms}``."""
    return [{"keys": label, **data_stats(q, k, v)} for label, k in keys.items()]


def whole_bytes(rows: Sequence[dict], column: str = "bytes_per_token") -> list[dict]:
    """``rows`` with ``column`` rounded to whole bytes (an int, so a table prints 1536, not 1.54e+03)."""
    return [{**r, column: round(r[column])} if column in r else dict(r) for r in rows]


def describe_front(front: Sequence[dict]) -> str:
    """A Pareto front (:func:`pareto_front`) in one line: ``scheme (bytes B, attention error), ...``."""
    return ", ".join(f"{r['scheme']} ({r['bytes_per_token']:.0f} B, {r['attn_err']:.3g})" for r in front)


def error_ratios(rows: Sequence[dict], numerator: str = "fp8_e5m2", denominator: str = "fp8_e4m3",
                 granularities: Sequence[str] = ("tensor", "head", "token")) -> list[dict]:
    """Two families compared scale by scale, from :func:`summarize`'s rows: per granularity ``g`` the errors of
    ``numerator/g`` over ``denominator/g``: ``{granularity, k_err, v_err, attn_err}`` (e5m2 over e4m3 by
    default: > 1 where e4m3 is the more accurate)."""
    by = {r["scheme"]: r for r in rows}
    missing = [f"{f}/{g}" for g in granularities for f in (numerator, denominator) if f"{f}/{g}" not in by]
    if missing:
        raise ValueError(f"rows have no scheme {missing} (they hold {sorted(by)})")
    return [{"granularity": g, **{c: by[f"{numerator}/{g}"][c] / by[f"{denominator}/{g}"][c]
                                  for c in ("k_err", "v_err", "attn_err")}} for g in granularities]

