"""The paged KV cache: K/V tensors for every layer, placed by a :class:`BlockManager`.

Storage is one buffer per cache, ``pool`` of shape ``[num_layers, 2, num_pages, page_elems]``
(dim 1: 0 = K, 1 = V). A page of ``page_tokens`` token slots is carved into blocks of one
size class; block ``b`` of size class ``bs`` starts at element ``b * block_stride(bs)``
of a layer's K (or V) plane, and :meth:`PagedKVCache.k_cache` views that plane in the
chosen layout (``workbench.layout``) for the kernels.

Alignment: the pool starts on a 128-byte boundary and every block's stride is a multiple
of 128 bytes, so each block begins on its own L2 line / 128-byte transaction boundary.
``page_bytes`` is ``page_tokens * heads * head_dim * elem_size`` rounded up to a multiple
of ``128 * lcm(blocks per page)``; :attr:`PagedKVCache.padding_bytes` says what that costs
(zero for the usual shapes, where a token's K row is already a multiple of 128 bytes).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from workbench import quant
from workbench.allocator import BlockManager, BlockPool, Placement
from workbench.allocator.errors import token_ids
from workbench.layout import Layout, block_shape, block_view
from workbench.quant import blocks as qblocks

ALIGN = 128  # bytes: one L2 line, one full coalesced warp transaction


@dataclass(frozen=True)
class VllmMetadata:
    """vLLM's paged-attention inputs for a batch of sequences (all int32)."""

    block_table: torch.Tensor  # [B, max_blocks + pad_blocks], padded with 0 (a valid id, never read past seq_lens)
    seq_lens: torch.Tensor  # [B]
    block_size: int


