"""``python -m workbench profile --out DIR``: on a CUDA GPU, the few benchmarks a what-if's GPU profile
(``workbench.whatif.profile.GpuProfile``) is made from, their result files written into DIR (target: under 10
minutes in all).

    python -m workbench profile --out profiles/h100      # GPU: three benchmarks, then how to use the folder
    python -m workbench profile --out DIR --dry-run      # anywhere: the commands it would run

The benchmarks, each run as its own ``python -m workbench bench ...`` process:

1. ``bench quant_decode`` on W1-W5, sections decode and write, the schemes of :data:`PROFILE_SCHEMES`: the copy
   bandwidth, each scheme's decode fraction of it per workload and its quantize-on-write fraction;
2. ``bench tiers --quick --only link``: the host link's curves (swaps to a host tier);
3. ``bench model_decode`` at batch 1, 16 and 64 (CUDA graph, compiled, no transformers): SmolLM2-135M's real
   decode step, to fit the per-layer floor at batch 1 and validate the step model at 16 and 64.

Then it prints how to use the folder: ``python -m workbench whatif --profile DIR --gpu NAME``, or
``GpuProfile.from_results(DIR, name=NAME)`` in Python. On a machine without CUDA it refuses (exit 2) unless
``--dry-run``.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import time
from pathlib import Path

import torch

from workbench.core.argtypes import ensure_writable_dir
from workbench.quant.names import PROFILE_SCHEMES

#: the result files a profile is read from, by their names' prefix
PREFIXES = ("quant-decode", "tiers", "model-decode")
_NAME = re.compile(r"^(?P<bench>quant-decode|tiers|model-decode)-(?P<gpu>.+)-\d{8}T\d{4,6}(-\d+)?\.json$")


class _Parser(argparse.ArgumentParser):
    """argparse that raises instead of exiting, so main() can return 2 with one clear line."""

    def error(self, message: str):
        raise ValueError(message)


def steps(out: Path | str) -> list[tuple[str, list[str]]]:
    """``(what it measures, the arguments after python -m workbench)`` of each benchmark, in the order they run."""
    out = str(out)
    return [
        ("copy bandwidth, decode and quantize-on-write per scheme on W1-W5",
         ["bench", "quant_decode", "--sections", "decode,write", "--schemes", ",".join(PROFILE_SCHEMES),
          "--out", out]),
        ("the host link's curves, both directions", ["bench", "tiers", "--quick", "--only", "link", "--out", out]),
        ("SmolLM2-135M's decode step at batch 1, 16, 64 (floor fit, validation)",
         ["bench", "model_decode", "--sections", "decode", "--batches", "1,16,64", "--compile", "--no-hf",
          "--out", out]),
    ]


def command_line(argv: list[str]) -> str:
    return " ".join(["python -m workbench", *argv])


def gpu_name(device_name: str) -> str:
    """The GPU's name as result files spell it (``workbench.results.run_files``): ``NVIDIA H200`` -> ``h200``."""
    return device_name.replace("NVIDIA ", "").replace(" ", "-").lower()


def profile_files(folder: Path | str, since: float = 0.0) -> dict[str, Path]:
    """``{prefix: the newest file}`` of each benchmark a profile needs in ``folder`` (modified at or after
    ``since``, a ``time.time()``)."""
    found: dict[str, Path] = {}
    for p in sorted(Path(folder).glob("*.json")):
        m = _NAME.match(p.name)
        if m and p.stat().st_mtime >= since:
            found[m["bench"]] = p
    return found


def usage(folder: Path | str, name: str, model_decode: str | None = None) -> str:
    """How to use a profile folder: the what-if's flags and the Python calls."""
    run = f'"{Path(folder) / model_decode}"' if model_decode else f'sorted(Path("{folder}").glob("model-decode-*"))[-1]'
    return "\n".join([
        f"use it (GPU name {name!r}, as the files spell it):",
        f"  python -m workbench whatif --profile {folder} --gpu {name} --model llama-3.1-8b --kv-gib G ...",
        "  from workbench.whatif import PRESETS, GpuProfile, fit_layer_overhead, whatif",
        f'  prof = GpuProfile.from_results("{folder}", name="{name}")',
        f'  prof = fit_layer_overhead(prof, PRESETS["smollm2-135m"], run={run})  # the per-layer floor, batch 1',
        '  whatif("llama-3.1-8b", profile=prof, ...)',
        "The profile's HBM size, tensor-core peak and prefill efficiency are assumed (the H200's datasheet, named so "
        "in its sources): on another GPU give --kv-gib, or dataclasses.replace(prof, hbm_gib=Measured(80.0, "
        "\"datasheet\"), peak_tflops=Measured(...)).",
    ])


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m workbench profile", description=" ".join(__doc__.split("\n\n")[0].split()),
                epilog=__doc__.split("\n\n", 1)[1],
                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, metavar="DIR", help="folder for the result files (created)")
    p.add_argument("--dry-run", action="store_true", help="print the commands it would run, run nothing")
    return p


def main(argv: list[str] | None = None) -> int:
    """Run the profile's benchmarks; returns the exit status (2: bad input or no CUDA; 1: a benchmark failed)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as e:  # --help
        return int(e.code or 0)
    except ValueError as e:
        print(f"profile: {e}", file=sys.stderr)
        return 2
    cuda = torch.cuda.is_available()
    if args.dry_run:
        name = gpu_name(torch.cuda.get_device_name(0)) if cuda else "NAME"
        print(f"profile: would run, into {args.out}:")
        for what, cmd in steps(args.out):
            print(f"  {command_line(cmd)}\n      # {what}")
        print(usage(args.out, name))
        return 0
    if not cuda:
        print("profile: needs a CUDA GPU (torch.cuda.is_available() is False here): the profile is that GPU's "
              "measured numbers; --dry-run prints the commands it would run", file=sys.stderr)
        return 2
    try:
        out = ensure_writable_dir(args.out)  # before the work, not after
    except ValueError as e:
        print(f"profile: argument --out: {e}", file=sys.stderr)
        return 2
    start, failed = time.time(), []
    for what, cmd in steps(out):
        print(f"profile: {command_line(cmd)}  ({what})", flush=True)
        t0 = time.perf_counter()
        rc = subprocess.run([sys.executable, "-m", "workbench", *cmd], check=False).returncode
        print(f"profile: exit {rc} in {time.perf_counter() - t0:.0f} s", flush=True)
        if rc:
            failed.append(cmd[1])
    files = profile_files(out, since=start - 1)
    missing = [p for p in PREFIXES if p not in files]
    print(f"\nprofile: {len(files)} files in {out} ({(time.time() - start) / 60:.1f} min)")
    for p in files.values():
        print(f"  {p.name}")
    if "quant-decode" in files:
        name = _NAME.match(files["quant-decode"].name)["gpu"]
        print(usage(out, name, files["model-decode"].name if "model-decode" in files else None))
    if failed or missing:
        print(f"profile: failed: {', '.join(failed) or '-'}; missing: {', '.join(missing) or '-'}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
