// The browser side of workbench.ui.plot_view.PlotView: one plotly figure, redrawn from the `figure` trait.

// plotly.js comes once per kernel, in one shared widget model (the `_plotly` trait names it) that every view
// refers to, and runs once per page as a classic script (it sets window.Plotly). A module of its 3.5 MB, or the
// source sent with every view, cost the browser ~0.2-0.4 s of CPU a view.
function loadPlotly(model) {
  if (globalThis.Plotly) return Promise.resolve(globalThis.Plotly);
  globalThis.__wbPlotlyLoading ??= (async () => {
    const ref = model.get("_plotly");  // "IPY_MODEL_<id>" (anywidget leaves a widget reference packed)
    const source = typeof ref === "string" ? await model.widget_manager.get_model(ref.slice("IPY_MODEL_".length)) : ref;
    const script = document.createElement("script");
    script.src = URL.createObjectURL(new Blob([source.get("source")], { type: "text/javascript" }));
    await new Promise((resolve, reject) => {
      script.onload = resolve;
      script.onerror = () => reject(new Error("plotly.js did not load"));
      document.head.appendChild(script);
    });
    URL.revokeObjectURL(script.src);
    return globalThis.Plotly;
  })().catch((e) => { globalThis.__wbPlotlyLoading = undefined; throw e; });
  return globalThis.__wbPlotlyLoading;
}

async function render({ model, el }) {
  const Plotly = await loadPlotly(model);
  const gd = document.createElement("div");
  gd.className = "wb-plot";
  el.appendChild(gd);
  const config = { displaylogo: false };  // not `responsive`: it sizes the div to 100% of an auto height (0 px)
  // Plotly.react replaces data and layout wholesale: nothing of the previous figure (an axis title, a shape,
  // a narrowed domain) survives a redraw, so the page shows exactly what a fresh figure would.
  // One draw at a time: both calls are asynchronous, and a newPlot (a resize) started while a react was still
  // drawing left the page with parts of neither figure (its layout emptied, or an old axis's autorange kept).
  // A view renders before JupyterLab attaches it (0 px wide: plotly would draw at its 700-px fallback, then again
  // at the real width). Nothing is drawn while the view has no width; the ResizeObserver draws it once it has one.
  let drawing = Promise.resolve();
  const draw = (plot = Plotly.react) => {
    drawing = drawing.then(() => {
      if (gd.clientWidth === 0) return;  // not attached (yet): drawn when the observer sees a width
      const fig = model.get("figure") || {};
      return plot(gd, fig.data || [], fig.layout || {}, config);
    }).catch((e) => setTimeout(() => { throw e; }));  // reported as the page's error; the next draw still runs
  };
  draw();
  model.on("change:figure", () => draw());
  // The output area's real width from then on, including sidebar toggles and window resizes. A fresh plot, not
  // Plots.resize: that one relayouts with autosize and drops the figure's own height from the layout.
  const observer = new ResizeObserver(() => {
    if (gd.clientWidth > 0 && (!gd._fullLayout || Math.abs(gd._fullLayout.width - gd.clientWidth) > 1)) {
      draw(Plotly.newPlot);
    }
  });
  observer.observe(el);
  return () => {
    observer.disconnect();
    model.off("change:figure");
    Plotly.purge(gd);
  };
}

export default { render };
