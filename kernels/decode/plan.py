"""A decode plan: built once per step from the batch, run once per layer (FlashInfer's plan / run split).

A decode step runs the same batch (block tables, lengths) through every layer, each layer with its own
queries and K/V caches of one geometry. :class:`DecodePlan` does, once, everything that depends only on
the batch and the caches' format and layout: the argument checks, the block-table check and the read of
the lengths (one device sync, see :func:`~workbench.kernels.validate.table_stats`), the split count and
chunk, the kernel's constexprs and strides, the scale pointers and the split-KV scratch. ``plan.run(q,
k_cache, v_cache, out)`` then only compares metadata with what was planned and launches: no host sync, no
allocation (except ``out`` when not given), so it can be captured in a CUDA graph together with the other
layers of the step. :func:`~workbench.kernels.decode.paged_decode` is plan-then-run in one call.

:func:`merge_states` / :func:`merge_state` merge partial attention outputs by their log-sum-exps (the
split-KV reduction, generalised), the piece a shared-prefix decode (two plans) needs.

Log-sum-exp units: the decode kernel keeps its softmax in ``exp2`` (scores pre-multiplied by
``log2(e)``), so the LSE it writes for a partial is ``s = log2(sum_j exp(sm_scale * q . k_j))``, i.e.
base 2: ``s_base2 = s_natural * log2(e)`` and ``s_natural = s_base2 * ln(2)``. FlashInfer's kernels write
base 2 as well (vLLM's FlashInfer backend merges with ``is_lse_base_on_e=False``; FlashInfer's context
parallel reduce calls base 2 "the default produced by FlashInfer"), while FlashAttention and PyTorch
return natural-log LSEs. :func:`merge_states` reads and writes base 2 by default; ``base=math.e`` takes
and returns natural logs.
"""

from __future__ import annotations

import math

import torch

from workbench.core.layout import Layout

from .. import common
from .. import validate as _validate
from ..launch import PlannedLaunch
from ..validate import capturing
from . import checks as _checks
from . import config as _config
from . import csr
from . import kernel as _kernel
from . import quant as _quant
from .groups import _groups_decode_kernel, planes_launch
from .merge import _merge_states_kernel
from .streams import _streams_decode_kernel, streams_launch, streams_tile

_Q_DTYPES = common.Q_DTYPES
_describe = common.describe


