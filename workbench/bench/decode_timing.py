"""How one paged decode is timed, shared by ``bench decode``, ``bench decode --impl`` (``byok_decode``) and the
decode sweep (``workbench.studies.kernels``):

- the callables timed: ours (:func:`ours_fn`, ``DecodePlan.run`` with the plan built outside the timed call) and the
  torch peers (:func:`peer_fns`: SDPA on a contiguous cache, gather-then-SDPA, FlexAttention paged);
- the launch heuristic's configuration for a workload (:func:`heuristic_config`);
- the float32 reference every row's ``rel_err`` is against (:func:`ref_fp32`);
- the timer (:func:`time_eager_and_graph`: the lower of two ``do_bench`` medians, and CUDA-graph replay);
- the row (:func:`decode_row`), printed as one line (:func:`print_row`);
- freeing memory between workloads (:func:`free_memory`).
"""

from __future__ import annotations

import gc
import math

import torch
import torch.nn.functional as F

from workbench.bench import harness
from workbench.core import kv_formats
from workbench.core.workloads import PagedKV
from workbench.kernels import DecodePlan, decode_config

PEERS = ("sdpa_contiguous", "gather_sdpa", "flex_paged")
DTYPES = {name: kv_formats.get(name).storage for name in ("fp16", "bf16", "fp8_e4m3")}  # the formats timed


