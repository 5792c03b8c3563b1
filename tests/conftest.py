"""Shared test fixtures, the one tolerance table and ``rel_err``. Importing workbench first fixes the backend
(interpreter on CPU)."""

from typing import NamedTuple

import pytest
import torch
from kernel_launches import (  # noqa: F401  (hooks: a test that launches a kernel must be marked 'kernels')
    pytest_configure,
    pytest_make_collect_report,
    pytest_runtest_makereport,
    pytest_runtest_setup,
)

import workbench
from workbench.bench.harness import rel_err  # noqa: F401  (the one definition: ||out - ref|| / ||ref||, float64)


@pytest.fixture
def device() -> torch.device:
    return workbench.device()


@pytest.fixture(scope="module")
def one_thread():
    """Small tensors: one torch thread (two stall each other on a busy 2-core CPU, as under pytest -n 2)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


# ---- tolerances --------------------------------------------------------------------------------------------------
class Tol(NamedTuple):
    """``atol``, ``rtol`` for elementwise checks (``assert_close_report(got, ref, *tol(dtype))``); ``rtol`` is
    also the bound on the norm-wise :func:`rel_err` of a computed output (``assert rel_err(got, ref) < rtol``)."""

    atol: float
    rtol: float


#: Kernels that move bytes (gather, write_kv into a cache of its source's width or a cast, copy_blocks,
#: compaction) are compared bit for bit, whatever the dtype.
EXACT = Tol(0.0, 0.0)

#: One row per dtype a kernel *computes* in (decode attention against its float64 reference): Liger-style
#: ``(dtype, atol, rtol)`` rows. The rtol column is what test_decode / test_kernel_validation bound rel_err by
#: (fp32 1e-4, fp16/bf16 1e-2, an fp8 cache 1e-2); atol is torch.testing's elementwise default for the dtype.
TOLERANCE_ROWS = [
    (torch.float32, 1e-5, 1e-4),
    (torch.float16, 1e-5, 1e-2),
    (torch.bfloat16, 1e-5, 1e-2),
    (torch.float8_e4m3fn, 1e-5, 1e-2),
    (torch.float8_e5m2, 1e-5, 1e-2),
]
TOLERANCES: dict[torch.dtype, Tol] = {dtype: Tol(atol, rtol) for dtype, atol, rtol in TOLERANCE_ROWS}


def tol(dtype: torch.dtype) -> Tol:
    """The row of :data:`TOLERANCES` for ``dtype`` (a KeyError names a dtype that has none)."""
    try:
        return TOLERANCES[dtype]
    except KeyError:
        raise KeyError(f"no tolerance for {dtype}: add a row to TOLERANCE_ROWS in tests/conftest.py") from None


# ---- readable parametrize ids --------------------------------------------------------------------------------------
DTYPE_IDS = {
    torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.float8_e4m3fn: "fp8e4m3",
    torch.float8_e5m2: "fp8e5m2", torch.int8: "int8", torch.int32: "int32", torch.int64: "int64",
}


def dtype_id(dtype) -> str:
    """``fp16`` for torch.float16 (strings, such as ``"fp8_e4m3"``, pass through)."""
    return DTYPE_IDS.get(dtype, str(dtype).removeprefix("torch."))


def kw_id(kw: dict) -> str:
    """``tpp8-rows`` style: a launch-kwargs dict as a short id (empty: ``default``)."""
    short = {"tokens_per_program": "tpp", "heads_per_program": "hpp", "rows_per_program": "rpp",
             "step_bytes": "step", "num_warps": "w"}
    parts = []
    for k, v in kw.items():
        if k in short:
            parts.append(f"{short[k]}{v}")
        elif v is True:
            parts.append(k.replace("_", ""))
        else:
            parts.append(str(v))
    return "-".join(parts) or "default"


# ---- helpers -------------------------------------------------------------------------------------------------------
def bits(t: torch.Tensor) -> torch.Tensor:
    """The bytes of ``t`` (contiguous), for bit-for-bit comparisons (:data:`EXACT`)."""
    return t.contiguous().view(torch.uint8)


def poison_like(t: torch.Tensor) -> torch.Tensor:
    """A buffer shaped like ``t`` full of NaN (or the max value for integer types),
    so an element a kernel forgot to write is caught."""
    if t.dtype.is_floating_point:
        return torch.full_like(t, float("nan"))
    return torch.full_like(t, torch.iinfo(t.dtype).max)


def assert_close_report(actual: torch.Tensor, expected: torch.Tensor, atol=0.0, rtol=0.0, what="") -> None:
    """torch.testing.assert_close with a report of where the first mismatches are (default: :data:`EXACT`)."""
    try:
        torch.testing.assert_close(actual, expected, atol=atol, rtol=rtol, equal_nan=False)
    except AssertionError as err:
        a, e = actual.float(), expected.float()
        bad = ~torch.isclose(a, e, atol=atol, rtol=rtol) | a.isnan()
        idx = bad.nonzero()[:8].tolist()
        rows = [f"  at {i}: got {a[tuple(i)].item()!r} expected {e[tuple(i)].item()!r}" for i in idx]
        head = f"{what}: {int(bad.sum())} of {bad.numel()} elements mismatch\n"
        raise AssertionError(head + "\n".join(rows)) from err
