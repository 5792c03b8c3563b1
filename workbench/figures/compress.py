"""Plotly figures of notebook 07 (KV compression), built from the rows of ``workbench.compress.sparsity_study``, the
panels' Quest recall and the committed results' tables (``workbench.results.compress``)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from workbench.figures.titles import setup_title
from workbench.results.compress import KINDS, STAGES

POLICY_COLORS = {"streaming": "#8d99ae", "h2o": "#e76f51", "snapkv": "#2a9d8f", "threshold": "#d4a72c",
                 "quest": "#264653"}
POLICY_NAMES = {"streaming": "StreamingLLM", "h2o": "H2O", "snapkv": "SnapKV", "threshold": "threshold (seed)",
                "quest": "Quest"}
KIND_COLORS = {"k_pre": "#264653", "k": "#2a9d8f", "v": "#e9c46a"}
PAGE_COLORS = {8: "#8d99ae", 16: "#264653", 32: "#2a9d8f", 64: "#e76f51"}
#: the token states of the attention map's strip: (colour, words); 0 dropped, 1 held but not attended / read, 2 kept
STATE_COLORS = ("#cfcfcf", "#e9c46a", "#2a9d8f")
CURRENT = "#d62828"
LINK_NAMES = {"dma_d2h": "DMA d2h", "dma_h2d": "DMA h2d", "pageable_d2h": "pageable d2h",
              "pageable_h2d": "pageable h2d", "disk_write": "disk write", "disk_read": "disk read"}


def _runs(mask: Sequence[bool]) -> list[tuple[int, int]]:
    """``[(first, last)]`` of the runs of True in ``mask``."""
    out, start = [], None
    for i, m in enumerate([*mask, False]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            out.append((start, i - 1))
            start = None
    return out


def _key(text: str, color: str) -> str:
    return f"<span style='color:{color}'>&#9632;</span> {text}"


def _subplot_titles(fig: go.Figure, size: int = 12) -> None:
    for a in fig.layout.annotations:
        a.font.size = size


def sparsification_overview(curves: Mapping[str, Sequence[Mapping]], chosen: str, current: Mapping,
                            attention: Sequence[Sequence[float]], states: Sequence[int], block_size: int,
                            setup: Mapping) -> go.Figure:
    """Every policy's error against the memory it keeps, and one choice laid over the attention it drops.

    Args:
        curves: per policy name, ``study.score_policies`` rows of layer ``"all"`` by budget (``blocks_kept``,
            ``blocks_full``, ``error``, ``frees``; ``point``: the words for a point's hover).
        chosen: the policy whose curve is drawn heavier.
        current: the chosen setting's row (ringed on its curve), with ``point``.
        attention: ``[Hq][T]`` the last prompt token's attention of the shown layer, per query head.
        states: ``[T]`` per token: 2 kept, 1 held but not attended (a partly kept block under ``keep``; a page
            Quest does not read), 0 dropped.
        block_size: tokens per block (the strip's block boundaries).
        setup: ``{"title", "subtitle", "map_title", "state_words", "held_attended"}``: ``state_words`` names the
            three states; ``held_attended``: whether state 1 is still read (``keep``) or not (Quest).
    """
    fig = make_subplots(rows=2, cols=2, specs=[[{"rowspan": 2}, {}], [None, {}]], column_widths=[0.4, 0.6],
                        row_heights=[0.85, 0.15], horizontal_spacing=0.1, vertical_spacing=0.035,
                        subplot_titles=("error against memory kept", setup["map_title"], None))
    _subplot_titles(fig)
    top = 0.05
    for name, rows in curves.items():
        big = name == chosen
        x = [r["blocks_kept"] / r["blocks_full"] for r in rows]
        y = [r["error"] for r in rows]
        top = max([top, *y])
        label = POLICY_NAMES[name] + (" (blocks read)" if not all(r["frees"] for r in rows) else "")
        fig.add_scatter(x=x, y=y, mode="lines+markers", name=label, legendrank=1 if big else 2,
                        line=dict(color=POLICY_COLORS[name], width=4 if big else 2,
                                  dash="dash" if name == "quest" else "solid"),
                        marker=dict(size=8 if big else 5), hovertext=[r["point"] for r in rows], hoverinfo="text",
                        row=1, col=1)
    fig.add_scatter(x=[1.0], y=[0.0], mode="markers", name="full cache", marker=dict(color="#111", size=9,
                    symbol="square"), hovertemplate="full cache: every block, error 0<extra></extra>", row=1, col=1)
    cx, cy = current["blocks_kept"] / current["blocks_full"], current["error"]
    fig.add_scatter(x=[cx], y=[cy], mode="markers", name="this setting",
                    marker=dict(color="rgba(0,0,0,0)", size=17, line=dict(color=CURRENT, width=3)),
                    hovertext=[current["point"]], hoverinfo="text", row=1, col=1)
    fig.update_xaxes(title_text="memory kept (blocks held / full)", range=[0, 1.04], title_standoff=6, row=1, col=1)
    fig.update_yaxes(title_text="attention-output error (rel. L2)", range=[0, top * 1.12], row=1, col=1)

    hq, T = len(attention), len(attention[0])
    z = [[math.log10(max(p, 1e-5)) for p in row] for row in attention]
    fig.add_heatmap(z=z, x=list(range(T)), y=[f"q{h}" for h in range(hq)], zmin=-4, zmax=0, colorscale="Viridis",
                    colorbar=dict(title=dict(text="log10 p", side="top", font_size=10), x=1.0, xanchor="left",
                                  y=1.0, yanchor="top", len=0.6, thickness=9, tickfont_size=9),
                    hovertemplate="token %{x}, head %{y}: log10 p = %{z:.2f}<extra></extra>", row=1, col=2)
    attended = [s == 2 or (s == 1 and setup.get("held_attended", True)) for s in states]
    xref = fig.get_subplot(1, 2).xaxis.plotly_name.replace("axis", "")
    yref = fig.get_subplot(1, 2).yaxis.plotly_name.replace("axis", "")
    # what attention no longer reads, washed out (one shapes list: add_vrect per run costs ~40 ms each)
    fig.layout.shapes = [dict(type="rect", xref=xref, yref=f"{yref} domain", x0=a - 0.5, x1=b + 0.5, y0=0, y1=1,
                              fillcolor="#efefef", opacity=0.85, line_width=0, layer="above")
                         for a, b in _runs([not m for m in attended])]
    fig.update_yaxes(autorange="reversed", tickfont_size=10, row=1, col=2)
    fig.update_xaxes(showticklabels=False, range=[-0.5, T - 0.5], row=1, col=2)
    words = setup["state_words"]
    fig.add_heatmap(z=[list(states)], x=list(range(T)), y=[0], zmin=-0.5, zmax=2.5, showscale=False,
                    colorscale=[[0, STATE_COLORS[0]], [1 / 3, STATE_COLORS[0]], [1 / 3, STATE_COLORS[1]],
                                [2 / 3, STATE_COLORS[1]], [2 / 3, STATE_COLORS[2]], [1, STATE_COLORS[2]]],
                    hovertext=[[f"token {t} (block {t // block_size}): {words[s]}" for t, s in enumerate(states)]],
                    hoverinfo="text", row=2, col=2)
    edges = range(block_size, T, block_size)
    fig.add_scatter(x=[v for e in edges for v in (e - 0.5, e - 0.5, None)],
                    y=[v for _ in edges for v in (-0.5, 0.5, None)], mode="lines", showlegend=False,
                    line=dict(color="white", width=1.5), hoverinfo="skip", row=2, col=2)
    key = "  ".join(_key(w, c) for w, c in zip(words, STATE_COLORS, strict=True) if w)
    fig.update_xaxes(title_text=f"prompt token (white lines: blocks of {block_size})<br>{key}", title_font_size=11,
                     range=[-0.5, T - 0.5], title_standoff=4, tickfont_size=10, row=2, col=2)
    fig.update_yaxes(showticklabels=False, range=[-0.5, 0.5], row=2, col=2)
    top = setup_title(setup, margin_t=168, height=620)  # wrapped to fit
    fig.update_layout(height=top["height"], margin=dict(t=top["margin_t"], r=10, l=60, b=40), title_font_size=14,
                      legend=dict(orientation="h", x=0.0, xanchor="left", y=-0.17, yanchor="top", font_size=11),
                      title=top["title"])
    return fig


def quest_overview(recall: Sequence[Mapping], page_size: int, share: float, speedups: Mapping[str, Sequence],
                   batch: int, setup: Mapping) -> go.Figure:
    """Quest's recall on real activations by page size, and what it bought on the H200.

    Args:
        recall: rows ``{page_size, share (nominal budget), pages, read (share of the keys read), recall,
            recall_per_head, recall_oracle}``.
        page_size, share: the chosen page size (drawn heavier, with its per-head and oracle recall) and budget.
        speedups: per run name, ``results.compress.quest_speedups`` rows at ``batch``, the shown run last.
        setup: ``{"title", "subtitle", "speed_title"}``.
    """
    fig = make_subplots(rows=1, cols=2, column_widths=[0.52, 0.48], horizontal_spacing=0.11, subplot_titles=(
        "attention inside the pages read", setup["speed_title"]))
    _subplot_titles(fig)
    sizes = sorted({r["page_size"] for r in recall})
    for ps in sizes:
        rows = sorted((r for r in recall if r["page_size"] == ps), key=lambda r: r["read"])
        big = ps == page_size
        variants = [("recall", "solid", f"{ps}-token pages")]
        if big:
            variants += [("recall_per_head", "dot", "per head (frees nothing)"),
                         ("recall_oracle", "dash", "best single set")]
        for key, dash, name in variants:
            fig.add_scatter(x=[r["read"] for r in rows], y=[r[key] for r in rows], mode="lines+markers", name=name,
                            line=dict(color=PAGE_COLORS.get(ps, "#555"), width=4 if big and key == "recall" else 2,
                                      dash=dash), marker=dict(size=7 if big else 5),
                            hovertext=[f"{ps}-token pages, budget {r['share']:.0%} of the pages ({r['pages']:.1f} "
                                       f"pages): {r['read']:.2f} of the keys read, {key} {r[key]:.3f}" for r in rows],
                            hoverinfo="text", row=1, col=1)
    cur = next(r for r in recall if r["page_size"] == page_size and r["share"] == share)
    fig.add_scatter(x=[cur["read"]], y=[cur["recall"]], mode="markers", name="this setting",
                    marker=dict(color="rgba(0,0,0,0)", size=17, line=dict(color=CURRENT, width=3)),
                    hovertemplate=f"{page_size}-token pages at {share:.0%}: recall {cur['recall']:.3f}<extra></extra>",
                    row=1, col=1)
    right = max(r["read"] for r in recall)
    low = min(r[k] for r in recall for k in ("recall", "recall_per_head", "recall_oracle"))
    fig.update_xaxes(title_text="share of the keys read a step", range=[0, min(1.02, right * 1.1)], title_standoff=6,
                     row=1, col=1)
    fig.update_yaxes(title_text="attention mass in the pages read", range=[max(0.0, low - 0.08), 1.0], row=1, col=1)

    names = list(speedups)
    last_rows = speedups[names[-1]] if names else []
    top = 1.2
    for run in names:
        rows = speedups[run]
        last = run == names[-1]
        for key, dash, what in (("speedup_graph", "solid", "CUDA graph"), ("speedup", "dot", "eager")):
            graph = key == "speedup_graph"
            y = [r[key] for r in rows]
            top = max([top, *y])
            fig.add_scatter(x=[r["share"] for r in rows], y=y, mode=("lines+markers+text" if graph else "lines+markers")
                            if last else "markers", name=f"H200, {what}" if last else "the other run",
                            showlegend=last or graph, text=[f"{v:.2f}x" for v in y] if graph and last else None,
                            textposition="top center", textfont_size=10,
                            line=dict(color="#264653" if last else "#9aa5ab", dash=dash, width=3 if last else 1),
                            marker=dict(size=8 if last else 6, symbol="circle" if last else "diamond"),
                            legendgroup=what if last else "other",
                            hovertext=[f"{run}: {r['budget_tokens']} of {r['context']} tokens, {what} {r[key]:.2f}x "
                                       f"({r['full_us_graph' if graph else 'full_us']:.0f} -> "
                                       f"{r['time_us_graph' if graph else 'time_us']:.0f} us)"
                                       for r in rows], hoverinfo="text", row=1, col=2)
    fig.add_hline(y=1.0, line=dict(color="#888", dash="dash", width=1), row=1, col=2)
    fig.add_vline(x=share, line=dict(color=CURRENT, dash="dot", width=2), row=1, col=2)
    xs = [r["share"] for r in last_rows] or [share]
    context = last_rows[0]["context"] if last_rows else "?"
    fig.update_xaxes(title_text=f"budget, tokens of {context} (bytes read: x fewer)", type="log", tickvals=xs,
                     ticktext=[f"{r['budget_tokens']}<br>{r['bytes_ratio']:.1f}x" for r in last_rows] or None,
                     tickangle=0, tickfont_size=10,
                     range=[math.log10(min([share, *xs]) / 1.4), math.log10(max([share, *xs]) * 1.4)],
                     title_standoff=6, row=1, col=2)
    fig.update_yaxes(title_text="full decode time / Quest's", range=[0, top * 1.25], row=1, col=2)
    top = setup_title(setup, margin_t=135, height=540)  # wrapped to fit
    fig.update_layout(height=top["height"], margin=dict(t=top["margin_t"], r=10, l=60, b=40), title_font_size=14,
                      legend=dict(orientation="h", x=0.0, xanchor="left", y=-0.2, yanchor="top", font_size=11),
                      title=top["title"])
    return fig


def delta_overview(by_layer: Mapping[int, Mapping[str, Mapping]], layer: int,
                   by_prompt: Mapping[str, Mapping[str, Mapping]], break_even: Sequence[Mapping],
                   setup: Mapping) -> go.Figure:
    """Lossless delta coding of real K/V: the ratio per layer and kind (the chosen layer's prompts as dots), and the
    codec speed a compressed swap would need on every measured link.

    Args:
        by_layer: ``results.compress.ratio_by_layer``; layer: the one framed, its prompts drawn as dots.
        by_prompt: ``results.compress.ratio_by_prompt`` of ``layer``.
        break_even: ``results.compress.fold_break_even`` rows of one chunk (``needed_serial``, ``needed_overlap``,
            ``cpu_gbps``, ``link_gbps``).
        setup: ``{"title", "subtitle", "ratio_title", "break_even_title"}``.
    """
    fig = make_subplots(rows=1, cols=2, column_widths=[0.52, 0.48], horizontal_spacing=0.1,
                        subplot_titles=(setup["ratio_title"], setup["break_even_title"]))
    _subplot_titles(fig)
    layers = [str(x) for x in by_layer]
    top = 1.3
    prompts = list(by_prompt)
    for kind, words in KINDS.items():
        y = [by_layer[x][kind]["ratio"] for x in by_layer]
        top = max([top, *y])
        fig.add_bar(x=layers, y=y, name=words, marker_color=KIND_COLORS[kind], offsetgroup=kind, legendgroup=kind,
                    hovertemplate=f"layer %{{x}}, {words}: %{{y:.3f}} (all prompts)<extra></extra>", row=1, col=1)
        dots = [by_prompt[p][kind]["ratio"] for p in prompts]
        top = max([top, *dots])
        fig.add_scatter(x=[str(layer)] * len(prompts), y=dots, mode="markers", offsetgroup=kind, legendgroup=kind,
                        showlegend=kind == "k", name=f"layer {layer}, one prompt each",
                        marker=dict(color="white", size=7, line=dict(color="#111", width=1.5)),
                        hovertext=[f"layer {layer}, {p}, {words}: {v:.3f}" for p, v in zip(prompts, dots, strict=True)],
                        hoverinfo="text", row=1, col=1)
    fig.add_scatter(x=layers, y=[by_layer[x]["k"].get("entropy_ratio") for x in by_layer], mode="markers",
                    name="entropy bound (cached keys)", marker=dict(symbol="line-ew-open", size=16,
                    color="#111", line=dict(width=2)), offsetgroup="k",
                    hovertemplate="layer %{x}: entropy bound of the cached keys %{y:.3f}<extra></extra>", row=1, col=1)
    i = layers.index(str(layer))
    fig.add_vrect(x0=i - 0.5, x1=i + 0.5, fillcolor=CURRENT, opacity=0.08, line=dict(color=CURRENT, width=2),
                  row=1, col=1)
    fig.update_xaxes(title_text="model layer", type="category", title_standoff=6, row=1, col=1)
    fig.update_yaxes(title_text="raw / stored bytes", range=[1.0, top * 1.06], row=1, col=1)

    rows = sorted(break_even, key=lambda r: r["link_gbps"])
    labels = [f"{LINK_NAMES.get(r['link'], r['link']).replace(' ', '<br>')}<br>{r['link_gbps']:.3g}" for r in rows]
    finite = [v for r in rows for v in (r["needed_serial"], r["needed_overlap"], r["cpu_gbps"]) if math.isfinite(v)]
    hi = max(finite) * 4 if finite else 10.0
    for key, name, color in (("needed_serial", "needed: codec, then link", "#e76f51"),
                             ("needed_overlap", "needed: pipelined", "#f4a261")):
        y = [r[key] if math.isfinite(r[key]) else hi for r in rows]
        fig.add_bar(x=labels, y=y, name=name, marker_color=color, offsetgroup=key,
                    text=[f"{r[key]:.3g}" if math.isfinite(r[key]) else "none" for r in rows],
                    textposition="outside", textfont_size=9,
                    hovertemplate="%{x}: " + name + " %{text} GB/s<extra></extra>", row=1, col=2)
    fig.add_scatter(x=labels, y=[r["cpu_gbps"] for r in rows], mode="markers", name="this CPU's codec",
                    marker=dict(symbol="x-thin-open", size=14, color="#111", line=dict(width=3)),
                    hovertemplate="%{x}: the CPU codec runs at %{y:.3g} GB/s<extra></extra>", row=1, col=2)
    lo = min(finite) / 3 if finite else 0.01
    fig.update_yaxes(title_text="codec GB/s (log)", type="log", range=[math.log10(lo), math.log10(hi * 3)],
                     dtick=1, row=1, col=2)
    fig.update_xaxes(title_text="link (GB/s)", tickfont_size=9, tickangle=0, title_standoff=4, row=1, col=2)
    top = setup_title(setup, margin_t=135, height=540)  # wrapped to fit
    fig.update_layout(height=top["height"], barmode="group", scattermode="group",
                      margin=dict(t=top["margin_t"], r=10, l=60, b=40),
                      title_font_size=14,
                      legend=dict(orientation="h", x=0.0, xanchor="left", y=-0.24, yanchor="top", font_size=11),
                      title=top["title"])
    return fig


MODEL_PANES = {"agreement": "next-token agreement", "drift": "log-prob drift", "perplexity": "perplexity (log)"}


def model_overview(curves: Mapping[tuple[str, str], Sequence[Mapping]], full: Mapping, drift: str,
                   setup: Mapping) -> go.Figure:
    """The real model with its cache evicted: agreement, drift and perplexity against the memory each policy kept.

    Args:
        curves: ``results.compress.model_curves`` ``{(policy, partial): rows}``, the ones to draw.
        full: the full cache's row (the reference lines).
        drift: the drift column (``mean_abs_drift``, ``max_abs_drift``, ``mean_kl``) of the middle pane.
        setup: ``{"title", "subtitle", "drift_title"}``.
    """
    fig = make_subplots(rows=1, cols=3, horizontal_spacing=0.08, subplot_titles=(
        MODEL_PANES["agreement"], setup["drift_title"], MODEL_PANES["perplexity"]))
    _subplot_titles(fig)
    shown = set()
    tops = {"drift": 0.1, "perplexity": full["perplexity"] * 1.5}
    for (policy, partial), rows in curves.items():
        x = [r["memory_kept"] for r in rows]
        first = policy not in shown
        shown.add(policy)
        for col, key in ((1, "agreement"), (2, drift), (3, "perplexity")):
            y = [r[key] for r in rows]
            if col == 2:
                tops["drift"] = max([tops["drift"], *y])
            if col == 3:
                tops["perplexity"] = max([tops["perplexity"], *y])
            fig.add_scatter(x=x, y=y, mode="lines+markers", name=POLICY_NAMES[policy], legendgroup=policy,
                            showlegend=False, line=dict(color=POLICY_COLORS[policy], width=2.5,
                                                                     dash="solid" if partial == "compact" else "dot"),
                            marker=dict(size=7, symbol="circle" if partial == "compact" else "circle-open"),
                            hovertext=[f"{POLICY_NAMES[policy]} {_budget(r)} ({partial}): memory "
                                       f"{r['memory_kept']:.2f}, {key} {r[key]:.3f}" for r in rows], hoverinfo="text",
                            row=1, col=col)
        if first:  # the legend's entry: the policy's colour, whatever the curves' dashes
            fig.add_scatter(x=[None], y=[None], mode="lines", name=POLICY_NAMES[policy], legendgroup=policy,
                            line=dict(color=POLICY_COLORS[policy], width=6), row=1, col=1)
    for dash, words in (("solid", "compact partial blocks"), ("dot", "keep partial blocks")):
        if any((p == "compact") == (dash == "solid") for _, p in curves):
            fig.add_scatter(x=[None], y=[None], mode="lines", name=words, line=dict(color="#555", dash=dash),
                            row=1, col=1)
    for col, key in ((1, "agreement"), (2, drift), (3, "perplexity")):
        fig.add_scatter(x=[0, 1.04], y=[full[key]] * 2, mode="lines", name="full cache", showlegend=col == 1,
                        legendgroup="full", line=dict(color="#111", dash="dash", width=1),
                        hovertemplate=f"full cache: {full[key]:.3f}<extra></extra>", row=1, col=col)
        fig.update_xaxes(title_text="memory kept", range=[0, 1.04], title_standoff=6, row=1, col=col)
    fig.update_yaxes(title_text="share of the full cache's tokens", range=[0, 1.05], row=1, col=1)
    fig.update_yaxes(range=[0, tops["drift"] * 1.1], row=1, col=2)
    fig.update_yaxes(type="log", range=[math.log10(full["perplexity"] / 1.2), math.log10(tops["perplexity"] * 1.2)],
                     row=1, col=3)
    top = setup_title(setup, margin_t=168, height=520)  # wrapped to fit
    fig.update_layout(height=top["height"], margin=dict(t=top["margin_t"], r=10, l=60, b=40), title_font_size=14,
                      legend=dict(orientation="h", x=0.0, xanchor="left", y=-0.16, yanchor="top", font_size=11),
                      title=top["title"])
    return fig


def _budget(r: Mapping) -> str:
    return f"p >= {r['budget']:g}" if r["policy"] == "threshold" else f"{r['budget']:.0%}"


def stage_words(config: str) -> str:
    return STAGES.get(config, config)