def ref_fp32(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lens: list[int], chunk: int = 8) -> torch.Tensor:
    """Float32 decode attention on a contiguous ``[B, Hkv, L, D]`` cache, a few sequences at a time."""
    B, Hq, D = q.shape
    hkv, L = k.shape[1], k.shape[2]
    out = torch.empty((B, Hq, D), dtype=torch.float32, device=q.device)
    pos = torch.arange(L, device=q.device)
    lens_t = torch.tensor(lens, device=q.device)
    for b0 in range(0, B, chunk):
        b1 = min(B, b0 + chunk)
        qq = q[b0:b1].float().view(b1 - b0, hkv, Hq // hkv, D)
        s = torch.einsum("bhgd,bhld->bhgl", qq, k[b0:b1].float()) / math.sqrt(D)
        s = s.masked_fill((pos[None, :] >= lens_t[b0:b1, None])[:, None, None, :], float("-inf"))
        p = torch.softmax(s, dim=-1).nan_to_num_(0.0)  # an empty sequence gives zeros
        out[b0:b1] = torch.einsum("bhgl,bhld->bhgd", p, v[b0:b1].float()).reshape(b1 - b0, Hq, D)
    return out


def time_eager_and_graph(fn, rep_ms: float, graph: bool) -> tuple[float, float | None, str | None]:
    """``(time_us, time_us_graph, graph_error)`` of one call: the eager time, then (``graph``) the CUDA-graph
    replay's, or None and why the call could not be captured."""
    # the lower of two medians: a host-side hiccup was seen to inflate one eager median by up to 25%
    # while the CUDA-graph time of the same call stayed put (docs/decode_tuning.md)
    t = min(harness.time_us(fn, rep_ms=rep_ms) for _ in range(2))
    if not graph:
        return t, None, None
    try:
        return t, harness.time_us_graph(fn, rep_ms=rep_ms), None
    except Exception as err:  # noqa: BLE001  (a peer that cannot be captured keeps its eager time)
        return t, None, f"graph: {type(err).__name__}: {str(err)[:120]}"


def _sdpa_mask(p: PagedKV) -> torch.Tensor | None:
    if min(p.lens) == p.max_seq_len:
        return None
    pos = torch.arange(p.max_seq_len, device=p.q.device)
    return (pos[None, :] < p.seq_lens[:, None].long())[:, None, None, :]  # [B, 1, 1, L]


def peer_fns(p: PagedKV, k: torch.Tensor, v: torch.Tensor) -> dict:
    """name -> zero-argument callable returning ``[B, Hq, D]`` (or an Exception if it cannot be built)."""
    qs = p.q.unsqueeze(2)  # [B, Hq, 1, D]
    mask = _sdpa_mask(p)
    fns = {"sdpa_contiguous": lambda: F.scaled_dot_product_attention(qs, k, v, attn_mask=mask, enable_gqa=True)}

    nblk = p.block_table.shape[1]
    idx = p.block_table.long()

    def gather_sdpa():
        B = idx.shape[0]
        kk = p.k_cache[idx].reshape(B, nblk * p.block_size, *p.k_cache.shape[2:])[:, : p.max_seq_len]
        vv = p.v_cache[idx].reshape(B, nblk * p.block_size, *p.v_cache.shape[2:])[:, : p.max_seq_len]
        return F.scaled_dot_product_attention(qs, kk.transpose(1, 2), vv.transpose(1, 2), attn_mask=mask,
                                              enable_gqa=True)

    fns["gather_sdpa"] = gather_sdpa if p.layout.value == "nhd" else ValueError("gather_sdpa needs nhd")
    try:
        fns["flex_paged"] = _flex_fn(p)
    except Exception as err:  # noqa: BLE001
        fns["flex_paged"] = err
    return fns


def _flex_fn(p: PagedKV):
    # torch's experimental paged attention and flex_attention: imported when a run builds the peer, so that an
    # older torch without them costs this peer only (its row's error), not the benchmark's import
    from torch.nn.attention.experimental._paged_attention import PagedAttention
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    dev = p.q.device
    B, nblk = p.block_table.shape
    n_pages = p.k_cache.shape[0]
    pa = PagedAttention(n_pages, p.block_size, B, device=str(dev))
    for b, n in enumerate(p.blocks_per_seq):
        pages = p.block_table[b, :n].long()
        pa.page_table[b, :n] = pages
        pa.physical_to_logical[b, pages] = torch.arange(n, device=dev)
        pa.capacity[b] = n * p.block_size
    lens = p.seq_lens.long()

    def logical(b, h, q_idx, kv_idx):
        return kv_idx < lens[b]

    bm = create_block_mask(logical, B, None, 1, nblk * p.block_size, device=dev, BLOCK_SIZE=p.block_size)
    cbm = pa.convert_logical_block_mask(bm, kv_len=lens)
    kf = p.k_cache.permute(2, 0, 1, 3).reshape(1, p.k_cache.shape[2], -1, p.k_cache.shape[3])  # copy
    vf = p.v_cache.permute(2, 0, 1, 3).reshape(1, p.v_cache.shape[2], -1, p.v_cache.shape[3])
    torch._dynamo.reset()  # one static compile per workload: a dynamic recompile leaves the decode path
    flex = torch.compile(flex_attention, fullgraph=True, dynamic=False)
    qs = p.q.unsqueeze(2)
    return lambda: flex(qs, kf, vf, block_mask=cbm, enable_gqa=True)


def ours_fn(p: PagedKV, cfg: dict, out: torch.Tensor):
    """The per-layer path: a :class:`DecodePlan` built once here (as once per decode step), and the timed
    callable only ``plan.run`` (metadata checks and the launches)."""
    launch = {k: cfg[k] for k in ("BLOCK_N", "num_warps", "num_stages", "use_dot") if k in cfg}
    mean = sum(p.lens) / max(1, len(p.lens))
    plan = DecodePlan(p.block_table, p.seq_lens, layout=p.layout, k_cache=p.k_cache, v_cache=p.v_cache,
                      num_q_heads=p.q.shape[1], q_dtype=p.q.dtype, num_splits=cfg.get("num_splits"),
                      max_seq_len=p.max_seq_len, mean_seq_len=mean, validate=False, **launch)
    return lambda: plan.run(p.q, p.k_cache, p.v_cache, out)


def _num_sms(device: torch.device) -> int:
    """The GPU's SM count the launch heuristic sizes its splits by; 0 off a GPU (its interpreter configuration)."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 0


def heuristic_config(p: PagedKV, kv_dtype: torch.dtype) -> dict:
    """The launch heuristic's configuration (``decode_config``) for the cache ``p`` on its device."""
    sms = _num_sms(p.q.device)
    B, Hq, D = p.q.shape
    hkv = p.k_cache.shape[2] if p.layout.value == "nhd" else p.k_cache.shape[1]
    return decode_config(B, hkv, Hq // hkv, D, p.block_size, p.max_seq_len, mean_seq_len=sum(p.lens) / B,
                         kv_dtype=kv_dtype, num_sms=sms, layout=p.layout)


def decode_row(w, impl, variant, p, kv_dtype_name, nbytes, copy_gbps, t, tg, err, cfg=None, extra=None) -> dict:
    """One timing's row: the workload and cache, ``time_us``/``time_us_graph``, ``gbps`` and ``frac_copy_bw``
    (``_graph``) against ``copy_gbps``, ``rel_err``, the launch configuration ``cfg`` (if any), then ``extra``."""
    row = {"workload": w.key, "workload_name": w.name, "impl": impl, "variant": variant, "layout": p.layout.value,
           "block_size": p.block_size, "kv_dtype": kv_dtype_name, "time_us": t, "time_us_graph": tg,
           "bytes": nbytes, "copy_gbps": copy_gbps, "rel_err": err}
    if t:
        row["gbps"] = nbytes / (t * 1e-6) / 1e9
        row["frac_copy_bw"] = row["gbps"] / copy_gbps if copy_gbps else None
    if tg:
        row["frac_copy_bw_graph"] = nbytes / (tg * 1e-6) / 1e9 / copy_gbps if copy_gbps else None
    if cfg:
        row.update({k: cfg[k] for k in ("BLOCK_N", "num_splits", "num_warps", "num_stages", "use_dot")})
    row.update(extra or {})
    return row


def print_row(row: dict) -> None:
    keys = ["workload", "impl", "status", "variant", "layout", "block_size", "kv_dtype", "block_stride_pad", "BLOCK_N",
            "num_splits", "num_warps", "num_stages", "use_dot", "time_us", "time_us_graph", "frac_copy_bw",
            "frac_copy_bw_graph", "rel_err", "error"]
    parts = []
    for k in keys:
        if row.get(k) is not None:
            v = row[k]
            parts.append(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}")
    print(" ".join(parts), flush=True)


def free_memory() -> None:
    """Collect the last workload's tensors and hand the allocator's cache back (workloads of several GB each)."""
    gc.collect()
    torch.cuda.empty_cache()
