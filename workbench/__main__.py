"""Command line: ``python -m workbench <command>``.

Commands:
  info          device, backend (compiled or interpreter), versions
  tour          execute notebooks/00_tour.ipynb headless, write reports/00_tour.html, print a summary
  bench NAME    run the benchmark module workbench.bench.NAME (its own --help)
  sim NAME      run a simulator command of workbench.sim (its own --help)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def cmd_info(_args: argparse.Namespace) -> int:
    from workbench.backend import describe

    for key, value in describe().items():
        print(f"{key:>8}: {value}")
    return 0


def cmd_tour(args: argparse.Namespace) -> int:
    # UI-side libraries: imported here so the core never needs them.
    import nbformat
    from nbclient import NotebookClient
    from nbconvert import HTMLExporter

    src = Path(args.notebook)
    if not src.is_file():
        print(f"tour: notebook not found: {src}", file=sys.stderr)
        return 2
    nb = nbformat.read(src, as_version=4)
    print(f"executing {src} ...", flush=True)
    NotebookClient(nb, timeout=args.timeout, kernel_name="python3",
                   resources={"metadata": {"path": str(src.parent)}}).execute()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    html_path = out_dir / (src.stem + ".html")
    html, _ = HTMLExporter().from_notebook_node(nb)
    html_path.write_text(html, encoding="utf-8")
    nbformat.write(nb, out_dir / src.name)
    print("\n".join(_summary(nb)))
    print(f"\nreport: {html_path}")
    print("explore the series interactively: make lab  (JupyterLab on notebooks/)")
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    import importlib

    from workbench.bench import BENCHMARKS as names

    if args.name not in names:
        print(f"bench: unknown benchmark {args.name!r}; choose from {', '.join(names)}",
              file=sys.stderr)
        return 2
    return importlib.import_module(f"workbench.bench.{args.name}").main(args.rest) or 0


def cmd_sim(args: argparse.Namespace) -> int:
    import importlib

    return importlib.import_module("workbench.sim.cli").main([args.name, *args.rest]) or 0


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
    parser = argparse.ArgumentParser(prog="python -m workbench", description="Paged KV-cache workbench")
    sub = parser.add_subparsers(dest="command", metavar="command")
    sub.required = True
    p = sub.add_parser("info", help="device, backend and versions")
    p.set_defaults(func=cmd_info)
    p = sub.add_parser("tour", help="run the tour notebook headless and write an HTML report")
    p.add_argument("--notebook", default=str(ROOT / "notebooks" / "00_tour.ipynb"))
    p.add_argument("--out", default=str(ROOT / "reports"), help="folder for the HTML report")
    p.add_argument("--timeout", type=int, default=600, help="seconds per cell")
    p.set_defaults(func=cmd_tour)
    p = sub.add_parser("bench", help="run a benchmark (python -m workbench bench NAME --help)")
    p.add_argument("name")
    p.add_argument("rest", nargs=argparse.REMAINDER)
    p.set_defaults(func=cmd_bench)
    p = sub.add_parser("sim", help="run the serving simulator (python -m workbench sim NAME --help)")
    p.add_argument("name")
    p.add_argument("rest", nargs=argparse.REMAINDER)
    p.set_defaults(func=cmd_sim)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
