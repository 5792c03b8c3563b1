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
        _no_run(fig, row=2, col=1)
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


def _family(r: dict) -> str:
    return r.get("family") or r["scheme"].split("/")[0]


def _speed_hover(r: dict) -> str:
    text = (f"{r.get('title', r['scheme'])}<br>{r['bytes_per_token']:.0f} B per token per layer<br>"
            f"attention error {r['attn_err']:.2g}")
    if r["speedup"] is None:
        return text + "<br>not timed in the run"
    text += (f"<br>decode speed-up over fp16 {r['speedup']:.2f} (min {r['speedup_min']:.2f}, "
             f"max {r['speedup_max']:.2f}, {r['workloads']} workloads)")
    if r.get("bw_fraction") is not None:
        text += f"<br>{r['bw_fraction']:.2f} of the copy bandwidth"
    if r.get("bytes_limit"):
        text += (f"<br>reads {r['bytes_vs_fp16']:.2f} of fp16's bytes: limit {r['bytes_limit']:.2f}x, "
                 f"{r['of_limit']:.0%} of it")
    return text + ("<br>on the 3-way front" if r["on_front"] else "")


def speed_overview(rows: list[dict], measured: str, source: str = "") -> go.Figure:
    """Bytes, error and measured decode speed of every scheme (``workbench.results.quant_speed.speed_rows``).

    Args:
        rows: ``speed_rows``'s rows (a scheme of zero error, the fp32 reference, cannot sit on the log axis and
            is left out).
        measured: what the speed-ups are (``quant_speed.run_label``, e.g. ``"H200, median W1-W5"``), for the
            colour bar.
        source: the run's file name, for the title's second line (may be empty).

    Returns:
        (a) bytes per token against attention error, each timed scheme coloured and sized by its speed-up over
        fp16, the 3-way front (fewer bytes, lower error, faster) ringed, untimed schemes grey; (b) the speed-up
        (median, bars min-max) against the bytes the decode reads relative to fp16's, with the bandwidth limit
        ``fp16 bytes / scheme bytes``: how far each scheme is from what its bytes allow.
    """
    if not rows:
        raise ValueError("speed_overview: rows is empty; pass quant_speed.speed_rows(...)")
    pts = [r for r in rows if r["attn_err"] > 0]
    timed = [r for r in pts if r["speedup"] is not None]
    fig = make_subplots(rows=1, cols=2, column_widths=[0.56, 0.44], horizontal_spacing=0.22,
                        subplot_titles=("bytes, error and speed (ring: 3-way front)",
                                        "speed-up and the bytes' limit"))
    # (a) every scheme: bytes x error, coloured by speed; the front ringed
    untimed = [r for r in pts if r["speedup"] is None]
    if untimed:
        fig.add_scatter(x=[r["bytes_per_token"] for r in untimed], y=[float(r["attn_err"]) for r in untimed],
                        mode="markers", name="not timed", hovertext=[_speed_hover(r) for r in untimed],
                        hoverinfo="text", marker=dict(color="#c8c8c8", size=9, line=dict(color="#888", width=1),
                                                      symbol=[_symbol(r["scheme"]) for r in untimed]),
                        row=1, col=1)
    dom = fig.layout.xaxis.domain
    if timed:
        fig.add_scatter(x=[r["bytes_per_token"] for r in timed], y=[float(r["attn_err"]) for r in timed],
                        mode="markers", name="timed (colour: speed-up)", showlegend=False,
                        hovertext=[_speed_hover(r) for r in timed], hoverinfo="text",
                        marker=dict(color=[r["speedup"] for r in timed], colorscale="RdYlGn", cmid=1.0,
                                    size=[min(26.0, 6 + 7 * r["speedup"]) for r in timed],
                                    symbol=[_symbol(r["scheme"]) for r in timed], line=dict(color="white", width=1),
                                    colorbar=dict(title=dict(text=f"decode speed-up over fp16<br>({measured})",
                                                             side="right", font_size=11),
                                                  x=dom[1] + 0.01, xanchor="left", thickness=12, len=1.0)),
                        row=1, col=1)  # red: slower than fp16, green: faster
        front = [r for r in timed if r["on_front"]]
        fig.add_scatter(x=[r["bytes_per_token"] for r in front], y=[float(r["attn_err"]) for r in front],
                        mode="markers", name="3-way front", hoverinfo="skip",
                        marker=dict(size=[min(26.0, 6 + 7 * r["speedup"]) + 9 for r in front], symbol="circle-open",
                                    color="#111", line=dict(width=2)), row=1, col=1)
    xs = [r["bytes_per_token"] for r in pts] or [1.0]
    ys = [float(r["attn_err"]) for r in pts] or [1e-3]
    lo, hi = min(xs) / 1.25, max(xs) * 1.25
    ticks = [t for t in (64, 100, 150, 200, 300, 400, 600, 800, 1200, 1600, 2400, 3200) if lo <= t <= hi]
    fig.update_xaxes(type="log", title_text="B per token per layer (K+V, scales and fp16 residual)",
                     range=[math.log10(lo), math.log10(hi)], tickvals=ticks or None, row=1, col=1)
    fig.update_yaxes(type="log", title_text="attention error vs fp32", exponentformat="power",
                     range=[math.log10(min(ys) / 2), math.log10(max(ys) * 2)], row=1, col=1)

    # (b) speed-up against the bytes read, beside the bandwidth limit
    read = [r for r in timed if r.get("bytes_vs_fp16")]
    if read:
        for fam in dict.fromkeys(_family(r) for r in read):
            rs = [r for r in read if _family(r) == fam]
            fig.add_scatter(x=[r["bytes_vs_fp16"] for r in rs], y=[r["speedup"] for r in rs], mode="markers",
                            name=fam, legend="legend2", hovertext=[_speed_hover(r) for r in rs], hoverinfo="text",
                            error_y=dict(type="data", symmetric=False, thickness=1, width=3,
                                         array=[r["speedup_max"] - r["speedup"] for r in rs],
                                         arrayminus=[r["speedup"] - r["speedup_min"] for r in rs]),
                            marker=dict(color=FAMILY_COLORS.get(fam, "#888"), size=10,
                                        symbol=[_symbol(r["scheme"]) for r in rs], line=dict(color="white", width=1)),
                            row=1, col=2)
        lo, hi = min(r["bytes_vs_fp16"] for r in read) / 1.3, max(r["bytes_vs_fp16"] for r in read) * 1.3
        line = [lo * (hi / lo) ** (i / 40) for i in range(41)]
        fig.add_scatter(x=line, y=[1 / x for x in line], mode="lines", name="limit: fp16 bytes / bytes read",
                        legend="legend2", line=dict(color="#444", dash="dash", width=1.5), hoverinfo="skip",
                        row=1, col=2)
        fig.add_scatter(x=[lo, hi], y=[1, 1], mode="lines", name="fp16's speed", legend="legend2",
                        line=dict(color="#888", dash="dot", width=1), hoverinfo="skip", row=1, col=2)
        sy = [r["speedup_min"] for r in read] + [1 / hi, 1 / lo]
        fig.update_xaxes(type="log", range=[math.log10(lo), math.log10(hi)],
                         title_text="bytes read per token / fp16's", row=1, col=2)
        fig.update_yaxes(type="log", range=[math.log10(min(sy) / 1.2), math.log10(max(sy) * 1.2)],
                         title_text="speed-up over fp16 (bars: min-max)", row=1, col=2)
    else:
        _no_run(fig, row=1, col=2)
    n_front = sum(r["on_front"] for r in rows)
    fig.update_layout(
        # (a)'s legend in its empty corner (few bytes and a low error: no scheme has both), (b)'s at the right
        height=520, margin=dict(t=95, r=10, l=80), title_font_size=14,
        legend=dict(x=dom[0] + 0.01, xanchor="left", y=0.02, yanchor="bottom", bgcolor="rgba(255,255,255,0.7)"),
        legend2=dict(x=1.0, xanchor="left", y=1.0, yanchor="top", title_text="families"),
        title=(f"Bytes, error and measured speed: {n_front} of {len(timed)} timed schemes on the 3-way front"
               if timed else "Bytes and error: no scheme timed yet")
              + f"<br><sup>{measured or 'no run'}{', ' + source if source else ''}; \u25cb tensor, \u25a1 head, "
              "\u25c7 token, \u2606 group scales</sup>")
    return fig


def _no_run(fig, row: int, col: int) -> None:
    """The second subplot (axes 2) without an H200 run: its axes hidden, the note of how to make one in their place."""
    fig.update_xaxes(visible=False, row=row, col=col)
    fig.update_yaxes(visible=False, row=row, col=col)
    dx, dy = fig.layout.xaxis2.domain, fig.layout.yaxis2.domain
    fig.add_annotation(text=NO_DECODE, xref="paper", yref="paper", x=(dx[0] + dx[1]) / 2, y=(dy[0] + dy[1]) / 2,
                       xanchor="center", yanchor="middle", align="center", showarrow=False,
                       font=dict(size=12, color="#555"))
