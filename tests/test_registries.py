"""Contract tests: every entry of every policy registry passes the same checks (issue 9 item 4).

A registry entry is a frozen, hashable config with a ``label`` and ``build(ctx)``; ``get(name)``
returns it, ``get(name, field=value)`` a changed copy, and bad names or options are refused with a
message naming them.
"""

import dataclasses

import pytest

from workbench.allocator import BlockManager, BlockPool, policies
from workbench.compress import policies as sparsity
from workbench.sim import strategies
from workbench.tiers import prefetch

pytestmark = pytest.mark.kernels  # runs Triton kernels: scripts/gpu_run.sh runs it compiled (tests/kernel_launches.py)

REGISTRIES = [
    pytest.param(policies.BLOCK_SIZE_POLICIES, policies.get, id="block-size-policies"),
    pytest.param(strategies.STRATEGIES, strategies.get, id="serving-strategies"),
    pytest.param(prefetch.PREFETCH, prefetch.get, id="prefetch-strategies"),
    pytest.param(sparsity.POLICIES, sparsity.get, id="sparsification-policies"),
]


@pytest.mark.parametrize("registry, get", REGISTRIES)
def test_every_entry_is_a_frozen_labelled_config(registry, get):
    for name, cfg in registry.items():
        assert dataclasses.is_dataclass(cfg) and cfg.__dataclass_params__.frozen, name
        hash(cfg)
        assert isinstance(cfg.label, str) and cfg.label, name
        assert callable(cfg.build), name
        assert get(name) is cfg and get(cfg) is cfg
        if not dataclasses.fields(cfg):  # a config without options ("none")
            continue
        first = dataclasses.fields(cfg)[0]
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(cfg, first.name, None)
        assert getattr(get(name, **{first.name: getattr(cfg, first.name)}), first.name) == getattr(cfg, first.name)


@pytest.mark.parametrize("registry, get", REGISTRIES)
def test_bad_names_and_options_are_refused(registry, get):
    with pytest.raises(ValueError, match="must be one of"):
        get("no-such-entry")
    with pytest.raises(ValueError, match="config"):
        get(42)
    name = next(iter(registry))
    with pytest.raises(ValueError, match="no option"):
        get(name, no_such_option=1)


@pytest.mark.parametrize("name", sorted(policies.BLOCK_SIZE_POLICIES))
def test_block_size_policies_choose_sizes_of_the_pool_and_copy_their_state(name):
    cfg = policies.get(name)
    sizes = (16, 64)
    state = cfg.build(policies.PolicyContext(sizes))
    for prompt, expected in [(1, None), (100, None), (100, 120), (4000, None), (10, 5000)]:
        assert state.choose(prompt, expected) in sizes
    twin = state.copy()
    state.observe(2000, 10)  # a long output: learning policies change their choice
    assert twin.choose(10, None) in sizes
    m = BlockManager(BlockPool(16, 64, sizes), cfg)
    m.add("a", [1, 2, 3])
    m.free("a")
    assert m.clone().policy.choose(3, None) == m.policy.choose(3, None)
    with pytest.raises(ValueError, match="not a size class"):
        cfg.build(policies.PolicyContext((3,)))


def test_learning_policy_state_is_not_shared_with_a_clone():
    m = BlockManager(BlockPool(16, 64, [16, 64]), policies.ByExpectedLength(16, 64, threshold=100))
    twin = m.clone()
    m.add("a", [1] * 5)
    m.append("a", [2] * 300)
    m.free("a")
    assert m.policy.average_output == 300 and twin.policy.average_output == 0


def test_manager_refuses_a_policy_that_is_not_a_config():
    class Duck:
        def choose(self, prompt_len, expected_len):
            return 16

    with pytest.raises(ValueError, match="policy must be"):
        BlockManager(BlockPool(4, 16), Duck())


# ---- KV formats (workbench.core.kv_formats): one table that every other module asks -----------------
def test_formats_agree_with_spec_cache_and_kernels():
    import torch
    from workbench.kernels.write import quant_mode

    from workbench import quant
    from workbench.cache import PagedKVCache
    from workbench.core import kv_formats, kv_spec

    for name, fmt in kv_formats.FORMATS.items():
        assert kv_spec.dtype_size(name) == fmt.bytes_per_value and kv_spec.TORCH_DTYPES[name] == fmt.storage
        schemes = [s for s in quant.SCHEMES.values() if s.format_name == name]
        assert schemes and all(s.format is fmt for s in schemes), f"no quant scheme stores {name}"
        if name in ("uint8", "int4", "int2"):  # codes whose scales live in the blocks: named by scheme only
            continue
        scales = {"k_scale": torch.ones(1), "v_scale": torch.ones(1)} if fmt.quantized else {}
        c = PagedKVCache(1, 2, 16, num_pages=2, kv_dtype=name, **scales)
        assert c.format is fmt and c.dtype == fmt.storage
        mode, qmin, qmax = quant_mode(fmt.storage)
        assert (qmin, qmax) == (fmt.qmin, fmt.qmax) and (mode == 0) == (not fmt.quantized)
    with pytest.raises(ValueError, match="uint8 codes"):
        PagedKVCache(1, 2, 16, num_pages=2, kv_dtype=torch.uint8)
    assert kv_formats.get("fp8") is kv_formats.FORMATS["fp8_e4m3"] and kv_formats.get(torch.int8).name == "int8"
    with pytest.raises(ValueError, match="kv_dtype"):
        kv_formats.get("fp7")


def test_scale_granularity_is_checked_per_kernel():
    import torch

    from workbench.core import kv_formats

    fp8 = kv_formats.get("fp8_e4m3")
    assert fp8.check_scale("k_scale", torch.ones(1), 4) == "tensor"
    assert fp8.check_scale("k_scale", torch.ones(4), 4) == "head"
    assert fp8.check_scale("k_scale", torch.ones(4), 4, kernel="decode") == "head"
    assert kv_formats.get("int8").check_scale("k_scale", torch.ones(1), 4, kernel="decode") == "tensor"
    with pytest.raises(ValueError, match="k_scale.*1 value or 4 values"):
        fp8.check_scale("k_scale", torch.ones(3), 4, kernel="decode")
    with pytest.raises(ValueError, match="only for quantized"):
        kv_formats.get("fp16").check_scale("k_scale", torch.ones(1), 4)


def test_decode_refuses_a_format_it_cannot_read_naming_it():
    import torch
    from workbench.kernels import DecodePlan, paged_decode

    import workbench

    dev = workbench.device()
    k = torch.zeros(4, 16, 2, 16, dtype=torch.uint8, device=dev)  # uint8 codes: which scheme is not in the dtype
    table = torch.zeros(1, 1, dtype=torch.int32, device=dev)
    lens = torch.ones(1, dtype=torch.int32, device=dev)
    q = torch.randn(1, 2, 16, device=dev).half()
    with pytest.raises(ValueError, match="uint8 codes.*name the scheme"):
        paged_decode(q, k, k, "nhd", table, lens)
    with pytest.raises(ValueError, match="uint8 codes.*name the scheme"):
        DecodePlan(table, lens, layout="nhd", k_cache=k, v_cache=k, num_q_heads=2, q_dtype=torch.float16)
    f64 = torch.zeros(4, 16, 2, 16, dtype=torch.float64, device=dev)
    with pytest.raises(ValueError, match="k_cache must be a quantization scheme"):
        paged_decode(q, f64, f64, "nhd", table, lens)
