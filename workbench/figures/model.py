"""Plotly figures of notebook 06 (the real model through the paged cache), built from the plain data of
``workbench.model.inspect`` (block-table grids, run timelines), a quantized run's agreement with fp16, and
the K/V statistics of ``workbench.model.capture``; and the model runner's decode paths (the cascade, Quest) of the
committed ``bench model_decode`` runs that notebooks 08 and 07 show (``workbench.results.model_paths``)."""

from __future__ import annotations

import html
import math

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from workbench.figures.titles import SUB_CHARS, TITLE_CHARS, wrap
from workbench.results import model_paths

# cells coloured by physical block id: twenty light colours, cycled (the id, written in the cell, is what decides)
BLOCK_COLORS = ("#8ecae6", "#ffb703", "#b7e4c7", "#f4a261", "#cdb4db", "#e9c46a", "#a8dadc", "#ffafcc",
                "#d4a373", "#bde0fe", "#fb8072", "#b3de69", "#fccde5", "#80b1d3", "#ffed6f", "#bc80bd",
                "#ccebc5", "#fdb462", "#d9d9d9", "#8dd3c7")
SHARED_LINE = dict(color="#1d3557", width=3)
NEW_LINE = dict(color="#d62828", width=2.5, dash="dot")
COUNT_COLORS = {"blocks_in_use": "#2a9d8f", "blocks_unshared": "#e76f51", "shared_blocks": "#264653",
                "cow_copies": "#e9c46a", "prefix_hit_blocks": "#8d99ae"}
COUNT_NAMES = {"blocks_in_use": "blocks in use", "blocks_unshared": "blocks without sharing",
               "shared_blocks": "shared blocks", "cow_copies": "copy-on-write copies",
               "prefix_hit_blocks": "prefix-hit blocks"}


def _discrete(colors) -> list:
    """A stepwise colorscale: value ``i`` of ``0..len(colors) - 1`` gets ``colors[i]``."""
    n = len(colors)
    return [[p, c] for i, c in enumerate(colors) for p in (i / n, (i + 1) / n)]


def _cell_text(block, refs, fill, block_size) -> str:
    if block is None:
        return ""
    share = f" \u00d7{refs}" if refs > 1 else ""
    return f"<b>{block}</b>{share}  <span style='font-size:10px'>{fill}/{block_size}</span>"


