"""Drive JupyterLab in headless Chromium: start a throwaway server, open a notebook, run it, read its figures.

Used by ``notebook_checks.py`` (this module's name never shadows the ``jupyterlab`` package).
The server runs on a copy of the notebooks in a temporary folder (running them never touches the
repository), on a free loopback port with an empty token, with the notebook's windowing off so every
cell is in the DOM. Chromium is Debian's (``/usr/bin/chromium``); playwright never downloads a browser.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

CHROMIUM = os.environ.get("WORKBENCH_CHROMIUM", "/usr/bin/chromium")

# Lab settings for a test run: every cell rendered (no windowing), no news or update pop-ups.
SETTINGS = {
    "@jupyterlab/notebook-extension/tracker.jupyterlab-settings": {"windowingMode": "none"},
    "@jupyterlab/apputils-extension/notification.jupyterlab-settings": {"fetchNews": "false",
                                                                         "checkForUpdates": False},
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LabServer:
    """``jupyter lab`` on a copy of ``notebooks`` under ``root``; ``stop()`` ends it and its kernels."""

    def __init__(self, notebooks: list[Path], root: Path, env: dict[str, str] | None = None):
        self.root = root
        work = root / "notebooks"
        work.mkdir(parents=True)
        for nb in notebooks:
            shutil.copy(nb, work / nb.name)
        settings = root / "settings"
        for name, value in SETTINGS.items():
            (settings / name).parent.mkdir(parents=True, exist_ok=True)
            (settings / name).write_text(json.dumps(value))
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(root / "jupyterlab.log", "w")  # noqa: SIM115 (closed in stop)
        cmd = [sys.executable, "-m", "jupyter", "lab", "--no-browser", f"--port={self.port}", "--ip=127.0.0.1",
               "--IdentityProvider.token=", "--ServerApp.password=", "--ServerApp.disable_check_xsrf=True",
               f"--LabApp.user_settings_dir={settings}", f"--LabApp.workspaces_dir={root / 'workspaces'}",
               "--LabServerApp.open_browser=False", f"--ServerApp.root_dir={work}",
               "--LabApp.expose_app_in_browser=True"]  # window.jupyterapp: one page opens every notebook
        if os.geteuid() == 0:
            cmd.append("--allow-root")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT,
                                     env={**os.environ, **(env or {}), "JUPYTER_RUNTIME_DIR": str(root / "runtime")})
        self._wait_up()

    def _wait_up(self, timeout: float = 90.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"jupyter lab exited ({self.proc.returncode}); see {self.root / 'jupyterlab.log'}")
            try:
                with urllib.request.urlopen(f"{self.url}/api/status", timeout=2):
                    return
            except OSError:
                time.sleep(0.5)
        raise TimeoutError(f"jupyter lab did not answer on {self.url} within {timeout:.0f} s")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


# In-page helpers. Every plotly figure on the page: its cell, its panel (if any), its width and its output's.
FIGURES_JS = """
() => [...document.querySelectorAll('.js-plotly-plot')].map(gd => {
  const panel = gd.closest('.wb-panel');
  const cell = gd.closest('.jp-Cell');
  const cells = [...document.querySelectorAll('.jp-Notebook .jp-Cell')];
  const box = gd.getBoundingClientRect();
  const out = gd.closest('.jp-OutputArea-output') || gd.parentElement;
  return {
    cell: cells.indexOf(cell),
    panel: panel ? [...panel.classList].find(c => c.startsWith('wb-panel-')) : null,
    width: box.width, output_width: out.getBoundingClientRect().width,
    svg: gd.querySelector('svg.main-svg') ? gd.querySelector('svg.main-svg').innerHTML.length : 0,
  };
})
"""

# Every key path of an object (arrays by index), with its value; `template` stays one opaque leaf.
FLATTEN_JS = """
window.__wbFlatten = (o, prefix = '', out = {}) => {
  for (const [k, v] of Object.entries(o || {})) {
    if (k.startsWith('_')) continue;
    const path = prefix ? `${prefix}.${k}` : k;
    if (k === 'template') out[path] = JSON.stringify(v);
    else if (v !== null && typeof v === 'object' && !ArrayBuffer.isView(v)) window.__wbFlatten(v, path, out);
    else out[path] = ArrayBuffer.isView(v) ? Array.from(v) : v;
  }
  return out;
};
"""

# Plotly keeps the figure a page shows on its graph div (`gd.data`, `gd.layout`). Draw the kernel's figure
# afresh in a hidden div of the same width and compare it with what the panel shows: keys only the panel
# has are stale (left by an earlier figure), keys only the fresh plot has are missing. The figure comes as JSON
# text: Playwright passes an object value by value (a 0.3-MB heatmap figure took 0.26 s a call, as text 0.02 s).
COMPARE_JS = """
async ([pid, figText]) => {
  const fig = JSON.parse(figText);
  const gd = document.querySelector(`.wb-panel-${pid} .js-plotly-plot`);
  const div = document.createElement('div');
  div.style.width = gd.clientWidth + 'px';
  document.body.appendChild(div);
  await Plotly.newPlot(div, fig.data, fig.layout);
  const shown = __wbFlatten(gd.layout), fresh = __wbFlatten(div.layout);
  const same = (a, b) => JSON.stringify(a) === JSON.stringify(b);
  const result = {
    stale: Object.keys(shown).filter(k => !(k in fresh)),
    missing: Object.keys(fresh).filter(k => !(k in shown)),
    differ: Object.keys(fresh).filter(k => k in shown && !same(shown[k], fresh[k])),
    data_same: same(__wbFlatten({d: gd.data}), __wbFlatten({d: div.data})),
  };
  Plotly.purge(div); div.remove();
  return result;
}
"""


class KernelConsole:
    """A second client on a notebook's kernel: run code there and get its stdout (the notebook's page
    ignores replies to requests it did not send). One connection for the whole notebook."""

    def __init__(self, connection_file: Path, timeout: float = 60.0):
        from jupyter_client import BlockingKernelClient

        self.timeout = timeout
        self.client = BlockingKernelClient()
        self.client.load_connection_file(str(connection_file))
        self.client.start_channels()
        self.client.wait_for_ready(timeout=timeout)

    def run(self, code: str) -> str:
        msg_id = self.client.execute(code, store_history=False)
        out = []
        while True:
            msg = self.client.get_iopub_msg(timeout=self.timeout)
            if msg["parent_header"].get("msg_id") != msg_id:
                continue
            kind, content = msg["msg_type"], msg["content"]
            if kind == "stream":
                out.append(content["text"])
            elif kind == "error":
                raise RuntimeError("\n".join(content["traceback"]))
            elif kind == "status" and content["execution_state"] == "idle":
                return "".join(out)

    def close(self) -> None:
        self.client.stop_channels()
