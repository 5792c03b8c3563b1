"""kernels/launch.py: a plan's launches skip Triton's per-launch path after the first, for arguments of the same
specialization only (the key logic on a stand-in kernel here; on a GPU, decode plans launched again and with
misaligned views give the first launch's output)."""

import inspect

import pytest
import torch
from workbench.kernels.decode.reference import paged_decode_ref
from workbench.kernels.launch import PlannedLaunch

import workbench

pytestmark = pytest.mark.kernels  # the decode case launches Triton kernels


class _Param:
    def __init__(self, name, default=inspect.Parameter.empty):
        self.name, self.default = name, default


class _FakeKernel:
    """A JITFunction stand-in: ``f(x_ptr, n, A: constexpr, B: constexpr = 7)``; records how it was launched."""

    arg_names = ["x_ptr", "n", "A", "B"]
    params = [_Param("x_ptr"), _Param("n"), _Param("A"), _Param("B", 7)]

    def __init__(self):
        self.triton_path, self.direct = [], []

    def __getitem__(self, grid):
        def launch(*args, **kw):
            self.triton_path.append((grid, args, kw))
            return _Compiled(self)
        return launch


class _Compiled:
    def __init__(self, fake):
        self.fake = fake

    def __getitem__(self, grid):
        return lambda *args: self.fake.direct.append((grid, args))


def test_a_planned_launch_reuses_the_compiled_kernel_for_the_same_specialization(monkeypatch):
    fake = _FakeKernel()
    launch = PlannedLaunch(fake, {"A": 3, "num_warps": 4})
    monkeypatch.setattr(launch, "_direct", True)
    x = torch.zeros(64)
    launch((2,), x, 5)  # compiled and launched by Triton
    launch((2,), x, 5)  # the kept kernel: every parameter in order, constexprs and defaults included
    [(grid, args, kw)] = fake.triton_path
    assert grid == (2,) and args[0] is x and args[1:] == (5,) and kw == {"A": 3, "num_warps": 4}
    [(grid, args)] = fake.direct
    assert grid == (2, 1, 1) and args[0] is x and args[1:] == (5, 3, 7)
    launch((2,), x, 16)  # another int: Triton specializes on it (== 1, % 16), so its path again
    launch((2,), x[1:], 5)  # a tensor 4 bytes off 16-byte alignment: the same
    launch((3,), x, 5)  # another grid
    assert len(fake.triton_path) == 4 and len(fake.direct) == 1
    y = x[4:]  # 16 bytes on: aligned, the first specialization
    launch((2,), y, 5)
    assert len(fake.direct) == 2 and fake.direct[-1][1][0] is y


def test_decode_plans_launched_again_give_the_first_launchs_output():
    from workbench.kernels import DecodePlan

    dev = workbench.device()
    g = torch.Generator().manual_seed(1)
    B, Hq, Hkv, D, bs, nb = 3, 8, 2, 64, 16, 12
    k, v = (torch.randn(nb, bs, Hkv, D, generator=g).half().to(dev) for _ in range(2))
    table = torch.randperm(nb, generator=g)[:9].reshape(B, 3).to(torch.int32).to(dev)
    lens = torch.tensor([40, 17, 48], dtype=torch.int32, device=dev)
    qq = torch.randn(B * Hq * D + 8, generator=g).half().to(dev)
    q = qq[:B * Hq * D].view(B, Hq, D)
    for splits, lse in ((1, False), (3, False), (2, True)):
        plan = DecodePlan(table, lens, layout="nhd", k_cache=k, v_cache=v, num_q_heads=Hq, q_dtype=q.dtype,
                          num_splits=splits, return_lse=lse)
        first = plan.run(q, k, v)
        first = first[0] if lse else first
        ref = paged_decode_ref(q, k, v, "nhd", table, lens)
        assert (first.float() - ref.to(first.device).float()).abs().max() < 2e-3
        for _ in range(2):
            again = plan.run(q, k, v)
            assert torch.equal(again[0] if lse else again, first)
        shifted = qq[8:].view(B, Hq, D)  # 16 bytes on: still aligned
        shifted.copy_(q.clone())
        got = plan.run(shifted, k, v)
        assert torch.equal(got[0] if lse else got, first)
        odd = torch.empty(B * Hq * D + 1, dtype=q.dtype, device=dev)[1:].view(B, Hq, D)  # 2 bytes off alignment
        odd.copy_(shifted)
        got = plan.run(odd, k, v)
        assert torch.equal(got[0] if lse else got, first)
