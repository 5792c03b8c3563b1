"""``python -m workbench check``: the conformance suite from a shell.

    python -m workbench check ours                          # decode, pairwise cases, exit 1 if any fails
    python -m workbench check mykernels.py:mine --level full  # import the file (it registers "mine"), check it
    python -m workbench check ours --op write --level smoke
    python -m workbench check starter --case 'decode/nhd/bs16/d64/hkv2/g4/fp16/lens=37,0,1,150/pad3/seed2'
    python -m workbench check --list                        # what is registered, what it claims, absent peers
    python -m workbench check --export problems/ --level smoke   # problem files for a kernel outside Python
    python -m workbench check --outputs problems/           # judge the outputs an outside kernel wrote there
    python -m workbench check flashinfer --json r.json      # GPU: each case in a worker replaced after a crash;
    python -m workbench check flashinfer --json r.json --resume   # r.journal.jsonl: continue a run that died

On a GPU the cases run isolated by default (--no-isolate: in this process, where a case that loses the CUDA
context stops the run). Cases outside what the implementation claims are listed as unsupported, not run
(--include-unsupported runs them, reported apart).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from workbench.conformance import exchange
from workbench.conformance.cases import LEVELS, cases_for
from workbench.conformance.implementations import ABSENT, available, get
from workbench.conformance.loading import load_module
from workbench.conformance.ops import OPS
from workbench.conformance.problems import Case
from workbench.conformance.suite import check
from workbench.core.argtypes import ensure_writable_dir, positive_float, positive_int
from workbench.results.provenance import machine_meta


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m workbench check", description=__doc__.splitlines()[0],
                                 epilog=__doc__.split("\n", 2)[2], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("impl", nargs="?", help="a registered implementation, or FILE.py:NAME / package.module:NAME "
                                            "(imported first: its register() calls run)")
    ap.add_argument("--op", default="decode", choices=list(OPS), help="the op (default decode)")
    ap.add_argument("--level", default="pairwise", choices=LEVELS, help="which cases (default pairwise)")
    ap.add_argument("--case", action="append", default=[], metavar="ID", help="run only this case (repeatable)")
    ap.add_argument("--load", action="append", default=[], metavar="MODULE", help="import a .py file or module first")
    ap.add_argument("--stop-after", type=positive_int, default=None, metavar="N", help="stop after N failures (>= 1)")
    ap.add_argument("--json", type=Path, default=None, metavar="PATH",
                    help="write the report as JSON (and journal the cases to PATH's stem + .journal.jsonl)")
    ap.add_argument("--journal", type=Path, default=None, metavar="PATH",
                    help="write each case's id before it runs and its result after (default with --json: "
                         "PATH.journal.jsonl)")
    ap.add_argument("--resume", action="store_true",
                    help="continue the journaled run: reuse finished cases, fail the one it died in, run the rest")
    ap.add_argument("--list", action="store_true", help="list the registered implementations and absent peers")
    ap.add_argument("--export", type=Path, default=None, metavar="DIR",
                    help="write the cases (of IMPL's claims, default ours) as problem files to DIR")
    ap.add_argument("--outputs", type=Path, default=None, metavar="DIR",
                    help="judge the output files in DIR of the problems there (or in --problems)")
    ap.add_argument("--problems", type=Path, default=None, metavar="DIR", help="with --outputs: the problems' folder")
    ap.add_argument("--isolate", action=argparse.BooleanOptionalAction, default=None,
                    help="run the cases in a worker process replaced after a crash or a lost CUDA context "
                         "(default: on with a GPU, off on a CPU)")
    ap.add_argument("--timeout", type=positive_float, default=600.0, metavar="SECONDS",
                    help="with --isolate: a case running longer fails and its worker is replaced (default 600)")
    ap.add_argument("--include-unsupported", action="store_true",
                    help="also run the cases outside the implementation's claims (reported apart, not failures)")
    ap.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    return ap


def _list() -> int:
    for impl in available():
        print(f"{impl.op:<14} {impl.name:<14} {impl.origin:<9} {impl.claims()}")
    for name, why in sorted(ABSENT.items()):
        print(f"{'decode':<14} {name:<14} {'absent':<9} {why}")
    return 0


def _cases(args, impl):
    if args.case:
        cases = [Case.parse(c) for c in args.case]
        for c in cases:
            if c.op != impl.op:
                raise ValueError(f"--case {c.id} is of op {c.op!r}, not {impl.op!r}")
        return cases
    return cases_for(impl, args.level)


def _write_json(path: Path, report) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"meta": machine_meta(), **report.to_json()}, indent=1, default=str) + "\n")


def _check_paths(args) -> None:
    """Every path the run writes, checked before it starts (ValueError naming the argument)."""
    if args.export is not None:
        try:
            ensure_writable_dir(args.export)
        except ValueError as e:
            raise ValueError(f"argument --export: {e}") from None
    for flag, path in (("--json", args.json), ("--journal", args.journal)):
        if path is None:
            continue
        if path.is_dir():
            raise ValueError(f"argument {flag}: {path} is a folder; name a file")
        try:
            ensure_writable_dir(path.parent)
        except ValueError as e:
            raise ValueError(f"argument {flag}: {e}") from None


def main(argv: list[str] | None = None) -> int:
    ap = _parser()
    args = ap.parse_args(argv)
    journal = args.journal or (args.json.with_suffix(".journal.jsonl") if args.json is not None else None)
    try:
        _check_paths(args)
        if args.resume and journal is None:
            raise ValueError("argument --resume: needs a journal (--journal PATH, or --json PATH)")
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
            isolate = torch.cuda.is_available() if args.isolate is None else args.isolate
            report = check(impl, cases=None if not args.case else cases, level=args.level, progress=not args.quiet,
                           stop_after=args.stop_after, each=save, isolate=isolate, journal=journal,
                           resume=args.resume, unsupported=True, include_unsupported=args.include_unsupported,
                           timeout_s=args.timeout)
    except ValueError as e:
        print(f"check: {e}", file=sys.stderr)
        return 2
    if args.json is not None:
        _write_json(args.json, report)
    try:
        print(report.summary(failures=10))
        if args.json is not None:
            print(f"wrote {args.json}" + (f" (journal {journal})" if journal is not None else ""))
    except BrokenPipeError:  # `| head`: the reader has gone, the verdict stands
        sys.stderr.close()
    return 0 if report.passed else 1