def block_tables(grid, timeline: list[dict], step: int, colour: str = "block", setup: dict | None = None,
                 pending: str = "") -> go.Figure:
    """The block tables at one snapshot of a run, and the run's counts over time.

    Args:
        grid: ``workbench.model.inspect.Grid`` of the snapshot (rows: sequences, columns: logical blocks).
        timeline: ``inspect.timeline`` of the whole run (one row per snapshot).
        step: the snapshot shown (index into ``timeline``).
        colour: ``"block"`` (physical block id, twenty colours cycled) or ``"refs"`` (ref count).
        setup: ``{prompts, samples, new_tokens, temperature, kv_dtype, ops, run, seconds}`` for the subtitle.
        pending: a line saying which controls changed since the run (empty: none).

    Returns:
        Left: a heatmap per sequence and logical block, the physical block id in the cell (``xN``: its ref
        count when shared) with the tokens it holds; shared blocks framed, blocks new at this snapshot (allocated
        or copied on write) dotted red. Right: blocks in use, blocks without sharing, shared blocks and
        copy-on-write copies at every snapshot, the shown one marked.
    """
    if colour not in ("block", "refs"):
        raise ValueError(f"colour must be 'block' or 'refs', got {colour!r}")
    row = timeline[step]
    fig = make_subplots(rows=1, cols=2, column_widths=[0.6, 0.4], horizontal_spacing=0.15,
                        subplot_titles=("block tables: a row per sequence, a column per logical block",
                                        "the run so far"))
    w, bs = grid.width, grid.block_size
    xs = [f"L{i}" for i in range(w)]
    text = [[_cell_text(b, r, f, bs) for b, r, f in zip(br, rr, fr, strict=True)]
            for br, rr, fr in zip(grid.block, grid.refs, grid.fill, strict=True)]
    hover = [[(f"{name}, logical block {i}: physical block {b}, {f} of {bs} tokens, ref count {r}"
               if b is not None else "") for i, (b, r, f) in enumerate(zip(br, rr, fr, strict=True))]
             for name, br, rr, fr in zip(grid.rows, grid.block, grid.refs, grid.fill, strict=True)]
    if colour == "block":
        z = [[None if b is None else b % len(BLOCK_COLORS) for b in br] for br in grid.block]
        heat = dict(colorscale=_discrete(BLOCK_COLORS), zmin=-0.5, zmax=len(BLOCK_COLORS) - 0.5, showscale=False)
    else:
        top = max([r for rr in grid.refs for r in rr if r is not None] + [2])
        z = grid.refs
        heat = dict(colorscale="Tealrose", zmin=1, zmax=top, showscale=True,
                    colorbar=dict(title=dict(text="refs", side="top"), x=0.525, xanchor="left", thickness=12,
                                  len=0.9, dtick=1 if top <= 12 else None))
    fig.add_heatmap(z=z, x=xs, y=grid.rows, text=text, texttemplate="%{text}", hovertext=hover, hoverinfo="text",
                    xgap=3, ygap=3, textfont=dict(size=12, color="#111"), name="blocks", showlegend=False,
                    **heat, row=1, col=1)
    frames = []  # the frames on the left plot's axes, set in one go (add_shape validates the whole list each time)
    for r, (rr, nr) in enumerate(zip(grid.refs, grid.new, strict=True)):
        for c, (refs, new) in enumerate(zip(rr, nr, strict=True)):
            if refs is not None and refs > 1:
                frames.append(dict(type="rect", x0=c - 0.46, x1=c + 0.46, y0=r - 0.44, y1=r + 0.44, line=SHARED_LINE,
                                   xref="x", yref="y"))
            if new:
                frames.append(dict(type="rect", x0=c - 0.38, x1=c + 0.38, y0=r - 0.36, y1=r + 0.36, line=NEW_LINE,
                                   xref="x", yref="y"))
    fig.layout.shapes = frames
    # legend entries for the two frames (shapes have none)
    for name, line in (("shared (ref \u2265 2)", SHARED_LINE), ("new block (allocated or copied)", NEW_LINE)):
        fig.add_scatter(x=[None], y=[None], mode="markers", name=name,
                        marker=dict(symbol="square-open", size=14, color=line["color"], line=dict(width=2.5)),
                        row=1, col=1)
    fig.update_xaxes(type="category", tickfont_size=11, row=1, col=1)
    fig.update_yaxes(autorange="reversed", type="category", row=1, col=1)

    x = [t["index"] for t in timeline]
    events = [t["event"] for t in timeline]
    for key in ("blocks_unshared", "blocks_in_use", "shared_blocks", "cow_copies"):
        fig.add_scatter(x=x, y=[t[key] for t in timeline], mode="lines+markers", name=COUNT_NAMES[key],
                        line=dict(color=COUNT_COLORS[key], dash="dot" if key == "blocks_unshared" else "solid"),
                        marker=dict(size=5), customdata=events,
                        hovertemplate=f"{COUNT_NAMES[key]}: %{{y}} after %{{customdata}} %{{x}}<extra></extra>",
                        row=1, col=2)
    fig.add_vline(x=row["index"], line=dict(color="#555", width=1.5, dash="dash"), row=1, col=2)
    top = max(max(t["blocks_unshared"] for t in timeline), 1)
    fig.update_xaxes(title_text="snapshot (prefill, fork, decode step)", range=[-0.5, max(x) + 0.5 if x else 0.5],
                     row=1, col=2)
    fig.update_yaxes(title_text="blocks", range=[0, top * 1.12 + 0.5], rangemode="tozero", row=1, col=2)

    decode_steps = sum(1 for t in timeline[:step + 1] if t["event"] == "step")
    what = f"decode step {decode_steps}" if row["event"] == "step" else row["event"]
    title = (f"snapshot {step} of {len(timeline) - 1} ({what}): {row['blocks_in_use']} blocks in use for "
             f"{row['sequences']} sequence{'s' if row['sequences'] != 1 else ''} ({row['blocks_unshared']} without "
             f"sharing)<br>{row['shared_blocks']} shared, {row['cow_copies']} copy-on-write copies, "
             f"{row['prefix_hit_tokens']} prefix-hit tokens")
    s = setup or {}
    sub = ""
    if s:
        sub = (f"{s['prompts']} prompt{'s' if s['prompts'] != 1 else ''} x {s['samples']} "
               f"sample{'s' if s['samples'] != 1 else ''}, {s['new_tokens']} new tokens, temperature "
               f"{s['temperature']:g}; {s['kv_dtype']} cache, {bs}-token blocks, ops={s['ops']} \u00b7 run "
               f"{s['run']}, {s['seconds']:.1f} s")
    lines = [title] + ([f"<sup>{sub}</sup>"] if sub else []) + (
        [f"<sup><span style='color:#d62828'>{pending}</span></sup>"] if pending else [])
    fig.update_layout(
        title=dict(text="<br>".join(lines), font_size=14, x=0.01, xanchor="left", y=1, yref="container",
                   yanchor="top", pad=dict(t=26)),
        height=max(400, 22 * len(grid.rows) + 270), margin=dict(t=128 if pending else 112, r=10, l=60, b=100),
        # the legend at the bottom, below the axis titles whatever the figure's height (it may wrap to two rows)
        legend=dict(orientation="h", x=0, xanchor="left", yref="container", y=0.0, yanchor="bottom", font_size=11))
    fig.layout.annotations[0].update(x=0, xanchor="left")
    return fig


