"""What a K/V write must satisfy, checked before the allocator's tables change: afterwards nothing may fail."""

from __future__ import annotations

import torch

from workbench.cache.storage import Storage
from workbench.kernels import check_write_kv
from workbench.kernels.write.api import check_dynamic_write
from workbench.kernels.write.kernel import SOURCE_DTYPES


def check_kv(st: Storage, launches: bool, scales: tuple, k: torch.Tensor, v: torch.Tensor, num_tokens: int,
             layers: int | None = None) -> None:
    """Everything the write kernel will check, checked now (ValueError naming ``k`` or ``v``).

    Args:
        st: the storage written into.
        launches: the writes launch the Triton kernel (``ops="kernels"``): its device checks apply too; the PyTorch
            ops write on any device (shapes and dtypes only).
        scales: layer 0's static ``(k_scale, v_scale)`` (every layer's have one shape).
        k, v: ``[layers, num_tokens, heads, head_dim]``.
        layers: K/V of that many layers (a decode step writes one at a time), default all.
    """
    want = (st.num_layers if layers is None else layers, num_tokens, st.num_kv_heads, st.head_dim)
    device = st.flat.device
    for name, t in (("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != want:
            got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{name} must be a tensor of shape {want} [layers, tokens, heads, head_dim], "
                             f"got {got}")
        if t.device != device:
            raise ValueError(f"{name} must be on the cache's device {device}, got {t.device}")
        if t.dtype not in SOURCE_DTYPES:
            raise ValueError(f"{name} must be float32, float16 or bfloat16, got {t.dtype}")
        if st.head_dim > 1 and t.stride(3) != 1:
            raise ValueError(f"{name} must have unit stride in head_dim (the last dim), got strides {t.stride()}")
        if num_tokens:  # refuses what the scheme cannot store (NaN/Inf, beyond its range) before anything changes
            st.scheme.check_input(name, t)
    if not num_tokens:
        return
    bs = st.block_pool.block_sizes[0]
    k_cache, v_cache = st.plane_view(0, 0, bs), st.plane_view(0, 1, bs)
    try:
        if st.scheme.scales_on_write:
            n = st.scheme.write_group if st.scheme.write_group > 1 else num_tokens
            slots = torch.empty(n, dtype=torch.int64, device=device)
            kk, vv = (t[0, :1].expand(n, -1, -1) for t in (k, v))  # the shape a group write has
            check_dynamic_write(kk, vv, k_cache, v_cache, st.layout, slots, st.scheme, launch=launches)
        else:
            check_write_kv(k[0], v[0], k_cache, v_cache, st.layout.value, *scales, launch=launches)
    except ValueError as e:
        raise ValueError(f"k/v cannot be written to this cache: {e}") from None
