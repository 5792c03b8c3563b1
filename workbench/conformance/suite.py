"""Run an implementation on its conformance cases and report what passed.

    report = check("mine")                      # the pairwise cases of op "decode" that "mine" claims
    report.passed, report.first_failure         # bool, the first failing CaseResult (None if all passed)
    print(report.summary())                     # counts, worst error per format, the first failure in full

Each case is built, run and judged by :func:`~workbench.conformance.judge.run_case` (the rules are there); a
run can isolate its cases in a worker process (:mod:`workbench.conformance.isolation`) and journal them
(:mod:`workbench.conformance.journal`).
"""

from __future__ import annotations

import math
import shlex
import time
import warnings
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm

import workbench
from workbench.conformance.cases import cases_for, unsupported_cases
from workbench.conformance.implementations import Impl, get
from workbench.conformance.isolation import Worker, context_lost, impl_ref, run_forked, run_ref, sticky
from workbench.conformance.journal import Journal, digest
from workbench.conformance.judge import CaseResult, run_case
from workbench.conformance.loading import command_name
from workbench.conformance.problems import Case
from workbench.conformance.suite_formats import SUITE_FORMATS
from workbench.publish.notebook import Bound


@dataclass
class Report:
    """A run's results. ``failures``: cases the implementation claims and fails (a peer "gets wrong");
    ``skipped``: the level's cases outside its claims, with the reason (unsupported by the adapter, not run, not
    failures); ``outside``: results of unsupported cases run anyway; ``stopped``: why the run ended early."""

    impl: str
    op: str
    backend: str
    results: list[CaseResult] = field(default_factory=list)
    seconds: float = 0.0
    skipped: list[tuple[Case, str]] = field(default_factory=list)
    stopped: str = ""
    isolated: bool = False
    workers_replaced: int = 0
    command: str = ""  # how the shell names the implementation (FILE.py:NAME for one a file registers)

    @property
    def passed(self) -> bool:
        return all(r.passed for r in self.results if r.supported) and not self.stopped

    @property
    def failures(self) -> list[CaseResult]:
        return [r for r in self.results if not r.passed and r.supported]

    @property
    def outside(self) -> list[CaseResult]:
        return [r for r in self.results if not r.supported]

    @property
    def first_failure(self) -> CaseResult | None:
        return next(iter(self.failures), None)

    def rows(self) -> list[dict]:
        return [r.row() for r in self.results]

    def worst_by(self, key: str = "kv_format") -> dict:
        """``{value: (worst error, cases, failures)}`` along one case field (the cases it claims)."""
        out: dict = {}
        for r in self.results:
            if not r.supported:
                continue
            k = getattr(r.case, key)
            worst, n, bad = out.get(k, (0.0, 0, 0))
            e = math.inf if r.error is None else r.error
            out[k] = (max(worst, e), n + 1, bad + (not r.passed))
        return out

    def skipped_reasons(self) -> dict[str, int]:
        """How many skipped cases each reason excludes (a case with two reasons counts under both)."""
        out: dict[str, int] = {}
        for _, why in self.skipped:
            for part in why.split("; "):
                out[part] = out.get(part, 0) + 1
        return dict(sorted(out.items(), key=lambda kv: -kv[1]))

    def summary(self, failures: int = 0) -> str:
        """Counts, worst error per format, then (``failures`` > 0) that many failing cases, the unsupported cases by
        reason, the cases run outside the claims, why the run stopped, and the first failure in full."""
        claimed = [r for r in self.results if r.supported]
        n, bad = len(claimed), len(self.failures)
        lines = [f"{self.impl} ({self.op}, {self.backend}): {n - bad}/{n} cases passed in {self.seconds:.1f} s"]
        for k, (worst, cnt, nbad) in self.worst_by().items():
            shown = f"{worst:.2e}" if nbad else Bound(worst)  # a pass: the bound, not digits that move across CPUs
            lines.append(f"  {k:<16} {cnt:>3} cases, {nbad} failed, worst error {shown}")
        if failures and self.failures:
            lines.append(f"wrong on {bad} of the cases it claims:")
            lines += [f"  FAIL {r.case.id}: {r.reason}" for r in self.failures[:failures]]
            if bad > failures:
                lines.append(f"  ... and {bad - failures} more (--json PATH writes them all)")
        if self.skipped:
            lines.append(f"unsupported by the adapter (skipped, not failures): {len(self.skipped)} cases")
            lines += [f"  {cnt:>4}  {why}" for why, cnt in self.skipped_reasons().items()]
        if self.outside:
            nout = sum(not r.passed for r in self.outside)
            lines.append(f"outside its claims, run anyway: {len(self.outside) - nout}/{len(self.outside)} passed")
            lines += [f"  FAIL {r.case.id}: {r.reason}" for r in self.outside if not r.passed][:max(failures, 0)]
        if self.stopped:
            lines.append(f"stopped: {self.stopped}")
        f = self.first_failure
        if f is not None:
            lines += ["first failure:", f"  case   {f.case.id}", f"  why    {f.reason}",
                      f"  as     {f.case!r}", f"  replay {self.replay(f.case)}",
                      "         or workbench.conformance.replay(impl, Case.parse(<the case id>))"]
        return "\n".join(lines)

    def replay(self, case: Case) -> str:
        """The shell command that runs ``case`` again on this implementation, as printed."""
        return case.replay().replace("<impl>", shlex.quote(self.command or self.impl))

    def to_json(self) -> dict:
        return {"impl": self.impl, "op": self.op, "backend": self.backend, "seconds": self.seconds,
                "passed": self.passed, "isolated": self.isolated, "workers_replaced": self.workers_replaced,
                "stopped": self.stopped, "wrong": [r.case.id for r in self.failures],
                "unsupported": [{"case": c.id, "why": why} for c, why in self.skipped],
                "cases": self.rows()}


