"""Static scales per layer through the kernels (issue 31): the write kernel stores each layer's codes with its own
scales (code for code the reference's), the decode plan is planned once and run per layer with the layer's scale
tensors (``DecodePlan.run(k_scale=, v_scale=)``: the cache's decode, the per-layer step, the shared-prefix cascade,
Quest and the CUDA-graph decoder pass them), and each layer's decode equals the reference on that layer's values.
Bad scale tensors given to a run are refused by name before anything is written."""

import pytest
import torch
from conftest import bits, rel_err
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_quant_layer_scales import STATIC, D, H, L, cache_of, calibrated, layered_kv
from workbench.kernels import DecodePlan, paged_decode
from workbench.kernels.decode.reference import paged_decode_ref
from workbench.kernels.quest.reference import key_bounds_ref

import workbench
from workbench.cache import PagedKVCache

pytestmark = pytest.mark.kernels  # runs Triton kernels: scripts/gpu_run.sh runs it compiled (tests/kernel_launches.py)

DEV = workbench.device()


def filled(name, by="layer", ops="kernels", seed=5, **kw):
    """A cache of ``name`` with scales calibrated per layer (or per cache) holding sequences a (40 tokens) and
    b (17), and the K/V written."""
    k, v = layered_kv(seed)
    cal = calibrated(name, k, v)
    ks, vs = cal.scales(per_layer=by == "layer")
    cache = cache_of(name, ks, vs, ops=ops, **kw)
    k, v = (k.to(cache.device), v.to(cache.device)) if ops == "kernels" else (k, v)
    cache.add("a", list(range(40)), k, v)
    cache.add("b", list(range(100, 117)), k[:, :17], v[:, :17])
    return cache, k, v


def decode_refs(cache, q, ids):
    """``paged_decode_ref`` of each layer on the values the cache reads back (``[L][B, Hq, D]`` float64)."""
    reads = [cache.read(s) for s in ids]
    one = torch.zeros((1, 1), dtype=torch.int32, device=q.device)
    out = []
    for layer in range(cache.num_layers):
        rows = [paged_decode_ref(q[i:i + 1], kr[layer][None], vr[layer][None], "nhd", one,
                                 torch.tensor([kr.shape[1]], dtype=torch.int32, device=q.device))
                for i, (kr, vr) in enumerate(reads)]
        out.append(torch.cat(rows))
    return out


@pytest.mark.parametrize("name", STATIC)
def test_kernel_writes_each_layer_as_the_reference_does(name):
    kern, k, v = filled(name, zero_storage=True)  # unwritten slots zero in both pools
    ref, _, _ = filled(name, ops="torch", zero_storage=True)
    assert kern.per_layer_scales and torch.equal(bits(kern.pool).cpu(), bits(ref.pool))  # code for code
    s = kern.scheme
    kr, vr = kern.read("a")
    for layer in range(L):
        lk, lv = (t.cpu() for t in kern.layer_scales(layer))
        assert torch.equal(kr[layer].cpu(), s.roundtrip(k[layer].cpu(), "k", lk)), layer
        assert torch.equal(vr[layer].cpu(), s.roundtrip(v[layer].cpu(), "v", lv)), layer


@pytest.mark.parametrize("name,layout", [("int8/tensor", "nhd"), ("fp8_e4m3/head", "hnd"), ("int8/head", "vllm"),
                                         ("fp8_e5m2/tensor", "nhd")])
def test_decode_of_each_layer_equals_the_reference(name, layout):
    """The cache's decode (a plan per call), the step (one plan, run per layer with the layer's scales) and the lse
    path, layer by layer, against the reference on that layer's values."""
    cache, k, v = filled(name, layout=layout)
    q = torch.randn(2, 2 * H, D, generator=torch.Generator().manual_seed(6)).half().to(cache.device)
    refs = decode_refs(cache, q, ["a", "b"])
    for layer in range(L):
        assert rel_err(cache.decode(q, ["a", "b"], layer), refs[layer]) < 1e-3, layer
        o, _ = cache.decode(q, ["a", "b"], layer, return_lse=True)
        assert rel_err(o, refs[layer]) < 1e-3, layer
    new_k, new_v = k[:, :2] * 0.5, v[:, :2] * 0.5
    step = cache.begin_step(["a", "b"], [7, 8])
    got = []
    for layer in range(L):
        step.write(layer, new_k[layer], new_v[layer])
        got.append(step.attend(q, layer))
    assert len(step._plans) == 1  # planned once, run per layer
    step.commit()
    refs = decode_refs(cache, q, ["a", "b"])  # the new tokens included, read back with each layer's scales
    for layer in range(L):
        assert rel_err(got[layer], refs[layer]) < 1e-3, layer


