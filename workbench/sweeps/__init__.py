"""Every panel's study as a command: named parameters, one pure function per point, tidy rows, resume by
parameters, local or Ray executors (``python -m workbench sweep --list``).

    from workbench import sweeps
    run = sweeps.run("coalescing", {"block_size": [8, 16, 32], "layout": ["nhd", "vllm"]})
    sweeps.load(run.json_path).rows
"""

from workbench.studies.base import Param, Study
from workbench.sweeps.catalog import get, listing, names, register
from workbench.sweeps.grid import point_key
from workbench.sweeps.runner import SweepRun, plan, run
from workbench.sweeps.store import COMMITTED, OUT, SweepFile, files, load

__all__ = ["COMMITTED", "OUT", "Param", "Study", "SweepFile", "SweepRun", "files", "get", "listing", "load", "names",
           "plan", "point_key", "register", "run"]
