"""The paged KV cache: K/V tensors for every layer, placed by a :class:`BlockManager`, over the parts of
``workbench.cache`` (storage, ops backend, KIVI's residual, key bounds, exports). What the tiers, eviction and the
model's decoders need is public here (``storage``, ``check_kv``, ``write_layer``, ``residual_state``, ...).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

import workbench
from workbench import quant
from workbench.allocator import BlockManager, BlockPool, Placement
from workbench.allocator.errors import token_ids
from workbench.cache import exports
from workbench.cache.bounds import KeyBounds, filled_blocks, filled_by
from workbench.cache.exports import FlashInferMetadata, VllmMetadata
from workbench.cache.ops import OPS, TorchOps
from workbench.cache.residual import ResidualWindow
from workbench.cache.step import DecodeStep
from workbench.cache.storage import Storage
from workbench.cache.write_checks import check_kv
from workbench.core.layout import Layout


class PagedKVCache:
    """K/V of ``num_layers`` layers in paged storage.

    Args:
        num_layers, num_kv_heads, head_dim: the model's KV shape.
        num_pages: pages of storage.
        page_tokens: token slots per page.
        block_sizes: block sizes a sequence may get (each divides ``page_tokens``); default ``(page_tokens,)``.
        policy: block-size policy (``workbench.allocator.FixedBlockSize`` / ``ByExpectedLength``).
        layout: ``"nhd"``, ``"hnd"`` or ``"vllm"``.
        kv_dtype: how K/V is stored: a ``workbench.quant`` scheme or its name (``"fp16"``, ``"fp8_e4m3/token"``,
            ``"int8_asym/token"``, ``"int4/kivi"``, ...; ``workbench.quant.SCHEMES``), a format name or a torch dtype
            (``"fp8"`` means e4m3 with static scales). Static fp8/int8 schemes need ``k_scale``/``v_scale``
            (``Scheme.calibrate`` computes them); ``token`` and ``group`` schemes compute their scales on write and
            keep them in the blocks (``workbench.quant.blocks``); KIVI keeps each sequence's newest tokens in fp16.
        device: default ``workbench.device()``.
        prefix_caching: reuse cached full blocks of a matching prefix.
        k_scale, v_scale: fp32 dequantization scales of static fp8/int8 schemes, per cache (one value, or one per
            kv head: ``[]``, ``[H]``) or per layer (``[L]``, ``[L, H]``: each layer's writes and decodes read its
            own; ``quant.Calibrator(scheme, num_layers=L)`` gives them), see ``workbench.quant.scale_table``.
        ops: ``"kernels"`` (the Triton kernels: write, copy, paged decode) or ``"torch"`` (their plain PyTorch
            references (``workbench.kernels.<op>.reference``), on the same blocks, tables and scales: fast on a CPU,
            where the kernels run under the Triton interpreter).
        zero_storage: fill the storage with zeros. By default it is ``torch.empty`` (whatever the
            allocator hands out, NaN included): kernels never read an unwritten slot, but a user who
            exports the raw pool (``blocks()``, ``k_cache()``) sees only written slots as defined.
        key_bounds: also keep, per block and kv head, the elementwise min and max of the block's keys as attention reads
            them, for Quest page selection (``workbench.compress.page_selection``; :meth:`key_bounds` per layer; kept
            and costed as ``workbench.cache.bounds`` says). Needs one block size and a scheme whose keys live in the
            blocks (not KIVI's packed groups); a tier below (``workbench.tiers``) is refused, as its swap-ins write
            blocks without recomputing them.

    Every method checks its arguments before it changes anything: a bad argument raises
    ``ValueError`` (or an allocator error) naming it, and the cache is exactly as before.
    """

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, num_pages: int, *,
                 page_tokens: int = 16, block_sizes: Sequence[int] | None = None, policy=None,
                 layout: Layout | str = "nhd", kv_dtype: str | torch.dtype = "fp16", device=None,
                 prefix_caching: bool = True, k_scale: torch.Tensor | None = None,
                 v_scale: torch.Tensor | None = None, zero_storage: bool = False, ops: str = "kernels",
                 key_bounds: bool = False):
        for name, v in (("num_layers", num_layers), ("num_kv_heads", num_kv_heads), ("head_dim", head_dim)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        if ops not in OPS:
            raise ValueError(f"ops must be 'kernels' or 'torch', got {ops!r}")
        if not isinstance(key_bounds, bool):
            raise ValueError(f"key_bounds must be True or False, got {key_bounds!r}")
        self.ops = ops
        self._ops = OPS[ops]  # the backend every write, copy, key-bound refresh and decode goes through
        self.layout = Layout.parse(layout)
        self.scheme = quant.resolve(kv_dtype)  # workbench.quant: codes, scales, residual
        self.format = self.scheme.format  # workbench.core.kv_formats: what the kernels and references ask
        self.dtype = self.format.storage
        self.device = torch.device(device) if device is not None else workbench.device()
        self._ops.check_device(self.device)
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, num_kv_heads, head_dim
        self.manager = BlockManager(BlockPool(num_pages, page_tokens, block_sizes), policy, prefix_caching)
        # the cache's own copy of its static scales, [2, L, S]: each layer reads its row (checked before allocating)
        self._scales = quant.scale_table(self.scheme, k_scale, v_scale, num_layers, num_kv_heads, self.device)
        if key_bounds:
            KeyBounds.check(self.scheme, self.pool_sizes)
        st = self.storage = Storage(self.manager.pool, num_layers, num_kv_heads, head_dim, self.scheme, self.layout,
                                    self.device, zero=zero_storage)
        self.code_dim, self.token_bytes, self.page_bytes, self.page_elems = (st.code_dim, st.token_bytes,
                                                                             st.page_bytes, st.page_elems)
        self.pool = st.pool  # [num_layers, 2, num_pages, page_elems]
        self.device = st.flat.device  # "cuda" -> "cuda:0": the exact device, for comparisons
        # as given (per cache [S], per layer [L, S]), views of the table, on the cache's device
        self.k_scale, self.v_scale = ((self._scales.k_scale, self._scales.v_scale) if self._scales is not None
                                      else (None, None))
        self.nonfinite = torch.zeros(1, dtype=torch.int32, device=self.device)  # NaN/Inf the write kernels saw
        self._window = ResidualWindow()  # KIVI: each sequence's newest tokens, in fp16 outside the blocks
        # Quest's key bounds: only the writes (write_layer) and copy_blocks change them
        self._bounds = KeyBounds(num_layers, self.manager.pool.num_blocks(self.pool_sizes[0]), num_kv_heads,
                                 head_dim, self.device) if key_bounds else None
        self.on_evict = None  # a tier below (workbench.tiers): called with the blocks the allocator evicted

    @property
    def on_evict(self):
        """A tier below (``workbench.tiers``): called with the blocks the allocator evicted."""
        return self._on_evict

    @on_evict.setter
    def on_evict(self, fn) -> None:
        if fn is not None and self._bounds is not None:
            if self.manager.pool.evicted == []:  # TieredCache set this just before: leave the pool as it was
                self.manager.pool.evicted = None
            raise ValueError("a tier below (workbench.tiers) is not supported with key_bounds=True: its swap-ins "
                             "write blocks without recomputing their key bounds")
        self._on_evict = fn

    # ---- geometry (workbench.cache.storage) ------------------------------------------
    @property
    def pool_sizes(self) -> tuple[int, ...]:
        return self.manager.pool.block_sizes

    def block_stride(self, block_size: int) -> int:
        """Elements from one block of this size class to the next (a multiple of 128 bytes)."""
        return self.storage.block_stride(block_size)

    @property
    def padding_bytes(self) -> dict[int, int]:
        """Per size class: bytes of alignment padding per block (K or V plane, one layer; scales not counted)."""
        return self.storage.padding_bytes

    @property
    def total_bytes(self) -> int:
        return self.storage.total_bytes

    def blocks(self, block_size: int) -> torch.Tensor:
        """The pool as ``[num_layers, 2, num_blocks, block_stride]`` for this size class (for block copies)."""
        return self.storage.blocks(block_size)

    def k_cache(self, layer: int, block_size: int | None = None) -> torch.Tensor:
        """Layer ``layer``'s K for one size class, in the cache's layout: ``[num_blocks, *block_shape]``."""
        return self.storage.plane_view(layer, 0, block_size or self.pool_sizes[0])

    def v_cache(self, layer: int, block_size: int | None = None) -> torch.Tensor:
        return self.storage.plane_view(layer, 1, block_size or self.pool_sizes[0])

    # ---- scales --------------------------------------------------------------------
    @property
    def per_layer_scales(self) -> bool:
        """The static scales were given per layer (``[L]`` / ``[L, H]``)."""
        return self._scales is not None and self._scales.per_layer

    def layer_scales(self, layer: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """``(k_scale, v_scale)`` that layer ``layer``'s writes and decodes use, ``[1]`` or ``[H]`` fp32 views
        (``(None, None)`` without static scales): what the kernels take for that layer."""
        if self._scales is None:
            return None, None
        if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < self.num_layers:
            raise ValueError(f"layer must be in [0, {self.num_layers}), got {layer!r}")
        return self._scales.layer(layer)

    def scales(self, layer: int, kind: str, block_size: int | None = None):
        """``(scale, zero)`` views ``[num_blocks, token groups, heads, channel groups]`` of the scales kept in the
        blocks of one layer and kind (``workbench.quant.blocks``); ``(None, None)`` for schemes without any."""
        return self.storage.scales(layer, kind, block_size or self.pool_sizes[0])

    def nonfinite_count(self) -> int:
        """NaN/Inf values the write kernels have seen (a device read)."""
        return int(self.nonfinite)

    # ---- key bounds (workbench.cache.bounds) -------------------------------------------
    @property
    def k_bounds(self) -> torch.Tensor | None:
        """``[num_layers, num_blocks, Hkv, 2, head_dim]`` fp16 (min, max) of each block's keys, or None
        (:class:`~workbench.cache.bounds.KeyBounds`: changed only by this cache's writes and block copies)."""
        return None if self._bounds is None else self._bounds.table

    def key_bounds(self, layer: int) -> torch.Tensor:
        """Layer ``layer``'s key bounds ``[num_blocks, Hkv, 2, head_dim]`` fp16 (``[.., 0, :]`` min, ``[.., 1, :]``
        max of each block's stored keys, rounded outward), for ``workbench.kernels.quest.quest_page_scores``."""
        if self._bounds is None:
            raise ValueError("this cache keeps no key bounds: build it with key_bounds=True")
        if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < self.num_layers:
            raise ValueError(f"layer must be in [0, {self.num_layers}), got {layer!r}")
        return self._bounds.table[layer]

    @property
    def key_bounds_bytes(self) -> int:
        """Bytes of the key bounds (0 without them)."""
        return 0 if self._bounds is None else self._bounds.nbytes

    def refresh_key_bounds(self, seq_ids: Sequence | None = None) -> None:
        """Recompute the key bounds of every block of ``seq_ids`` (default: every live sequence) from the stored
        keys: for code that writes K into blocks by other means than this cache's methods."""
        if self._bounds is None:
            raise ValueError("this cache keeps no key bounds: build it with key_bounds=True")
        ids = list(self.manager.seq_ids) if seq_ids is None else list(seq_ids)
        touched = self._bounds.touched(self.pool_sizes[0], filled_blocks(self.manager, ids))
        for layer in range(self.num_layers):
            self._refresh_bounds(layer, self.pool_sizes[0], touched)

    def written_blocks(self, block_size: int, slots: torch.Tensor):
        """``(blocks, token counts)`` a write of ``slots`` (one slot per block: a decode step) fills, on the device,
        for :meth:`write_layer`'s ``touched``; None without key bounds."""
        return None if self._bounds is None else self._bounds.touched(block_size, slots)

    def _refresh_bounds(self, layer: int, bs: int, touched) -> None:
        self._bounds.refresh(self._ops, self.storage, layer, bs, touched, self.layer_scales(layer)[0])

    # ---- sequence operations -------------------------------------------------------
    def add(self, seq_id, tokens: Sequence[int], k: torch.Tensor, v: torch.Tensor, *,
            expected_len: int | None = None, extra_key: object = None) -> Placement:
        """Start a sequence: ``k``, ``v`` are ``[num_layers, len(tokens), heads, head_dim]``.

        Tokens found in the prefix cache are not written again (their K/V is already there).
        The new full blocks join the prefix cache only once their K/V is written.
        """
        tokens = token_ids("tokens", tokens)
        self.check_kv(k, v, len(tokens))
        cp = self.manager.checkpoint(seq_id)
        placement = self.manager.add(seq_id, tokens, expected_len=expected_len, extra_key=extra_key, publish=False)
        self._write_or_undo(cp, placement, k, v)
        return placement

    def append(self, seq_id, tokens: Sequence[int], k: torch.Tensor, v: torch.Tensor) -> Placement:
        """Append tokens with their K/V (``[num_layers, len(tokens), heads, head_dim]``)."""
        tokens = token_ids("tokens", tokens)
        self.check_kv(k, v, len(tokens))
        cp = self.manager.checkpoint(seq_id)
        placement = self.manager.append(seq_id, tokens, publish=False)
        self._write_or_undo(cp, placement, k, v)
        return placement

    def begin_step(self, seq_ids: Sequence, tokens: Sequence[int]) -> DecodeStep:
        """Reserve a slot for one new token of each sequence and return the :class:`~workbench.cache.step.DecodeStep`
        that writes and attends layer by layer; nothing is published until it commits."""
        return DecodeStep(self, seq_ids, tokens)

    def append_batch(self, seq_ids: Sequence, tokens: Sequence[int], k: torch.Tensor,
                     v: torch.Tensor) -> list[Placement]:
        """One new token for each of ``seq_ids`` (a decode step): ``k``, ``v`` ``[num_layers, B, heads, head_dim]``.

        All or nothing: the sequences' slots are reserved together (copy-on-write copies included), then each
        layer is written by one kernel launch for the whole batch; if any sequence is refused (out of blocks, an
        unknown id, bad K/V) no sequence has changed. KIVI schemes (an fp16 residual per sequence) append sequence
        by sequence after the same checks: each append is whole, and one refused for lack of blocks leaves the
        sequences after it untouched."""
        seq_ids = list(seq_ids) if isinstance(seq_ids, Sequence) and not isinstance(seq_ids, (str, bytes)) else None
        if not seq_ids:
            raise ValueError("seq_ids must be a non-empty list of distinct sequence ids")
        self.check_kv(k, v, len(seq_ids))
        if self.scheme.keeps_residual:
            tokens = token_ids("tokens", tokens)
            if len(tokens) != len(seq_ids):
                raise ValueError(f"tokens must hold one token per sequence ({len(seq_ids)}), got {len(tokens)}")
            exports.batch_block_size(self.manager, seq_ids)
            pairs = enumerate(zip(seq_ids, tokens, strict=True))
            return [self.append(s, [t], k[:, i:i + 1], v[:, i:i + 1]) for i, (s, t) in pairs]
        with self.begin_step(seq_ids, tokens) as step:
            self._write_layers(step.block_size, step.slots, k, v)
        return step.placements

    def fork(self, parent_id, child_id) -> None:
        self.manager.fork(parent_id, child_id)
        self._window.fork(parent_id, child_id)

    def free(self, seq_id, *, observe: bool = True) -> None:
        """Release the sequence (``observe=False``: not finished, the block-size policy does not learn from it)."""
        self.manager.free(seq_id, observe=observe)
        self._window.drop(seq_id)

    # ---- KIVI's fp16 residual (workbench.cache.residual) -------------------------------
    def quantized_tokens(self, seq_id) -> int:
        """Tokens of the sequence stored in its blocks (all of them but a KIVI scheme's fp16 residual)."""
        return self._window.in_blocks(seq_id, self.manager.num_tokens(seq_id))

    def residual(self, seq_id) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The sequence's newest tokens kept in fp16 (KIVI), ``(k, v)`` ``[num_layers, n, heads, head_dim]``."""
        self.manager.num_tokens(seq_id)  # validates seq_id
        return self._window.get(seq_id)

    def residual_state(self, seq_id) -> tuple[int | None, tuple[torch.Tensor, torch.Tensor] | None]:
        """``(tokens in the blocks, fp16 residual)`` as recorded for the sequence (None: not recorded, as for schemes
        without a residual): what a tier below keeps while it is swapped out (:meth:`set_residual_state`)."""
        self.manager.num_tokens(seq_id)  # validates seq_id
        return self._window.state(seq_id)

    def set_residual_state(self, seq_id, quantized: int | None,
                           residual: tuple[torch.Tensor, torch.Tensor] | None) -> None:
        """Record the sequence's :meth:`residual_state` (a swap-in, an eviction); None forgets one of them."""
        self.manager.num_tokens(seq_id)  # validates seq_id
        self._window.set(seq_id, quantized, residual)

    # ---- block copies and evictions --------------------------------------------------
    def copy_blocks(self, block_size: int, pairs: Sequence[tuple[int, int]]) -> None:
        """Copy blocks ``src -> dst`` of one size class, in every layer, K and V (the kernel checks the ids)."""
        self.manager.pool.num_blocks(block_size)  # validates block_size
        self.flush_evictions()  # every write into newly allocated blocks starts here: their old bytes go down first
        pairs = list(pairs)
        if not pairs:
            return
        src = torch.tensor([s for s, _ in pairs], dtype=torch.int64, device=self.device)
        dst = torch.tensor([d for _, d in pairs], dtype=torch.int64, device=self.device)
        self._ops.copy_blocks(self.storage, block_size, src, dst)
        if self._bounds is not None:  # the bounds travel with their block (copy-on-write, compaction's moves)
            self._bounds.copy(src, dst)

    def flush_evictions(self) -> None:
        """Hand the prefix blocks the allocator just evicted to :attr:`on_evict` (a tier below copies them down),
        before anything overwrites them; without a listener they are forgotten, as before."""
        evicted = self.manager.pool.evicted
        if evicted:
            batch = list(evicted)
            evicted.clear()
            if self.on_evict is not None:
                self.on_evict(batch)

    # ---- reads ---------------------------------------------------------------------
    def gather(self, seq_id) -> tuple[torch.Tensor, torch.Tensor]:
        """A sequence's K and V, contiguous: each ``[num_layers, num_tokens, heads, head_dim]``."""
        bs = self.manager.block_size(seq_id)
        return exports.gather_kv(self.storage, bs, self.manager.block_table(seq_id), self.manager.num_tokens(seq_id))

    def read(self, seq_id) -> tuple[torch.Tensor, torch.Tensor]:
        """A sequence's K and V as attention reads them, fp32 ``[num_layers, num_tokens, heads, head_dim]``:
        codes dequantized with the blocks' (or the static) scales, then the fp16 residual (PyTorch, for checks)."""
        bs = self.manager.block_size(seq_id)
        return exports.read_kv(self.storage, self.layer_scales, bs, self.manager.block_table(seq_id),
                               self.quantized_tokens(seq_id), self._window.get(seq_id))

    def read_prefix(self, tokens: Sequence[int], *, expected_len: int | None = None,
                    extra_key: object = None) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of the longest cached prefix of ``tokens`` that :meth:`add` would reuse, as attention reads
        them (fp32 ``[num_layers, hit tokens, heads, head_dim]``; zero tokens on a miss). Changes nothing: a
        runner attends over these and computes only the rest of the prompt, then calls :meth:`add`."""
        bs, hits = self.manager.cached_prefix(tokens, expected_len=expected_len, extra_key=extra_key)
        return exports.read_kv(self.storage, self.layer_scales, bs, hits, len(hits) * bs, None)

    # ---- decode --------------------------------------------------------------------
    def decode(self, q: torch.Tensor, seq_ids: Sequence, layer: int, *, sm_scale: float | None = None,
               return_lse: bool = False, **launch) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Decode attention of one query token per sequence over layer ``layer``: ``q`` ``[B, Hq, head_dim]`` ->
        ``[B, Hq, head_dim]``. The paged decode kernel reads the blocks (dequantizing inside its loop); a KIVI
        scheme's fp16 residual is attended by the same kernel and merged by log-sum-exp. ``return_lse``: also
        each head's log-sum-exp ``[B, Hq]`` (fp32, base 2), to merge with attention over other keys."""
        meta = self.vllm_metadata(seq_ids)
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"layer must be in [0, {self.num_layers}), got {layer}")
        bs = meta.block_size
        k_cache, v_cache = self.k_cache(layer, bs), self.v_cache(layer, bs)
        residuals = [None if r is None else (r[0][layer], r[1][layer]) for r in map(self._window.get, seq_ids)]
        lens = meta.seq_lens  # without a residual every token is in the blocks
        if any(r is not None for r in residuals):
            lens = torch.tensor([self.quantized_tokens(s) for s in seq_ids], dtype=torch.int32, device=self.device)
        k_scale, v_scale = self.layer_scales(layer)
        return self._ops.decode(self.storage, q, k_cache, v_cache, meta.block_table, lens, residuals,
                                k_scale=k_scale, v_scale=v_scale, sm_scale=sm_scale, return_lse=return_lse,
                                launch=launch)

    def decode_torch(self, q: torch.Tensor, layer: int, block_size: int, block_table: torch.Tensor,
                     seq_lens: torch.Tensor, *, sm_scale: float | None = None, residual=None):
        """The paged decode in PyTorch, whatever the cache's ``ops``: ``(out [B, Hq, D] fp32, lse [B, Hq] base 2)``."""
        k_scale, v_scale = self.layer_scales(layer)
        return TorchOps.attend(self.storage, q, self.k_cache(layer, block_size), self.v_cache(layer, block_size),
                               block_table, seq_lens, k_scale=k_scale, v_scale=v_scale, sm_scale=sm_scale,
                               residuals=residual)

    def decode_plan(self, block_table: torch.Tensor, seq_lens: torch.Tensor, layer: int, block_size: int, *,
                    num_q_heads: int, q_dtype: torch.dtype, max_seq_len: int | None = None,
                    sm_scale: float | None = None, shared_prefix: str = "off", ref_counts=None, **launch):
        """A batch's decode plan by the cache's ops, made on layer ``layer``'s views and scales, then run per layer:
        ``plan.run(q, k_cache, v_cache, k_scale=, v_scale=)`` (``workbench.cache.ops``: ``KernelOps.plan``)."""
        k_scale, v_scale = self.layer_scales(layer)
        return self._ops.plan(self.storage, block_table, seq_lens, k_cache=self.k_cache(layer, block_size),
                              v_cache=self.v_cache(layer, block_size), num_q_heads=num_q_heads, q_dtype=q_dtype,
                              max_seq_len=max_seq_len, k_scale=k_scale, v_scale=v_scale, sm_scale=sm_scale,
                              shared_prefix=shared_prefix, ref_counts=ref_counts, launch=launch)

    # ---- exports (workbench.cache.exports) ---------------------------------------------
    def vllm_metadata(self, seq_ids: Sequence, *, pad_blocks: int = 0) -> VllmMetadata:
        """Block table and lengths (``pad_blocks``: zero columns on the right, see ``exports.vllm_metadata``)."""
        return exports.vllm_metadata(self.manager, seq_ids, self.device, pad_blocks)

    def slot_mapping(self, seq_id, start: int = 0, end: int | None = None) -> torch.Tensor:
        """vLLM's ``slot_mapping`` (int32, ``block * block_size + offset``) for tokens ``start:end``."""
        return torch.tensor(self.manager.slot_mapping(seq_id, start, end), dtype=torch.int32, device=self.device)

    def flashinfer_metadata(self, seq_ids: Sequence) -> FlashInferMetadata:
        return exports.flashinfer_metadata(self.manager, seq_ids, self.device)

    # ---- writes --------------------------------------------------------------------
    def check_kv(self, k: torch.Tensor, v: torch.Tensor, num_tokens: int, layers: int | None = None) -> None:
        """Everything the write kernel will check, checked now, so nothing fails after the tables change
        (``workbench.cache.write_checks``): ``k``, ``v`` ``[layers or num_layers, num_tokens, heads, head_dim]``."""
        check_kv(self.storage, self._ops.launches, self.layer_scales(0), k, v, num_tokens, layers)

    def write_layer(self, layer: int, block_size: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    touched=None) -> None:
        """K/V ``[T, heads, head_dim]`` of one layer into reserved ``slots`` (int64), then the key bounds of the
        ``touched`` blocks (:meth:`written_blocks`; default one slot per block). Unchecked: see :meth:`check_kv`."""
        k_scale, v_scale = self.layer_scales(layer)
        self._ops.write(self.storage, layer, block_size, slots, k, v, k_scale, v_scale, self.nonfinite)
        if self._bounds is not None:
            self._refresh_bounds(layer, block_size, touched if touched is not None
                                 else self._bounds.touched(block_size, slots))

    def write_staged(self, staged, layer: int, block_size: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     k_scale=None, v_scale=None, nonfinite: torch.Tensor | None = None) -> None:
        """K/V ``[T, heads, head_dim]`` into blocks outside the pool with this cache's ops backend (its kernels or
        their references, as its own writes): ``staged`` has ``scheme``, ``layout`` and ``plane_view(layer, kind,
        block_size)`` (a tier's staging buffer, ``workbench.tiers.formats``). Unchecked."""
        if nonfinite is None:
            nonfinite = torch.zeros(1, dtype=torch.int32, device=k.device)
        self._ops.write(staged, layer, block_size, slots, k, v, k_scale, v_scale, nonfinite)

    def _write_layers(self, bs: int, slot_t: torch.Tensor, src_k: torch.Tensor, src_v: torch.Tensor,
                      touched=None) -> None:
        if touched is None:
            touched = self.written_blocks(bs, slot_t)  # one slot per block (append_batch)
        for layer in range(self.num_layers):
            self.write_layer(layer, bs, slot_t, src_k[layer], src_v[layer], touched)

    def _write_or_undo(self, cp, placement: Placement, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write, then publish the new full blocks; if the write fails anyway, undo the add/append."""
        seq = placement.seq_id
        try:
            written, residual = self._apply(placement, k, v)
        except BaseException:
            self.manager.restore(cp, placement)
            raise
        if self.scheme.keeps_residual:  # only KIVI (int4 / int2 groups) keeps tokens outside the blocks
            self._window.set(seq, written, residual)
        self.manager.publish(seq, upto=written)

    def _apply(self, placement: Placement, k: torch.Tensor, v: torch.Tensor):
        """Copy-on-write copies first, then write the new tokens' K/V through the slot mapping. Returns
        ``(tokens now in the blocks, the new fp16 residual or None)``; changes no Python state."""
        bs, seq = placement.block_size, placement.seq_id
        self.copy_blocks(bs, placement.copies)
        total = self.manager.num_tokens(seq)
        first = placement.first - (total - k.shape[1])  # index into k/v of the first token not yet in the cache
        residual = None
        if self.scheme.keeps_residual:  # KIVI: the oldest whole groups go to the blocks, the newest stay in fp16
            done = self._window.in_blocks(seq, placement.first)  # tokens already in the blocks
            target, src_k, src_v, residual = self._window.pending(self.scheme, seq, k[:, first:], v[:, first:],
                                                                  done, total)
            slots = self.manager.slot_mapping(seq, done, target)
        else:
            target = total
            src_k, src_v = k[:, first:], v[:, first:]
            slots = placement.slots
        if not slots:
            return target, residual
        touched = None if self._bounds is None else self._bounds.touched(bs, filled_by(bs, slots))
        self._write_layers(bs, torch.tensor(slots, dtype=torch.int64, device=self.device), src_k, src_v, touched)
        return target, residual
