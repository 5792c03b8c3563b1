"""The implementations that come registered: ours (``workbench.kernels``), our PyTorch references, the starter
kernel, and the peers that are importable on this machine (FlashInfer, vLLM's Triton attention). A peer that cannot
be imported is listed in :data:`ABSENT` with the reason, never registered as a stand-in.

Loaded on the registry's first lookup (:func:`load`, handed to the registry by the package's ``__init__``), so
importing the package costs nothing.
"""

from __future__ import annotations

from workbench.conformance import implementations
from workbench.conformance import suite_formats as fmts
from workbench.conformance.implementations import register

ABSENT = implementations.ABSENT  # peer name -> why it is not registered here
ALL_LAYOUTS = ("nhd", "hnd", "vllm")
DECODE_FORMATS = tuple(fmts.SUITE_FORMATS)


def ours_decode(q, k_cache, v_cache, layout, block_table, seq_lens, sm_scale, k_scale, v_scale, quant, out):
    from workbench.kernels import paged_decode

    return paged_decode(q, k_cache, v_cache, layout, block_table, seq_lens, sm_scale=sm_scale, k_scale=k_scale,
                        v_scale=v_scale, quant=quant, out=out)


def reference_decode(q, k_cache, v_cache, layout, block_table, seq_lens, sm_scale, k_scale, v_scale, quant, out):
    from workbench.kernels.common import scheme_of
    from workbench.kernels.decode.reference import decode_cache_ref

    scheme = scheme_of(k_cache.dtype, quant)
    got, _ = decode_cache_ref(scheme, q, k_cache, v_cache, layout, block_table, seq_lens, q.shape[-1],
                              k_scale=k_scale, v_scale=v_scale, sm_scale=sm_scale)
    return out.copy_(got)


def ours_shared_prefix(q, k_cache, v_cache, layout, block_table, seq_lens, sm_scale, k_scale, v_scale, quant,
                       ref_counts, out):
    from workbench.shared_prefix import SharedPrefixDecode

    dec = SharedPrefixDecode(block_table, seq_lens, layout=layout, k_cache=k_cache, v_cache=v_cache,
                             num_q_heads=q.shape[1], q_dtype=q.dtype, ref_counts=ref_counts, path="shared",
                             sm_scale=sm_scale, k_scale=k_scale, v_scale=v_scale,
                             **({"quant": quant} if quant else {}))
    return dec.run(q, k_cache, v_cache, out=out)


def ours_write(key, value, k_cache, v_cache, layout, slot_mapping, k_scale, v_scale):
    from workbench.kernels import write_kv

    write_kv(key, value, k_cache, v_cache, layout, slot_mapping, k_scale, v_scale)


def reference_write(key, value, k_cache, v_cache, layout, slot_mapping, k_scale, v_scale):
    from workbench.kernels.write.reference import write_kv_ref

    write_kv_ref(key, value, k_cache, v_cache, layout, slot_mapping, k_scale, v_scale)


def ours_copy(pool, src, dst):
    from workbench.kernels import copy_blocks

    copy_blocks(pool, src, dst)


def reference_copy(pool, src, dst):
    from workbench.kernels.copy.reference import copy_blocks_ref

    copy_blocks_ref(pool, src, dst)


_LOADED = False


def load() -> None:
    """Register the built-in implementations and whichever peers import (once)."""
    global _LOADED
    if _LOADED:
        return
    _LOADED = True  # first: the register calls below come back here
    from workbench.conformance import peers
    from workbench.conformance.starter import starter_decode

    for op, name, fn, origin, claims in [
        ("decode", "ours", ours_decode, "ours", dict(formats=DECODE_FORMATS)),
        ("decode", "reference", reference_decode, "reference", dict(formats=DECODE_FORMATS)),
        ("decode", "starter", starter_decode, "example", dict(layouts=("nhd", "hnd"), formats=fmts.CAST)),
        ("shared_prefix", "ours", ours_shared_prefix, "ours", dict(formats=DECODE_FORMATS)),
        ("shared_prefix", "reference", reference_decode, "reference", dict(formats=DECODE_FORMATS)),
        ("write", "ours", ours_write, "ours", dict(formats=fmts.WRITE_FORMATS)),
        ("write", "reference", reference_write, "reference", dict(formats=fmts.WRITE_FORMATS)),
        ("copy", "ours", ours_copy, "ours", {}),
        ("copy", "reference", reference_copy, "reference", {}),
    ]:
        register(op, name, fn, origin=origin, layouts=claims.pop("layouts", ALL_LAYOUTS), replace=True, **claims)
    for name, make in peers.PEERS.items():
        try:
            fn, claims = make()
        except Exception as e:  # noqa: BLE001  (absent or broken install: listed, not registered)
            ABSENT[name] = f"{type(e).__name__}: {str(e)[:160]}"
            continue
        register("decode", name, fn, origin="peer", replace=True, **claims)
