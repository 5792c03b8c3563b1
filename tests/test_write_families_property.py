"""The property of issue 31's write kernels: each family's kernel and the generic one (kernels/write/dynamic.py)
write the same bytes (codes, scales, zero points, untouched poison) for random schemes, layouts, block sizes, head
dims, magnitudes and fp16/fp32 sources (tests/test_write_families.py holds the rest)."""

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from test_write_families import DEV, DYNAMIC, POISON, awkward, group_slots, scheme_for
from workbench.kernels.write import dynamic as dyn

from workbench.core.layout import Layout
from workbench.quant import blocks as qblocks

pytestmark = pytest.mark.kernels  # runs Triton kernels: scripts/gpu_run.sh runs it compiled


@pytest.fixture(scope="module", autouse=True)
def _threads(one_thread):
    """One torch thread: two stall each other on a busy 2-core CPU."""


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(name=st.sampled_from(DYNAMIC), layout=st.sampled_from(["nhd", "hnd", "vllm"]), bs=st.sampled_from([16, 32]),
       d=st.sampled_from([32, 64, 128]), n_groups=st.integers(1, 3), scale=st.sampled_from([1e-3, 1.0, 200.0]),
       fp32=st.booleans(), seed=st.integers(0, 2**16))
def test_family_and_generic_kernels_write_the_same_bytes(name, layout, bs, d, n_groups, scale, fp32, seed):
    scheme = scheme_for(name)
    g = torch.Generator().manual_seed(seed)
    H, nb = 2, 4
    try:  # the vllm key layout packs x = 16 bytes a run: a row of fewer code bytes (int2 at D=32: 8) is refused
        qblocks.empty_cache(scheme, layout, "k", 1, bs, H, d, "cpu")
    except ValueError as e:
        assert layout == "vllm" and "vllm key layout" in str(e), e
        assume(False)
    slots = group_slots(n_groups, 16, bs, nb, g)
    T = slots.numel()
    def source():  # finite in its dtype
        x = awkward(g, T, H, d, torch.float32) * scale
        return (x if fp32 else x.clamp(-60000, 60000).half()).to(DEV)

    k, v = source(), source()
    planes = []
    for generic in (False, True):
        caches = [qblocks.empty_cache(scheme, layout, kind, nb, bs, H, d, DEV, fill=POISON) for kind in "kv"]
        counter = torch.zeros(1, dtype=torch.int32, device=DEV)
        for ln in dyn.dynamic_launches(k, v, caches[0], caches[1], Layout.parse(layout), slots.to(DEV), scheme, bs,
                                       nb, counter, generic=generic):
            ln()
        assert int(counter) == 0
        planes.append([qblocks.plane_of(c).view(torch.uint8).cpu() for c in caches])
    for kind, a, b in zip("kv", *planes, strict=True):
        assert torch.equal(a, b), f"{name} {layout} bs={bs} D={d}: {kind} bytes differ at {(a != b).nonzero()[:3]}"