class DecodePlan:
    """Paged decode of one batch, planned once and run per layer.

    Args:
        block_table: ``[B, max_blocks]`` int32, physical block of each logical block (entries past a
            sequence's last block are padding, never read).
        seq_lens: ``[B]`` int32 context lengths.
        layout: ``"nhd"``, ``"hnd"`` or ``"vllm"``: the caches' layout.
        k_cache, v_cache: one layer's K/V caches (any layer: every layer ``run`` is given must have exactly
            their shape, strides, dtype and device).
        num_q_heads: query heads ``Hq`` (a multiple of the caches' kv heads).
        q_dtype: the queries' dtype (fp16, bf16 or fp32); the caches are q's dtype or fp8.
        max_seq_len: ``max(seq_lens)`` if known. Without it the plan reads the lengths (one device sync).
        mean_seq_len: mean length, a hint for the split heuristic (ragged batches).
        num_splits: split-KV chunks per sequence; ``None`` asks :func:`~workbench.kernels.decode.decode_config`.
        k_scale, v_scale: dequantization scales (floats, or fp32 tensors of one value or one per kv head), shared
            by the layers unless ``run`` is given a layer's own (tensors of the planned shape: per-layer scales).
        sm_scale: softmax scale, default ``1 / sqrt(head_dim)``.
        validate: check the used block ids against the caches' blocks and the lengths against the table
            (one reduction and one device sync, shared with the read of the lengths). Skipped while a CUDA graph
            is being captured; ``max_seq_len`` with ``validate=False`` plans without touching the device.
        return_lse: ``run`` also returns each query head's log-sum-exp (base 2, see the module docstring), so two
            plans' results merge with :func:`merge_state` (a shared prefix and the rest). The kernel then always
            writes partials (even for one split) and :func:`merge_states`' kernel combines them.
        **launch: :func:`~workbench.kernels.decode.decode_config` overrides (``BLOCK_N``, ``num_warps``,
            ``num_stages``, ``use_dot``, ``k3d``, ``planes``), as for ``paged_decode``; ``batch_fast=True`` launches the
            programs sequence-fastest (grid ``(B, Hkv, splits)``), so sequences reading the same blocks at once share
            them in L2 (the cascade's tiles of one segment).

    The plan keeps references to ``block_table`` and ``seq_lens`` (no copies): their contents may be updated
    in place between runs (a replayed CUDA graph) as long as they stay valid for the caches and the table
    (``run`` does not check them again) and no length exceeds ``max_seq_len`` by much: the chunk was chosen
    for it (a longer sequence is still right, its last split takes the rest, only slower).

    The scratch for the splits belongs to the plan: runs of one plan must be ordered (one stream), which the
    layers of a step are.
    """

    def __init__(
        self,
        block_table: torch.Tensor,
        seq_lens: torch.Tensor,
        *,
        layout: Layout | str,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        num_q_heads: int,
        q_dtype: torch.dtype,
        max_seq_len: int | None = None,
        mean_seq_len: float | None = None,
        num_splits: int | None = None,
        k_scale: float | torch.Tensor | None = None,
        v_scale: float | torch.Tensor | None = None,
        sm_scale: float | None = None,
        validate: bool = True,
        return_lse: bool = False,
        **launch,
    ) -> None:
        layout = Layout.parse(layout)
        hq, device = _check_heads_and_dtype(num_q_heads, q_dtype, block_table)
        B = block_table.shape[0] if block_table.dim() >= 1 else -1
        hkv, block_size = _checks._check_batch(k_cache, v_cache, layout, block_table, seq_lens, B, hq, q_dtype, device)
        D = _values_head_dim(k_cache, v_cache, layout, q_dtype, device, launch.get("quant"))
        self._setup(layout, block_table, seq_lens, k_cache, v_cache, B, hq, D, hkv, block_size, q_dtype, device,
                    max_seq_len, mean_seq_len, num_splits, k_scale, v_scale, sm_scale, validate, launch,
                    return_lse=return_lse)

    @classmethod
    def from_csr(
        cls,
        kv_indptr: torch.Tensor,
        kv_indices: torch.Tensor,
        kv_last_page_len: torch.Tensor,
        *,
        layout: Layout | str,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        num_q_heads: int,
        q_dtype: torch.dtype,
        max_seq_len: int | None = None,
        validate: bool = True,
        **kwargs,
    ) -> DecodePlan:
        """A plan from FlashInfer's CSR page table: sequence ``b`` holds pages
        ``kv_indices[kv_indptr[b]:kv_indptr[b + 1]]``, the last one ``kv_last_page_len[b]`` tokens full
        (``1..page_size``; a sequence of no pages has length 0 whatever its entry says).

        The table is converted once, on the device, to a padded ``[B, max_pages]`` block table (``plan.block_table``;
        padding 0) and lengths (``plan.seq_lens``). Host syncs as for the padded form: one (``max_pages``, the
        lengths and, with ``validate``, the checks of ``kv_indptr``, ``kv_last_page_len`` and every used page id,
        all read together), none with ``max_seq_len`` given and ``validate=False`` (the table is then
        ``ceil(max_seq_len / page_size)`` wide). Other keyword arguments are :class:`DecodePlan`'s.
        """
        layout = Layout.parse(layout)
        hq, device = _check_heads_and_dtype(num_q_heads, q_dtype, kv_indptr, name="kv_indptr")
        block_size, _, _ = _checks._cache_geometry(k_cache, v_cache, layout, q_dtype, device)
        D = _values_head_dim(k_cache, v_cache, layout, q_dtype, device, kwargs.get("quant"))
        block_table, seq_lens, stats = csr.padded_table(kv_indptr, kv_indices, kv_last_page_len, device, block_size,
                                                        min(k_cache.shape[0], v_cache.shape[0]), max_seq_len, validate)
        B = seq_lens.shape[0]
        plan = object.__new__(cls)
        hkv = _checks._check_batch(k_cache, v_cache, layout, block_table, seq_lens, B, hq, q_dtype, device)[0]
        launch = dict(kwargs)
        plan._setup(layout, block_table, seq_lens, k_cache, v_cache, B, hq, D, hkv, block_size, q_dtype, device,
                    max_seq_len, launch.pop("mean_seq_len", None), launch.pop("num_splits", None),
                    launch.pop("k_scale", None), launch.pop("v_scale", None), launch.pop("sm_scale", None),
                    False, launch, stats=stats, return_lse=launch.pop("return_lse", False))
        return plan

    @classmethod
    def _checked(cls, layout, block_table, seq_lens, k_cache, v_cache, B, Hq, D, hkv, block_size, q_dtype, device,
                 max_seq_len, mean_seq_len, num_splits, k_scale, v_scale, sm_scale, validate, launch,
                 scratch=True) -> DecodePlan:
        """A plan from arguments ``paged_decode`` has checked already (``scratch=False``: none preallocated, each
        ``_launch(..., fresh_scratch=True)`` allocates its own)."""
        plan = object.__new__(cls)
        plan._setup(layout, block_table, seq_lens, k_cache, v_cache, B, Hq, D, hkv, block_size, q_dtype, device,
                    max_seq_len, mean_seq_len, num_splits, k_scale, v_scale, sm_scale, validate, launch,
                    scratch=scratch)
        return plan

    def _setup(self, layout, block_table, seq_lens, k_cache, v_cache, B, Hq, D, hkv, block_size, q_dtype, device,
               max_seq_len, mean_seq_len, num_splits, k_scale, v_scale, sm_scale, validate, launch, stats=None,
               scratch=True, return_lse=False):
        launch = dict(launch)
        scheme = common.scheme_of(k_cache.dtype, launch.pop("quant", None))
        bad = set(launch) - set(_config.LAUNCH_KEYS)
        if bad:
            raise ValueError(f"launch options must be among {_config.LAUNCH_KEYS}, got {sorted(bad)}")
        dq = _quant.decode_quant(scheme, k_cache, v_cache, block_size, hkv, D, k_scale, v_scale, q_dtype,
                                 _config._interpreted())
        launch.update(dq.fixed)  # what the family's codes fix (packed keys are read as [BLOCK_N, bytes] rows)
        if not _config._interpreted():
            for k, v in _quant.launch_defaults(scheme, D).items():
                launch.setdefault(k, v)
        if max_seq_len is not None and max_seq_len < 0:
            raise ValueError(f"max_seq_len must be >= 0, got {max_seq_len}")
        check_ids = validate and not capturing(block_table)
        if stats is None and (max_seq_len is None or check_ids):
            if max_seq_len is None and capturing(block_table):
                raise ValueError("max_seq_len is required while a CUDA graph is being captured (no host reads then)")
            num_blocks = min(k_cache.shape[0], v_cache.shape[0])
            # one device sync: the lengths' min/max/sum and (check_ids) the table's ids
            stats = _validate.table_stats(block_table, seq_lens, block_size, num_blocks, check_ids=check_ids)
        if max_seq_len is None:
            max_seq_len = stats.max
            mean_seq_len = stats.total / B if B else 0.0
        f = dict(layout=layout, batch_size=B, num_q_heads=Hq, num_kv_heads=hkv, head_dim=D, block_size=block_size,
                 q_dtype=q_dtype, kv_dtype=k_cache.dtype, quant=scheme, device=device, max_seq_len=int(max_seq_len),
                 block_table=block_table, seq_lens=seq_lens, return_lse=bool(return_lse), _q_shape=(B, Hq, D),
                 _k_meta=(tuple(k_cache.shape), k_cache.stride()), _v_meta=(tuple(v_cache.shape), v_cache.stride()))
        if B == 0:  # nothing to launch (the launch options are not even looked at, as paged_decode always did)
            f.update(num_splits=1, chunk=0, config={}, _split=False)
            return _fill(self, f)
        interp = _config._interpreted()
        planes = launch.pop("planes", False)  # packed groups: the planes kernel where it applies (groups.py)
        cfg0 = _config.decode_config(B, hkv, Hq // hkv, D, block_size, max(f["max_seq_len"], 1),
                                     kv_dtype=k_cache.dtype, num_sms=0 if interp else _config._num_sms(device),
                                     layout=layout) if planes else None
        streams = launch.pop("streams", None)  # per-token packed codes: streams a tile at most (streams.py)
        bn0 = int(launch.get("BLOCK_N", cfg0["BLOCK_N"])) if planes else 0
        if planes and streams != 0 and "BLOCK_N" not in launch:  # the streams kernel's tile by context
            bn0 = streams_tile(mean_seq_len if mean_seq_len is not None else f["max_seq_len"], f["max_seq_len"])
        pl = streams_launch(dq.constexprs, layout, bn0, Hq // hkv, streams) if planes and streams != 0 else None
        kind = "streams" if pl is not None else "planes"
        if pl is None and planes:
            pl = planes_launch(dq.constexprs, layout, bn0)
        if pl is not None:
            launch.update(BLOCK_N=pl.pop("BLOCK_N"), use_dot=True)
        splits, chunk, geo = _config._launch_params(layout, B, Hq, D, hkv, block_size, q_dtype, k_cache, v_cache,
                                                 f["max_seq_len"], mean_seq_len, num_splits, launch, interp,
                                                 0 if interp else _config._num_sms(device))
        ks_ptr, ks_val = _checks._scale_arg("k_scale", k_scale, device, hkv)
        vs_ptr, vs_val = _checks._scale_arg("v_scale", v_scale, device, hkv)
        s_sc_h = int(any(p is not None and p.numel() > 1 for p in (ks_ptr, vs_ptr)))  # 1: per kv head
        if s_sc_h:  # both through [Hkv] pointers; a per-tensor one is broadcast on the device (no host read)
            ks_ptr, vs_ptr = (p if p is not None and p.numel() > 1 else
                              (p.expand(hkv).contiguous() if p is not None else torch.full((hkv,), val, device=device))
                              for p, val in ((ks_ptr, ks_val), (vs_ptr, vs_val)))
        scale_ptr = ks_ptr is not None or vs_ptr is not None
        if scale_ptr:  # both through pointers: one code path
            ks_ptr = ks_ptr if ks_ptr is not None else torch.full((1,), ks_val, device=device)
            vs_ptr = vs_ptr if vs_ptr is not None else torch.full((1,), vs_val, device=device)
        sm_scale = 1.0 / math.sqrt(D) if sm_scale is None else float(sm_scale)
        ce = geo.constexprs
        split = splits > 1 or f["return_lse"]  # the LSE comes from the partials' merge, even of one split
        batch_fast = bool(launch.get("batch_fast", False))
        f.update(
            num_splits=splits, chunk=chunk, _grid=(B, hkv, splits) if batch_fast else (splits, hkv, B), _split=split,
            config={"BLOCK_N": ce["BLOCK_N"], "num_splits": splits, "num_warps": ce["num_warps"],
                    "num_stages": ce["num_stages"], "use_dot": ce["USE_DOT"], "k3d": ce["K3D"],
                    "kernel": "generic" if pl is None else kind, **({"streams": pl["R"]} if "R" in (pl or {}) else {})},
            _scale_args=(ks_ptr, vs_ptr, ks_val, vs_val) if scale_ptr else (None, None, ks_val, vs_val),
            _qk_scale=sm_scale * _kernel.LOG2E,
            _tail=(block_table.stride(0), *geo.k_strides, *geo.v_strides, chunk, splits),
            _qargs=(s_sc_h, *dq.args[1:]),
            _constexprs=dict(SPLIT=split, SCALE_PTR=scale_ptr, BATCH_FAST=batch_fast, **ce, **dq.constexprs,
                             **(pl or {})),
            _decode_kernel=(_kernel._paged_decode_kernel if pl is None else
                            _streams_decode_kernel if kind == "streams" else _groups_decode_kernel),
        )
        if split:  # the splits' scratch, reused by every run of the plan
            f.update(_o_part=torch.empty((B, Hq, splits, D), dtype=torch.float32, device=device) if scratch else None,
                     _lse=torch.empty((B, Hq, splits), dtype=torch.float32, device=device) if scratch else None,
                     _o_part_shape=(B, Hq, splits, D), _reduce_grid=(Hq, B),
                     _reduce_kw=dict(HEAD_DIM=D, BLOCK_D=geo.block_d, BLOCK_S=common.next_pow2(splits),
                                     num_warps=4))
            if f["return_lse"]:  # the merge of the partials [B, Hq, S, D] / [B, Hq, S] into out and lse
                f.update(_merge_args=(Hq * splits * D, D, splits * D, Hq * splits, 1, splits),
                         _merge_kw=dict(HEAD_DIM=D, BLOCK_D=geo.block_d, BLOCK_S=min(16, common.next_pow2(splits)),
                                        HAS_N=True, N_FROM_LEN=True, num_warps=4))
        # the launches the plan repeats: Triton's per-launch path once (kernels/launch.py)
        f["_launches"] = {"decode": PlannedLaunch(f["_decode_kernel"], f["_constexprs"])}
        if split:
            f["_launches"]["reduce"] = PlannedLaunch(_kernel._decode_reduce_kernel, f["_reduce_kw"])
            if f["return_lse"]:
                f["_launches"]["merge"] = PlannedLaunch(_merge_states_kernel, f["_merge_kw"])
        return _fill(self, f)

    def run(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor | None = None,
            lse: torch.Tensor | None = None, *, k_scale: torch.Tensor | None = None,
            v_scale: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Decode attention of one layer: ``q`` ``[B, Hq, D]`` over ``k_cache``/``v_cache`` (the planned geometry).

        Checks metadata only (shapes, strides, dtypes, devices against the plan; ValueError naming the
        argument), then launches: no host sync, no allocation except ``out`` (and ``lse``) when None, so a whole
        multi-layer step can be captured in one CUDA graph. Returns ``out`` (``[B, Hq, D]``, q's dtype); a plan
        built with ``return_lse=True`` returns ``(out, lse)``, ``lse`` ``[B, Hq]`` fp32 in base 2 (``-inf`` for an
        empty sequence), ready for :func:`merge_state` with another plan's (a shared prefix).

        ``k_scale``, ``v_scale``: this layer's static scales (per-layer scales; each defaults to the planned one), fp32
        tensors of the planned scales' shape (:attr:`scale_shape`) on the plan's device with unit stride, e.g. a
        row view of a ``[L, Hkv]`` table: only their addresses change, so a captured graph holds one per layer."""
        self._check_inputs(q, k_cache, v_cache)
        if out is not None and (not isinstance(out, torch.Tensor) or out.shape != self._q_shape
                                or out.dtype != self.q_dtype or out.device != self.device or out.stride(2) != 1):
            raise ValueError(f"out must be a {self.q_dtype} tensor of shape {self._q_shape} on {self.device} with "
                             f"unit last stride; got {_describe(out)}")
        if lse is not None:
            if not self.return_lse:
                raise ValueError("lse is written only by a plan built with return_lse=True")
            if not isinstance(lse, torch.Tensor) or lse.shape != self._q_shape[:2] or lse.dtype != torch.float32 \
                    or lse.device != self.device:
                raise ValueError(f"lse must be an fp32 tensor of shape {self._q_shape[:2]} on {self.device}; got "
                                 f"{_describe(lse)}")
        scales = self.layer_scales(k_scale, v_scale)
        return self._launch(q, k_cache, v_cache, out, lse=lse, scales=scales)

    def run_partials(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, *,
                     k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None):
        """The decode kernel alone, for a caller that merges its split partials with other states in one launch of
        its own (the shared-prefix cascade): ``(o_part, lse_part)``, the plan's scratch ``[B, Hq, S, D]`` fp32
        (normalized) and ``[B, Hq, S]`` fp32 base-2 log-sum-exps; split ``s`` of row ``b`` is written only where
        ``s < ceil(seq_lens[b] / chunk)`` (:attr:`chunk`, :attr:`num_splits`). A plan built with ``return_lse=True``
        (it keeps its partials); checked as :meth:`run`, overwritten by the plan's next run."""
        if not self.return_lse:
            raise ValueError("run_partials needs a plan built with return_lse=True (its split partials are kept)")
        self._check_inputs(q, k_cache, v_cache)
        scales = self.layer_scales(k_scale, v_scale)
        if self.batch_size:
            _, args, _ = self._decode_call(q, k_cache, v_cache, q, self._o_part, self._lse, scales)
            self._launches["decode"](self._grid, *args)
        return self._o_part, self._lse

    def _check_inputs(self, q, k_cache, v_cache) -> None:
        if not isinstance(q, torch.Tensor) or q.shape != self._q_shape or q.dtype != self.q_dtype \
                or q.device != self.device or q.stride(2) != 1:
            raise ValueError(f"q must be a {self.q_dtype} tensor of shape {self._q_shape} on {self.device} with unit "
                             f"last stride, as planned; got {_describe(q)}")
        for name, cache, (shape, stride) in (("k_cache", k_cache, self._k_meta), ("v_cache", v_cache, self._v_meta)):
            if not isinstance(cache, torch.Tensor) or cache.shape != shape or cache.stride() != stride \
                    or cache.dtype != self.kv_dtype or cache.device != self.device:
                raise ValueError(f"{name} must have the planned geometry: a {self.kv_dtype} tensor of shape {shape}, "
                                 f"strides {stride} on {self.device}; got {_describe(cache)}")

    @property
    def scale_shape(self) -> tuple[int, ...] | None:
        """The shape ``run``'s ``k_scale`` / ``v_scale`` must have (``(1,)`` or ``(Hkv,)``); None: planned without
        scale tensors (no static scales, or floats), so ``run`` takes none."""
        ks_ptr = self._scale_args[0] if self.batch_size else None  # an empty batch plans no scales
        return None if ks_ptr is None else tuple(ks_ptr.shape)

    def layer_scales(self, k_scale=None, v_scale=None) -> tuple | None:
        """``(k_scale, v_scale)`` pointers for a run with a layer's own scales (checked as ``run`` states, naming the
        argument); None when neither is given (the planned ones)."""
        if (k_scale is None and v_scale is None) or not self.batch_size:  # nothing launched for an empty batch
            return None
        want = self.scale_shape
        if want is None:
            raise ValueError("k_scale/v_scale can be given to run only by a plan built with fp32 scale tensors "
                             "(k_scale, v_scale of a static fp8/int8 cache)")
        planned = self._scale_args
        got = []
        for i, (name, sc) in enumerate((("k_scale", k_scale), ("v_scale", v_scale))):
            if sc is None:
                got.append(planned[i])
            elif not isinstance(sc, torch.Tensor) or tuple(sc.shape) != want or sc.dtype != torch.float32 \
                    or sc.device != self.device or (sc.numel() > 1 and sc.stride(0) != 1):
                raise ValueError(f"{name} must be an fp32 tensor of the planned shape {want} on {self.device} with unit "
                                 f"stride (a layer's scales); got {_describe(sc)}")
            else:
                got.append(sc)
        return tuple(got)

    def _launch(self, q, k_cache, v_cache, out, fresh_scratch=False, lse=None, scales=None):
        if out is None:
            out = torch.empty(self._q_shape, dtype=self.q_dtype, device=self.device)
        if self.return_lse and lse is None:
            lse = torch.empty(self._q_shape[:2], dtype=torch.float32, device=self.device)
        if self.batch_size == 0:
            return (out, lse) if self.return_lse else out
        if not self._split:
            o_part = lse_part = out  # unused
        elif fresh_scratch:  # paged_decode: a call's own scratch, as a one-shot call always had
            o_part = torch.empty(self._o_part_shape, dtype=torch.float32, device=self.device)
            lse_part = torch.empty(self._o_part_shape[:3], dtype=torch.float32, device=self.device)
        else:
            o_part, lse_part = self._o_part, self._lse
        _, args, _ = self._decode_call(q, k_cache, v_cache, out, o_part, lse_part, scales)
        self._launches["decode"](self._grid, *args)
        if self.return_lse:
            self._launches["merge"](
                (self.batch_size, self.num_q_heads), o_part, lse_part, self.seq_lens, out, lse, *self._merge_args,
                out.stride(0), out.stride(1), lse.stride(0), lse.stride(1), self.num_splits, 1.0, self.chunk,
            )
            return out, lse
        if self._split:
            self._launches["reduce"](
                self._reduce_grid, o_part, lse_part, self.seq_lens, out, out.stride(0), out.stride(1), self.chunk,
                self.num_splits,
            )
        return out

    def _decode_call(self, q, k_cache, v_cache, out, o_part, lse_part, scales=None):
        ks_ptr, vs_ptr, ks_val, vs_val = self._scale_args
        if scales is not None:  # a layer's own scales, checked by layer_scales
            ks_ptr, vs_ptr = scales
        args = (q, k_cache, v_cache, self.block_table, self.seq_lens, out, o_part, lse_part,
                q if ks_ptr is None else ks_ptr, q if vs_ptr is None else vs_ptr, ks_val, vs_val, self._qk_scale,
                q.stride(0), q.stride(1), out.stride(0), out.stride(1), *self._tail, *self._qargs)
        return self._decode_kernel, args, self._constexprs

    def kernel_call(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor):
        """``(kernel, args, constexprs)``: the decode kernel a run launches and its arguments (scratch included, as
        for a run with ``out=None``), without launching it: for tools that compile it ahead of time and read what it
        costs (``workbench.bench.anatomy``). Launch options (``num_warps``, ``num_stages``) are among the
        constexprs, as Triton takes them."""
        out = torch.empty(self._q_shape, dtype=self.q_dtype, device=self.device)
        o_part = torch.empty(self._o_part_shape, dtype=torch.float32, device=self.device) if self._split else out
        lse_part = torch.empty(self._o_part_shape[:3], dtype=torch.float32, device=self.device) if self._split else out
        return self._decode_call(q, k_cache, v_cache, out, o_part, lse_part)

    def __repr__(self) -> str:
        return (f"DecodePlan({self.layout.value}, B={self.batch_size}, Hq={self.num_q_heads}, Hkv={self.num_kv_heads}, "
                f"D={self.head_dim}, page={self.block_size}, kv={self.kv_dtype}, max_seq_len={self.max_seq_len}, "
                f"splits={self.num_splits}, chunk={self.chunk})")

    def __setattr__(self, name, value):
        raise AttributeError(f"DecodePlan is fixed once planned (setting {name!r}): build a new plan")


def _values_head_dim(k_cache, v_cache, layout, q_dtype, device, quant_arg) -> int:
    """The values' head_dim of caches whose rows hold ``code_dim`` elements (packed codes: fewer)."""
    code_dim = _checks._cache_geometry(k_cache, v_cache, layout, q_dtype, device)[2]
    return _quant.values_head_dim(common.scheme_of(k_cache.dtype, quant_arg), code_dim)


def _fill(plan: DecodePlan, fields: dict) -> None:
    plan.__dict__.update(fields)  # past __setattr__: the one place a plan is written


def _check_heads_and_dtype(num_q_heads, q_dtype, first, name="block_table"):
    if isinstance(num_q_heads, bool) or not isinstance(num_q_heads, int) or num_q_heads < 1:
        raise ValueError(f"num_q_heads must be an int >= 1, got {num_q_heads!r}")
    if q_dtype not in _Q_DTYPES:
        raise ValueError(f"q_dtype must be fp16, bf16 or fp32, got {q_dtype}")
    if not isinstance(first, torch.Tensor):
        raise ValueError(f"{name} must be a tensor, got {type(first).__name__}")
    return num_q_heads, first.device

