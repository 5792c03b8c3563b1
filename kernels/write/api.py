"""``write_kv`` and its pre-flight ``check_write_kv``: argument checks, per-geometry launch plans, the launch;
``write_kv_blocks``: every slot of blocks of values into the same slots of quantized blocks (a tier's demotion)."""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import triton

from workbench.core import kv_formats
from workbench.core.backend import kernel_device_problem
from workbench.core.layout import Layout, addressing, split_x
from workbench.quant import blocks as qblocks

from .. import common
from .config import Launch, launch_config, quant_mode
from .dynamic import blocks_source, check_dynamic, check_group_slots, dynamic_launches, write_dynamic
from .kernel import FP8_GRID, QUANT_MATHS, QUANT_NONE, SOFT_ROUND, SOURCE_DTYPES, _write_kv_kernel, _write_rows_kernel


def _check_scale(name: str, scale, num_heads: int, device) -> int:
    """Validate a quantization scale; return its head stride (0 per tensor, else the [H] stride)."""
    if not isinstance(scale, torch.Tensor):
        raise ValueError(f"{name} must be an fp32 tensor (one element or [{num_heads}]), got {type(scale).__name__}")
    if scale.dtype != torch.float32:
        raise ValueError(f"{name} must be float32, got {scale.dtype}")
    if scale.device != device:
        raise ValueError(f"{name} must be on the cache's device {device}, got {scale.device}")
    if scale.numel() == 1:
        return 0
    if scale.dim() == 1 and scale.shape[0] == num_heads:
        return scale.stride(0)
    raise ValueError(f"{name} must have one element or shape [{num_heads}] (per kv head), got {tuple(scale.shape)}")


