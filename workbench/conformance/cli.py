"""``python -m workbench check``: the conformance suite from a shell.

    python -m workbench check ours                          # decode, pairwise cases, exit 1 if any fails
    python -m workbench check mykernels.py:mine --level full  # import the file (it registers "mine"), check it
    python -m workbench check ours --op write --level smoke
    python -m workbench check starter --case 'decode/nhd/bs16/d64/hkv2/g4/fp16/lens=37,0,1,150/pad3/seed2'
    python -m workbench check --list                        # what is registered, what it claims, absent peers
    python -m workbench check --export problems/ --level smoke   # problem files for a kernel outside Python
    python -m workbench check --outputs problems/           # judge the outputs an outside kernel wrote there
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import sys
from pathlib import Path

from workbench.conformance.registry import OPS


def load_module(spec: str) -> None:
    """Import a ``.py`` file or a dotted module, so that its ``register`` calls run."""
    path = Path(spec)
    if spec.endswith(".py"):
        if not path.is_file():
            raise ValueError(f"no such file: {spec}")
        mod_spec = importlib.util.spec_from_file_location(path.stem, path)
        module = importlib.util.module_from_spec(mod_spec)
        sys.modules[path.stem] = module
        mod_spec.loader.exec_module(module)
    else:
        importlib.import_module(spec)


def _parser() -> argparse.ArgumentParser:
    from workbench.conformance.cases import LEVELS

    ap = argparse.ArgumentParser(prog="python -m workbench check", description=__doc__.splitlines()[0],
                                 epilog=__doc__.split("\n", 2)[2], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("impl", nargs="?", help="a registered implementation, or FILE.py:NAME / package.module:NAME "
                                            "(imported first: its register() calls run)")
    ap.add_argument("--op", default="decode", choices=list(OPS), help="the op (default decode)")
    ap.add_argument("--level", default="pairwise", choices=LEVELS, help="which cases (default pairwise)")
    ap.add_argument("--case", action="append", default=[], metavar="ID", help="run only this case (repeatable)")
    ap.add_argument("--load", action="append", default=[], metavar="MODULE", help="import a .py file or module first")
    ap.add_argument("--stop-after", type=int, default=None, metavar="N", help="stop after N failures")
    ap.add_argument("--json", type=Path, default=None, metavar="PATH", help="write the report as JSON")
    ap.add_argument("--list", action="store_true", help="list the registered implementations and absent peers")
    ap.add_argument("--export", type=Path, default=None, metavar="DIR",
                    help="write the cases (of IMPL's claims, default ours) as problem files to DIR")
    ap.add_argument("--outputs", type=Path, default=None, metavar="DIR",
                    help="judge the output files in DIR of the problems there (or in --problems)")
    ap.add_argument("--problems", type=Path, default=None, metavar="DIR", help="with --outputs: the problems' folder")
    ap.add_argument("--isolate", action="store_true",
                    help="run each case in a forked child (CPU): a kernel that crashes the interpreter fails its case")
    ap.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    return ap


def _list() -> int:
    from workbench.conformance import builtin
    from workbench.conformance.registry import available

    for impl in available():
        print(f"{impl.op:<14} {impl.name:<14} {impl.origin:<9} {impl.claims()}")
    for name, why in sorted(builtin.ABSENT.items()):
        print(f"{'decode':<14} {name:<14} {'absent':<9} {why}")
    return 0


def _cases(args, impl):
    from workbench.conformance.cases import cases_for
    from workbench.conformance.problems import Case

    if args.case:
        cases = [Case.parse(c) for c in args.case]
        for c in cases:
            if c.op != impl.op:
                raise ValueError(f"--case {c.id} is of op {c.op!r}, not {impl.op!r}")
        return cases
    return cases_for(impl, args.level)


def _write_json(path: Path, report) -> None:
    from workbench.provenance import machine_meta

    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"meta": machine_meta(), **report.to_json()}, indent=1, default=str) + "\n")


def main(argv: list[str] | None = None) -> int:
    ap = _parser()
    args = ap.parse_args(argv)
    from workbench.conformance import exchange
    from workbench.conformance.registry import get
    from workbench.conformance.suite import check

    try:
        for m in args.load:
            load_module(m)
        name = args.impl
        if name and ":" in name and not name.startswith(("decode/", "write/", "copy/", "shared_prefix/")):
            module, name = name.rsplit(":", 1)
            load_module(module)
        if args.list:
            return _list()
        if args.outputs is not None:
            report = exchange.judge_outputs(args.problems or args.outputs, args.outputs, name or "outside")
        else:
            if args.export is None and not name:
                ap.error("name an implementation to check (python -m workbench check --list shows them)")
            impl = get(name or "ours", args.op)
            cases = _cases(args, impl)
            if args.export is not None:
                paths = exchange.export_problems(cases, args.export)
                print(f"wrote {len(paths)} problems and manifest.json to {args.export}")
                return 0
            save = None
            if args.json is not None:  # every 10 cases and at the end: a run cut short keeps what it checked
                def save(rep):
                    if len(rep.results) % 10 == 0:
                        _write_json(args.json, rep)
            report = check(impl, cases=cases, progress=not args.quiet, stop_after=args.stop_after, each=save,
                           isolate=args.isolate)
    except ValueError as e:
        print(f"check: {e}", file=sys.stderr)
        return 2
    if args.json is not None:
        _write_json(args.json, report)
    try:
        print(report.summary())
        for r in report.failures[:10]:
            print(f"  FAIL {r.case.id}: {r.reason}")
        if len(report.failures) > 10:
            print(f"  ... and {len(report.failures) - 10} more (--json PATH writes them all)")
        if args.json is not None:
            print(f"wrote {args.json}")
    except BrokenPipeError:  # `| head`: the reader has gone, the verdict stands
        sys.stderr.close()
    return 0 if report.passed else 1