def test_one_plan_runs_every_layer_with_its_scales():
    cache, _, _ = filled("int8/head")
    q = torch.randn(2, 2 * H, D, generator=torch.Generator().manual_seed(7)).half().to(cache.device)
    meta = cache.vllm_metadata(["a", "b"])
    k0, v0 = cache.layer_scales(0)
    plan = DecodePlan(meta.block_table, meta.seq_lens, layout=cache.layout, k_cache=cache.k_cache(0),
                      v_cache=cache.v_cache(0), num_q_heads=2 * H, q_dtype=q.dtype, k_scale=k0, v_scale=v0)
    assert plan.scale_shape == (H,)
    for layer in range(L):
        ks, vs = cache.layer_scales(layer)
        want = paged_decode(q, cache.k_cache(layer), cache.v_cache(layer), cache.layout, meta.block_table,
                            meta.seq_lens, k_scale=ks, v_scale=vs)
        got = plan.run(q, cache.k_cache(layer), cache.v_cache(layer), k_scale=ks, v_scale=vs)
        assert torch.equal(got, want), layer  # the same kernel and arguments: bit for bit
    # without the layer's scales the plan uses the planned ones (layer 0's): layer 2 reads wrong values
    assert not torch.equal(plan.run(q, cache.k_cache(2), cache.v_cache(2)),
                           plan.run(q, cache.k_cache(2), cache.v_cache(2), k_scale=cache.layer_scales(2)[0],
                                    v_scale=cache.layer_scales(2)[1]))


BAD_RUN = ["shape", "per_tensor", "fp16", "strided", "device", "list", "float_plan", "cast_plan"]


@settings(max_examples=16, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(bad=st.sampled_from(BAD_RUN), which=st.sampled_from(["k_scale", "v_scale"]), seed=st.integers(0, 2**16))
def test_bad_scales_given_to_a_run_are_refused_before_anything_is_written(bad, which, seed):
    g = torch.Generator().manual_seed(seed)
    B, Hq, bs, nb = 2, 2 * H, 16, 4
    table = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32, device=DEV)
    lens = torch.tensor([20, 9], dtype=torch.int32, device=DEV)
    dtype = torch.float16 if bad == "cast_plan" else torch.int8
    kc = torch.randint(-100, 100, (nb, bs, H, D), generator=g).to(dtype=dtype, device=DEV)
    vc = torch.randint(-100, 100, (nb, bs, H, D), generator=g).to(dtype=dtype, device=DEV)
    planned = {"float_plan": 0.02, "cast_plan": None}.get(bad, torch.full((H,), 0.02, device=DEV))
    plan = DecodePlan(table, lens, layout="nhd", k_cache=kc, v_cache=vc, num_q_heads=Hq, q_dtype=torch.float16,
                      k_scale=planned, v_scale=planned)
    q = torch.randn(B, Hq, D, generator=g).half().to(DEV)
    good = torch.rand(H, generator=g).to(DEV) + 0.01
    sc = {"shape": torch.rand(H + 1, generator=g).to(DEV), "per_tensor": torch.rand(1, generator=g).to(DEV),
          "fp16": good.half(), "strided": torch.rand(2 * H, generator=g).to(DEV)[::2],
          "device": good.to("meta"), "list": good.tolist()}.get(bad, good)
    out = torch.full((B, Hq, D), float("nan"), dtype=torch.float16, device=DEV)
    before = bits(out).clone()
    with pytest.raises(ValueError, match=which if bad not in ("float_plan", "cast_plan") else "k_scale/v_scale"):
        plan.run(q, kc, vc, out, **{which: sc})
    assert torch.equal(bits(out), before), "a refused run wrote its output"


def test_shared_prefix_cascade_takes_each_layers_scales():
    cache, k, v = filled("fp8_e4m3/tensor")
    cache.fork("a", "c")  # c shares a's 40 tokens: two full blocks read once for both by the cascade
    q = torch.randn(3, 2 * H, D, generator=torch.Generator().manual_seed(8)).half().to(cache.device)
    ids = ["a", "c", "b"]
    with cache.begin_step(ids, [1, 2, 3]) as step:
        for layer in range(L):
            step.write(layer, k[layer, :3], v[layer, :3])
            plain = step.attend(q, layer)
            shared = step.attend(q, layer, shared_prefix="shared")
            assert rel_err(shared, plain.double()) < 1e-3, layer
        assert any(getattr(p, "path", "") == "shared" for p in step._plans.values())
    refs = decode_refs(cache, q, ids)
    assert rel_err(plain, refs[L - 1]) < 1e-3


