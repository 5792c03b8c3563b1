"""Sweeps of quantized K/V: notebook 03 (dtypes and quantization), one scheme's memory and errors on synthetic K/V."""

from __future__ import annotations

from workbench.quant.names import QUANT_SWEEP_GRID
from workbench.quant.names import STUDY_FAMILIES as FAMILIES  # workbench.quant.study.FAMILIES
from workbench.sweeps.spec import Param, Sweep, register


def quant_point(family: str, granularity: str, group: int, residual: int, key_mode: str, outlier: int,
                num_layers: int, num_tokens: int, num_kv_heads: int, head_dim: int, gqa_group: int, num_queries: int,
                seed: int) -> dict:
    """``study.evaluate`` of ``study.scheme_for(...)`` on the panel's synthetic K/V (post-RoPE keys, correlated
    queries), averaged over layers by ``study.summarize``; ``on_front``: the scheme is on the Pareto front of
    bytes per token against attention error among every scheme of the registry (``study.pareto_front``)."""
    from workbench.quant import study

    k, v = study.synthetic_kv(num_layers, num_tokens, num_kv_heads, head_dim, outlier_scale=float(outlier),
                              seed=seed)
    k = study.apply_rope(k)
    q = study.synthetic_queries(k, num_queries, gqa_group, seed=seed + 1)
    s = study.scheme_for(family, granularity, group, residual, key_mode, head_dim=head_dim)
    selected = study.summarize(study.evaluate(s, q, k, v))[0]
    rows = [r for r in study.summarize(study.evaluate_all(None, q, k, v)) if r["scheme"] != "fp32"]
    titles = {r["title"] for r in rows}
    front = study.pareto_front(rows if selected["title"] in titles else [*rows, selected])
    row = {c: selected[c] for c in ("scheme", "title", "bytes_per_token", "quantized_tokens", "k_err", "v_err",
                                    "attn_err", "attn_err_max", "topk")}
    row.update(on_front=selected["title"] in {r["title"] for r in front}, front_size=len(front),
               quantized=s.quantized)
    return row


ERR = "relative, vs fp32"
# every column's label and unit on the panel's axes (workbench.sweeps.spec.Column)
QUANT_COLUMNS = {
    "family": ("scheme family",), "granularity": ("scales (fp8, int8)",), "group": ("KIVI group", "tokens"),
    "residual": ("fp16 residual", "tokens"), "key_mode": ("keys (int4, int2)",),
    "outlier": ("key outlier channels", "x the others"), "num_layers": ("layers",), "num_tokens": ("tokens",),
    "num_kv_heads": ("kv heads",), "head_dim": ("head dim", "elements"), "gqa_group": ("query heads per kv head",),
    "num_queries": ("decode queries per layer",), "seed": ("seed",),
    "attn_err": ("attention-output error", ERR), "attn_err_max": ("worst layer's attention-output error", ERR),
    "k_err": ("key error", ERR), "v_err": ("value error", ERR), "topk": ("top-8 tokens still in the top 8 (share)",),
    "bytes_per_token": ("K+V of a token and layer", "B"), "on_front": ("on the Pareto front",),
    "front_size": ("schemes on the Pareto front",), "quantized_tokens": ("tokens quantized",),
    "quantized": ("quantized (not a cast)",),
}

register(Sweep(
    "quant", "one K/V quantization scheme on synthetic K/V: bytes per token against key, value and attention error", (
        Param("family", "str", "int4", choices=FAMILIES, grid=QUANT_SWEEP_GRID),
        Param("granularity", "str", "tensor", choices=("tensor", "head", "token"),
              help="scales of fp8 / int8 (other families ignore it)"),
        Param("group", "int", 32, choices=(8, 16, 32, 64, 128), help="KIVI group size of int4 / int2"),
        Param("residual", "int", 128, choices=tuple(range(0, 257, 32)), help="newest tokens kept fp16 (int4 / int2)"),
        Param("key_mode", "str", "channel", choices=("channel", "token"), help="int4 / int2 keys per channel or token"),
        Param("outlier", "int", 8, minimum=1, maximum=10, grid=(1, 4, 8), help="key outlier channels' magnitude (x)"),
        Param("num_layers", "int", 2, minimum=1, maximum=64, help="synthetic layers (the panel: 6)"),
        Param("num_tokens", "int", 512, minimum=1, maximum=16384),
        Param("num_kv_heads", "int", 3, minimum=1, maximum=64),
        Param("head_dim", "int", 64, choices=(32, 64, 80, 96, 128)),
        Param("gqa_group", "int", 3, minimum=1, maximum=16, help="query heads per kv head"),
        Param("num_queries", "int", 64, minimum=1, maximum=4096, help="decode queries per layer"),
        Param("seed", "int", 0, minimum=0)),
    quant_point, notebook="03_dtypes_and_quantization", panel="quant_panel", x="outlier", color="family",
    y=("attn_err", "k_err", "v_err", "topk", "bytes_per_token", "on_front"), columns=QUANT_COLUMNS))