def _token_cells(pieces: list[str], first: int | None, colour: str) -> str:
    """Token pieces as one HTML string, the piece at ``first`` (the first divergence) highlighted."""
    out = []
    for i, p in enumerate(pieces):
        t = html.escape(p).replace("\n", "\u21b5")
        out.append(f"<b><span style='color:{colour}'>[{t}]</span></b>" if i == first else t)
    return "".join(out)


def agreement(result: dict) -> go.Figure:
    """A quantized cache's greedy run against fp16's on the same prompt.

    Args:
        result: ``scheme``; ``ref_pieces``/``pieces`` (token texts of the fp16 and the quantized run);
            ``ref_logprobs``/``logprobs`` (log-prob of each chosen token); ``first_divergence`` (index or None);
            ``equal`` (leading tokens equal); ``new_tokens``; ``drift`` (per position before the divergence: the
            quantized run's log-prob minus fp16's of the same token); ``bytes_per_token`` of both caches
            (``ref_bytes``, ``bytes``); optional ``note``.

    Returns:
        Top: the log-prob of every chosen token in both runs, the first divergence marked; under it the drift of
        the tokens both runs share (until they part). Bottom: the two texts side by side, the first differing token
        in red.
    """
    n = len(result["ref_logprobs"])
    first = result["first_divergence"]
    fig = make_subplots(rows=3, cols=1, row_heights=[0.42, 0.2, 0.38], vertical_spacing=0.09,
                        specs=[[{}], [{}], [{"type": "table"}]])
    x = list(range(n))
    fig.add_scatter(x=x, y=result["ref_logprobs"], mode="lines+markers", name="fp16",
                    line=dict(color="#264653"), hovertext=result["ref_pieces"],
                    hovertemplate="fp16 token %{x} %{hovertext}: log-prob %{y:.3f}<extra></extra>", row=1, col=1)
    fig.add_scatter(x=list(range(len(result["logprobs"]))), y=result["logprobs"], mode="lines+markers",
                    name=result["scheme"], line=dict(color="#e76f51", dash="dot"), hovertext=result["pieces"],
                    hovertemplate=f"{result['scheme']} token %{{x}} %{{hovertext}}: log-prob %{{y:.3f}}"
                                  "<extra></extra>", row=1, col=1)
    drift = result["drift"]
    fig.add_bar(x=list(range(len(drift))), y=drift, name=f"drift: {result['scheme']} minus fp16 (same token)",
                marker_color="#2a9d8f", hovertemplate="token %{x}: drift %{y:.3g}<extra></extra>", row=2, col=1)
    if first is not None:
        for r in (1, 2):
            fig.add_vline(x=first, line=dict(color="#d62828", width=2, dash="dash"), row=r, col=1)
        fig.add_annotation(x=first, y=1.0, yref="y domain", text=f" first divergence: token {first}",
                           showarrow=False, xanchor="left", yanchor="top", font=dict(color="#d62828", size=12),
                           row=1, col=1)
    for r in (1, 2):
        fig.update_xaxes(range=[-0.5, n - 0.5], row=r, col=1)
    fig.update_xaxes(title_text="generated token", row=2, col=1)
    low = min([*result["ref_logprobs"], *result["logprobs"], -0.1])
    fig.update_yaxes(title_text="log-prob", range=[1.08 * low, -0.04 * low], row=1, col=1)
    big = max([abs(d) for d in drift] + [1e-3])
    fig.update_yaxes(title_text="drift", range=[-1.15 * big, 1.15 * big], nticks=5, zeroline=True,
                     zerolinecolor="#888", row=2, col=1)
    fig.add_table(header=dict(values=[f"<b>fp16</b> ({result['ref_bytes']:.0f} B/token/layer)",
                                      f"<b>{result['scheme']}</b> ({result['bytes']:.0f} B/token/layer)"],
                              fill_color="#e9ecef", align="left", font=dict(size=13)),
                  cells=dict(values=[[_token_cells(result["ref_pieces"], first, "#264653")],
                                     [_token_cells(result["pieces"], first, "#d62828")]],
                             align="left", font=dict(size=13), height=28, fill_color="white"),
                  row=3, col=1)
    maxd = max([abs(d) for d in drift], default=0.0)
    if first is None:
        what = f"identical; largest log-prob drift {maxd:.2g}"
    else:
        what = f"they part at token {first}; largest log-prob drift before it {maxd:.2g}"
    title = (f"{result['scheme']} against fp16, greedy: {result['equal']} of {result['new_tokens']} tokens equal "
             f"({what})")
    note = f"<br><sup>{result['note']}</sup>" if result.get("note") else ""
    fig.update_layout(title=dict(text=title + note, font_size=14), height=620, margin=dict(t=100, r=10, l=70, b=20),
                      legend=dict(orientation="h", x=0, y=1.02, yanchor="bottom", xanchor="left"))
    return fig