def test_key_bounds_and_quest_read_each_layers_keys():
    cache, _, _ = filled("int8/tensor", key_bounds=True)
    from workbench.compress.quest_decode import quest_decode

    table = torch.tensor(cache.manager.block_table("a"), dtype=torch.long, device=cache.device)
    counts = torch.tensor([16, 16, 8], dtype=torch.long, device=cache.device)
    kr, _ = cache.read("a")
    q = torch.randn(2, 2 * H, D, generator=torch.Generator().manual_seed(9)).half().to(cache.device)
    refs = decode_refs(cache, q, ["a", "b"])
    for layer in range(L):
        want = key_bounds_ref(cache.scheme, cache.k_cache(layer), cache.layout, D, table, counts,
                              cache.layer_scales(layer)[0])
        bounds = cache.key_bounds(layer)[table]
        assert torch.equal(bounds, want), layer
        lo, hi = bounds[:, :, 0].float(), bounds[:, :, 1].float()  # [3 blocks, H, D]
        keys = torch.nn.functional.pad(kr[layer], (0, 0, 0, 0, 0, 8)).view(3, 16, H, D)
        assert bool((keys[:2] >= lo[:2, None]).all() and (keys[:2] <= hi[:2, None]).all())
        out = quest_decode(cache, q, ["a", "b"], layer, page_budget=8)  # every page: plain attention
        assert rel_err(out, refs[layer]) < 1e-3, layer


def test_graph_decoder_passes_each_layers_scales_eagerly():
    """The CUDA-graph step's code, eagerly (no graphs on a CPU): one plan for every layer, each run given its layer's
    scales; its logits are the runner's (whose per-layer step is checked against the reference above)."""
    from workbench.model import SMOLLM2_135M, Llama, PagedKV, Runner, random_weights
    from workbench.model.graph import GraphDecoder

    cfg = SMOLLM2_135M.with_layers(2)
    model = Llama(cfg, random_weights(cfg, seed=1), device=DEV)
    prompts = [list(range(300, 320)), list(range(40, 51))]
    ks = torch.tensor([0.01, 0.05])  # per layer, per tensor: 5x apart
    caches = [PagedKVCache(2, cfg.num_key_value_heads, cfg.head_dim, 12, page_tokens=16, kv_dtype="int8/tensor",
                           k_scale=ks, v_scale=ks * 0.5, device=DEV) for _ in range(3)]
    runners = [Runner(model, PagedKV(c)) for c in caches]
    for r in runners:
        for s, p in zip("ab", prompts, strict=True):
            r.prefill(s, p)
    dec, wrong = (GraphDecoder(model, c, batch_size=2, max_seq_len=64, use_graph=False) for c in caches[1:])
    first = dec._scales(0)
    wrong._scales = lambda layer: first  # what a decoder passing no layer's scales would read: layer 0's everywhere
    toks = [3, 4]
    for _ in range(2):
        want = runners[0].step(["a", "b"], toks)
        got = dec.step(["a", "b"], toks)
        assert float((want - got).abs().max()) < 3e-3  # the runner's q is fp16, the decoder's fp32
        assert float((want - wrong.step(["a", "b"], toks)).abs().max()) > 0.1
        toks = want.argmax(-1).tolist()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA-graph capture needs a CUDA GPU (none here: the eager "
                    "test above runs the same step code with per-layer scales)")
def test_graph_replay_with_per_layer_scales_equals_the_eager_step_on_the_gpu():
    from workbench.model import SMOLLM2_135M, Llama, PagedKV, Runner, random_weights
    from workbench.model.graph import GraphDecoder

    cfg = SMOLLM2_135M.with_layers(2)
    model = Llama(cfg, {k: v.half() for k, v in random_weights(cfg, seed=1).items()}, dtype=torch.float16,
                  device="cuda")
    outs = []
    for use_graph in (False, True):
        ks = torch.tensor([[0.01] * 3, [0.05] * 3], device="cuda")  # [L, H]
        cache = PagedKVCache(2, 3, 64, 24, page_tokens=16, kv_dtype="fp8_e4m3/head", k_scale=ks, v_scale=ks * 0.5,
                             device="cuda")
        runner = Runner(model, PagedKV(cache))
        for s, p in zip("ab", [list(range(300, 320)), list(range(40, 51))], strict=True):
            runner.prefill(s, p)
        dec = GraphDecoder(model, cache, 2, 64, use_graph=use_graph)
        toks, got = [3, 4], []
        for _ in range(4):
            out = dec.step(["a", "b"], toks).clone()
            got.append(out)
            toks = out.argmax(-1).tolist()
        outs.append(torch.stack(got))
    assert float((outs[0] - outs[1]).abs().max()) < 1e-2
