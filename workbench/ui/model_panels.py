"""The panels of notebook 06: SmolLM2-135M generating through the paged cache (block tables growing and shared,
live), a quantized cache's greedy run against fp16's, and the real K/V statistics per layer.

Like ``workbench.ui.panels``, they hold no logic: ``workbench.model.inspect`` records and counts,
``model_figures`` draws. The generation panel runs the model only when its Generate button is pressed (a run
takes seconds on a CPU): moving its run controls says on the figure that they changed; the snapshot slider
and the colour toggle redraw the recorded run at once.
"""

from __future__ import annotations

import html
from collections.abc import Sequence

import ipywidgets as W

from workbench import quant
from workbench.figures import model as model_figures
from workbench.model import inspect
from workbench.model.agreement import agreement_result, calibration_sample, greedy  # the agreement panel's runs
from workbench.studies.model import AGREEMENT
from workbench.ui.controls import controls_for
from workbench.ui.panels import Panel

DEFAULT_PROMPTS = "Name a fruit.\nName a colour."
RUN_CONTROLS = {"prompt": "prompts", "max_new_tokens": "new tokens", "n": "samples", "temperature": "temperature"}


def _texts_html(rows: list[tuple[str, str, str]], note: str = "") -> str:
    """``(sequence label, prompt line, generated text)`` rows as a small grid of text."""
    cells = "".join(
        f"<div style='font-weight:600;color:#264653;white-space:nowrap'>{html.escape(label)}</div>"
        f"<div style='color:#6c757d;white-space:nowrap'>{html.escape(prompt)}</div>"
        f"<div style='white-space:pre-wrap;word-break:break-word'>{html.escape(text) or '&nbsp;'}</div>"
        for label, prompt, text in rows)
    head = f"<div style='color:#555;margin-bottom:4px'>{html.escape(note)}</div>" if note else ""
    return (f"<div style='font-size:13px;line-height:1.35;padding:4px 8px'>{head}<div style='display:grid;"
            f"grid-template-columns:max-content minmax(0,max-content) minmax(0,1fr);column-gap:14px;row-gap:3px'>"
            f"{cells}</div></div>")


