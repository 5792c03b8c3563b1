"""One conformance case run and judged: :func:`run_case` builds the problem (``Case.build``), calls the
implementation with the inputs it asks for, then judges it into a :class:`CaseResult`:

- decode, shared_prefix: the output (``out`` written, or returned) must be ``[B, Hq, D]`` in q's dtype, finite
  everywhere (``out`` starts as NaN and the pool's unwritten slots are poison), exactly zero for empty sequences,
  and within the format's tolerance of the float64 reference (norm-wise relative error over the other sequences);
- write: every byte of both pools (codes, padding, untouched slots) equals the reference write's; a quantized
  format may differ by one code at a written value (rounding at a midpoint);
- copy: every byte of the pool equals the reference copy's;
- all ops: the inputs it only reads (q, the caches of decode, tables, lengths) are byte for byte unchanged.

A case that raises fails with the exception's text. The worst error per case is its ``error`` (relative error for
decode, differing bytes or codes for write/copy).

The rules are also what :mod:`workbench.conformance.exchange` judges an outside kernel's output files by.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch

import workbench
from workbench.conformance.implementations import Impl
from workbench.conformance.problems import Case
from workbench.conformance.suite_formats import SUITE_FORMATS
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
    from workbench.kernels.write.reference import quant_code_distance  # here: as problems.py's references

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
