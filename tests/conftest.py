"""Shared test fixtures. Importing workbench first fixes the backend (interpreter on CPU)."""

import pytest
import torch

import workbench


@pytest.fixture
def device() -> torch.device:
    return workbench.device()


def poison_like(t: torch.Tensor) -> torch.Tensor:
    """A buffer shaped like ``t`` full of NaN (or the max value for integer types),
    so an element a kernel forgot to write is caught."""
    if t.dtype.is_floating_point:
        return torch.full_like(t, float("nan"))
    return torch.full_like(t, torch.iinfo(t.dtype).max)


def assert_close_report(actual: torch.Tensor, expected: torch.Tensor, atol=0.0, rtol=0.0, what="") -> None:
    """torch.testing.assert_close with a report of where the first mismatches are."""
    try:
        torch.testing.assert_close(actual, expected, atol=atol, rtol=rtol, equal_nan=False)
    except AssertionError as err:
        a, e = actual.float(), expected.float()
        bad = ~torch.isclose(a, e, atol=atol, rtol=rtol) | a.isnan()
        idx = bad.nonzero()[:8].tolist()
        rows = [f"  at {i}: got {a[tuple(i)].item()!r} expected {e[tuple(i)].item()!r}" for i in idx]
        head = f"{what}: {int(bad.sum())} of {bad.numel()} elements mismatch\n"
        raise AssertionError(head + "\n".join(rows)) from err
