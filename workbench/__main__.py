"""Command line: ``python -m workbench <command>``.

Commands:
  info          device, backend (compiled or interpreter), versions
  tour          execute notebooks/00_tour.ipynb headless, write reports/00_tour.html (charts work offline),
                print a summary
  report        execute every notebook headless (smoke sizes; --full for full sizes on a GPU), one progress bar
                each, and write a static site: a page per notebook (charts work offline) and index.html with the
                key numbers each computed and links to their data files (reports/site unless --out DIR)
  bench NAME    run the benchmark module workbench.bench.NAME (its own --help); results go to results/
                (git-ignored) unless --out DIR
  sim NAME      run a simulator command of workbench.sim (its own --help)
  generate      generate text with SmolLM2-135M through the paged cache (its own --help)
  capture       store real per-layer K/V and attention of fixed prompts in data/activations (its own --help)
  sweep NAME    run a notebook panel's sweep over a grid of parameters into tidy CSV/JSON, resumable (--list)
  check IMPL    run the conformance suite on a registered kernel, export its cases, judge outside outputs
                (its own --help)
  whatif        a serving what-if: a model, a GPU profile, a trace and the knobs in; throughput, latency, memory,
                the why of a step and the quality column out, every number with its source (its own --help)
  profile       GPU: run the few benchmarks a what-if's GPU profile is made from into --out DIR (its own --help)

``main(argv)`` returns the exit status (2 for bad input, with a message and no traceback).
"""

from __future__ import annotations

import argparse
import glob
import importlib
import sys
from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as dist_version
from pathlib import Path

import torch

import workbench
from workbench.bench import BENCHMARKS
from workbench.commands import sim as sim_cli
from workbench.commands.generate import cpu_threads
from workbench.core.argtypes import ensure_writable_dir, positive_int
from workbench.core.backend import describe

# nbformat, nbclient and the report/site modules (UI-side libraries, 0.4 s and more) are imported by the commands
# that use them (tour, report), so the core and the other commands never need them

ROOT = Path(__file__).resolve().parent.parent


def version() -> str:
    """The installed distribution's version, else ``workbench.__version__`` (a bare checkout)."""
    try:
        return dist_version("kv-workbench")
    except PackageNotFoundError:
        return getattr(workbench, "__version__", "unknown")


def cmd_info(_args: argparse.Namespace) -> int:
    info = describe()
    gen = cpu_threads(str(info["device"]).split(":")[0])
    info["threads"] = (f"torch {torch.get_num_threads()} here; generate uses "
                       + (f"{gen} (small CPU work: --threads N)" if gen else "torch's default on a GPU"))
    for key, value in info.items():
        print(f"{key:>8}: {value}")
    return 0


def _read_notebook(command: str, flag: str, path: Path):
    """The notebook at ``path``, else None after one line naming the argument (not JSON, not a notebook)."""
    import nbformat

    try:
        return nbformat.read(path, as_version=4)
    except Exception as e:  # noqa: BLE001  (not JSON, not a notebook, unreadable: one message, no traceback)
        print(f"{command}: argument {flag}: {path} is not a Jupyter notebook ({type(e).__name__})", file=sys.stderr)
        return None


def _out_dir(command: str, out) -> Path | None:
    """``--out`` created and writable, else None after one line naming it."""
    try:
        return ensure_writable_dir(out)
    except ValueError as e:
        print(f"{command}: argument --out: {e}", file=sys.stderr)
        return None


def cmd_tour(args: argparse.Namespace) -> int:
    # UI-side libraries: imported here so the core never needs them.
    import nbformat
    from nbclient import NotebookClient

    from workbench.publish.page import CellProgress, local_kernel, offline_html

    src = Path(args.notebook)
    if not src.is_file():
        print(f"tour: argument --notebook: notebook not found: {src}", file=sys.stderr)
        return 2
    nb = _read_notebook("tour", "--notebook", src)
    out_dir = None if nb is None else _out_dir("tour", args.out)  # before the notebook runs, not after
    if out_dir is None:
        return 2
    print(f"executing {src} ...", flush=True)
    # no widget state: it holds each view's plotly.js (5 MB) and no viewer without a kernel can use it
    with local_kernel() as kernel:  # IPC, not TCP: no "running over TCP without encryption" warning
        NotebookClient(nb, timeout=args.timeout, kernel_name="python3", store_widget_state=False,
                       resources={"metadata": {"path": str(src.parent)}}, **CellProgress(nb).hooks(),
                       **kernel).execute()
    nb.metadata.pop("widgets", None)
    html_path = out_dir / (src.stem + ".html")
    html_path.write_text(offline_html(nb, title=src.stem), encoding="utf-8")
    nbformat.write(nb, out_dir / src.name)
    print("\n".join(_summary(nb)))
    print(f"\nreport: {html_path} ({_megabytes(html_path)}; charts work offline)")
    print("explore the series interactively: make lab  (JupyterLab on notebooks/)")
    return 0


