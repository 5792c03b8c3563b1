"""The command line every benchmark shares (``python -m workbench bench NAME``): a parser whose common flags are
spelled one way (``--out``; ``--smoke`` where the benchmark has a quick CPU check), the refusal of a GPU benchmark
on a machine without one, and the output folder, checked before any work so that a bad ``--out`` fails at once.

    ap = BenchParser("decode", __doc__, smoke=SMOKE_HELP, gpu=True)
    ap.add_argument("--quick", action="store_true", help="fewer sweep points")   # the benchmark's own options
    args = ap.parse_args(argv)
    out = ap.start(args)               # None: no GPU (said on stderr); a bad --out exits 2 through ap.error
    if out is None:
        return 2
    ...
    run_files.write_results("decode", rows, meta, out)   # decode-<gpu>-<date>.json in out

Where results go: :data:`~workbench.results.run_files.DEFAULT_OUT` (``results/``, git-ignored) unless ``--out DIR``;
``data/results`` holds the committed runs the notebooks plot (``--out data/results``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from workbench.core import backend
from workbench.core.argtypes import writable_dir
from workbench.results import run_files

OUT_HELP = "result folder (default results/, git-ignored; data/results holds the committed ones)"
SMOKE_HELP = "tiny shapes, correctness only (the Triton interpreter on a CPU)"  # the GPU benchmarks' --smoke


def require_gpu(bench: str, smoke: bool = True) -> bool:
    """True when kernels run compiled on a CUDA GPU; otherwise say so on stderr (the caller exits 2), pointing at
    ``--smoke`` when the benchmark has one."""
    if torch.cuda.is_available() and not backend.is_interpreted():
        return True
    found = "the Triton interpreter is active" if torch.cuda.is_available() else "found none"
    print(f"bench {bench} needs a CUDA GPU ({found})" + ("; use --smoke for a tiny CPU check" if smoke else ""),
          file=sys.stderr)
    return False


class BenchParser(argparse.ArgumentParser):
    """``python -m workbench bench NAME``'s parser: the first line of ``doc`` as its description, ``--smoke`` (with
    help ``smoke``) where the benchmark has a CPU check, ``--out DIR`` unless ``out=False`` (a command that only
    reads results); ``gpu``: the benchmark needs a CUDA GPU (unless ``--smoke``), checked by :meth:`start`."""

    def __init__(self, name: str, doc: str, *, smoke: str | None = None, gpu: bool = False, out: bool = True):
        super().__init__(prog=f"python -m workbench bench {name}", description=doc.strip().splitlines()[0])
        self.bench, self.gpu, self.has_smoke = name, gpu, smoke is not None
        if smoke is not None:
            self.add_argument("--smoke", action="store_true", help=smoke)
        if out:
            self.add_argument("--out", type=Path, default=None, metavar="DIR", help=OUT_HELP)

    def start(self, args: argparse.Namespace) -> Path | None:
        """The checks before any work: a GPU (a GPU benchmark not run with ``--smoke``), then the output folder
        ``--out`` (default :data:`~workbench.results.run_files.DEFAULT_OUT`) created and writable; a bad one ends the
        program through :meth:`error` (exit 2). None: no GPU, said on stderr; the caller exits 2."""
        if self.gpu and not getattr(args, "smoke", False) and not require_gpu(self.bench, self.has_smoke):
            return None
        return writable_dir(self, run_files.DEFAULT_OUT if args.out is None else args.out)
