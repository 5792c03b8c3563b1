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

import torch

from workbench.conformance.cases import cases_for
from workbench.conformance.formats import SUITE_FORMATS
from workbench.conformance.problems import Case
from workbench.conformance.registry import Impl, get
from workbench.quant import blocks as qblocks


@dataclass
class CaseResult:
    case: Case
    passed: bool
    error: float | None  # decode: relative error; write/copy: bytes (or codes) that differ
    tol: float
    reason: str = ""  # why it failed ("" when it passed)
    seconds: float = 0.0

    def row(self) -> dict:
        c = self.case
        finite = self.error is not None and math.isfinite(self.error)
        return {"case": c.id, "passed": self.passed, "error": self.error if finite else None,
                "tol": self.tol, "reason": self.reason, "seconds": self.seconds, "layout": c.layout,
                "block_size": c.block_size, "head_dim": c.head_dim,
                "num_kv_heads": c.num_kv_heads, "group": c.group, "kv_format": c.kv_format, "lens": list(c.lens),
                "pad": c.pad, "seed": c.seed, "shared": c.shared}


@dataclass
class Report:
    impl: str
    op: str
    backend: str
    results: list[CaseResult] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def passed(self) -> bool:
        return all(r.passed for r in self.results)

    @property
    def failures(self) -> list[CaseResult]:
        return [r for r in self.results if not r.passed]

    @property
    def first_failure(self) -> CaseResult | None:
        return next(iter(self.failures), None)

    def rows(self) -> list[dict]:
        return [r.row() for r in self.results]

    def worst_by(self, key: str = "kv_format") -> dict:
        """``{value: (worst error, cases, failures)}`` along one case field."""
        out: dict = {}
        for r in self.results:
            k = getattr(r.case, key)
            worst, n, bad = out.get(k, (0.0, 0, 0))
            e = math.inf if r.error is None else r.error
            out[k] = (max(worst, e), n + 1, bad + (not r.passed))
        return out

    def summary(self) -> str:
        n, bad = len(self.results), len(self.failures)
        lines = [f"{self.impl} ({self.op}, {self.backend}): {n - bad}/{n} cases passed in {self.seconds:.1f} s"]
        for k, (worst, cnt, nbad) in self.worst_by().items():
            lines.append(f"  {k:<16} {cnt:>3} cases, {nbad} failed, worst error {worst:.2e}")
        f = self.first_failure
        if f is not None:
            lines += ["first failure:", f"  case   {f.case.id}", f"  why    {f.reason}",
                      f"  as     {f.case!r}", f"  replay {f.case.replay().replace('<impl>', self.impl)}",
                      "         or workbench.conformance.replay(impl, Case.parse(<the case id>))"]
        return "\n".join(lines)

    def to_json(self) -> dict:
        return {"impl": self.impl, "op": self.op, "backend": self.backend, "seconds": self.seconds,
                "passed": self.passed, "cases": self.rows()}


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
        return err, (f"relative error {err:.3e} > {tol:.0e}; worst at sequence {b} (length {int(n[b])}), q head {h}: "
                     f"{float(per.max()):.3e}")
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
    from workbench.kernels.reference import quant_code_distance

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
          isolate: bool = False) -> Report:
    """Run ``impl`` (a registered name of ``op`` or an :class:`Impl`) on its cases (``level``'s, or ``cases``).

    ``stop_after``: stop after that many failures (None: run every case). ``progress``: a tqdm bar. ``each``: called
    with the report so far after every case (the CLI saves partial JSON with it: a run cut short keeps its cases).
    ``isolate``: run each case in a forked child process (CPU only), so a kernel that crashes the interpreter (a read
    outside its tensors: the interpreter has no memory protection) fails its case instead of killing this process.
    """
    import workbench

    impl = get(impl, op)
    todo = list(cases) if cases is not None else cases_for(impl, level)
    for c in todo:
        if c.op != impl.op:
            raise ValueError(f"cases must be of op {impl.op!r}, got one of {c.op!r}: {c.id}")
    backend = "interpreter" if workbench.is_interpreted() else f"compiled ({_device_name(device)})"
    report = Report(impl.name, impl.op, backend)
    t0 = time.perf_counter()
    it = todo
    if progress:
        from tqdm.auto import tqdm

        it = tqdm(todo, desc=f"check {impl.name}", unit="case")
    if isolate and torch.cuda.is_initialized():
        raise ValueError("isolate=True forks a child per case, which CUDA does not survive: use it on a CPU")
    for c in it:
        report.results.append(run_isolated(impl, c, device) if isolate else run_case(impl, c, device))
        report.seconds = time.perf_counter() - t0
        if each is not None:
            each(report)
        if stop_after is not None and len(report.failures) >= stop_after:
            break
    report.seconds = time.perf_counter() - t0
    return report


def check_quietly(impl: str | Impl, level: str = "smoke", progress: bool = False, op: str = "decode") -> Report:
    """:func:`check` of ``impl`` at ``level`` with the Triton interpreter's numpy warnings silenced: a kernel that
    reads the suite's NaN poison makes the interpreter's reductions warn ("All-NaN slice"), which says nothing the
    failed case does not say better."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        return check(impl, op=op, level=level, progress=progress)


def run_isolated(impl: Impl, case: Case, device=None, timeout_s: float = 600.0) -> CaseResult:
    """:func:`run_case` in a forked child: a crash or a hang (past ``timeout_s``) is a failed case, not a dead
    process. The child inherits the registry, so an implementation defined in a notebook cell works too."""
    import multiprocessing as mp
    import signal

    ctx = mp.get_context("fork")
    recv, send = ctx.Pipe(duplex=False)
    child = ctx.Process(target=_child, args=(send, impl, case, device), daemon=True)
    t0 = time.perf_counter()
    child.start()
    send.close()
    got = None
    if recv.poll(timeout_s):  # a result, or the end of the pipe when the child died
        try:
            got = recv.recv()
        except EOFError:
            got = None
    child.join(5)
    tol = SUITE_FORMATS[case.kv_format].tol if case.op in ("decode", "shared_prefix") else 0.0
    if got is not None:
        return got
    if child.is_alive():
        child.kill()
        return CaseResult(case, False, None, tol, f"timed out after {timeout_s:.0f} s", time.perf_counter() - t0)
    code = child.exitcode
    how = f"signal {signal.Signals(-code).name}" if code is not None and code < 0 else f"exit status {code}"
    return CaseResult(case, False, None, tol, f"crashed the process ({how}): a read or write outside its tensors?",
                      time.perf_counter() - t0)


def _child(send, impl, case, device) -> None:
    import faulthandler

    faulthandler.disable()  # a crash here is the case's verdict, reported by the parent (replay it to debug)
    try:
        send.send(run_case(impl, case, device))
    finally:
        send.close()


def replay(impl: str | Impl, case: Case | str, op: str | None = None, device=None) -> CaseResult:
    """Run one case again (a :class:`Case` or its id), e.g. the first failure of a report."""
    case = Case.parse(case) if isinstance(case, str) else case
    return run_case(get(impl, op or case.op), case, device)


def _device_name(device) -> str:
    if torch.cuda.is_available():
        return torch.cuda.get_device_name(torch.device(device) if device else None)
    return "cpu"