def kv_stats(layers: list[dict], layer: int, head: int, source: str) -> go.Figure:
    """Real K/V statistics per layer (``workbench.model.capture.kv_stats`` / ``average_stats`` layers).

    Args:
        layers: one dict per layer with ``k_pre``, ``k``, ``v`` (``absmax [H][D]``, ``ratio [H]``, ``top3 [H][3]``),
            ``sink0``, ``sink4``.
        layer, head: the layer and kv head shown channel by channel.
        source: what the statistics are of (for the title).

    Returns:
        Top left: per layer, the largest channel's absmax over the median channel's, for the head's keys before
        and after RoPE and its values. Top right: attention of the last query on token 0 (the sink) and on tokens
        0-3, per layer. Bottom: the chosen layer and head, every channel's absmax before and after RoPE, the top
        channels labelled.
    """
    L = len(layers)
    d = layers[layer]
    fig = make_subplots(rows=2, cols=2, row_heights=[0.5, 0.5], vertical_spacing=0.27, horizontal_spacing=0.1,
                        specs=[[{}, {}], [{"colspan": 2}, None]],
                        subplot_titles=(f"kv head {head}: largest / median channel absmax",
                                        "the last query's attention on the first tokens",
                                        f"layer {layer}, kv head {head}: absmax of each key channel"))
    lx = list(range(L))
    series = (("k_pre", "keys before RoPE", "#e76f51", "solid"), ("k", "keys after RoPE", "#2a9d8f", "solid"),
              ("v", "values", "#8d99ae", "dot"))
    for key, name, color, dash in series:
        fig.add_scatter(x=lx, y=[r[key]["ratio"][head] for r in layers], mode="lines+markers", name=name,
                        line=dict(color=color, dash=dash), marker=dict(size=5), legend="legend",
                        hovertemplate=f"layer %{{x}}: {name} %{{y:.1f}}x<extra></extra>", row=1, col=1)
    fig.add_scatter(x=[layer], y=[d["k_pre"]["ratio"][head]], mode="markers", name=f"layer {layer}",
                    marker=dict(size=14, symbol="circle-open", color="#d62828", line=dict(width=3)),
                    showlegend=False, hoverinfo="skip", row=1, col=1)
    fig.update_xaxes(title_text="layer", range=[-0.5, L - 0.5], row=1, col=1)
    ratios = [r[key]["ratio"][head] for r in layers for key, *_ in series]
    lo, hi = math.log10(max(min(ratios), 1e-3) / 1.15), math.log10(max(max(ratios), 1e-3) * 1.15)
    # explicit ranges everywhere: an autorange that annotations widen can settle differently on a redraw
    fig.update_yaxes(title_text="max / median", type="log", range=[lo, hi], row=1, col=1)
    colors = ["#d62828" if i == layer else "#264653" for i in lx]
    fig.add_bar(x=lx, y=[r["sink0"] for r in layers], name="on token 0", marker_color=colors, legend="legend2",
                hovertemplate="layer %{x}: %{y:.3f} of the attention on token 0<extra></extra>", row=1, col=2)
    fig.add_scatter(x=lx, y=[r["sink4"] for r in layers], mode="lines+markers", name="on tokens 0-3", legend="legend2",
                    line=dict(color="#e9c46a"), marker=dict(size=5),
                    hovertemplate="layer %{x}: %{y:.3f} on tokens 0-3<extra></extra>", row=1, col=2)
    fig.update_xaxes(title_text="layer (red: the chosen one)", range=[-0.5, L - 0.5], row=1, col=2)
    fig.update_yaxes(title_text="attention mass", range=[0, 1.05], row=1, col=2)

    D = len(d["k_pre"]["absmax"][head])
    cx = list(range(D))
    for key, name, color in (("k_pre", "before RoPE", "#e76f51"), ("k", "after RoPE", "#2a9d8f")):
        a = d[key]["absmax"][head]
        fig.add_bar(x=cx, y=a, name=f"{name} (top {', '.join(map(str, d[key]['top3'][head]))})", marker_color=color,
                    opacity=0.85, legend="legend3",
                    hovertemplate=f"channel %{{x}} {name}: absmax %{{y:.2f}}<extra></extra>",
                    row=2, col=1)
    for c in d["k_pre"]["top3"][head]:
        fig.add_annotation(x=c, y=d["k_pre"]["absmax"][head][c], text=f"ch {c}", showarrow=True, arrowhead=0,
                           ay=-18, font=dict(size=11, color="#e76f51"), row=2, col=1)
    fig.update_xaxes(title_text=f"channel (0-{D // 2 - 1} and {D // 2}-{D - 1} rotate together: pair i, i + {D // 2})",
                     range=[-0.7, D - 0.3], dtick=4, row=2, col=1)
    top = max(max(d[key]["absmax"][head]) for key in ("k_pre", "k"))
    fig.update_yaxes(title_text="absmax over tokens", range=[0, 1.18 * top], row=2, col=1)
    # one legend per plot, each under its plot's axis title (the bottom one too: inside its plot, the top channels'
    # labels ran into it)
    top_row = fig.layout.yaxis.domain[0]
    below = dict(orientation="h", yanchor="top", y=top_row - 0.12, font_size=11)
    fig.update_layout(
        barmode="group", height=710, margin=dict(t=112, r=10, l=70, b=75),
        title=dict(font_size=14, x=0.01, xanchor="left", y=1, yref="container", yanchor="top", pad=dict(t=26), text=(
            f"layer {layer}, kv head {head}: largest key channel {d['k_pre']['ratio'][head]:.1f}x the median before "
            f"RoPE, {d['k']['ratio'][head]:.1f}x after;<br>{d['sink0']:.2f} of the last query's attention on token 0"
            f"<br><sup>{html.escape(source)}</sup>")),
        legend=dict(x=fig.layout.xaxis.domain[0], xanchor="left", **below),
        legend2=dict(x=fig.layout.xaxis2.domain[0], xanchor="left", **below),
        legend3=dict(x=fig.layout.xaxis3.domain[0], xanchor="left", y=-0.09, yanchor="top", orientation="h",
                     font_size=11))
    return fig