def notebook_paths(specs: list[str] | None) -> list[Path]:
    """The notebooks ``report`` runs: each spec a path, a glob or a name, looked up relative to the current folder,
    then the repository, then ``notebooks/``, with ``.ipynb`` added when it has none (``00_tour``, ``'0[0-2]*'``,
    ``notebooks/05_*.ipynb``); matches in sorted order, duplicates once; no spec: every
    ``notebooks/[0-9][0-9]_*.ipynb``. Raises ``ValueError`` naming a spec that matches nothing and where it looked."""
    if not specs:
        return sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
    bases = [Path.cwd(), ROOT, ROOT / "notebooks"]
    paths: dict[Path, None] = {}
    for spec in specs:
        if Path(spec).is_file():
            matches = [spec]
        else:
            pattern = spec if spec.endswith((".ipynb", "*")) else spec + ".ipynb"
            matches = []
            for base in bases:
                for pat in dict.fromkeys((spec, pattern)):
                    found = sorted(glob.glob(str(base / pat)))
                    matches = [m for m in found if m.endswith(".ipynb") and Path(m).is_file()]
                    if matches:
                        break
                if matches:
                    break
        if not matches:
            raise ValueError(f"no notebook matches {spec!r}: it was tried as a path or glob (.ipynb added when "
                             f"missing) relative to {', '.join(str(b) for b in dict.fromkeys(bases))}")
        paths.update(dict.fromkeys(Path(m).resolve() for m in matches))
    return list(paths)


def cmd_report(args: argparse.Namespace) -> int:
    from workbench.publish.site import (
        build_site,  # UI-side libraries (nbclient, plotly): imported here, not by the core
    )

    try:
        paths = notebook_paths(args.notebooks)
    except ValueError as e:
        print(f"report: argument --notebooks: {e}", file=sys.stderr)
        return 2
    if not paths:
        print(f"report: argument --notebooks: no notebooks in {ROOT / 'notebooks'}", file=sys.stderr)
        return 2
    if any(_read_notebook("report", "--notebooks", path) is None for path in paths):
        return 2
    out_dir = _out_dir("report", args.out)  # before the notebooks run, not after
    if out_dir is None:
        return 2
    sizes = "full sizes (WORKBENCH_SMOKE=0)" if args.full else "smoke sizes (WORKBENCH_SMOKE=1; --full for full sizes)"
    print(f"executing {len(paths)} notebooks at {sizes} ...", flush=True)
    site = build_site(paths, out_dir, full=args.full, timeout=args.timeout)
    width = max(len(r.source.stem) for r in site.runs)
    print(f"\nsite: {site.index} ({len(site.runs)} pages; charts work offline)")
    for r in site.runs:
        missing = [s for s, link in r.files.items() if link is None]
        line = f"  {r.source.stem:<{width}}  {r.seconds:7.1f} s  {'ok' if r.ok else 'FAILED'}"
        line += f"  {sum(len(n['numbers']) for n in r.numbers)} key numbers" if r.numbers else ""
        line += f", {len(missing)} data file(s) missing" if missing else ""
        print(line + (f"\n    {r.error}" if r.error else ""))
    failed = [r.source.stem for r in site.runs if not r.ok]
    print(f"  {'total':<{width}}  {site.seconds:7.1f} s" + (f"  {len(failed)} failed: {', '.join(failed)}"
                                                           if failed else ""))
    return 0 if site.ok else 1


def cmd_bench(args: argparse.Namespace) -> int:
    if args.name is None:
        print("bench: name a benchmark\n" + _listing("benchmarks", BENCHMARKS), file=sys.stderr)
        return 2
    if args.name not in BENCHMARKS:
        print(f"bench: unknown benchmark {args.name!r}; choose from {', '.join(BENCHMARKS)}",
              file=sys.stderr)
        return 2
    module = args.name
    if module == "decode" and any(a.split("=")[0] in ("--impl", "--load") for a in args.rest):
        module = "byok_decode"  # bench decode --impl NAME: any registered implementation beside ours and the peers
    # by name, the one run: each benchmark's module imports what it measures (the kernels, the model, the suite)
    return importlib.import_module(f"workbench.bench.{module}").main(args.rest) or 0


def cmd_sim(args: argparse.Namespace) -> int:
    if args.name is None:
        print("sim: name a command\n" + _listing("commands", sim_cli.COMMANDS), file=sys.stderr)
        return 2
    return sim_cli.main([args.name, *args.rest]) or 0


# commands whose own parsers take every option after the name
OWN_PARSER_COMMANDS = {"generate": "workbench.commands.generate", "capture": "workbench.model.capture",
                  "check": "workbench.commands.check", "sweep": "workbench.commands.sweep",
                  "whatif": "workbench.commands.whatif", "profile": "workbench.commands.profile"}


def cmd_own_parser(args: argparse.Namespace) -> int:
    # by name, the one run (the suite, the model's capture, the sweeps' runner: none needed by the others)
    return importlib.import_module(OWN_PARSER_COMMANDS[args.command]).main(args.rest) or 0