def _row_align(a, elem_size: int) -> int:
    """Divisibility (elements) of every row offset blk*s_blk + tok*s_tok + h*s_head, capped at 16 bytes."""
    g = math.gcd(a.s_blk, a.s_tok, a.s_head)
    return common.pow2_divisor(g, max(1, 16 // elem_size))


def _cache_geometry(cache: torch.Tensor, layout: Layout, kind: str) -> tuple[int, int, int, int]:
    """``(blocks, block_size, heads, head_dim)`` of one cache, read off its shape (workbench.core.layout)."""
    s = cache.shape
    if layout is Layout.NHD:
        return s[0], s[1], s[2], s[3]
    if layout is Layout.HND:
        return s[0], s[2], s[1], s[3]
    if kind == "k":  # [blocks, H, D // x, block_size, x]
        return s[0], s[3], s[1], s[2] * s[4]
    return s[0], s[3], s[1], s[2]  # [blocks, H, D, block_size]


def _checked_shapes(key, value, k_cache, v_cache, layout, slot_mapping, code_dim=None, launch=True,
                    names=("key", "value")):
    """Validate shapes, dtypes and devices; return ``(block_size, num_blocks)``. ``code_dim``: elements a cache row
    holds when it is not ``head_dim`` (packed codes). ``launch``: also whether this backend can launch a kernel on
    that device (False: the PyTorch ops will write, which run on any device). ``names``: what the messages call
    ``key`` and ``value`` (``write_kv_blocks``: its sources)."""
    for name, t in zip(names, (key, value), strict=True):
        if not isinstance(t, torch.Tensor) or t.dim() != 3:
            raise ValueError(f"{name} must be a [T, H, D] tensor, got {getattr(t, 'shape', type(t))}")
        if t.dtype not in SOURCE_DTYPES:
            raise ValueError(f"{name} must be float32, float16 or bfloat16, got {t.dtype}")
        if t.shape[2] > 1 and t.stride(2) != 1:
            raise ValueError(f"{name} must have unit stride in head_dim, got strides {t.stride()}")
    if value.shape != key.shape:
        raise ValueError(f"value must have the key's shape {tuple(key.shape)}, got {tuple(value.shape)}")
    num_tokens, num_heads, head_dim = key.shape
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        if not isinstance(cache, torch.Tensor):
            raise ValueError(f"{name} must be a tensor, got {type(cache).__name__}")
    if k_cache.dtype != v_cache.dtype:
        raise ValueError(f"v_cache must have k_cache's dtype {k_cache.dtype}, got {v_cache.dtype}")
    writable = [f.storage for f in kv_formats.FORMATS.values() if f.writable]
    if k_cache.dtype not in writable:
        raise ValueError(f"k_cache dtype must be one of {writable} (formats with a write kernel), got {k_cache.dtype}")
    shapes = {}
    for name, cache, kind in (("k_cache", k_cache, "k"), ("v_cache", v_cache, "v")):
        want = 5 if (layout is Layout.VLLM and kind == "k") else 4
        if cache.dim() != want:
            raise ValueError(f"{name} must be a {want}-D {layout.value} cache, got shape {tuple(cache.shape)}")
        nb, bs, h, d = _cache_geometry(cache, layout, kind)
        want = head_dim if code_dim is None else code_dim
        if (h, d) != (num_heads, want):
            packed = f" (packed: {want} bytes a row)" if want != head_dim else ""
            raise ValueError(
                f"{names[0]} has {num_heads} heads x {head_dim} dims{packed} but {name} holds {h} x {d} "
                f"({layout.value} layout)"
            )
        shapes[name] = (nb, bs)
    if shapes["k_cache"] != shapes["v_cache"]:
        raise ValueError(f"v_cache must have k_cache's blocks and block size {shapes['k_cache']}, got {shapes['v_cache']}")
    if not isinstance(slot_mapping, torch.Tensor) or slot_mapping.dim() != 1 or slot_mapping.dtype not in (
        torch.int32, torch.int64
    ):
        raise ValueError(f"slot_mapping must be a 1-D int32 or int64 tensor, got {getattr(slot_mapping, 'dtype', None)}")
    if slot_mapping.shape[0] != num_tokens:
        raise ValueError(f"slot_mapping must have {num_tokens} entries (one per token), got {slot_mapping.shape[0]}")
    device = k_cache.device
    for name, t in (*zip(names, (key, value), strict=True), ("v_cache", v_cache), ("slot_mapping", slot_mapping)):
        if t.device != device:
            raise ValueError(f"{name} must be on the cache's device {device}, got {t.device}")
    why = kernel_device_problem({"k_cache": device}) if launch else None  # a CPU cache under compiled Triton
    if why is not None:
        raise ValueError(why)
    num_blocks, block_size = shapes["k_cache"]
    return block_size, num_blocks


class _Plan(NamedTuple):
    """Everything a launch needs that depends only on shapes, strides, dtypes and keywords."""

    kernel: object
    grid: tuple[int, ...]
    args: tuple  # runtime scalars after the 7 tensors
    consts: dict  # constexprs and num_warps
    num_slots: int
    s_scale_h: int
    empty: bool  # nothing to write (no tokens or no heads)


_PLANS: common.PlanCache[_Plan] = common.PlanCache()  # per geometry: a repeated call's host work is a lookup


def _meta(t) -> tuple | None:
    """What validation and the plan read from a tensor (None for a non-tensor: never cached)."""
    return (t.shape, t.stride(), t.dtype, t.device) if isinstance(t, torch.Tensor) else None


def _make_plan(key, value, k_cache, v_cache, layout, slot_mapping, k_scale, v_scale, kw, launch=True) -> _Plan:
    """Validate everything but the slot values and choose the launch (see write_kv)."""
    layout = Layout.parse(layout)
    block_size, num_blocks = _checked_shapes(key, value, k_cache, v_cache, layout, slot_mapping, launch=launch)
    num_tokens, num_heads, head_dim = key.shape
    quant, qmin, qmax = quant_mode(k_cache.dtype)
    if quant == QUANT_NONE:
        for name, scale in (("k_scale", k_scale), ("v_scale", v_scale)):
            if scale is not None:
                raise ValueError(f"{name} is only for fp8/int8 caches; this cache stores {k_cache.dtype}")
        s_scale_h = 0
    else:
        for name, scale in (("k_scale", k_scale), ("v_scale", v_scale)):
            if scale is None:
                raise ValueError(f"{name} is required: the cache stores {k_cache.dtype} (quantized)")
        s_k = _check_scale("k_scale", k_scale, num_heads, k_cache.device)
        s_v = _check_scale("v_scale", v_scale, num_heads, k_cache.device)
        if s_k != s_v:
            raise ValueError("k_scale and v_scale must both be per tensor or both per head, with the same stride")
        s_scale_h = s_k
    cfg = launch_config(num_tokens, num_heads, head_dim, block_size, layout, quant != QUANT_NONE, **kw)
    num_slots = num_blocks * block_size
    if num_tokens == 0 or num_heads == 0:
        return _Plan(None, (), (), {}, num_slots, s_scale_h, True)
    ka, va = addressing(k_cache, layout, "k"), addressing(v_cache, layout, "v")
    elem = k_cache.element_size()
    src_align = common.pow2_divisor(
        math.gcd(key.stride(0), key.stride(1), value.stride(0), value.stride(1)), max(1, 16 // key.element_size())
    )
    bt = cfg.tokens_per_program
    # runs are stored along the token axis only where tokens are innermost and a run fits one block
    run_ok = bt > 1 and block_size % bt == 0

    def run_align(a) -> int:
        return common.pow2_divisor(math.gcd(a.s_blk, a.s_head, a.s_dgrp, a.s_d, bt), max(1, 16 // elem))

    mant, emin = FP8_GRID.get(k_cache.dtype, (0, 0))
    consts = dict(
        KS_D=ka.s_d, VS_D=va.s_d, KX=ka.x, VX=va.x, K_SPLIT=ka.x != head_dim, V_SPLIT=va.x != head_dim,
        K_RUN=run_ok and ka.s_tok == 1, V_RUN=run_ok and va.s_tok == 1, A_SRC=src_align,
        KA_ROW=_row_align(ka, elem), VA_ROW=_row_align(va, elem), KA_RUN=run_align(ka), VA_RUN=run_align(va),
        QUANT=quant, QMIN=qmin, QMAX=qmax, MANT=mant, EMIN=emin,
        QMATH=QUANT_MATHS.index(cfg.quant_math), SOFT=SOFT_ROUND,
        BLOCK_T=bt, BLOCK_D=triton.next_power_of_2(head_dim), num_warps=cfg.num_warps,
    )
    strides = (key.stride(0), key.stride(1), value.stride(0), value.stride(1), s_scale_h,
               ka.s_blk, ka.s_tok, ka.s_head, ka.s_dgrp, va.s_blk, va.s_tok, va.s_head, va.s_dgrp)
    if cfg.scheme == "head":
        grid = (triton.cdiv(num_tokens, bt), num_heads)
        return _Plan(_write_kv_kernel, grid, (num_tokens, head_dim, block_size, num_slots, *strides), consts,
                     num_slots, s_scale_h, False)
    n_kind = 2 if cfg.kv_split else 1
    n_hgroups = triton.cdiv(num_heads, cfg.heads_per_program)
    consts.update(N_KIND=n_kind, BLOCK_H=cfg.heads_per_program)
    grid = (triton.cdiv(num_tokens, bt) * n_hgroups * n_kind,)
    args = (num_tokens, num_heads, head_dim, block_size, num_slots, n_hgroups, *strides)
    return _Plan(_write_rows_kernel, grid, args, consts, num_slots, s_scale_h, False)


def _cached_plan(key, value, k_cache, v_cache, layout, slot_mapping, k_scale, v_scale, kw, launch=True) -> _Plan:
    """The launch plan of this geometry, from the per-geometry cache or made (and validated) now. ``launch`` is in
    the key: a plan checked for the PyTorch ops (no device guard) is never taken for a launch."""
    metas = (_meta(key), _meta(value), _meta(k_cache), _meta(v_cache), _meta(slot_mapping))
    plan_key = None
    if None not in metas and isinstance(layout, str) and (k_scale is None or isinstance(k_scale, torch.Tensor)) and (
        v_scale is None or isinstance(v_scale, torch.Tensor)
    ):
        plan_key = (layout, *metas, _meta(k_scale) if k_scale is not None else None,
                    _meta(v_scale) if v_scale is not None else None, *kw.values(), launch)
    return _PLANS.get(plan_key, lambda: _make_plan(key, value, k_cache, v_cache, layout, slot_mapping, k_scale,
                                                   v_scale, kw, launch))


def check_write_kv(key, value, k_cache, v_cache, layout, k_scale=None, v_scale=None, *, launch=True) -> None:
    """Raise the ValueError :func:`write_kv` would raise for these tensors, without writing anything.

    Everything but the slot values is checked (shapes, strides, dtypes, devices, scales), so a
    caller can validate before it commits state (the cache checks before it allocates blocks).
    ``launch=False``: the same checks but whether a kernel can run on the tensors' device (a caller writing with
    the PyTorch ops, which run on any device, as a cache with ``ops="torch"`` does).
    """
    slots = torch.empty(key.shape[0] if isinstance(key, torch.Tensor) and key.dim() else 0, dtype=torch.int64,
                        device=k_cache.device if isinstance(k_cache, torch.Tensor) else None)
    _cached_plan(key, value, k_cache, v_cache, layout, slots, k_scale, v_scale, dict.fromkeys(_WRITE_KEYWORDS),
                 launch)


_WRITE_KEYWORDS = ("scheme", "tokens_per_program", "num_warps", "heads_per_program", "kv_split", "quant_math")


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    layout: Layout | str,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    *,
    tokens_per_program: int | None = None,
    num_warps: int | None = None,
    scheme: str | None = None,
    heads_per_program: int | None = None,
    kv_split: bool | None = None,
    quant_math: str | None = None,
    quant=None,
    nonfinite: torch.Tensor | None = None,
    validate: bool = True,
) -> None:
    """Write new tokens' K and V into one layer's paged cache, in place.

    Args:
        key: ``[T, H, D]`` fp32/fp16/bf16, any token/head strides, unit stride in ``D``.
        value: ``[T, H, D]``, like ``key``.
        k_cache: one layer's K cache in ``layout`` (``workbench.core.layout``; padded block strides are fine).
        v_cache: one layer's V cache, same dtype, blocks and block size as ``k_cache``.
        layout: ``"nhd"``, ``"hnd"`` or ``"vllm"``.
        slot_mapping: ``[T]`` int32/int64, ``block * block_size + offset``; ``-1`` skips the token.
        k_scale: fp32, one element or ``[H]``: required for fp8/int8 caches, rejected otherwise.
        v_scale: like ``k_scale``, for V.
        tokens_per_program: tokens each program writes (power of two).
        num_warps: warps per program (power of two).
        scheme: ``"head"`` (one head x ``tokens_per_program`` tokens, K and V, per program) or ``"rows"``
            (``heads_per_program`` heads x ``tokens_per_program`` tokens, all loads before the stores);
            see the module docstring.
        heads_per_program: ``"rows"`` only: heads per program, a power of two (default: all heads).
        kv_split: ``"rows"`` only: K and V in separate programs (twice the programs, half the tile each).
        quant_math: fp8/int8 caches: ``"exact"``, ``"cast"`` or ``"rcp"`` (module docstring).
        quant: a ``workbench.quant`` scheme (name or object) whose scales are computed on write and stored in the
            blocks (``"fp8_e4m3/token"``, ``"int8_asym/token"``, ``"int4/kivi"``, ...; ``kernels/write/dynamic.py``);
            ``k_scale``/``v_scale`` must then be None. Static and plain schemes need not be named (the dtype says).
        nonfinite: int32 ``[1]`` counter of NaN/Inf inputs (dynamic schemes), added to on the device; without
            it a validated call warns when it saw any.
        validate: check that every slot is ``-1`` or inside the cache (one device sync). Skipped while a
            CUDA graph is being captured. The kernel never writes an out-of-range slot either way.

    Keywords left ``None`` come from :data:`PREFILL_DEFAULTS` (prefill-sized batches) and then the
    scheme's heuristic (:func:`default_launch`, :func:`rows_launch`); :func:`launch_config` resolves them.
    Validation of shapes and the launch choice are cached per geometry, so a repeated call costs a
    dictionary lookup on the host; with ``validate=False`` the call does no device work besides the kernel.
    """
    kw = dict(scheme=scheme, tokens_per_program=tokens_per_program, num_warps=num_warps,
              heads_per_program=heads_per_program, kv_split=kv_split, quant_math=quant_math)
    qs = _dynamic_scheme(k_cache, quant)
    if qs is not None:
        _write_dynamic(key, value, k_cache, v_cache, layout, slot_mapping, k_scale, v_scale, qs, nonfinite, validate,
                       tokens_per_program, num_warps)
        return
    plan, launches = _static_launches(key, value, k_cache, v_cache, layout, slot_mapping, k_scale, v_scale, kw)
    if validate:
        _check_slot_values(slot_mapping, plan.num_slots, k_cache)
    for launch in launches:
        launch()


def write_launches(key, value, k_cache, v_cache, layout, slot_mapping, k_scale=None, v_scale=None, *,
                   quant=None, nonfinite=None, launch: bool = True, **kw) -> list[Launch]:
    """The kernel launches :func:`write_kv` makes for these arguments, checked as it checks them (slot values
    aside) but not made: for tools that compile them ahead of time (``workbench.bench.anatomy --kernel write``).
    ``kw``: write_kv's launch keywords; ``launch``: as in :func:`check_write_kv`. A dynamic scheme's launches count
    non-finite inputs into ``nonfinite`` (a fresh counter when None)."""
    unknown = set(kw) - set(_WRITE_KEYWORDS)
    if unknown:
        raise ValueError(f"write_launches takes write_kv's launch keywords {_WRITE_KEYWORDS}, got {sorted(unknown)}")
    kw = {k: kw.get(k) for k in _WRITE_KEYWORDS}
    qs = _dynamic_scheme(k_cache, quant)
    if qs is None:
        return _static_launches(key, value, k_cache, v_cache, layout, slot_mapping, k_scale, v_scale, kw, launch)[1]
    block_size, num_blocks = _dynamic_checks(key, value, k_cache, v_cache, layout, slot_mapping, k_scale, v_scale, qs,
                                             nonfinite, launch)
    counter = nonfinite if nonfinite is not None else torch.zeros(1, dtype=torch.int32, device=k_cache.device)
    return dynamic_launches(key, value, k_cache, v_cache, Layout.parse(layout), slot_mapping, qs, block_size,
                            num_blocks, counter, kw["tokens_per_program"], kw["num_warps"])


def write_kv_blocks(k_src: torch.Tensor, v_src: torch.Tensor, src_layout: Layout | str, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, layout: Layout | str, *, quant, nonfinite: torch.Tensor | None = None) -> None:
    """Every slot of ``nb`` blocks of values into the same slot of ``nb`` blocks of ``quant``'s codes and scales, in
    one pass: the write kernels read the source blocks where they lie (two strides a token: block and slot) and
    store their NaN/Inf as 0, counted into ``nonfinite``. The codes are :func:`write_kv`'s of the blocks' values
    with NaN/Inf as 0, byte for byte. A tier's demotion of a cast device's blocks is this
    (``workbench.tiers.formats.encode``): the device bytes read once, no values tensor in between.

    Args:
        k_src: ``nb`` blocks of K values ``[nb, *block_shape]`` in ``src_layout``, fp32/fp16/bf16, any strides (a
            block view: ``workbench.core.layout.block_view``).
        v_src: V's, like ``k_src``.
        src_layout: ``"nhd"``, ``"hnd"`` or ``"vllm"``.
        k_cache: ``nb`` blocks of the sources' block size in ``layout``, with room for ``quant``'s scales.
        v_cache: V's, like ``k_cache``.
        layout: the caches' layout.
        quant: a scheme whose scales are computed on write (token or groups family), of ``k_cache``'s dtype.
        nonfinite: int32 ``[1]`` on the caches' device, added to on the device (no sync).

    Raises ValueError naming the argument for a bad one, before anything is written.
    """
    try:
        src_layout = Layout.parse(src_layout)
    except ValueError:
        raise ValueError(f"src_layout must be one of {', '.join(m.value for m in Layout)}, got {src_layout!r}") from None
    rows, nb, bs = _source_rows(k_src, v_src, src_layout)
    if not isinstance(k_cache, torch.Tensor):
        raise ValueError(f"k_cache must be a tensor, got {type(k_cache).__name__}")
    qs = _dynamic_scheme(k_cache, quant)
    if qs is None:
        raise ValueError(f"quant must be a scheme whose scales are computed on write (token or groups family), got "
                         f"{quant!r}")
    layout = Layout.parse(layout)
    slots = torch.arange(rows.shape[0], dtype=torch.int64, device=k_cache.device)  # slot i of the source: slot i
    block_size, num_blocks = _checked_shapes(rows, rows, k_cache, v_cache, layout, slots, qs.code_dim(rows.shape[2]),
                                             names=("k_src", "v_src"))
    if (num_blocks, block_size) != (nb, bs):
        raise ValueError(f"k_cache must hold the sources' {nb} blocks of {bs} tokens, got {num_blocks} of {block_size}")
    if bs % qs.write_group:
        raise ValueError(f"{qs.name} quantizes keys over groups of {qs.write_group} tokens, which blocks of {bs} do not "
                         f"tile")
    check_dynamic(qs, rows, k_cache, v_cache, layout, block_size)
    _check_counter(nonfinite, k_cache)
    counter = nonfinite if nonfinite is not None else torch.zeros(1, dtype=torch.int32, device=k_cache.device)
    sources = (blocks_source(k_src, src_layout, "k", rows.shape[2]), blocks_source(v_src, src_layout, "v", rows.shape[2]))
    for launch in dynamic_launches(rows, rows, k_cache, v_cache, layout, slots, qs, block_size, num_blocks, counter,
                                   sources=sources):
        launch()


def _source_rows(k_src, v_src, layout: Layout) -> tuple[torch.Tensor, int, int]:
    """Check :func:`write_kv_blocks`'s sources; ``(rows, nb, block_size)``, ``rows`` a ``[nb * block_size, H, D]``
    tensor of their dtype and device, one row of memory expanded: the shape that ``write_kv``'s checks and the
    launches read (never its values)."""
    geometry = []
    for name, t, kind in (("k_src", k_src, "k"), ("v_src", v_src, "v")):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a tensor of blocks in src_layout, got {type(t).__name__}")
        if t.dtype not in SOURCE_DTYPES:
            raise ValueError(f"{name} must be float32, float16 or bfloat16, got {t.dtype}")
        want = 5 if (layout is Layout.VLLM and kind == "k") else 4
        if t.dim() != want:
            raise ValueError(f"{name} must be a {want}-D {layout.value} block view, got shape {tuple(t.shape)}")
        geometry.append(_cache_geometry(t, layout, kind))
    if v_src.dtype != k_src.dtype:
        raise ValueError(f"v_src must have k_src's dtype {k_src.dtype}, got {v_src.dtype}")
    if geometry[1] != geometry[0]:
        raise ValueError(f"v_src must have k_src's (blocks, block size, heads, head_dim) {geometry[0]}, got "
                         f"{geometry[1]}")
    if layout is Layout.VLLM and k_src.shape[4] != split_x(k_src.element_size()):  # a kernel's plane: whole groups
        raise ValueError(f"k_src must hold groups of {split_x(k_src.element_size())} channels (16 bytes, the vllm key "
                         f"layout), got {k_src.shape[4]}")
    nb, bs, h, d = geometry[0]
    return k_src.new_empty(d).expand(nb * bs, h, d), nb, bs


def _dynamic_scheme(k_cache, quant):
    """The scheme whose scales ``write_kv`` computes on write for this cache (``quant`` named, or a uint8 cache),
    else None (plain and static writes: the dtype says)."""
    if isinstance(k_cache, torch.Tensor) and (quant is not None or k_cache.dtype == torch.uint8):
        qs = common.scheme_of(k_cache.dtype, quant)
        if qs.scales_on_write:
            return qs
    return None


def _static_launches(key, value, k_cache, v_cache, layout, slot_mapping, k_scale, v_scale, kw, launch=True):
    """``(plan, launches)`` of a plain or static-scale write (one launch, none when there is nothing to write)."""
    plan = _cached_plan(key, value, k_cache, v_cache, layout, slot_mapping, k_scale, v_scale, kw, launch)
    if plan.empty:
        return plan, []
    if plan.consts["QUANT"] == QUANT_NONE:
        k_scale, v_scale = k_cache, v_cache  # placeholders: never read
    args = (key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale, *plan.args)
    return plan, [Launch(plan.kernel, plan.grid, args, plan.consts)]


def check_dynamic_write(key, value, k_cache, v_cache, layout, slot_mapping, scheme, *, launch=True) -> tuple[int, int]:
    """Every host-side check of a dynamic-scheme write; ``(block_size, num_blocks)``. ``launch``: as in
    :func:`check_write_kv`."""
    layout = Layout.parse(layout)
    code_dim = qblocks.code_dim(scheme, key.shape[2]) if isinstance(key, torch.Tensor) and key.dim() == 3 else None
    block_size, num_blocks = _checked_shapes(key, value, k_cache, v_cache, layout, slot_mapping, code_dim, launch)
    check_dynamic(scheme, key, k_cache, v_cache, layout, block_size)
    return block_size, num_blocks


def _dynamic_checks(key, value, k_cache, v_cache, layout, slot_mapping, k_scale, v_scale, scheme, nonfinite,
                    launch=True) -> tuple[int, int]:
    """The checks of a dynamic-scheme write but the slot values; ``(block_size, num_blocks)``."""
    for name, sc in (("k_scale", k_scale), ("v_scale", v_scale)):
        if sc is not None:
            raise ValueError(f"{name} must be None for {scheme.name}: its scales are computed on write")
    _check_counter(nonfinite, k_cache)
    return check_dynamic_write(key, value, k_cache, v_cache, layout, slot_mapping, scheme, launch=launch)


def _check_counter(nonfinite, k_cache) -> None:
    if nonfinite is not None and (not isinstance(nonfinite, torch.Tensor) or nonfinite.dtype != torch.int32
                                  or nonfinite.numel() != 1 or nonfinite.device != k_cache.device):
        raise ValueError(f"nonfinite must be an int32 tensor of one element on {k_cache.device}, got "
                         f"{getattr(nonfinite, 'dtype', type(nonfinite).__name__)}")


def _write_dynamic(key, value, k_cache, v_cache, layout, slot_mapping, k_scale, v_scale, scheme, nonfinite, validate,
                   tokens_per_program=None, num_warps=None):
    block_size, num_blocks = _dynamic_checks(key, value, k_cache, v_cache, layout, slot_mapping, k_scale, v_scale,
                                             scheme, nonfinite)
    layout = Layout.parse(layout)
    if validate and _check_slot_values(slot_mapping, num_blocks * block_size, k_cache):
        if scheme.write_group > 1:
            check_group_slots(scheme, slot_mapping, block_size)
        for name, t in (("key", key), ("value", value)):  # finite values the scheme cannot store (NaN is counted)
            scheme.check_input(name, t, allow_nonfinite=True)
    write_dynamic(key, value, k_cache, v_cache, layout, slot_mapping, scheme, block_size, num_blocks, nonfinite,
                  validate, tokens_per_program, num_warps)


def _check_slot_values(slot_mapping, num_slots: int, k_cache) -> bool:
    """Every slot ``-1`` or in ``[0, num_slots)`` (one device sync); False when there was nothing to read (no
    slots, or a CUDA graph being captured)."""
    if not slot_mapping.numel() or (k_cache.is_cuda and torch.cuda.is_current_stream_capturing()):
        return False
    lo, hi = (int(v) for v in torch.aminmax(slot_mapping))
    if lo < -1 or hi >= num_slots:
        raise ValueError(f"slot_mapping values must be -1 or in [0, {num_slots}), got range [{lo}, {hi}]")
    return True
