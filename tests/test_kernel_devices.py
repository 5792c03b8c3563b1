"""One device for a cache and every tensor a kernel sees (issue 30 item 2): on the H200 the runner's kernel path
handed CPU tensors to compiled Triton kernels ("Pointer argument (at 0) cannot be accessed from Triton (cpu
tensor?)") because the test built its cache on the CPU. The guard that refuses it is plain logic over devices, so
it is tested here for the compiled backend too (all tensors are CPU ones under the interpreter)."""

import pytest
import torch
from workbench.kernels import check_write_kv, write_kv

import workbench
from workbench import quant
from workbench.cache import PagedKVCache
from workbench.core import backend
from workbench.core.backend import check_kernel_devices, kernel_device_problem
from workbench.model import SMOLLM2_135M, Llama, PagedKV, Runner, random_weights

pytestmark = pytest.mark.kernels  # runs Triton kernels: scripts/gpu_run.sh runs it compiled (tests/kernel_launches.py)

CPU, GPU0, GPU1 = torch.device("cpu"), torch.device("cuda:0"), torch.device("cuda:1")


@pytest.mark.parametrize("devices, interpreted, problem", [
    ({"k": GPU0, "v": GPU0}, False, None),
    ({"k": torch.device("cuda"), "v": GPU0}, False, None),  # "cuda" is the current device, cuda:0
    ({"k": CPU}, True, None),  # the interpreter reads host memory
    ({"k": GPU0}, True, None),  # ... and device memory (it copies)
    ({"k": CPU}, False, "k on cpu: compiled Triton kernels read GPU memory only"),
    ({"q": GPU0, "k_cache": CPU, "table": CPU}, False, "one kernel launch needs its tensors on one device"),
    ({"k": GPU0, "v": GPU1}, False, "k on cuda:0, v on cuda:1"),
    ({"k": CPU, "v": GPU0}, True, "one kernel launch needs its tensors on one device"),
    ({"k_cache": CPU, "v_cache": CPU}, False, "k_cache, v_cache on cpu"),
])
def test_kernel_device_problem(devices, interpreted, problem):
    got = kernel_device_problem(devices, interpreted)
    assert (got is None) if problem is None else (problem in got), got


def test_check_kernel_devices_names_what_and_skips_none():
    check_kernel_devices("decode", interpreted=False, q=GPU0, k_cache=GPU0, k_scale=None)  # devices or tensors
    with pytest.raises(ValueError, match=r"^decode: q on cpu"):
        check_kernel_devices("decode", interpreted=False, q=torch.zeros(1), k_scale=None)


@pytest.fixture
def compiled(monkeypatch):
    """Judge devices as the compiled (GPU) backend does, whatever this machine runs. The write kernel's cached plans
    were judged for this machine's backend: none is kept across the switch."""
    from workbench.kernels.write import _PLANS

    _PLANS.clear()
    monkeypatch.setattr(backend, "is_interpreted", lambda: False)
    yield
    _PLANS.clear()


def test_a_cpu_cache_with_kernel_ops_is_refused_under_compiled_triton(compiled):
    with pytest.raises(ValueError, match=r"ops='kernels' with device=cpu: device on cpu: compiled Triton kernels"):
        PagedKVCache(1, 2, 16, 4, device="cpu", ops="kernels")
    PagedKVCache(1, 2, 16, 4, device="cpu", ops="torch")  # the PyTorch ops run anywhere


def test_write_kv_refuses_cpu_tensors_under_compiled_triton(compiled):
    k = torch.zeros(2, 2, 16)
    kc = torch.zeros(4, 4, 2, 16)
    with pytest.raises(ValueError, match="k_cache on cpu: compiled Triton kernels read GPU memory only"):
        write_kv(k, k, kc, kc.clone(), "nhd", torch.arange(2))


def test_runner_refuses_a_model_and_a_store_on_two_devices():
    cfg = SMOLLM2_135M.with_layers(1)
    model = Llama(cfg, random_weights(cfg, seed=0))  # on the CPU

    class Elsewhere:  # a store keeping K/V on a GPU (no GPU needed to build it)
        num_layers, device = 1, GPU0

    with pytest.raises(ValueError, match="kv keeps K/V on cuda:0 but the model computes on cpu"):
        Runner(model, Elsewhere())
    cache = PagedKVCache(1, cfg.num_key_value_heads, cfg.head_dim, 4, device=workbench.device())
    if cache.device.type == "cpu":
        Runner(model, PagedKV(cache))  # one device: accepted


@pytest.mark.parametrize("scheme", ["fp16", "int8", "int8/token", "int4/kivi"])
def test_a_cpu_cache_with_torch_ops_writes_under_compiled_triton(compiled, scheme):
    """Regression (H200 run, ~45 failures): the cache ran the write kernel's device guard over a CPU pool although
    ops='torch' writes with PyTorch; the shape and dtype checks still hold for it."""
    static = quant.resolve(scheme).static
    scales = dict(k_scale=torch.tensor([0.05]), v_scale=torch.tensor([0.05])) if static else {}
    cache = PagedKVCache(1, 2, 32, 4, page_tokens=32, kv_dtype=scheme, device="cpu", ops="torch", **scales)
    k, v = (torch.randn(1, 40, 2, 32, generator=torch.Generator().manual_seed(i)) for i in range(2))
    cache.add("a", list(range(40)), k, v)
    cache.append("a", [40], k[:, :1], v[:, :1])
    rk, _ = cache.read("a")
    assert rk.shape[1] == 41 and torch.isfinite(rk).all()
    before = cache.manager.block_table("a")
    with pytest.raises(ValueError, match="must be float32, float16 or bfloat16"):
        cache.append("a", [41], k[:, :1].double(), v[:, :1].double())
    assert cache.manager.block_table("a") == before and cache.manager.num_tokens("a") == 41


def test_a_write_checked_for_the_torch_ops_is_still_refused_for_a_launch(compiled):
    """check_write_kv(launch=False) caches a plan of that geometry; a launch must not take it unguarded."""
    k, kc = torch.zeros(2, 2, 16), torch.zeros(4, 4, 2, 16)
    check_write_kv(k, k, kc, kc.clone(), "nhd", launch=False)
    for _ in range(2):  # the second call finds the plan cached
        with pytest.raises(ValueError, match="k_cache on cpu: compiled Triton kernels read GPU memory only"):
            check_write_kv(k, k, kc, kc.clone(), "nhd")
        with pytest.raises(ValueError, match="k_cache on cpu: compiled Triton kernels read GPU memory only"):
            write_kv(k, k, kc, kc.clone(), "nhd", torch.arange(2))
    with pytest.raises(ValueError, match="value must have the key's shape"):  # argument checks without the guard
        check_write_kv(k, k[:1], kc, kc.clone(), "nhd", launch=False)
