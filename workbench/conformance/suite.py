"""Run an implementation on its conformance cases and report what passed.

    report = check("mine")                      # the pairwise cases of op "decode" that "mine" claims
    report.passed, report.first_failure         # bool, the first failing CaseResult (None if all passed)
    print(report.summary())                     # counts, worst error per format, the first failure in full

Per case: build the problem (``Case.build``), call the implementation with the inputs it asks for, then judge it:

- decode, shared_prefix: the output (``out`` written, or returned) must be ``[B, Hq, D]`` in q's dtype, finite
  everywhere (``out`` starts as NaN and the pool's unwritten slots are poison), exactly zero for empty sequences,
  and within the format's tolerance of the float64 reference (norm-wise relative error over the other sequences);
- write: every byte of both pools (codes, padding, untouched slots) equals the reference write's; a quantized
  format may differ by one code at a written value (rounding at a midpoint);
- copy: every byte of the pool equals the reference copy's;
- all ops: the inputs it only reads (q, the caches of decode, tables, lengths) are byte for byte unchanged.

A case that raises fails with the exception's text. The worst error per case is its ``error`` (relative error for
decode, differing bytes or codes for write/copy).
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from workbench.conformance.cases import cases_for
from workbench.conformance.formats import SUITE_FORMATS
from workbench.conformance.problems import Case
from workbench.conformance.registry import Impl, get
from workbench.notebook import Bound
from workbench.quant import blocks as qblocks


@dataclass
class CaseResult:
    case: Case
    passed: bool
    error: float | None  # decode: relative error; write/copy: bytes (or codes) that differ
    tol: float
    reason: str = ""  # why it failed ("" when it passed)
    seconds: float = 0.0
    supported: bool = True  # False: outside the implementation's claims, run anyway (include_unsupported)

    def row(self) -> dict:
        c = self.case
        finite = self.error is not None and math.isfinite(self.error)
        return {"case": c.id, "passed": self.passed, "error": self.error if finite else None,
                "tol": self.tol, "reason": self.reason, "seconds": self.seconds, "supported": self.supported,
                "layout": c.layout,
                "block_size": c.block_size, "head_dim": c.head_dim,
                "num_kv_heads": c.num_kv_heads, "group": c.group, "kv_format": c.kv_format, "lens": list(c.lens),
                "pad": c.pad, "seed": c.seed, "shared": c.shared}

    @classmethod
    def from_row(cls, row: dict) -> CaseResult:
        """The result a :meth:`row` was made from (a journal's finished case)."""
        return cls(Case.parse(row["case"]), bool(row["passed"]), row.get("error"), row["tol"], row.get("reason", ""),
                   row.get("seconds", 0.0), row.get("supported", True))


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
        import shlex

        return case.replay().replace("<impl>", shlex.quote(self.command or self.impl))

    def to_json(self) -> dict:
        return {"impl": self.impl, "op": self.op, "backend": self.backend, "seconds": self.seconds,
                "passed": self.passed, "isolated": self.isolated, "workers_replaced": self.workers_replaced,
                "stopped": self.stopped, "wrong": [r.case.id for r in self.failures],
                "unsupported": [{"case": c.id, "why": why} for c, why in self.skipped],
                "cases": self.rows()}


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """The bytes a tensor's view covers, as a flat uint8 copy (a cache view: its whole plane, padding included)."""
    if t.dim() >= 2 and t.stride(-1) == 1:
        return qblocks.plane_of(t).reshape(-1).view(torch.uint8).clone()
    return t.contiguous().reshape(-1).view(torch.uint8).clone()


READ_ONLY = {"decode": ("q", "k_cache", "v_cache", "block_table", "seq_lens", "kv_indptr", "kv_indices",
                        "kv_last_page_len", "k_scale", "v_scale", "ref_counts"),
             "write": ("key", "value", "slot_mapping", "k_scale", "v_scale"), "copy": ("src", "dst")}


def judge_decode(got, inputs: dict, ref: torch.Tensor, tol: float) -> tuple[float | None, str]:
    q, lens = inputs["q"], inputs["seq_lens"]
    if got is None:
        got = inputs["out"]
    if not isinstance(got, torch.Tensor):
        return None, f"returned {type(got).__name__}, expected a [B, Hq, D] tensor (or None after writing out)"
    if tuple(got.shape) != tuple(q.shape) or got.dtype != q.dtype:
        return None, f"output is {tuple(got.shape)} {got.dtype}, expected {tuple(q.shape)} {q.dtype}"
    g = got.double().cpu()
    r = ref.double().cpu()
    n = lens.cpu()
    bad = ~torch.isfinite(g)
    if bad.any():
        b, h, d = (int(x) for x in bad.nonzero()[0])
        return math.inf, (f"non-finite output at [{b}, {h}, {d}] (sequence {b} of length {int(n[b])}, q head {h}): "
                          f"{int(bad.sum())} values; a read past the sequence, a wrong block, or out left unwritten")
    empty = n == 0
    if empty.any() and bool((g[empty] != 0).any()):
        b = int(empty.nonzero()[0])
        return math.inf, f"sequence {b} is empty (length 0) but its output is not zero"
    keep = ~empty
    if not keep.any():
        return 0.0, ""
    diff = (g[keep] - r[keep])
    err = float(diff.norm() / r[keep].norm().clamp_min(1e-30))
    if err > tol:
        per = diff.norm(dim=-1) / r[keep].norm(dim=-1).clamp_min(1e-30)  # [B', Hq]
        i = int(per.argmax())
        rows = keep.nonzero().reshape(-1)
        b, h = int(rows[i // per.shape[1]]), i % per.shape[1]
        return err, (f"relative error {err:.2e} > {tol:.0e}; worst at sequence {b} (length {int(n[b])}), q head {h}: "
                     f"{float(per.max()):.2e}")
    return err, ""


def judge_bytes(got: torch.Tensor, want: torch.Tensor, what: str) -> tuple[float, str]:
    a, b = _bytes(got), _bytes(want)
    if a.shape != b.shape:
        return math.inf, f"{what} changed size"
    diff = a != b
    if not diff.any():
        return 0.0, ""
    first = int(diff.nonzero()[0])
    per_block = qblocks.plane_of(got).stride(0) * got.element_size() if got.dim() >= 2 else a.numel()
    return float(diff.sum()), (f"{int(diff.sum())} bytes of {what} differ from the reference; the first at byte "
                               f"{first} (block {first // per_block}, byte {first % per_block} in it)")


def judge_write(inputs: dict, ref) -> tuple[float, str]:
    """``ref``: the planes after the reference write, then (optionally) before it: a quantized code may be one
    apart from the reference's only where the reference wrote."""
    from workbench.kernels.write.reference import quant_code_distance

    worst, why = 0.0, ""
    wants, befores = ref[:2], ref[2:4]
    for i, (name, want) in enumerate(zip(("k_cache", "v_cache"), wants, strict=True)):
        got = inputs[name]
        err, reason = judge_bytes(got, want, name)
        if err and got.element_size() == 1 and not reason.endswith("changed size"):
            ga, wa = qblocks.plane_of(got).contiguous(), qblocks.plane_of(want).contiguous()
            dist = quant_code_distance(ga, wa)
            written = (wa.view(torch.uint8) != qblocks.plane_of(befores[i]).contiguous().view(torch.uint8)
                       if befores else torch.ones_like(dist, dtype=torch.bool))
            if int(dist.max()) <= 1 and not bool(((dist > 0) & ~written).any()):
                err, reason = float(dist.max()), ""
            elif int(dist.max()) > 1:
                reason += f"; codes up to {int(dist.max())} apart"
            else:
                reason += "; outside the written values"
        worst = max(worst, err)
        why = why or reason
    return worst, why


def run_case(impl: Impl, case: Case, device=None) -> CaseResult:
    """Build ``case``, run ``impl`` on it and judge the result (see the module docstring)."""
    import workbench

    device = device or workbench.device()
    op = "decode" if case.op == "shared_prefix" else case.op
    tol = SUITE_FORMATS[case.kv_format].tol if op == "decode" else 0.0
    inputs = case.build(device)
    ref = inputs.pop("ref")
    before = {k: _bytes(inputs[k]) for k in READ_ONLY[op] if isinstance(inputs.get(k), torch.Tensor)}
    t0 = time.perf_counter()
    try:
        got = impl(dict(inputs))
        if torch.cuda.is_available() and str(device).startswith("cuda"):
            torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001  (a failing implementation is a failed case, not a crash of the suite)
        return CaseResult(case, False, None, tol, f"raised {type(e).__name__}: {str(e)[:300]}",
                          time.perf_counter() - t0)
    seconds = time.perf_counter() - t0
    if op == "decode":
        err, why = judge_decode(got, inputs, ref, tol)
    elif op == "write":
        err, why = judge_write(inputs, ref)
    else:
        err, why = judge_bytes(inputs["pool"], ref, "pool")
    for k, b in before.items():
        if not why and not torch.equal(_bytes(inputs[k]), b):
            why = f"modified its input {k}, which it may only read"
    return CaseResult(case, not why, err, tol, why, seconds)


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
    import workbench
    from workbench.conformance.cases import unsupported_cases
    from workbench.conformance.cli import command_name
    from workbench.conformance.isolation import Worker, context_lost, impl_ref, sticky
    from workbench.conformance.journal import Journal, digest

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
        from tqdm.auto import tqdm

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
    from workbench.conformance.isolation import run_ref, sticky

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
        from workbench.conformance.isolation import run_forked

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
    import warnings

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
