"""Plotly figures of the quantization study (notebook 03), built from the plain rows of
``workbench.quant.error_study`` and the decode benchmark's result rows."""

from __future__ import annotations

import math

import plotly.graph_objects as go
from plotly.subplots import make_subplots

FAMILY_COLORS = {"fp16": "#264653", "bf16": "#457b9d", "fp8_e4m3": "#2a9d8f", "fp8_e5m2": "#8ab17d",
                 "int8": "#e9c46a", "int8_asym": "#f4a261", "int4": "#e76f51", "int2": "#b5838d", "fp32": "#8d99ae"}
SCALE_SYMBOLS = {"tensor": "circle", "head": "square", "token": "diamond", "kivi": "star"}
ERROR_COLORS = {"k_err": "#2a9d8f", "v_err": "#e9c46a", "attn_err": "#264653"}
ERROR_NAMES = {"k_err": "K error", "v_err": "V error", "attn_err": "attention error"}
WORKLOAD_COLORS = ("#264653", "#2a9d8f", "#e9c46a", "#f4a261", "#e76f51", "#8d99ae")
NO_DECODE = ("no H200 results yet: run<br>`python -m workbench bench quant_decode<br>--out data/results`"
             " on a GPU")


def _symbol(scheme: str) -> str:
    return SCALE_SYMBOLS.get(scheme.split("/")[-1], "circle")


def _hover(r: dict) -> str:
    return (f"{r['title']}<br>{r['bytes_per_token']:.0f} B per token per layer<br>attention error "
            f"{r['attn_err']:.3g}, top-k {r['topk']:.3f}<br>K error {r['k_err']:.3g}, V error {r['v_err']:.3g}")


