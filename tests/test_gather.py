"""The paged gather kernel against its PyTorch reference, in every layout."""

import pytest
import torch
from conftest import assert_close_report, dtype_id, poison_like
from workbench.kernels import paged_gather
from workbench.kernels.gather.reference import paged_gather_ref

from workbench.core.layout import Layout, block_shape, from_nhd, to_nhd

pytestmark = pytest.mark.kernels  # runs Triton kernels: scripts/gpu_run.sh runs it compiled (tests/kernel_launches.py)


def random_paged(num_blocks, block_size, heads, head_dim, dtype, seq_lens, device, seed):
    """A random NHD cache and a random (fragmented) block table for ``seq_lens``."""
    g = torch.Generator().manual_seed(seed)
    nhd = torch.randn(num_blocks, block_size, heads, head_dim, generator=g).to(dtype)
    per_seq = [-(-n // block_size) for n in seq_lens]
    assert sum(per_seq) <= num_blocks
    perm = torch.randperm(num_blocks, generator=g)
    table = torch.full((len(seq_lens), max(per_seq, default=0) + 1), -1, dtype=torch.int32)
    used = 0
    for b, n in enumerate(per_seq):
        table[b, :n] = perm[used : used + n].to(torch.int32)
        used += n
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    return nhd.to(device), table.to(device), lens.to(device)


@pytest.mark.parametrize("layout", list(Layout))
@pytest.mark.parametrize("kind", ["k", "v"])
@pytest.mark.parametrize(
    "block_size,heads,head_dim,dtype",
    [
        pytest.param(bs, h, d, dt, id=f"bs{bs}-h{h}-d{d}-{dtype_id(dt)}")
        for bs, h, d, dt in [
            (16, 2, 64, torch.float16),
            (1, 3, 80, torch.bfloat16),
            (8, 1, 128, torch.float32),
            (32, 2, 64, torch.float8_e4m3fn),
        ]
    ],
)
def test_gather_matches_reference(layout, kind, block_size, heads, head_dim, dtype, device):
    seq_lens = [1, 37, 0, 64, 5]
    nhd, table, lens = random_paged(128, block_size, heads, head_dim, dtype, seq_lens, device, block_size)
    cache = from_nhd(nhd, layout, kind)
    assert cache.shape[1:] == block_shape(layout, kind, block_size, heads, head_dim, nhd.element_size())
    assert torch.equal(to_nhd(cache, layout, kind).contiguous().view(torch.uint8), nhd.view(torch.uint8))
    expected = paged_gather_ref(cache, layout, kind, table, lens)
    out = poison_like(expected.float()).to(dtype) if dtype.is_floating_point else poison_like(expected)
    got = paged_gather(cache, layout, kind, table, lens, out=out)
    # bit-for-bit: a gather moves bytes, it computes nothing
    assert_close_report(got.view(torch.uint8), expected.view(torch.uint8), what=f"{layout} {kind}")


def test_gather_rejects_bad_input(device):
    nhd, table, lens = random_paged(8, 4, 1, 16, torch.float16, [5, 3], device, seed=0)
    with pytest.raises(ValueError, match="block_table"):
        paged_gather(nhd, "nhd", "k", table.long(), lens)
    with pytest.raises(ValueError, match="seq_lens"):
        paged_gather(nhd, "nhd", "k", table, torch.tensor([99, 1], dtype=torch.int32, device=device))
    with pytest.raises(ValueError, match="layout"):
        paged_gather(nhd, "nope", "k", table, lens)
    with pytest.raises(ValueError, match="out"):
        paged_gather(nhd, "nhd", "k", table, lens, out=torch.empty(1, device=device))


def test_block_view_checks_the_plane():
    from workbench.core.layout import block_view

    plane = torch.empty(4, 256, dtype=torch.float16)  # 4 blocks padded to 512 bytes
    v = block_view(plane, "vllm", "k", 2, 3, 40)  # 240 elements a block: [3, 5, 2, 8]
    assert v.shape == (4, 3, 5, 2, 8) and v.stride()[0] == 256
    with pytest.raises(ValueError, match="cannot hold"):
        block_view(plane, "nhd", "k", 4, 2, 64)
    with pytest.raises(ValueError, match="2-D"):
        block_view(plane[None], "nhd", "k", 1, 1, 16)