def check(impl: str | Impl, *, op: str = "decode", level: str = "pairwise", cases: Iterable[Case] | None = None,
          device=None, progress: bool = False, stop_after: int | None = None, each=None,
          isolate: bool = False, journal: str | Path | None = None, resume: bool = False,
          unsupported: bool = False, include_unsupported: bool = False, timeout_s: float = 600.0) -> Report:
    """Run ``impl`` (a registered name of ``op`` or an :class:`Impl`) on its cases (``level``'s, or ``cases``).

    Only the cases it claims run; given ``cases`` it does not claim are skipped too (``include_unsupported``: run
    them, reported apart as ``outside``). ``unsupported``: also list the level's cases outside its claims
    (``report.skipped``, by reason in the summary). ``stop_after``: stop after that many failures (None: run every
    case; >= 1). ``progress``: a tqdm bar naming the running case. ``each``: called with the report so far after
    every case (the CLI saves partial JSON with it: a run cut short keeps its cases).

    ``isolate``: run the cases in a spawned worker process (:mod:`workbench.conformance.isolation`), replaced when
    a case kills it or loses its CUDA context: that case fails, named, and the next runs in a fresh worker (an
    implementation defined in a notebook cell cannot be spawned: on a CPU each case then runs in a forked child).
    Without it, a case that loses the CUDA context stops the run (``report.stopped``): every later case would fail.
    ``journal``: a file each case is written to before it runs and its result after; ``resume`` continues a
    journaled run: finished cases are reused, a case started and never finished (the process died in it) fails as
    crashed, the rest run.
    """
    impl = get(impl, op)
    if stop_after is not None and (isinstance(stop_after, bool) or not isinstance(stop_after, int) or stop_after < 1):
        raise ValueError(f"stop_after must be an int >= 1 (failures before stopping) or None, got {stop_after!r}")
    todo = list(cases) if cases is not None else cases_for(impl, level)
    for c in todo:
        if c.op != impl.op:
            raise ValueError(f"cases must be of op {impl.op!r}, got one of {c.op!r}: {c.id}")
    skipped = [(c, why) for c in todo if (why := impl.unsupported(c))]  # given cases it does not claim
    if include_unsupported:
        todo += [c for c, _ in unsupported_cases(impl, level)] if cases is None else []
        skipped = []
    else:
        todo = [c for c in todo if not impl.unsupported(c)]
        skipped += unsupported_cases(impl, level) if unsupported and cases is None else []
    ref = impl_ref(impl) if isolate else None
    if isolate and ref is None and torch.cuda.is_initialized():
        raise ValueError(f"isolate: {impl.name!r} cannot be rebuilt in a fresh process (define it in a .py file and "
                         "check FILE.py:NAME), and a forked child does not survive CUDA")
    backend = "interpreter" if workbench.is_interpreted() else f"compiled ({_device_name(device)})"
    report = Report(impl.name, impl.op, backend, skipped=skipped, isolated=isolate, command=command_name(impl))
    log = None
    if journal is not None:
        header = {"run": "check", "impl": impl.name, "op": impl.op, "cases": len(todo),
                  "digest": digest(c.id for c in todo)}
        log = Journal(journal, header, resume=resume)
    elif resume:
        raise ValueError("resume needs a journal (--journal PATH, or --json PATH: PATH.journal.jsonl)")
    worker = Worker(timeout_s) if ref is not None else None
    t0 = time.perf_counter()
    bar = None
    if progress:
        bar = tqdm(total=len(todo), desc=f"check {impl.name}", unit="case")
    try:
        for n, c in enumerate(todo):
            if bar is not None:
                bar.set_postfix_str(c.id, refresh=True)  # a hard crash leaves the case on screen
            fresh = log is None or (c.id not in log.done and c.id not in log.crashed)
            result = _one(impl, c, device, log, worker, ref, isolate, timeout_s)
            result.supported = not impl.unsupported(c)
            report.results.append(result)
            report.seconds = time.perf_counter() - t0
            if bar is not None:
                bar.update(1)
            if each is not None:
                each(report)
            if fresh and not isolate and not result.passed and result.reason.startswith("raised"):
                lost = context_lost() or (result.reason if sticky(result.reason) else "")
                if lost:
                    result.reason += " [the CUDA context is lost: later cases cannot run in this process]"
                    report.stopped = (f"case {c.id} left the CUDA context unusable ({lost}); {len(todo) - n - 1} "
                                      f"cases not run: rerun with --isolate, or with --resume to continue after it")
                    break
            if stop_after is not None and len(report.failures) >= stop_after:
                break
    finally:
        if bar is not None:
            bar.close()
        if worker is not None:
            report.workers_replaced = worker.replaced
            worker.close()
        if log is not None:
            log.close()
    report.seconds = time.perf_counter() - t0
    return report