def quant_overview(selected: dict, layers: list[dict], schemes: list[dict], front: list[dict],
                   decode: list[dict], decode_scheme: str | None, setup: dict) -> go.Figure:
    """The study on one page.

    Args:
        selected: the chosen scheme's summary row (``study.summarize``).
        layers: its per-layer rows (``study.evaluate``).
        schemes: the summary rows of every scheme of the registry (fp32, the reference, left out).
        front: the Pareto front of ``schemes`` plus ``selected`` (``study.pareto_front``).
        decode: measured decode rows (``quant-decode-*.json``), possibly empty.
        decode_scheme: the registry name whose decode rows are the chosen scheme's (framed), None when the run has
            none (the heatmap's title says so).
        setup: ``{data, layers, tokens, heads, head_dim, stored, note}`` for the title (``data`` names the K/V,
            ``stored`` says how they are stored, ``note`` a third line, may be empty).

    Returns:
        (a) bytes per token against attention error for every scheme, the front as a line, the choice ringed;
        (b) the choice's K, V and attention error per layer; (c) measured decode speed-up over fp16 per scheme
        and workload (or what to run to measure it).
    """
    fig = make_subplots(rows=2, cols=2, specs=[[{"colspan": 2}, None], [{}, {}]], column_widths=[0.58, 0.42],
                        row_heights=[0.54, 0.46], vertical_spacing=0.14, horizontal_spacing=0.2,
                        subplot_titles=("every scheme (\u25cb tensor, \u25a1 head, \u25c7 token, \u2606 group "
                                        "scales)",
                                        "measured decode: speed-up over fp16", "your choice, per layer"))
    # (a) every scheme, by family; the Pareto front; the choice
    for fam in dict.fromkeys(r["family"] for r in schemes):
        rs = [r for r in schemes if r["family"] == fam]
        fig.add_scatter(x=[r["bytes_per_token"] for r in rs], y=[r["attn_err"] for r in rs], mode="markers",
                        name=fam, marker=dict(color=FAMILY_COLORS.get(fam, "#888"), size=10,
                                              symbol=[_symbol(r["scheme"]) for r in rs],
                                              line=dict(color="white", width=1)),
                        hovertext=[_hover(r) for r in rs], hoverinfo="text", row=1, col=1)
    fig.add_scatter(x=[r["bytes_per_token"] for r in front], y=[r["attn_err"] for r in front], mode="lines",
                    name="Pareto front", line=dict(color="#444", dash="dot", width=1.5), hoverinfo="skip",
                    row=1, col=1)
    fig.add_scatter(x=[selected["bytes_per_token"]], y=[selected["attn_err"]], mode="markers",
                    name="your choice", hovertext=[_hover(selected)], hoverinfo="text",
                    marker=dict(size=20, symbol="circle-open", color="#d62828", line=dict(width=3)), row=1, col=1)
    pts = [*schemes, selected]
    xs = [r["bytes_per_token"] for r in pts]
    ys = [r["attn_err"] for r in pts if r["attn_err"] > 0] or [1e-3]
    fig.update_xaxes(type="log", title_text="bytes per token per layer (K+V, scales and fp16 residual counted)",
                     range=[math.log10(min(xs) / 1.25), math.log10(max(xs) * 1.25)], row=1, col=1)
    fig.update_yaxes(type="log", title_text="attention error vs fp32", exponentformat="power",
                     range=[math.log10(min(ys) / 2), math.log10(max(ys) * 2)], row=1, col=1)

    # (b) the choice, layer by layer
    lx = [r["layer"] for r in layers]
    for key in ("k_err", "v_err", "attn_err"):
        fig.add_scatter(x=lx, y=[r[key] for r in layers], mode="lines+markers", name=ERROR_NAMES[key],
                        legend="legend2", line=dict(color=ERROR_COLORS[key]), row=2, col=2)
    fig.update_xaxes(title_text="layer", dtick=1 if len(lx) <= 12 else None, row=2, col=2)
    fig.update_yaxes(type="log", title_text="relative error", exponentformat="power", nticks=6, row=2, col=2)

    # (c) measured decode speed-up, scheme x workload, or what to run to measure it
    if decode:
        workloads = sorted(dict.fromkeys(r["workload"] for r in decode))
        order = sorted(dict.fromkeys(r["scheme"] for r in decode),
                       key=lambda s: -max(r.get("bytes_per_token") or 0 for r in decode if r["scheme"] == s))
        by = {(r["scheme"], r["workload"]): r for r in decode}
        z = [[by[(s, w)].get("speedup_vs_fp16") if (s, w) in by else None for w in workloads] for s in order]
        text = [[f"{v:.2f}" if v is not None else "" for v in row] for row in z]
        hover = [[(f"{s} on {w}: {by[(s, w)]['time_us']:.1f} us, {by[(s, w)].get('bw_fraction', 0):.2f} of "
                   f"bandwidth, rel err {by[(s, w)].get('rel_err', 0):.2g}") if (s, w) in by else ""
                  for w in workloads] for s in order]
        fig.add_heatmap(z=z, x=workloads, y=order, text=text, texttemplate="%{text}", hovertext=hover,
                        hoverinfo="text", colorscale="RdYlGn", zmid=1.0, showscale=False, xgap=1, ygap=1,
                        row=2, col=1)  # red: slower than fp16, green: faster
        if decode_scheme in order:
            i = order.index(decode_scheme)
            fig.add_shape(type="rect", x0=-0.5, x1=len(workloads) - 0.5, y0=i - 0.5, y1=i + 0.5,
                          line=dict(color="#111", width=3), row=2, col=1)
        fig.update_yaxes(autorange="reversed", type="category", tickfont_size=10, row=2, col=1)
        fig.update_xaxes(type="category", side="bottom", row=2, col=1)
        r0 = decode[0]
        gpu, date = str(r0.get("gpu", "GPU")).replace("NVIDIA ", ""), str(r0.get("date", ""))[:10]
        fig.layout.annotations[1].text = (f"decode on {gpu} ({date}): speed-up over fp16" if decode_scheme in order
                                          else f"{gpu} ({date}): speed-up; your choice not timed")  # one line
    else:
        fig.update_xaxes(visible=False, row=2, col=1)
        fig.update_yaxes(visible=False, row=2, col=1)
        dx, dy = fig.layout.xaxis2.domain, fig.layout.yaxis2.domain
        fig.add_annotation(text=NO_DECODE, xref="paper", yref="paper", x=(dx[0] + dx[1]) / 2,
                           y=(dy[0] + dy[1]) / 2, xanchor="center", yanchor="middle", align="center",
                           showarrow=False, font=dict(size=12, color="#555"))
    s = setup
    fig.update_layout(
        # margins that fit the scheme names (heatmap) and the axis titles: no automargin push to settle
        height=760, margin=dict(t=125, r=10, l=110 if decode else 80), title_font_size=14,
        legend=dict(x=1.0, xanchor="left", y=1.0, yanchor="top", title_text="schemes"),
        legend2=dict(x=1.0, xanchor="left", y=fig.layout.yaxis3.domain[1], yanchor="top", title_text="per layer"),
        title=f"{selected['title']}: {selected['bytes_per_token']:.0f} B/token/layer, attention error "
              f"{selected['attn_err']:.3g}, top-8 {selected['topk']:.3f}<br>"
              f"<sup>{s['data']}, {s['layers']} layers x {s['tokens']} tokens x {s['heads']} kv heads x "
              f"{s['head_dim']}: {s['stored']}"
              f"{'<br>' + s['note'] if s.get('note') else ''}</sup>")
    return fig


def kivi_bars(summary: list[dict]) -> go.Figure:
    """Attention error of per-channel and per-token keys, per width and RoPE side (``study.kivi_summary``)."""
    fig = go.Figure()
    x = [[f"int{r['bits']}" for r in summary], [r["keys"] for r in summary]]
    for mode, color in (("channel", "#2a9d8f"), ("token", "#e76f51")):
        ys = [r[mode] for r in summary]
        fig.add_bar(x=x, y=ys, name=f"per-{mode} keys", marker_color=color, text=[f"{y:.3f}" for y in ys],
                    textposition="outside")
    fig.update_layout(barmode="group", yaxis_title="attention error (keys only)", height=360, margin=dict(t=30))
    return fig