class GenerationPanel(Panel):
    """Prompts (one a line, each in the chat template), new tokens, samples per prompt and temperature; the
    Generate button runs SmolLM2-135M through a fresh paged cache (``inspect.record``) and draws its block tables
    as they grow; afterwards the ``snapshot`` slider steps through the recorded prefills, forks and decode steps
    and ``colour`` switches between physical block ids and ref counts. The generated text is shown under the
    figure, at the chosen snapshot.

    Args:
        model, tok: :func:`workbench.model.load_smollm2`'s.
        prompt: the prompt box's text.
        max_new_tokens, n, temperature, seed: the first run's settings (runs on construction).
        page_tokens: tokens per block; kv_dtype: the cache's scheme (fp16: what the tables show is the same for
            any); ops: ``"kernels"`` / ``"torch"`` (default: kernels on a GPU).
        max_tokens_limit: the new-tokens slider's maximum.
        live: redraw the figure at every snapshot while a run goes (False: only at its end).
    """

    def __init__(self, model, tok, prompt: str = DEFAULT_PROMPTS, max_new_tokens: int = 16, n: int = 2,
                 temperature: float = 0.8, seed: int = 0, page_tokens: int = 16, kv_dtype: str = "fp16",
                 ops: str | None = None, max_tokens_limit: int = 64, live: bool = True):
        self.model, self.tok = model, tok
        self.seed, self.page_tokens, self.kv_dtype, self.ops, self.live_draw = seed, page_tokens, kv_dtype, ops, live
        self.recorded: inspect.Recorded | None = None
        self.run_values: dict = {}
        self.runs = 0
        self._quiet = False
        controls = {
            "prompt": W.Textarea(value=prompt, description="prompts, one a line", rows=3, continuous_update=False,
                                 layout=W.Layout(width="420px")),
            "max_new_tokens": W.IntSlider(value=max_new_tokens, min=1, max=max_tokens_limit, description="new tokens"),
            "n": W.IntSlider(value=n, min=1, max=4, description="samples"),
            "temperature": W.FloatSlider(value=temperature, min=0.0, max=1.5, step=0.1, readout_format=".1f",
                                         description="temperature"),
            "step": W.IntSlider(value=0, min=0, max=0, description="snapshot"),
            "colour": W.ToggleButtons(options=[("physical block", "block"), ("ref count", "refs")], value="block",
                                      description="colour"),
        }
        self.button = W.Button(description="Generate", button_style="primary", icon="play",
                               tooltip="run the model with these settings", layout=W.Layout(width="140px"))
        self.button.on_click(lambda _b: self.generate())
        self.info = W.HTML()
        # no side margin (it fits the panel); every sequence shown: an inner scroll box hid all but four
        self.texts = W.HTML(layout=W.Layout(width="100%", margin="2px 0"))
        self._run({k: c.value for k, c in controls.items()})
        controls["step"].max = controls["step"].value = len(self.recorded.snapshots) - 1
        super().__init__(controls, self._compute, lambda r: model_figures.block_tables(**r), live=False)
        controls["step"].continuous_update = True  # a redraw of the recorded run is cheap: follow the handle
        box = self.widget.children[0]
        row = W.HBox([self.button, self.info], layout=W.Layout(align_items="center", padding="2px 4px"))
        self.widget.children = (box, row, self.status, self.view, self.texts)
        self._first = (self.recorded, self.run_values, self.runs)  # the run reset() shows again
        self._show_texts()

    def _restore(self) -> None:
        self.recorded, self.run_values, self.runs = self._first
        self.controls["step"].max = len(self.recorded.snapshots) - 1

    # ---- runs ------------------------------------------------------------------------------------------------
    def prompts(self, text: str | None = None) -> list[list[int]]:
        return inspect.chat_prompts(self.tok, self.controls["prompt"].value if text is None else text)

    def _run(self, values: dict, on_snapshot=None) -> None:
        prompts = self.prompts(values["prompt"])
        if not prompts:
            raise ValueError("the prompt box is empty: write one prompt a line")
        self.recorded = inspect.record(self.model, prompts, values["max_new_tokens"], n=values["n"],
                                       temperature=values["temperature"], seed=self.seed, kv_dtype=self.kv_dtype,
                                       page_tokens=self.page_tokens, ops=self.ops, on_snapshot=on_snapshot)
        self.run_values = {k: values[k] for k in RUN_CONTROLS}
        self.runs += 1

    def generate(self) -> None:
        """Run the model with the controls' settings (what the Generate button does), drawing as it goes."""
        values = self.values()
        snaps: list = []
        lines = [line.strip() for line in values["prompt"].splitlines() if line.strip()]

        def live(snap):
            snaps.append(snap)
            if not self.live_draw:
                return
            tl = inspect.timeline(snaps)
            setup = self._setup(values, running=True)
            fig = model_figures.block_tables(inspect.block_grid(snap, snaps[-2] if len(snaps) > 1 else None),
                                             tl, len(snaps) - 1, values["colour"], setup, "running\u2026")
            self.figure = fig
            self.view.show(fig)
            rows = [(inspect.seq_label(s), lines[s[0]], self.tok.decode(t[len(prompts[s[0]]):]))
                    for s, t in zip(snap.seq_ids, snap.tokens, strict=True)]
            self.texts.value = _texts_html(rows, f"generating: snapshot {snap.index} ({snap.event})")

        prompts = self.prompts(values["prompt"])
        self.button.disabled, self.button.description = True, "Generating\u2026"
        self.info.value = ""
        try:
            self._run(values, on_snapshot=live)
        except Exception as e:  # noqa: BLE001  (said in the panel; the last run stays shown)
            self.figure = model_figures.block_tables(**self.compute())  # back to the last run (not redraw(): it
            self.view.show(self.figure)  # would clear the status that says why)
            self.status.value = f"<span style='color:#b00020'>{type(e).__name__}: {html.escape(str(e))}</span>"
            return
        finally:
            self.button.disabled, self.button.description = False, "Generate"
        step = self.controls["step"]
        self._quiet = True
        try:
            step.max = len(self.recorded.snapshots) - 1
            step.value = step.max
        finally:
            self._quiet = False
        self.redraw()

    # ---- drawing ---------------------------------------------------------------------------------------------
    def _setup(self, values: dict, running: bool = False) -> dict:
        rec = self.recorded
        v = values if running else self.run_values
        return {"prompts": len(self.prompts(v["prompt"])), "samples": v["n"], "new_tokens": v["max_new_tokens"],
                "temperature": v["temperature"], "kv_dtype": rec.kv_dtype if rec else self.kv_dtype,
                "ops": rec.ops if rec else (self.ops or "?"), "run": self.runs + (1 if running else 0),
                "seconds": 0.0 if running or rec is None else rec.seconds}

    def pending(self, values: dict | None = None) -> str:
        """Which run controls differ from the shown run's ('' when none)."""
        values = values or self.values()
        changed = []
        for k, label in RUN_CONTROLS.items():
            if values[k] != self.run_values.get(k):
                if k == "prompt":
                    n = len(self.prompts(values[k]))
                    changed.append(f"{label}: {n} line{'s' if n != 1 else ''} edited")
                else:
                    changed.append(f"{label} {values[k]:g}")
        return f"changed since this run: {', '.join(changed)}; press Generate" if changed else ""

    def _compute(self, prompt, max_new_tokens, n, temperature, step, colour) -> dict:
        rec = self.recorded
        snaps = rec.snapshots
        step = min(step, len(snaps) - 1)
        width = max(len(t) for s in snaps for t in s.tables)  # the run's extent: the grid stays still
        grid = inspect.block_grid(snaps[step], snaps[step - 1] if step else None, width=width,
                                  seq_ids=snaps[-1].seq_ids)
        values = {"prompt": prompt, "max_new_tokens": max_new_tokens, "n": n, "temperature": temperature}
        return {"grid": grid, "timeline": inspect.timeline(snaps), "step": step, "colour": colour,
                "setup": self._setup(values), "pending": self.pending(values)}

    def redraw(self) -> None:
        if self._quiet or self._holding:
            return
        super().redraw()
        self._show_texts()

    def _show_texts(self) -> None:
        rec = self.recorded
        step = min(self.controls["step"].value, len(rec.snapshots) - 1)
        snap = rec.snapshots[step]
        last = step == len(rec.snapshots) - 1
        lines = [line.strip() for line in self.run_values["prompt"].splitlines() if line.strip()]
        gen = rec.generation.tokens if last else rec.generated(snap)
        rows = [(inspect.seq_label(s), lines[s[0]], self.tok.decode(gen[s])) for s in snap.seq_ids]
        note = ("generated text (all tokens)" if last else
                f"text in the cache at snapshot {step} ({snap.event}): prompt, then the tokens fed back so far")
        self.texts.value = _texts_html(rows, note)
        hits = rec.generation.prefix_hit_tokens
        self.info.value = (f"<span style='color:#555'>last run: {len(rec.prompts)} prompts "
                           f"({', '.join(str(len(p)) for p in rec.prompts)} tokens; prefix hits "
                           f"{', '.join(str(hits[i]) for i in sorted(hits))}), {rec.seconds:.1f} s</span>")


