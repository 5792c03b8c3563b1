"""Re-execute notebooks in place (CPU, SMOKE sizes) so their stored outputs are what nbval checks.

    .venv/bin/python scripts/execute_notebooks.py notebooks/00_tour.ipynb [...]

Then run nbval on each one (docs/notebooks.md). What a checked output may show is the same on every CPU (the same
page), so the outputs stored on one machine pass on another.

Widget state (plotly.js itself, megabytes) is not stored, so a stored widget output could only show its
text/plain repr: it is dropped, and the output keeps the panel's static plotly snapshot, which JupyterLab
draws until the notebook runs (and the live panel replaces it).
"""

import os
import sys
from pathlib import Path

import nbformat
from nbclient import NotebookClient

from workbench.publish.page import PLOTLY_MIME, WIDGET_MIME, local_kernel

os.environ.setdefault("CI", "1")
os.environ["WORKBENCH_SMOKE"] = "1"  # SMOKE sizes, as nbval runs them, whatever this shell's WORKBENCH_SMOKE says
for name in sys.argv[1:] or sorted(str(p) for p in Path("notebooks").glob("[0-9]*.ipynb")):
    path = Path(name)
    nb = nbformat.read(path, as_version=4)
    with local_kernel() as kernel:  # IPC sockets, as tour and report start theirs: no TCP warning
        NotebookClient(nb, timeout=900, kernel_name="python3", store_widget_state=False,
                       resources={"metadata": {"path": str(path.parent)}}, **kernel).execute()
    nb.metadata.pop("widgets", None)
    for cell in nb.cells:
        cell.metadata.pop("execution", None)
        for output in cell.get("outputs", []):
            if PLOTLY_MIME in output.get("data", {}):
                output["data"].pop(WIDGET_MIME, None)
    nbformat.write(nb, path)
    print(f"executed {path} ({path.stat().st_size // 1024} KiB)")
