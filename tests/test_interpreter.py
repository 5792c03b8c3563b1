"""``workbench.core.interpreter``: triton.language patched once a launch instead of once a helper call, with the same
outputs bit for bit (the shared-prefix cascade: decode, merge and helper kernels; the quantizing write: triton's own
``tl.core`` helpers) and the language put back after every launch."""

import pytest
import torch
import triton
import triton.language as tl
import triton.runtime.interpreter as interp
import workbench.kernels  # noqa: F401  (installs it under the interpreter)

import workbench
from workbench import conformance as C
from workbench.core import interpreter

pytestmark = [pytest.mark.kernels, pytest.mark.usefixtures("one_thread"),
              pytest.mark.skipif(not workbench.is_interpreted(), reason="compiled kernels patch nothing")]

CASES = ["shared_prefix/nhd/bs16/d64/hkv2/g4/fp16/lens=40,16,17,50/pad3/seed5/shared1",
         "write/hnd/bs8/d64/hkv2/g1/int8:head/lens=37/pad0/seed4"]


@pytest.fixture
def triton_own():
    """Triton's own patching for the test, the workbench's back after it."""
    interpreter.uninstall()
    yield
    assert interpreter.install()


def run(case_id: str) -> list[torch.Tensor]:
    """What ``ours`` writes for a case: its outputs (the cascade's attention; the write's K and V caches)."""
    case = C.Case.parse(case_id)
    inputs = case.build(workbench.device())
    inputs.pop("ref")
    out = C.get("ours", case.op)(inputs)
    return [out] if out is not None else [inputs["k_cache"], inputs["v_cache"]]


def count_patchings(monkeypatch) -> list[int]:
    """Calls of triton's patching of one module (``_patch_builtin``), from now on."""
    calls, patch = [0], interp._patch_builtin

    def counting(*args, **kwargs):
        calls[0] += 1
        return patch(*args, **kwargs)

    monkeypatch.setattr(interp, "_patch_builtin", counting)
    return calls


def test_installed_here():
    assert interpreter.installed() and interpreter.install()  # installing again changes nothing


@pytest.mark.parametrize("case_id", CASES, ids=["cascade", "int8-write"])
def test_outputs_are_triton_own_bit_for_bit_with_far_fewer_patchings(case_id, monkeypatch, request):
    calls = count_patchings(monkeypatch)
    ours, ours_calls = run(case_id), calls[0]
    request.getfixturevalue("triton_own")
    assert not interpreter.installed()
    calls[0] = 0
    theirs, theirs_calls = run(case_id), calls[0]
    assert len(ours) == len(theirs)
    for a, b in zip(ours, theirs, strict=True):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    assert 0 < ours_calls < theirs_calls / 4, (ours_calls, theirs_calls)


@triton.jit
def _checked(x, fail: tl.constexpr):
    tl.static_assert(not fail, "the helper refuses")
    return x * 2 + 1


@triton.jit
def _kernel(ptr, n: tl.constexpr, fail: tl.constexpr):
    offs = tl.arange(0, n)
    tl.store(ptr + offs, _checked(tl.load(ptr + offs), fail))


def test_the_language_is_put_back_after_a_launch_and_after_a_failing_one():
    original = tl.range, tl.tensor.__add__
    x = torch.randn(16)
    with pytest.raises(triton.runtime.errors.InterpreterError, match="the helper refuses"):
        _kernel[(1,)](x.clone(), 16, True)
    assert (tl.range, tl.tensor.__add__) == original
    y = x.clone()
    _kernel[(2,)](y, 16, False)  # after a failed launch the next one patches and runs as before
    assert torch.equal(y, (x * 2 + 1) * 2 + 1) and (tl.range, tl.tensor.__add__) == original
