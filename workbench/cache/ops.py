"""The cache's ops backends: the Triton kernels, or their plain PyTorch references on the same blocks, tables and
scales (fast on a CPU, where the kernels run under the Triton interpreter). One object per backend with the same
methods, chosen once when the cache is built (``OPS[ops]``); they act on a :class:`~workbench.cache.storage.Storage`
and know nothing of the cache.

No method checks its arguments: the cache checked them before. ``kernels.write_kv`` and ``backend.is_interpreted``
are looked up at each call, not bound at import (tests replace them: a write that fails, the compiled backend's
judgement on a CPU).
"""

from __future__ import annotations

import torch

from workbench import kernels
from workbench.cache.storage import Storage
from workbench.core import backend
from workbench.kernels.decode.reference import decode_cache_ref
from workbench.kernels.quest.reference import key_bounds_ref
from workbench.kernels.write.config import interpreter_launch
from workbench.kernels.write.reference import write_cache_ref
from workbench.shared_prefix import SharedPrefixDecode


class KernelOps:
    """The Triton kernels: write, block copy, key bounds, paged decode."""

    name = "kernels"
    launches = True  # the write checks also judge the launch (devices, backend)

    def check_device(self, device: torch.device) -> None:
        """Every kernel the cache launches reads its pool: refused here, not inside Triton."""
        backend.check_kernel_devices(f"ops='kernels' with device={device}", device=device)

    def write(self, st: Storage, layer: int, block_size: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              k_scale, v_scale, nonfinite: torch.Tensor) -> None:
        """K/V ``[T, heads, head_dim]`` of one layer into ``slots`` (``nonfinite`` counts the NaN/Inf seen)."""
        k_cache, v_cache = st.plane_view(layer, 0, block_size), st.plane_view(layer, 1, block_size)
        if st.scheme.scales_on_write:
            kernels.write_kv(k, v, k_cache, v_cache, st.layout, slots, quant=st.scheme, nonfinite=nonfinite,
                             validate=False)
        else:
            launch = interpreter_launch(k.shape[0], block_size, st.layout) if backend.is_interpreted() else {}
            kernels.write_kv(k, v, k_cache, v_cache, st.layout, slots, k_scale=k_scale, v_scale=v_scale,
                             validate=False, **launch)

    def copy_blocks(self, st: Storage, block_size: int, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Blocks ``src -> dst`` of one size class, every layer, K and V."""
        kernels.copy_blocks(st.blocks(block_size), src, dst)

    def key_bounds(self, st: Storage, layer: int, block_size: int, bounds: torch.Tensor, blocks: torch.Tensor,
                   counts: torch.Tensor, k_scale) -> None:
        """Recompute ``bounds[blocks]`` (layer ``layer``'s ``[num_blocks, Hkv, 2, D]``) from the stored keys."""
        kernels.key_bounds(st.plane_view(layer, 0, block_size), st.layout, bounds, blocks, counts, quant=st.scheme,
                           k_scale=k_scale)

    def decode(self, st: Storage, q, k_cache, v_cache, table, lens, residuals, *, k_scale, v_scale, sm_scale,
               return_lse: bool, launch: dict):
        """Paged decode of ``q`` ``[B, Hq, D]`` over the first ``lens`` tokens of ``table``'s blocks; then each
        sequence's ``residuals`` entry (fp16 ``(k, v)`` ``[n, H, D]``, or None) attended by the same kernel over a
        one-block table, merged by log-sum-exp. ``(out, lse)`` with ``return_lse``."""
        kw = dict(quant=st.scheme, sm_scale=sm_scale, **launch)
        if st.scheme.needs_static_scales:
            kw.update(k_scale=k_scale, v_scale=v_scale)
        shape = dict(layout=st.layout, k_cache=k_cache, v_cache=v_cache, num_q_heads=q.shape[1], q_dtype=q.dtype,
                     return_lse=True)
        if not any(r is not None for r in residuals):
            if not return_lse:
                return kernels.paged_decode(q, k_cache, v_cache, st.layout, table, lens, **kw)
            return kernels.DecodePlan(table, lens, **shape, **kw).run(q, k_cache, v_cache)
        o_blocks, s_blocks = kernels.DecodePlan(table, lens, **shape, **kw).run(q, k_cache, v_cache)
        B, width = len(residuals), max(r[0].shape[0] if r is not None else 0 for r in residuals)
        rk = torch.zeros((B, width, st.num_kv_heads, st.head_dim), dtype=q.dtype, device=q.device)
        rv = torch.zeros_like(rk)
        for i, r in enumerate(residuals):
            if r is not None:
                rk[i, :r[0].shape[0]] = r[0]
                rv[i, :r[1].shape[0]] = r[1]
        r_lens = torch.tensor([r[0].shape[0] if r is not None else 0 for r in residuals], dtype=torch.int32,
                              device=q.device)
        own = torch.arange(B, dtype=torch.int32, device=q.device)[:, None]  # sequence i owns "block" i
        r_plan = kernels.DecodePlan(own, r_lens, layout="nhd", k_cache=rk, v_cache=rv, num_q_heads=q.shape[1],
                                    q_dtype=q.dtype, return_lse=True, sm_scale=sm_scale, **launch)
        o_res, s_res = r_plan.run(q, rk, rv)
        merged = kernels.merge_state(o_blocks, s_blocks, o_res, s_res)
        return merged if return_lse else merged[0]

    def plan(self, st: Storage, table, lens, *, k_cache, v_cache, num_q_heads: int, q_dtype, max_seq_len: int,
             k_scale, v_scale, sm_scale, shared_prefix: str, ref_counts, launch: dict):
        """A step's decode plan, made once and run per layer (``run(q, k_cache, v_cache, k_scale=, v_scale=)``):
        a ``DecodePlan``, or with ``shared_prefix`` ``"auto"``/``"shared"`` a ``SharedPrefixDecode``
        (``workbench.shared_prefix``), given the blocks' holder counts by ``ref_counts()``."""
        kw = dict(quant=st.scheme, sm_scale=sm_scale, **launch)
        if st.scheme.needs_static_scales:
            kw.update(k_scale=k_scale, v_scale=v_scale)
        if shared_prefix == "off":
            return kernels.DecodePlan(table, lens, layout=st.layout, k_cache=k_cache, v_cache=v_cache,
                                      num_q_heads=num_q_heads, q_dtype=q_dtype, max_seq_len=max_seq_len, **kw)
        return SharedPrefixDecode(table, lens, layout=st.layout, k_cache=k_cache, v_cache=v_cache,
                                  num_q_heads=num_q_heads, q_dtype=q_dtype, ref_counts=ref_counts(),
                                  path=shared_prefix, **kw)


class TorchOps:
    """The kernels' PyTorch references (``workbench.kernels.<op>.reference``)."""

    name = "torch"
    launches = False  # writes on any device: the write checks judge shapes and dtypes only

    def check_device(self, device: torch.device) -> None:
        """The PyTorch ops run anywhere."""

    def write(self, st: Storage, layer: int, block_size: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              k_scale, v_scale, nonfinite: torch.Tensor) -> None:
        k_cache, v_cache = st.plane_view(layer, 0, block_size), st.plane_view(layer, 1, block_size)
        write_cache_ref(st.scheme, k, v, k_cache, v_cache, st.layout, slots, k_scale, v_scale)

    def copy_blocks(self, st: Storage, block_size: int, src: torch.Tensor, dst: torch.Tensor) -> None:
        blocks = st.blocks(block_size)
        blocks[:, :, dst] = blocks[:, :, src]

    def key_bounds(self, st: Storage, layer: int, block_size: int, bounds: torch.Tensor, blocks: torch.Tensor,
                   counts: torch.Tensor, k_scale) -> None:
        bounds[blocks] = key_bounds_ref(st.scheme, st.plane_view(layer, 0, block_size), st.layout, st.head_dim,
                                        blocks, counts, k_scale)

    @staticmethod
    def attend(st: Storage, q, k_cache, v_cache, table, lens, *, k_scale, v_scale, sm_scale, residuals=None):
        """The paged decode in PyTorch: ``(out [B, Hq, D] fp32, lse [B, Hq] base 2)``."""
        return decode_cache_ref(st.scheme, q, k_cache, v_cache, st.layout, table, lens, st.head_dim,
                                k_scale=k_scale, v_scale=v_scale, sm_scale=sm_scale, residual=residuals)

    def decode(self, st: Storage, q, k_cache, v_cache, table, lens, residuals, *, k_scale, v_scale, sm_scale,
               return_lse: bool, launch: dict):
        o, lse = self.attend(st, q, k_cache, v_cache, table, lens, k_scale=k_scale, v_scale=v_scale,
                             sm_scale=sm_scale, residuals=residuals)
        return (o.to(q.dtype), lse) if return_lse else o.to(q.dtype)

    def plan(self, st: Storage, table, lens, *, k_cache, v_cache, num_q_heads: int, q_dtype, max_seq_len: int,
             k_scale, v_scale, sm_scale, shared_prefix: str, ref_counts, launch: dict):
        """No plan to make: each run decodes the batch in PyTorch (``shared_prefix``, ``launch`` unused)."""
        return ReferencePlan(st, table, lens, sm_scale)


class ReferencePlan:
    """:meth:`TorchOps.plan`: a step's decode by the PyTorch reference, run per layer like a kernel plan."""

    def __init__(self, st: Storage, table: torch.Tensor, lens: torch.Tensor, sm_scale: float | None):
        self.st, self.table, self.lens, self.sm_scale = st, table, lens, sm_scale

    def run(self, q, k_cache, v_cache, *, k_scale=None, v_scale=None) -> torch.Tensor:
        out, _ = TorchOps.attend(self.st, q, k_cache, v_cache, self.table, self.lens, k_scale=k_scale,
                                 v_scale=v_scale, sm_scale=self.sm_scale)
        return out.to(q.dtype)


OPS = {"kernels": KernelOps(), "torch": TorchOps()}
