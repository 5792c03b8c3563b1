"""The quant study: notebook 03 (dtypes and quantization), one K/V quantization scheme's memory and errors on synthetic
K/V against every other scheme's. ``QUANT`` is both the panel's controls (``workbench.ui.quant_panels``) and the
``quant`` sweep; :func:`evaluate` is what each computes, on the panel's data or the sweep's.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from workbench.quant import error_study
from workbench.quant.families import Scheme
from workbench.quant.names import QUANT_SWEEP_GRID, STUDY_FAMILIES, STUDY_GROUP_FAMILIES, STUDY_SCALED_FAMILIES
from workbench.quant.synthetic import apply_rope, synthetic_kv, synthetic_queries
from workbench.studies.base import Param, Study


class Data(NamedTuple):
    """Queries, post-RoPE keys and values (shapes as ``error_study.evaluate``) and every registry scheme's summary
    row on them (fp32, the reference, left out): what every choice of scheme is compared with."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    schemes: list[dict]


def data_for(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Data:
    """``(q, k, v)`` (synthetic or captured) with every scheme's summary row (about a second at the panel's size)."""
    rows = error_study.summarize(error_study.evaluate_all(None, q, k, v))
    return Data(q, k, v, [r for r in rows if r["scheme"] != "fp32"])


@functools.lru_cache(maxsize=16)
def synthetic(num_layers: int, num_tokens: int, num_kv_heads: int, head_dim: int, gqa_group: int, num_queries: int,
              outlier: float, seed: int) -> Data:
    """The study's synthetic K/V (``synthetic_kv``, post-RoPE keys, ``synthetic_queries`` correlated
    with them), kept for the next point or redraw of the same data (a pure function of its arguments)."""
    k, v = synthetic_kv(num_layers, num_tokens, num_kv_heads, head_dim, outlier_scale=float(outlier), seed=seed)
    k = apply_rope(k)
    return data_for(synthetic_queries(k, num_queries, gqa_group, seed=seed + 1), k, v)


class Evaluation(NamedTuple):
    scheme: Scheme
    selected: dict  # the chosen scheme's summary row (error_study.summarize), averaged over layers
    layers: list[dict]  # its per-layer rows (error_study.evaluate)
    front: list[dict]  # the Pareto front of every scheme and the choice (error_study.pareto_front)


def evaluate(data: Data, family: str, granularity: str, group: int, residual: int, key_mode: str) -> Evaluation:
    """``error_study.evaluate`` of ``error_study.scheme_for(...)`` on ``data``, and the Pareto front of bytes per
    token against attention error among every scheme of the registry and the choice."""
    s = error_study.scheme_for(family, granularity, group, residual, key_mode, head_dim=data.k.shape[-1])
    layers = error_study.evaluate(s, data.q, data.k, data.v)
    selected = error_study.summarize(layers)[0]
    rows = data.schemes
    front = error_study.pareto_front(rows if selected["title"] in {r["title"] for r in rows} else [*rows, selected])
    return Evaluation(s, selected, layers, front)


def quant_point(family: str, granularity: str, group: int, residual: int, key_mode: str, outlier: int,
                num_layers: int, num_tokens: int, num_kv_heads: int, head_dim: int, gqa_group: int, num_queries: int,
                seed: int) -> dict:
    """:func:`evaluate` on the synthetic K/V, the chosen scheme's row averaged over layers; ``on_front``: the scheme
    is on the Pareto front of bytes per token against attention error among every scheme of the registry."""
    data = synthetic(num_layers, num_tokens, num_kv_heads, head_dim, gqa_group, num_queries, float(outlier), seed)
    e = evaluate(data, family, granularity, group, residual, key_mode)
    row = {c: e.selected[c] for c in ("scheme", "title", "bytes_per_token", "quantized_tokens", "k_err", "v_err",
                                      "attn_err", "attn_err_max", "topk")}
    row.update(on_front=e.selected["title"] in {r["title"] for r in e.front}, front_size=len(e.front),
               quantized=e.scheme.quantized)
    return row


def draw(result: dict):
    """The panel's page (``quant_figures.quant_overview``) of ``result``: its keyword arguments."""
    from workbench.figures import quant as quant_figures  # plotly: an optional dependency, imported only to draw

    return quant_figures.quant_overview(**result)


ERR = "relative, vs fp32"
# every column's label and unit on the panel's axes (workbench.studies.base.Column)
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

QUANT = Study(
    "quant", "one K/V quantization scheme on synthetic K/V: bytes per token against key, value and attention error", (
        Param("family", "str", "int4", choices=STUDY_FAMILIES, grid=QUANT_SWEEP_GRID, label="scheme"),
        # ordered coarse to fine; a slider so that, greyed out, it is plainly not in play
        Param("granularity", "str", "tensor", choices=("tensor", "head", "token"),
              help="scales of fp8 / int8 (other families ignore it)", label="scales", widget="slider"),
        Param("group", "int", 32, choices=(8, 16, 32, 64, 128), help="KIVI group size of int4 / int2",
              label="group size"),
        Param("residual", "int", 128, choices=tuple(range(0, 257, 32)), help="newest tokens kept fp16 (int4 / int2)",
              label="fp16 residual"),
        Param("key_mode", "str", "channel", choices=("channel", "token"), help="int4 / int2 keys per channel or token",
              label="keys", labels={"channel": "per channel", "token": "per token"}),
        Param("outlier", "int", 8, minimum=1, maximum=10, grid=(1, 4, 8), help="key outlier channels' magnitude (x)",
              label="key outliers (x)"),
        Param("num_layers", "int", 2, minimum=1, maximum=64, help="synthetic layers (the panel: 6)"),
        Param("num_tokens", "int", 512, minimum=1, maximum=16384),
        Param("num_kv_heads", "int", 3, minimum=1, maximum=64),
        Param("head_dim", "int", 64, choices=(32, 64, 80, 96, 128)),
        Param("gqa_group", "int", 3, minimum=1, maximum=16, help="query heads per kv head"),
        Param("num_queries", "int", 64, minimum=1, maximum=4096, help="decode queries per layer"),
        Param("seed", "int", 0, minimum=0)),
    quant_point, notebook="03_dtypes_and_quantization", panel="quant_panel", x="outlier", color="family",
    y=("attn_err", "k_err", "v_err", "topk", "bytes_per_token", "on_front"), columns=QUANT_COLUMNS,
    controls=("family", "granularity", "group", "residual", "outlier", "key_mode"), enabled={
        "granularity": lambda family, **_: family in STUDY_SCALED_FAMILIES,
        "group": lambda family, **_: family in STUDY_GROUP_FAMILIES,
        "residual": lambda family, **_: family in STUDY_GROUP_FAMILIES,
        "key_mode": lambda family, **_: family in STUDY_GROUP_FAMILIES},
    draw=draw)
STUDIES = (QUANT,)