def _listing(title: str, described: dict[str, str]) -> str:
    """``title:`` then one ``name  description`` line per entry (the epilog of ``bench``/``sim --help``)."""
    width = max(map(len, described))
    return f"{title}:\n" + "\n".join(f"  {name:<{width}}  {text}" for name, text in described.items())


def _megabytes(path: Path) -> str:
    return f"{path.stat().st_size / 1e6:.1f} MB"


def _summary(nb) -> list[str]:
    """The text printed by the notebook's cells tagged 'summary'."""
    lines = []
    for cell in nb.cells:
        if cell.cell_type == "code" and "summary" in cell.metadata.get("tags", []):
            for output in cell.get("outputs", []):
                if output.get("output_type") == "stream":
                    lines.extend(output["text"].rstrip().splitlines())
    return lines


def build_parser() -> argparse.ArgumentParser:
    raw = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(prog="python -m workbench", description="Paged KV-cache workbench")
    parser.add_argument("--version", action="version", version=f"%(prog)s {version()}")
    sub = parser.add_subparsers(dest="command", metavar="command")
    sub.required = True
    p = sub.add_parser("info", help="device, backend and versions")
    p.set_defaults(func=cmd_info)
    p = sub.add_parser("tour", help="run the tour notebook headless and write an HTML report")
    p.add_argument("--notebook", default=str(ROOT / "notebooks" / "00_tour.ipynb"))
    p.add_argument("--out", default=str(ROOT / "reports"), help="folder for the HTML report")
    p.add_argument("--timeout", type=positive_int, default=600, help="seconds per cell (>= 1)")
    p.set_defaults(func=cmd_tour)
    p = sub.add_parser("report", help="run every notebook headless and write a static HTML site with their key numbers",
                       description="Execute the notebook series headless (smoke sizes unless --full), one progress "
                       "bar per notebook, and write a static site: a page per notebook with its charts drawn "
                       "offline, index.html with the key numbers each computed and copies of their data files. "
                       "Exits 1 if a notebook failed (its page shows what ran).")
    p.add_argument("--full", action="store_true", help="full sizes (WORKBENCH_SMOKE=0), for a GPU machine")
    p.add_argument("--out", default=str(ROOT / "reports" / "site"), help="folder for the site (default reports/site)")
    p.add_argument("--notebooks", nargs="+", metavar="GLOB_OR_PATH",
                   help="notebooks to run, in this order (default: every notebooks/[0-9][0-9]_*.ipynb)")
    p.add_argument("--timeout", type=positive_int, default=900, help="seconds per cell (>= 1)")
    p.set_defaults(func=cmd_report)
    p = sub.add_parser(
        "bench", help="run a benchmark (python -m workbench bench NAME --help)", formatter_class=raw,
        description="Run the benchmark NAME with its own options (python -m workbench bench NAME --help).",
        epilog=_listing("benchmarks", BENCHMARKS) + "\n\nResults go to results/ (git-ignored) unless --out DIR;\n"
        "data/results/ holds the committed runs the notebooks plot (written only by --out data/results).")
    p.add_argument("name", nargs="?", metavar="NAME", help="one of: " + ", ".join(BENCHMARKS))
    p.add_argument("rest", nargs=argparse.REMAINDER, help="the benchmark's options")
    p.set_defaults(func=cmd_bench)
    p = sub.add_parser(
        "sim", help="run the serving simulator (python -m workbench sim NAME --help)", formatter_class=raw,
        description="Run the simulator command NAME with its own options (python -m workbench sim NAME --help).",
        epilog=_listing("commands", sim_cli.COMMANDS))
    p.add_argument("name", nargs="?", metavar="NAME", help="one of: " + ", ".join(sim_cli.COMMANDS))
    p.add_argument("rest", nargs=argparse.REMAINDER, help="the command's options")
    p.set_defaults(func=cmd_sim)
    for name, text in (("generate", "generate with SmolLM2-135M through the paged cache (generate --help)"),
                       ("capture", "store real K/V and attention of fixed prompts (capture --help)"),
                       ("check", "check a kernel on the conformance suite (check --help)"),
                       ("sweep", "run a panel's sweep over a grid, resumable (sweep --list, sweep --help)"),
                       ("whatif", "a serving what-if for a model, GPU and trace, with sources (whatif --help)"),
                       ("profile", "GPU: the benchmarks a what-if's GPU profile is made from (profile --help)")):
        p = sub.add_parser(name, help=text, add_help=False)
        p.add_argument("rest", nargs=argparse.REMAINDER, help="the command's options")
        p.set_defaults(func=cmd_own_parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run one command; returns its exit status (``--help``/``--version`` 0, bad arguments 2)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        if argv and argv[0] in OWN_PARSER_COMMANDS:  # their own parsers take every option after the name
            return cmd_own_parser(argparse.Namespace(command=argv[0], rest=argv[1:]))
        args = build_parser().parse_args(argv)
        return args.func(args)
    except SystemExit as e:  # argparse (and a benchmark's parser.error) exit: hand back the status
        if isinstance(e.code, str):
            print(e.code, file=sys.stderr)
            return 1
        return int(e.code or 0)


if __name__ == "__main__":
    sys.exit(main())