def generation_panel(model, tok, **kwargs) -> GenerationPanel:
    """:class:`GenerationPanel` (its arguments)."""
    return GenerationPanel(model, tok, **kwargs)


# ---- a quantized cache against fp16 ----------------------------------------------------------------------------
# calibration_sample, greedy and agreement_result live in workbench.model.agreement (imported above, under the
# same names): the panel below and the sweep `agreement` (workbench.studies.model, whose figure it draws) call them.


def agreement_panel(model, tok, prompts: dict[str, list[int]], new_tokens: int = 16, scheme: str = "int4/token",
                    schemes: Sequence[str] = AGREEMENT.param("scheme").choices, ops: str | None = None,
                    refs: dict | None = None, results: dict | None = None, calibration=None) -> Panel:
    """Scheme and prompt -> a greedy run with that cache against fp16's: tokens equal, first divergence, log-prob
    drift, the two texts side by side. Runs are kept: going back to a setting redraws at once.

    Args:
        prompts: name -> token ids (the dropdown's choices, in order).
        new_tokens: tokens generated per run.
        schemes: the dropdown's schemes (default: the ``agreement`` study's, every scheme but fp16).
        refs, results: runs already made, to start from (prompt name -> fp16 :func:`greedy` run;
            ``(scheme, prompt name)`` -> :func:`agreement_result`); the panel adds its own to them.
        calibration: :func:`calibration_sample` (computed at the first static scheme when None).
    """
    refs = {} if refs is None else refs
    results = {} if results is None else results
    calibration = [] if calibration is None else [calibration]  # else computed at the first static scheme

    def compute(scheme, prompt):
        key = (scheme, prompt)
        if key not in results:
            if prompt not in refs:
                refs[prompt] = greedy(model, prompts[prompt], new_tokens, "fp16", ops)
            if quant.get(scheme).needs_static_scales and not calibration:
                calibration.append(calibration_sample(model, tok))
            results[key] = agreement_result(model, tok, prompts[prompt], new_tokens, scheme, refs[prompt], ops,
                                            calibration[0] if calibration else None)
        return {**results[key], "prompt_name": prompt}

    controls = controls_for(AGREEMENT, {"scheme": scheme}, options={"scheme": schemes})
    # the panel's own prompts (any tokenized ones; the sweep runs the captured prompts by name)
    controls["prompt"] = W.Dropdown(options=list(prompts), value=next(iter(prompts)), description="prompt")
    panel = Panel(controls, compute, AGREEMENT.draw, live=False)
    panel.results = results
    return panel


