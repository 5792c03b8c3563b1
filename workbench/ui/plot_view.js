// The browser side of workbench.ui.plot_view.PlotView: one plotly figure, redrawn from the `figure` trait.
function render({ model, el }) {
  const Plotly = globalThis.Plotly;
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
