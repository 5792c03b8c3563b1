"""One device for a cache and every tensor a kernel sees (issue 30 item 2): on the H200 the runner's kernel path
handed CPU tensors to compiled Triton kernels ("Pointer argument (at 0) cannot be accessed from Triton (cpu
tensor?)") because the test built its cache on the CPU. The guard that refuses it is plain logic over devices, so
it is tested here for the compiled backend too (all tensors are CPU ones under the interpreter)."""

import pytest
import torch
from workbench.kernels import write_kv

import workbench
from workbench import backend
from workbench.backend import check_kernel_devices, kernel_device_problem
from workbench.cache import PagedKVCache
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
    """Judge devices as the compiled (GPU) backend does, whatever this machine runs."""
    monkeypatch.setattr(backend, "is_interpreted", lambda: False)


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