# ---- K/V statistics ----------------------------------------------------------------------------------------------
def kv_stats_panel(sources: dict[str, dict], layer: int = 15, head: int = 0) -> Panel:
    """Layer, kv head and source (the average over the captured prompts, or one of them) -> outlier key channels
    per layer before and after RoPE, the attention sink per layer, and the chosen layer's channels.

    Args:
        sources: :func:`workbench.model.inspect.kv_stats_sources` (or ``{name: {"layers": capture.kv_stats(...)
            ["layers"], "tokens": T}}``).
    """
    if not sources:
        raise ValueError("sources must hold at least one set of statistics (inspect.kv_stats_sources)")
    first = next(iter(sources.values()))
    L, H = len(first["layers"]), len(first["layers"][0]["k_pre"]["ratio"])
    controls = {
        "layer": W.IntSlider(value=min(layer, L - 1), min=0, max=L - 1, description="layer"),
        "head": W.ToggleButtons(options=[(f"head {h}", h) for h in range(H)], value=head, description="kv head"),
        "source": W.Dropdown(options=list(sources), value=next(iter(sources)), description="K/V of"),
    }

    def compute(layer, head, source):
        s = sources[source]
        what = source if s.get("tokens") is None else f"prompt '{source}' ({s['tokens']} tokens)"
        return {"layers": s["layers"], "layer": layer, "head": head,
                "source": f"SmolLM2-135M prefill, {what}: data/activations (python -m workbench capture)"}

    return Panel(controls, compute, lambda r: model_figures.kv_stats(**r), live=False)
