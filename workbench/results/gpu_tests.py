"""The GPU test run's results file (issue 30 item 2). ``scripts/gpu_run.sh tests`` runs every test marked
``kernels`` (``pytest -m kernels``, no ``-x``; ``tests/kernel_launches.py`` says which tests must carry the marker)
with pytest's own ``--junitxml`` (no plugin needed on the GPU image); this module reads the JUnit XML and writes
one JSON file: passed / failed / errors / skipped counts, per test file and in all, and the ids of the tests that
failed or errored with the first line of their message, stamped like every result
(:func:`workbench.results.provenance.machine_meta`: GPU, torch / triton / CUDA versions, python, commit, date).

    python -m workbench.results.gpu_tests OUT.json RESULTS.xml [MORE.xml ...]    # exit 1 when a test failed or errored

Several XML files (a run split over calls) make one results file; ``--meta-from`` takes the stamp of a results file
the GPU wrote (merging on another machine must not stamp that one). The committed file lives in ``data/results``.
"""

from __future__ import annotations

import argparse
import json
import sys
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path

from workbench.results.provenance import machine_meta

OUTCOMES = ("passed", "failed", "errors", "skipped")


def _test_id(case: ET.Element) -> str:
    """pytest's node id from a ``testcase`` (``file`` is written with ``junit_family=xunit1``; without it the id is
    built from the dotted class name)."""
    name, cls, file = case.get("name", ""), case.get("classname", ""), case.get("file")
    if not cls:  # a collection error: the module is the name
        return name
    if file:
        module = file[:-3].replace("/", ".") if file.endswith(".py") else file
        inner = cls[len(module) + 1:] if cls.startswith(module + ".") else ""
        return "::".join(p for p in (file, inner, name) if p)
    return f"{cls.replace('.', '/')}.py::{name}"


def _outcome(case: ET.Element) -> tuple[str, str]:
    """``(outcome, first line of its message)`` of one testcase."""
    for tag, outcome in (("failure", "failed"), ("error", "errors"), ("skipped", "skipped")):
        el = case.find(tag)
        if el is not None:
            text = el.get("message") or (el.text or "")
            return outcome, (text.strip().splitlines() or [""])[0][:300]
    return "passed", ""


def read_junit(path: Path | str) -> list[dict]:
    """One row per test case of a pytest JUnit XML file: ``id``, ``file``, ``outcome``, ``message``, ``time_s``.

    Raises:
        ValueError: naming ``path`` when it is not a JUnit XML file.
    """
    path = Path(path)
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError) as e:
        raise ValueError(f"{path} is not a readable JUnit XML file ({e})") from None
    if root.tag not in ("testsuites", "testsuite"):
        raise ValueError(f"{path} is not a JUnit XML file (root <{root.tag}>)")
    rows = []
    for case in root.iter("testcase"):
        outcome, message = _outcome(case)
        tid = _test_id(case)
        rows.append({"id": tid, "file": tid.split("::")[0], "outcome": outcome, "message": message,
                     "time_s": float(case.get("time") or 0.0)})
    return rows


def summarize(rows: list[dict]) -> dict:
    """Counts in all and per file, and the failed and erroring tests (id and message)."""
    per_file: dict[str, Counter] = {}
    for r in rows:
        per_file.setdefault(r["file"], Counter())[r["outcome"]] += 1
    total = Counter(r["outcome"] for r in rows)
    return {
        "counts": {o: total.get(o, 0) for o in OUTCOMES},
        "files": [{"file": f, **{o: c.get(o, 0) for o in OUTCOMES}} for f, c in sorted(per_file.items())],
        "failed": [{"id": r["id"], "message": r["message"]} for r in rows if r["outcome"] == "failed"],
        "errors": [{"id": r["id"], "message": r["message"]} for r in rows if r["outcome"] == "errors"],
    }


def write(out: Path | str, junit: list[Path | str], meta: dict | None = None, command: str = "") -> dict:
    """Read ``junit`` files, write the stamped summary to ``out`` (JSON) and return it."""
    if not junit:
        raise ValueError("junit must name at least one JUnit XML file")
    rows = [r for p in junit for r in read_junit(p)]
    if meta is None:
        meta = machine_meta()
    doc = {"meta": {**meta, "command": command}, **summarize(rows), "junit": [Path(p).name for p in junit]}
    Path(out).write_text(json.dumps(doc, indent=1) + "\n")
    return doc


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m workbench.results.gpu_tests", description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path, help="the JSON file to write")
    ap.add_argument("junit", type=Path, nargs="+", help="pytest --junitxml files")
    ap.add_argument("--command", default="pytest -m kernels tests/", help="what ran, recorded in meta")
    ap.add_argument("--meta-from", type=Path, default=None,
                    help="a gpu_tests JSON whose stamp (meta) to keep: the GPU's, when merging elsewhere")
    args = ap.parse_args(argv)
    try:
        meta = None
        if args.meta_from is not None:
            try:
                meta = {k: v for k, v in json.loads(args.meta_from.read_text())["meta"].items() if k != "command"}
            except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
                raise ValueError(f"--meta-from {args.meta_from} is not a gpu_tests results file ({e})") from None
        doc = write(args.out, args.junit, meta, command=args.command)
    except ValueError as e:
        print(f"gpu_tests: {e}", file=sys.stderr)
        return 2
    c = doc["counts"]
    print(f"{args.out}: {c['passed']} passed, {c['failed']} failed, {c['errors']} errors, {c['skipped']} skipped")
    for r in doc["failed"] + doc["errors"]:
        print(f"  FAILED {r['id']}: {r['message']}")
    return 1 if c["failed"] or c["errors"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