def _one(impl: Impl, case: Case, device, log, worker, ref, isolate: bool, timeout_s: float) -> CaseResult:
    """One case: from the journal when it finished before (or crashed there), else run (isolated or here)."""
    tol = SUITE_FORMATS[case.kv_format].tol if case.op in ("decode", "shared_prefix") else 0.0
    if log is not None and case.id in log.done:
        return CaseResult.from_row(log.done[case.id])
    if log is not None and case.id in log.crashed:
        result = CaseResult(case, False, None, tol, f"crashed the process while it ran (started in the journal "
                                                    f"{log.path}, never finished)")
        log.finish(case.id, result.row())
        return result
    if log is not None:
        log.start(case.id)
    if worker is not None:
        t0 = time.perf_counter()
        status, value = worker.call(run_ref, ref, case, device)
        if status == "ok":
            result = value
            if not worker.lost and not result.passed and sticky(result.reason):  # the kernel's own raise said so
                worker.lost = result.reason
                worker.retire()
            if worker.lost:
                probe = "" if worker.lost == result.reason else f" ({worker.lost})"
                result.reason += f" [the CUDA context is lost{probe}: the next case runs in a fresh worker]"
        else:
            why = value if status != "raised" else f"the suite raised {value}"
            if worker.lost and status == "raised":
                why += "; the next case runs in a fresh worker"
            result = CaseResult(case, False, None, tol, why, time.perf_counter() - t0)
    elif isolate:
        result = run_forked(impl, case, device, timeout_s)
    else:
        result = run_case(impl, case, device)
    if log is not None:
        log.finish(case.id, result.row())
    return result


def check_quietly(impl: str | Impl, level: str = "smoke", progress: bool = False, op: str = "decode") -> Report:
    """:func:`check` of ``impl`` at ``level`` with the Triton interpreter's numpy warnings silenced: a kernel that
    reads the suite's NaN poison makes the interpreter's reductions warn ("All-NaN slice"), which says nothing the
    failed case does not say better."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        return check(impl, op=op, level=level, progress=progress)


def replay(impl: str | Impl, case: Case | str, op: str | None = None, device=None) -> CaseResult:
    """Run one case again (a :class:`Case` or its id), e.g. the first failure of a report."""
    case = Case.parse(case) if isinstance(case, str) else case
    return run_case(get(impl, op or case.op), case, device)


def _device_name(device) -> str:
    if torch.cuda.is_available():
        return torch.cuda.get_device_name(torch.device(device) if device else None)
    return "cpu"