# the runner's decode paths: the reference grey, the cascade's modes and Quest's budgets in warm colours
PATH_COLORS = {"off": "#8d99ae", "auto": "#2a9d8f", "shared": "#e76f51", "full": "#8d99ae"}
BUDGET_COLORS = ("#e76f51", "#f4a261", "#e9c46a", "#bc6c25")


def _path_hover(r: dict) -> str:
    ms, tps = r["step_ms"], r["tokens_per_s"]
    return (f"{model_paths.label(r)}: {tps:.3g} tokens/s, {ms:.1f} ms a step, {model_paths.speedup(r):.2f}x<br>"
            f"attends: {model_paths.paths_text(r['paths'])}<br>one layer's kv.attend alone: {r['attend_us']:.0f} µs "
            f"({r['attend_share']:.0%} of the step over all layers)")


def decode_paths(run: dict, section: str) -> go.Figure:
    """The runner's tokens/s through each configuration of a ``bench model_decode`` run's ``section``
    (``workbench.results.model_paths``), one bar a configuration, its speedup against the section's reference
    written on it: ``cascade``: the three ``shared_prefix`` modes; ``quest``: grouped by batch, a bar for the full
    cache and one per page budget."""
    rows = model_paths.section_rows(run, section)
    if not rows:
        raise ValueError(f"section {section!r}: run {model_paths.run_name(run)} has no such rows")
    fig = go.Figure()
    first = rows[0]
    if section == "cascade":
        for r in rows:
            mode = r["shared_prefix"]
            fig.add_bar(x=[f"{mode}: {model_paths.MODES.get(mode, mode)}"], y=[r["tokens_per_s"]], name=mode,
                        marker_color=PATH_COLORS.get(mode, "#888"), text=[f"{r['speedup_vs_plain']:.2f}x"],
                        textposition="outside", hovertext=[_path_hover(r)], hoverinfo="text", showlegend=False)
        fig.update_xaxes(title_text="PagedKV(shared_prefix=...)")
        head = f"The model runner through the cascade: {first['samples']} samples of one {first['prompt']}-token prompt"
        what = "on each bar: tokens/s against plain paged decode (off)"
    else:
        budgets = list(dict.fromkeys(r["page_budget"] for r in rows if r["kv"] != "full"))
        for key in ["full", *budgets]:
            mine = [r for r in rows if (r["kv"] == "full" if key == "full" else r["page_budget"] == key)]
            name = "full cache" if key == "full" else f"Quest, {key} pages ({mine[0]['budget_tokens']} tokens)"
            color = PATH_COLORS["full"] if key == "full" else BUDGET_COLORS[budgets.index(key) % len(BUDGET_COLORS)]
            fig.add_bar(x=[f"batch {r['batch']}" for r in mine], y=[r["tokens_per_s"] for r in mine], name=name,
                        marker_color=color, text=[f"{r['speedup_vs_full']:.2f}x" for r in mine],
                        textposition="outside", hovertext=[_path_hover(r) for r in mine], hoverinfo="text")
        fig.update_xaxes(title_text="batch (copies of the prompt, each in its own blocks)")
        head = f"The model runner through Quest: a {first['prompt']}-token prompt, full cache vs page budgets"
        what = "on each bar: tokens/s against the full cache at the same batch"
    top = max(r["tokens_per_s"] for r in rows)
    fig.update_yaxes(title_text="tokens/s (eager runner)", range=[0, top * 1.18])
    gpu = run["info"].get("gpu", "GPU unknown")
    sub = "<br>".join(wrap(line, SUB_CHARS) for line in (
        f"{gpu} \u00b7 {model_paths.run_name(run)} \u00b7 random fp16 weights", what))
    fig.update_layout(title=dict(text=f"{wrap(head, TITLE_CHARS)}<br><sup>{sub}</sup>", font_size=14),
                      barmode="group", height=440, margin=dict(t=110, r=10, l=70, b=100),
                      legend=dict(orientation="h", x=0, xanchor="left", y=-0.22, yanchor="top"))
    return fig