@dataclass(frozen=True)
class FlashInferMetadata:
    """FlashInfer's CSR page table for a batch of sequences (all int32)."""

    kv_indptr: torch.Tensor  # [B + 1]
    kv_indices: torch.Tensor  # [nnz] physical pages of every sequence, in order
    kv_last_page_len: torch.Tensor  # [B] tokens in each sequence's last page (1..page_size)
    page_size: int


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
        key_bounds: also keep, per block and kv head, the elementwise min and max of the block's keys (Quest page
            selection, ``workbench.compress.quest``): :meth:`key_bounds` ``[num_blocks, Hkv, 2, head_dim]`` fp16 per
            layer, rounded outward so they stay true bounds, of the keys as attention reads them (dequantized).
            Every write recomputes the bounds of the blocks it touched from the stored keys
            (``workbench.kernels.quest.key_bounds``, one launch per layer after the write kernel), copy-on-write and
            compaction's block moves copy them with the block. Needs one block size and a scheme whose keys live in
            the blocks (not KIVI's packed groups); a tier below (``workbench.tiers``) is refused, as its swap-ins
            write blocks without recomputing them. Costs ``2 * head_dim * 2`` bytes per block, kv head and layer
            (1/16 of the K+V of 16-token fp16 blocks).

    Every method checks its arguments before it changes anything: a bad argument raises
    ``ValueError`` (or an allocator error) naming it, and the cache is exactly as before.
    """

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, num_pages: int, *,
                 page_tokens: int = 16, block_sizes: Sequence[int] | None = None, policy=None,
                 layout: Layout | str = "nhd", kv_dtype: str | torch.dtype = "fp16", device=None,
                 prefix_caching: bool = True, k_scale: torch.Tensor | None = None,
                 v_scale: torch.Tensor | None = None, zero_storage: bool = False, ops: str = "kernels",
                 key_bounds: bool = False):
        import workbench
        from workbench.kernels.common import check_kernel_shape

        for name, v in (("num_layers", num_layers), ("num_kv_heads", num_kv_heads), ("head_dim", head_dim)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        if ops not in ("kernels", "torch"):
            raise ValueError(f"ops must be 'kernels' or 'torch', got {ops!r}")
        if not isinstance(key_bounds, bool):
            raise ValueError(f"key_bounds must be True or False, got {key_bounds!r}")
        self.ops = ops
        self.layout = Layout.parse(layout)
        self.scheme = quant.resolve(kv_dtype)  # workbench.quant: codes, scales, residual
        self.format = self.scheme.format  # workbench.formats: what the kernels and references ask
        self.dtype = self.format.storage
        self.device = torch.device(device) if device is not None else workbench.device()
        if ops == "kernels":  # every kernel this cache launches reads its pool: refused here, not inside Triton
            from workbench.backend import check_kernel_devices

            check_kernel_devices(f"ops='kernels' with device={self.device}", device=self.device)
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, num_kv_heads, head_dim
        self.manager = BlockManager(BlockPool(num_pages, page_tokens, block_sizes), policy, prefix_caching)
        # the cache's own copy of its static scales, [2, L, S]: each layer reads its row (checked before allocating)
        self._scales = quant.scale_table(self.scheme, k_scale, v_scale, num_layers, num_kv_heads, self.device)
        if key_bounds and len(self.pool_sizes) > 1:
            raise ValueError(f"key_bounds=True needs a cache with one block size (a Quest page is a block), got "
                             f"block_sizes {self.pool_sizes}")
        if key_bounds and not self.scheme.supports_key_bounds:
            raise ValueError(f"key_bounds=True is not supported with kv_dtype {self.scheme.name}: its keys are packed "
                             "in groups and its newest tokens live in an fp16 residual outside the blocks")
        elem = self.dtype.itemsize
        self.code_dim = qblocks.code_dim(self.scheme, head_dim)  # elements a row (packed codes: bytes)
        for bs in self.pool_sizes:  # validates the scheme and layout against the shape early, naming both
            try:
                self.scheme.check_shape(num_kv_heads, head_dim)
                check_kernel_shape(self.scheme, head_dim)
                block_shape(self.layout, "k", bs, num_kv_heads, self.code_dim, elem)
                qblocks.block_bytes(self.scheme, bs, num_kv_heads, head_dim)
            except ValueError as e:
                raise ValueError(f"kv_dtype {self.scheme.name} cannot be stored in the {self.layout.value} layout with "
                                 f"{num_kv_heads} heads x {head_dim} dims, block size {bs}: {e}") from None
        self.token_bytes = num_kv_heads * self.code_dim * elem  # one token's K (or V) codes in one layer
        bpp_lcm = math.lcm(*(page_tokens // bs for bs in self.pool_sizes))
        step = ALIGN * bpp_lcm
        need = max(page_tokens // bs * qblocks.block_bytes(self.scheme, bs, num_kv_heads, head_dim)
                   for bs in self.pool_sizes)  # codes and the blocks' scales
        self.page_bytes = -(-need // step) * step
        if self.page_bytes % elem:
            raise ValueError(f"page of {self.page_bytes} bytes is not a whole number of {self.dtype} elements")
        self.page_elems = self.page_bytes // elem
        plane = num_pages * self.page_elems  # one layer's K (or V)
        alloc = torch.zeros if zero_storage else torch.empty
        flat = alloc(num_layers * 2 * plane + ALIGN // elem, dtype=self.dtype, device=self.device)
        self._flat = flat
        self.device = flat.device  # "cuda" -> "cuda:0": the exact device, for comparisons
        # as given (per cache [S], per layer [L, S]), views of the table, on the cache's device
        self.k_scale, self.v_scale = ((self._scales.k_scale, self._scales.v_scale) if self._scales is not None
                                      else (None, None))
        self.nonfinite = torch.zeros(1, dtype=torch.int32, device=self.device)  # NaN/Inf the write kernels saw
        self._quantized: dict = {}  # seq_id -> tokens stored as codes (the rest is the fp16 residual)
        self._residual: dict = {}  # seq_id -> (k, v) [num_layers, n, heads, head_dim] fp16, the newest tokens
        self.on_evict = None  # a tier below (workbench.tiers): called with the blocks the allocator evicted
        self._base = (-flat.data_ptr() % ALIGN) // elem  # first 128-byte aligned element
        self._plane = plane
        self.pool = flat.as_strided((num_layers, 2, num_pages, self.page_elems),
                                    (2 * plane, plane, self.page_elems, 1), self._base)
        # [num_layers, num_blocks, Hkv, 2, head_dim] fp16 (min, max) of each block's keys; only the write paths
        # (_write_layer -> _refresh_bounds) and copy_blocks change it. Unwritten blocks hold the empty bound.
        self.k_bounds: torch.Tensor | None = None
        if key_bounds:
            nb = self.manager.pool.num_blocks(self.pool_sizes[0])
            self.k_bounds = torch.empty((num_layers, nb, num_kv_heads, 2, head_dim), dtype=torch.float16,
                                        device=self.device)
            self.k_bounds[:, :, :, 0] = float("inf")
            self.k_bounds[:, :, :, 1] = float("-inf")

    @property
    def on_evict(self):
        """A tier below (``workbench.tiers``): called with the blocks the allocator evicted."""
        return self._on_evict

    @on_evict.setter
    def on_evict(self, fn) -> None:
        if fn is not None and getattr(self, "k_bounds", None) is not None:
            if self.manager.pool.evicted == []:  # TieredCache set this just before: leave the pool as it was
                self.manager.pool.evicted = None
            raise ValueError("a tier below (workbench.tiers) is not supported with key_bounds=True: its swap-ins "
                             "write blocks without recomputing their key bounds")
        self._on_evict = fn

    # ---- geometry ------------------------------------------------------------------
    @property
    def pool_sizes(self) -> tuple[int, ...]:
        return self.manager.pool.block_sizes

    def block_stride(self, block_size: int) -> int:
        """Elements from one block of this size class to the next (a multiple of 128 bytes)."""
        return self.page_elems // self.manager.pool.blocks_per_page(block_size)

    @property
    def padding_bytes(self) -> dict[int, int]:
        """Per size class: bytes of alignment padding per block (K or V plane, one layer; scales not counted)."""
        return {bs: self.block_stride(bs) * self.dtype.itemsize
                - qblocks.block_bytes(self.scheme, bs, self.num_kv_heads, self.head_dim) for bs in self.pool_sizes}

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
        bs = block_size or self.pool_sizes[0]
        if kind not in ("k", "v"):
            raise ValueError(f"kind must be 'k' or 'v', got {kind!r}")
        sc = qblocks.block_scales(self.scheme, kind, bs, self.num_kv_heads, self.head_dim)
        if sc is None:
            return None, None
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"layer must be in [0, {self.num_layers}), got {layer}")
        return qblocks.scale_views(self.blocks(bs)[layer, "kv".index(kind)], sc)

    def key_bounds(self, layer: int) -> torch.Tensor:
        """Layer ``layer``'s key bounds ``[num_blocks, Hkv, 2, head_dim]`` fp16 (``[.., 0, :]`` min, ``[.., 1, :]``
        max of each block's stored keys, rounded outward), for ``workbench.kernels.quest.quest_page_scores``."""
        if self.k_bounds is None:
            raise ValueError("this cache keeps no key bounds: build it with key_bounds=True")
        if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < self.num_layers:
            raise ValueError(f"layer must be in [0, {self.num_layers}), got {layer!r}")
        return self.k_bounds[layer]

    @property
    def key_bounds_bytes(self) -> int:
        """Bytes of the key bounds (0 without them)."""
        return 0 if self.k_bounds is None else self.k_bounds.numel() * self.k_bounds.element_size()

    def refresh_key_bounds(self, seq_ids: Sequence | None = None) -> None:
        """Recompute the key bounds of every block of ``seq_ids`` (default: every live sequence) from the stored
        keys: for code that writes K into blocks by other means than this cache's methods."""
        if self.k_bounds is None:
            raise ValueError("this cache keeps no key bounds: build it with key_bounds=True")
        ids = list(self.manager.seq_ids) if seq_ids is None else list(seq_ids)
        fill: dict[int, int] = {}
        for s in ids:
            bs, n = self.manager.block_size(s), self.manager.num_tokens(s)
            for i, b in enumerate(self.manager.block_table(s)):
                fill[b] = max(fill.get(b, 0), min(bs, n - i * bs))
        touched = self._touched(self.pool_sizes[0], fill)
        for layer in range(self.num_layers):
            self._refresh_bounds(layer, self.pool_sizes[0], touched)

    def nonfinite_count(self) -> int:
        """NaN/Inf values the write kernels have seen (a device read)."""
        return int(self.nonfinite)

    @property
    def total_bytes(self) -> int:
        return self.pool.numel() * self.dtype.itemsize

    def blocks(self, block_size: int) -> torch.Tensor:
        """The pool as ``[num_layers, 2, num_blocks, block_stride]`` for this size class (for block copies)."""
        stride = self.block_stride(block_size)
        n = self.manager.pool.num_blocks(block_size)
        return self._flat.as_strided((self.num_layers, 2, n, stride), (2 * self._plane, self._plane, stride, 1),
                                     self._base)

    def _plane_view(self, layer: int, kind: int, block_size: int) -> torch.Tensor:
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"layer must be in [0, {self.num_layers}), got {layer}")
        return block_view(self.blocks(block_size)[layer, kind], self.layout, "kv"[kind], block_size,
                          self.num_kv_heads, self.code_dim)

    def k_cache(self, layer: int, block_size: int | None = None) -> torch.Tensor:
        """Layer ``layer``'s K for one size class, in the cache's layout: ``[num_blocks, *block_shape]``."""
        return self._plane_view(layer, 0, block_size or self.pool_sizes[0])

    def v_cache(self, layer: int, block_size: int | None = None) -> torch.Tensor:
        return self._plane_view(layer, 1, block_size or self.pool_sizes[0])

    # ---- sequence operations -------------------------------------------------------
    def add(self, seq_id, tokens: Sequence[int], k: torch.Tensor, v: torch.Tensor, *,
            expected_len: int | None = None, extra_key: object = None) -> Placement:
        """Start a sequence: ``k``, ``v`` are ``[num_layers, len(tokens), heads, head_dim]``.

        Tokens found in the prefix cache are not written again (their K/V is already there).
        The new full blocks join the prefix cache only once their K/V is written.
        """
        tokens = token_ids("tokens", tokens)
        self._check_kv(k, v, len(tokens))
        cp = self.manager.checkpoint(seq_id)
        placement = self.manager.add(seq_id, tokens, expected_len=expected_len, extra_key=extra_key, publish=False)
        self._write_or_undo(cp, placement, k, v)
        return placement

    def append(self, seq_id, tokens: Sequence[int], k: torch.Tensor, v: torch.Tensor) -> Placement:
        """Append tokens with their K/V (``[num_layers, len(tokens), heads, head_dim]``)."""
        tokens = token_ids("tokens", tokens)
        self._check_kv(k, v, len(tokens))
        cp = self.manager.checkpoint(seq_id)
        placement = self.manager.append(seq_id, tokens, publish=False)
        self._write_or_undo(cp, placement, k, v)
        return placement

    def begin_step(self, seq_ids: Sequence, tokens: Sequence[int]):
        """Reserve a slot for one new token of each sequence and return the :class:`~workbench.step.DecodeStep`
        that writes and attends layer by layer (``workbench.step``); nothing is published until it commits."""
        from workbench.step import DecodeStep

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
        self._check_kv(k, v, len(seq_ids))
        if self.scheme.keeps_residual:
            tokens = token_ids("tokens", tokens)
            if len(tokens) != len(seq_ids):
                raise ValueError(f"tokens must hold one token per sequence ({len(seq_ids)}), got {len(tokens)}")
            self._batch(seq_ids)
            pairs = enumerate(zip(seq_ids, tokens, strict=True))
            return [self.append(s, [t], k[:, i:i + 1], v[:, i:i + 1]) for i, (s, t) in pairs]
        with self.begin_step(seq_ids, tokens) as step:
            self._write_layers(step.block_size, step.slots, k, v)
        return step.placements

    def fork(self, parent_id, child_id) -> None:
        self.manager.fork(parent_id, child_id)
        if parent_id in self._quantized:
            self._quantized[child_id] = self._quantized[parent_id]
        if parent_id in self._residual:
            self._residual[child_id] = self._residual[parent_id]  # never written in place: sharing is safe

    def free(self, seq_id) -> None:
        self.manager.free(seq_id)
        self._quantized.pop(seq_id, None)
        self._residual.pop(seq_id, None)

    def quantized_tokens(self, seq_id) -> int:
        """Tokens of the sequence stored in its blocks (all of them but a KIVI scheme's fp16 residual)."""
        n = self.manager.num_tokens(seq_id)
        return self._quantized.get(seq_id, n)

    def residual(self, seq_id) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The sequence's newest tokens kept in fp16 (KIVI), ``(k, v)`` ``[num_layers, n, heads, head_dim]``."""
        self.manager.num_tokens(seq_id)  # validates seq_id
        return self._residual.get(seq_id)

    def copy_blocks(self, block_size: int, pairs: Sequence[tuple[int, int]]) -> None:
        """Copy blocks ``src -> dst`` of one size class, in every layer, K and V (the kernel checks the ids)."""
        from workbench.kernels import copy_blocks

        self.manager.pool.num_blocks(block_size)  # validates block_size
        self.flush_evictions()  # every write into newly allocated blocks starts here: their old bytes go down first
        pairs = list(pairs)
        if not pairs:
            return
        src = torch.tensor([s for s, _ in pairs], dtype=torch.int64, device=self.device)
        dst = torch.tensor([d for _, d in pairs], dtype=torch.int64, device=self.device)
        if self.ops == "torch":
            blocks = self.blocks(block_size)
            blocks[:, :, dst] = blocks[:, :, src]
        else:
            copy_blocks(self.blocks(block_size), src, dst)
        if self.k_bounds is not None:  # the bounds travel with their block (copy-on-write, compaction's moves)
            self.k_bounds[:, dst] = self.k_bounds[:, src]

    def flush_evictions(self) -> None:
        """Hand the prefix blocks the allocator just evicted to :attr:`on_evict` (a tier below copies them down),
        before anything overwrites them; without a listener they are forgotten, as before."""
        evicted = self.manager.pool.evicted
        if evicted:
            batch = list(evicted)
            evicted.clear()
            if self.on_evict is not None:
                self.on_evict(batch)

    def gather(self, seq_id) -> tuple[torch.Tensor, torch.Tensor]:
        """A sequence's K and V, contiguous: each ``[num_layers, num_tokens, heads, head_dim]``."""
        from workbench.kernels import paged_gather

        bs = self.manager.block_size(seq_id)
        table = torch.tensor([self.manager.block_table(seq_id)], dtype=torch.int32, device=self.device)
        if table.shape[1] == 0:
            table = torch.zeros((1, 1), dtype=torch.int32, device=self.device)
        lens = torch.tensor([self.manager.num_tokens(seq_id)], dtype=torch.int32, device=self.device)
        ks = [paged_gather(self.k_cache(layer, bs), self.layout, "k", table, lens) for layer in range(self.num_layers)]
        vs = [paged_gather(self.v_cache(layer, bs), self.layout, "v", table, lens) for layer in range(self.num_layers)]
        return torch.stack(ks), torch.stack(vs)

    def read(self, seq_id) -> tuple[torch.Tensor, torch.Tensor]:
        """A sequence's K and V as attention reads them, fp32 ``[num_layers, num_tokens, heads, head_dim]``:
        codes dequantized with the blocks' (or the static) scales, then the fp16 residual (PyTorch, for checks)."""
        bs = self.manager.block_size(seq_id)
        return self._read_blocks(bs, self.manager.block_table(seq_id), self.quantized_tokens(seq_id),
                                 self._residual.get(seq_id))

    def read_prefix(self, tokens: Sequence[int], *, expected_len: int | None = None,
                    extra_key: object = None) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of the longest cached prefix of ``tokens`` that :meth:`add` would reuse, as attention reads
        them (fp32 ``[num_layers, hit tokens, heads, head_dim]``; zero tokens on a miss). Changes nothing: a
        runner attends over these and computes only the rest of the prompt, then calls :meth:`add`."""
        bs, hits = self.manager.cached_prefix(tokens, expected_len=expected_len, extra_key=extra_key)
        return self._read_blocks(bs, hits, len(hits) * bs, None)

    def _read_blocks(self, bs: int, blocks: list[int], n: int, res) -> tuple[torch.Tensor, torch.Tensor]:
        from workbench.kernels.gather.reference import paged_gather_ref
        from workbench.kernels.write.reference import dequantize_cache_ref

        table = torch.tensor([blocks or [0]], dtype=torch.int32, device=self.device)
        lens = torch.tensor([n], dtype=torch.int32, device=self.device)
        out = []
        for kind, view in (("k", self.k_cache), ("v", self.v_cache)):
            layers = []
            for layer in range(self.num_layers):
                vals = dequantize_cache_ref(self.scheme, view(layer, bs), self.layout, kind, self.head_dim)
                x = paged_gather_ref(vals, "nhd", kind, table, lens)  # [n, H, D]
                scale = self.layer_scales(layer)["kv".index(kind)]
                if scale is not None:
                    x = x * scale.reshape(1, -1, 1)
                layers.append(x)
            x = torch.stack(layers)
            if res is not None:
                x = torch.cat([x, res["kv".index(kind)].float()], 1)
            out.append(x)
        return out[0], out[1]

    def decode(self, q: torch.Tensor, seq_ids: Sequence, layer: int, *, sm_scale: float | None = None,
               return_lse: bool = False, **launch) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Decode attention of one query token per sequence over layer ``layer``: ``q`` ``[B, Hq, head_dim]`` ->
        ``[B, Hq, head_dim]``. The paged decode kernel reads the blocks (dequantizing inside its loop); a KIVI
        scheme's fp16 residual is attended by the same kernel and merged by log-sum-exp. ``return_lse``: also
        each head's log-sum-exp ``[B, Hq]`` (fp32, base 2), to merge with attention over other keys."""
        from workbench.kernels import DecodePlan, merge_state, paged_decode

        meta = self.vllm_metadata(seq_ids)
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"layer must be in [0, {self.num_layers}), got {layer}")
        bs = meta.block_size
        k_cache, v_cache = self.k_cache(layer, bs), self.v_cache(layer, bs)
        if self.ops == "torch":
            residuals = [self._residual.get(s) for s in seq_ids]
            lens = torch.tensor([self.quantized_tokens(s) for s in seq_ids], dtype=torch.int32, device=self.device)
            o, lse = self.decode_torch(q, layer, bs, meta.block_table, lens, sm_scale=sm_scale,
                                       residual=[None if r is None else (r[0][layer], r[1][layer]) for r in residuals])
            return (o.to(q.dtype), lse) if return_lse else o.to(q.dtype)
        kw = dict(quant=self.scheme, sm_scale=sm_scale, **launch)
        if self.scheme.needs_static_scales:
            kw.update(zip(("k_scale", "v_scale"), self.layer_scales(layer), strict=True))
        residuals = [self._residual.get(s) for s in seq_ids]
        if not any(r is not None for r in residuals):
            if not return_lse:
                return paged_decode(q, k_cache, v_cache, self.layout, meta.block_table, meta.seq_lens, **kw)
            plan = DecodePlan(meta.block_table, meta.seq_lens, layout=self.layout, k_cache=k_cache, v_cache=v_cache,
                              num_q_heads=q.shape[1], q_dtype=q.dtype, return_lse=True, **kw)
            return plan.run(q, k_cache, v_cache)
        lens = torch.tensor([self.quantized_tokens(s) for s in seq_ids], dtype=torch.int32, device=self.device)
        plan = DecodePlan(meta.block_table, lens, layout=self.layout, k_cache=k_cache, v_cache=v_cache,
                          num_q_heads=q.shape[1], q_dtype=q.dtype, return_lse=True, **kw)
        o_blocks, s_blocks = plan.run(q, k_cache, v_cache)
        width = max(r[0].shape[1] if r is not None else 0 for r in residuals)
        B = len(seq_ids)
        rk = torch.zeros((B, width, self.num_kv_heads, self.head_dim), dtype=q.dtype, device=self.device)
        rv = torch.zeros_like(rk)
        for i, r in enumerate(residuals):
            if r is not None:
                rk[i, :r[0].shape[1]] = r[0][layer]
                rv[i, :r[1].shape[1]] = r[1][layer]
        r_lens = torch.tensor([r[0].shape[1] if r is not None else 0 for r in residuals], dtype=torch.int32,
                              device=self.device)
        table = torch.arange(B, dtype=torch.int32, device=self.device)[:, None]  # sequence i owns "block" i
        r_plan = DecodePlan(table, r_lens, layout="nhd", k_cache=rk, v_cache=rv, num_q_heads=q.shape[1],
                            q_dtype=q.dtype, return_lse=True, sm_scale=sm_scale, **launch)
        o_res, s_res = r_plan.run(q, rk, rv)
        merged = merge_state(o_blocks, s_blocks, o_res, s_res)
        return merged if return_lse else merged[0]

    # ---- exports -------------------------------------------------------------------
    def _batch(self, seq_ids: Sequence) -> int:
        if isinstance(seq_ids, (str, bytes)) or not isinstance(seq_ids, Sequence) or not seq_ids:
            raise ValueError(f"seq_ids must be a non-empty list of sequence ids, got {seq_ids!r}")
        sizes = {self.manager.block_size(s) for s in seq_ids}
        if len(sizes) > 1:
            raise ValueError(f"seq_ids must share one block size for a single batch, got sizes {sorted(sizes)}")
        return sizes.pop()

    def vllm_metadata(self, seq_ids: Sequence, *, pad_blocks: int = 0) -> VllmMetadata:
        """Block table and lengths; ``pad_blocks`` extra zero columns on the right, as vLLM's own tables
        carry (its unified Triton kernel reads table entries a tile past a sequence's end)."""
        if isinstance(pad_blocks, bool) or not isinstance(pad_blocks, int) or pad_blocks < 0:
            raise ValueError(f"pad_blocks must be an int >= 0, got {pad_blocks!r}")
        bs = self._batch(seq_ids)
        tables = [self.manager.block_table(s) for s in seq_ids]
        width = max(1, max(len(t) for t in tables)) + pad_blocks
        table = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)  # one host->tensor copy
        lens = torch.tensor([self.manager.num_tokens(s) for s in seq_ids], dtype=torch.int32)
        return VllmMetadata(table.to(self.device), lens.to(self.device), bs)

    def slot_mapping(self, seq_id, start: int = 0, end: int | None = None) -> torch.Tensor:
        """vLLM's ``slot_mapping`` (int32, ``block * block_size + offset``) for tokens ``start:end``."""
        return torch.tensor(self.manager.slot_mapping(seq_id, start, end), dtype=torch.int32, device=self.device)

    def flashinfer_metadata(self, seq_ids: Sequence) -> FlashInferMetadata:
        bs = self._batch(seq_ids)
        tables = [self.manager.block_table(s) for s in seq_ids]
        indptr = torch.tensor([0, *torch.tensor([len(t) for t in tables]).cumsum(0).tolist()], dtype=torch.int32)
        indices = torch.tensor([b for t in tables for b in t], dtype=torch.int32)
        last = torch.tensor([(n - 1) % bs + 1 for n in map(self.manager.num_tokens, seq_ids)],
                            dtype=torch.int32)  # 1..page_size: a sequence holds at least one token
        return FlashInferMetadata(indptr.to(self.device), indices.to(self.device), last.to(self.device), bs)

    # ---- internals -----------------------------------------------------------------
    def _check_kv(self, k: torch.Tensor, v: torch.Tensor, num_tokens: int, layers: int | None = None) -> None:
        """Everything the write kernel will check, checked now: nothing may fail after the tables change.
        ``layers``: K/V of that many layers (a decode step writes one at a time), default all."""
        from workbench.kernels import check_write_kv
        from workbench.kernels.write.api import check_dynamic_write
        from workbench.kernels.write.kernel import SOURCE_DTYPES

        want = (self.num_layers if layers is None else layers, num_tokens, self.num_kv_heads, self.head_dim)
        for name, t in (("k", k), ("v", v)):
            if not isinstance(t, torch.Tensor) or tuple(t.shape) != want:
                got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                raise ValueError(f"{name} must be a tensor of shape {want} [layers, tokens, heads, head_dim], "
                                 f"got {got}")
            if t.device != self.device:
                raise ValueError(f"{name} must be on the cache's device {self.device}, got {t.device}")
            if t.dtype not in SOURCE_DTYPES:
                raise ValueError(f"{name} must be float32, float16 or bfloat16, got {t.dtype}")
            if self.head_dim > 1 and t.stride(3) != 1:
                raise ValueError(f"{name} must have unit stride in head_dim (the last dim), got strides {t.stride()}")
            if num_tokens:  # refuses what the scheme cannot store (NaN/Inf, beyond its range) before anything changes
                self.scheme.check_input(name, t)
        if num_tokens:
            bs = self.pool_sizes[0]
            launch = self.ops == "kernels"  # the PyTorch ops write on any device: shapes and dtypes only
            try:
                if self.scheme.scales_on_write:
                    n = self.scheme.write_group if self.scheme.write_group > 1 else num_tokens
                    slots = torch.empty(n, dtype=torch.int64, device=self.device)
                    kk, vv = (t[0, :1].expand(n, -1, -1) for t in (k, v))  # the shape a group write has
                    check_dynamic_write(kk, vv, self.k_cache(0, bs), self.v_cache(0, bs), self.layout, slots,
                                        self.scheme, launch=launch)
                else:
                    check_write_kv(k[0], v[0], self.k_cache(0, bs), self.v_cache(0, bs), self.layout.value,
                                   *self.layer_scales(0), launch=launch)  # every layer's scales have one shape
            except ValueError as e:
                raise ValueError(f"k/v cannot be written to this cache: {e}") from None

    def _write_or_undo(self, cp, placement: Placement, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write, then publish the new full blocks; if the write fails anyway, undo the add/append."""
        seq = placement.seq_id
        try:
            written, residual = self._apply(placement, k, v)
        except BaseException:
            self.manager.restore(cp, placement)
            raise
        if self.scheme.keeps_residual:  # only KIVI (int4 / int2 groups) keeps tokens outside the blocks
            self._quantized[seq] = written
            if residual is None:
                self._residual.pop(seq, None)
            else:
                self._residual[seq] = residual
        self.manager.publish(seq, upto=written)

    def _apply(self, placement: Placement, k: torch.Tensor, v: torch.Tensor):
        """Copy-on-write copies first, then write the new tokens' K/V through the slot mapping. Returns
        ``(tokens now in the blocks, the new fp16 residual or None)``; changes no Python state."""

        bs = placement.block_size
        seq = placement.seq_id
        self.copy_blocks(bs, placement.copies)
        total = self.manager.num_tokens(seq)
        first = placement.first - (total - k.shape[1])  # index into k/v of the first token not yet in the cache
        done = self._quantized.get(seq, placement.first)  # tokens already in the blocks
        residual = None
        if self.scheme.keeps_residual:  # KIVI: the oldest whole groups go to the blocks, the newest stay in fp16
            old = self._residual.get(seq)
            # the fp16 values, saturated at +-65504 (a plain cast made Inf, then NaN groups), as the residual holds
            # them: a token is quantized from the same values whether it waited in the residual or not
            new_k, new_v = quant.to_fp16(k[:, first:]), quant.to_fp16(v[:, first:])
            pend_k = torch.cat([old[0], new_k], 1) if old is not None else new_k  # tokens [done, total)
            pend_v = torch.cat([old[1], new_v], 1) if old is not None else new_v
            target = max(done, self.scheme.quantized_tokens(total))
            n = target - done
            src_k, src_v = pend_k[:, :n], pend_v[:, :n]
            residual = (pend_k[:, n:].contiguous(), pend_v[:, n:].contiguous()) if target < total else None
            slots = self.manager.slot_mapping(seq, done, target)
        else:
            target = total
            src_k, src_v = k[:, first:], v[:, first:]
            slots = placement.slots
        if not slots:
            return target, residual
        touched = None
        if self.k_bounds is not None:
            fill: dict[int, int] = {}
            for s in slots:
                fill[s // bs] = max(fill.get(s // bs, 0), s % bs + 1)
            touched = self._touched(bs, fill)
        self._write_layers(bs, torch.tensor(slots, dtype=torch.int64, device=self.device), src_k, src_v, touched)
        return target, residual

    def _touched(self, bs: int, slots) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The blocks a write fills and their tokens after it, ``(blocks, counts)`` on the device, for the key
        bounds: from ``{block: tokens}`` (host) or from a slot tensor with one slot per block (a decode step: every
        sequence writes its own block; device arithmetic, no sync). None without key bounds."""
        if self.k_bounds is None:
            return None
        if isinstance(slots, torch.Tensor):
            return slots // bs, slots % bs + 1
        pairs = torch.tensor(list(slots.items()), dtype=torch.int64).reshape(-1, 2).T.contiguous().to(self.device)
        return pairs[0], pairs[1]  # one host -> device copy

    def _refresh_bounds(self, layer: int, bs: int, touched) -> None:
        """Recompute layer ``layer``'s key bounds of the ``touched`` blocks from their stored keys."""
        from workbench.kernels.quest import key_bounds
        from workbench.kernels.quest.reference import key_bounds_ref

        blocks, counts = touched
        k_cache = self.k_cache(layer, bs)
        k_scale = self.layer_scales(layer)[0]
        if self.ops == "torch":
            self.k_bounds[layer, blocks] = key_bounds_ref(self.scheme, k_cache, self.layout, self.head_dim, blocks,
                                                          counts, k_scale)
        else:
            key_bounds(k_cache, self.layout, self.k_bounds[layer], blocks, counts, quant=self.scheme, k_scale=k_scale)

    def _write_layers(self, bs: int, slot_t: torch.Tensor, src_k: torch.Tensor, src_v: torch.Tensor,
                      touched=None) -> None:
        if touched is None:
            touched = self._touched(bs, slot_t)  # one slot per block (append_batch)
        for layer in range(self.num_layers):
            self._write_layer(layer, bs, slot_t, src_k[layer], src_v[layer], touched)

    def _write_layer(self, layer: int, bs: int, slot_t: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     touched=None) -> None:
        """K/V ``[T, heads, head_dim]`` of one layer into their slots (checked before: no validation here), then
        the key bounds of the ``touched`` blocks (:meth:`_touched`; default: one slot per block)."""
        from workbench.backend import is_interpreted
        from workbench.kernels import write_kv
        from workbench.kernels.write.config import interpreter_launch
        from workbench.kernels.write.reference import write_cache_ref

        k_cache, v_cache = self.k_cache(layer, bs), self.v_cache(layer, bs)
        k_scale, v_scale = self.layer_scales(layer)
        if self.ops == "torch":
            write_cache_ref(self.scheme, k, v, k_cache, v_cache, self.layout, slot_t, k_scale, v_scale)
        elif self.scheme.scales_on_write:
            write_kv(k, v, k_cache, v_cache, self.layout, slot_t, quant=self.scheme, nonfinite=self.nonfinite,
                     validate=False)
        else:
            launch = interpreter_launch(k.shape[0], bs, self.layout) if is_interpreted() else {}
            write_kv(k, v, k_cache, v_cache, self.layout, slot_t, k_scale=k_scale, v_scale=v_scale,
                     validate=False, **launch)
        if self.k_bounds is not None:
            self._refresh_bounds(layer, bs, touched if touched is not None else self._touched(bs, slot_t))

    def decode_torch(self, q: torch.Tensor, layer: int, block_size: int, block_table: torch.Tensor,
                     seq_lens: torch.Tensor, *, sm_scale: float | None = None,
                     residual=None) -> tuple[torch.Tensor, torch.Tensor]:
        """The paged decode in PyTorch (``ops="torch"``): ``(out [B, Hq, D] fp32, lse [B, Hq] base 2)``."""
        from workbench.kernels.decode.reference import decode_cache_ref

        bs = block_size
        k_scale, v_scale = self.layer_scales(layer)
        return decode_cache_ref(self.scheme, q, self.k_cache(layer, bs), self.v_cache(layer, bs), self.layout,
                                block_table, seq_lens, self.head_dim, k_scale=k_scale, v_scale=v_scale,
                                sm_scale=sm_scale, residual=residual)
