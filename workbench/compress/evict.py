"""A policy's dropped tokens applied to a :class:`~workbench.cache.PagedKVCache`: real blocks go back to the pool.

kvpress evicts by masking a dense cache, so nothing is freed. Here a sequence's token set (one for every layer
and head: ``workbench.compress.policies``' ``keep(obs)``) rewrites its block table:

- a block with no kept token leaves the table: one reference dropped (a block shared with a fork or held by the
  prefix cache is released only by this sequence; it is freed when its last holder lets go);
- ``partial="keep"``: a partly dropped block stays whole, its dropped tokens still attended; nothing is copied;
- ``partial="compact"``: exactly the kept tokens remain, packed in order into ``ceil(kept / block_size)`` blocks.
  A whole kept block that lands on a block boundary of the packed order stays where it is (its table entry just
  moves); the other kept tokens are copied, token by token, into blocks taken from the pool. Attention over cached
  post-RoPE keys does not depend on their order, so packing is exact.

Exactness. Bytes are moved, never recomputed: fp32/fp16/bf16 codes are bit-identical after the move, and so are
the codes of every quantized scheme whose scales are per token or static (fp8/int8 per tensor, head or token,
int8_asym, int4/int2 per token: the in-block scales and zero points travel with their token). Refused with a
ValueError: schemes whose scales cover a group of tokens (KIVI's per-channel keys) or that keep an fp16 residual
outside the blocks (``int4/kivi``, ``int2/kivi``): a token cannot leave its group.

Prefix cache. An evicted sequence's tokens are no longer the prefix its K/V was computed with, so the sequence
stops publishing (``BlockManager.stop_publishing``, inherited by forks): no compacted block and no block filled
later by decode ever joins the prefix cache. Blocks published before the eviction keep their keys: their bytes are
never written (a compaction writes only into fresh blocks), so a later prompt that hits them reads exactly the K/V
a prefill of that prefix computes. The leading blocks that kept their place keep their entries too.

Atomicity. The new tables are built on a clone of the allocator (``BlockManager.clone``); bad arguments raise
``ValueError`` naming them and a lack of blocks raises ``OutOfBlocks`` before the cache changes; the K/V is copied
and only then is the clone's state swapped in. Fresh blocks come from the head of the free queue, where the
sequence's released blocks arrive last, so they are reused only when nothing else is free; each (layer, K/V) plane
gathers all of its moved tokens before it writes any, so that reuse is safe. Not undone: cached free blocks the
allocation evicted (handed to a tier below first, as every allocation does).

A cache with Quest key bounds (``key_bounds=True``) gets the bounds of the packed blocks recomputed from their
stored keys (``PagedKVCache.refresh_key_bounds``); kept blocks keep theirs.

Cost: ``"keep"`` copies nothing; ``"compact"`` copies every kept token after the first partly dropped block except
whole blocks that land on a block boundary. A published block is never written in place (its prefix-cache key
would lie), so a packed block is always a fresh one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from workbench.allocator import OutOfBlocks
from workbench.analysis import fragmentation
from workbench.cache import PagedKVCache
from workbench.compress.block_keep import PARTIAL, block_keep
from workbench.compress.observation import Observation, attention_error, attention_output
from workbench.core.layout import Layout
from workbench.publish.notebook import Bound  # fp16 rounding: its digits differ between CPUs, its bound does not
from workbench.quant import blocks as qblocks

_TOKEN_AXIS = {Layout.NHD: 1, Layout.HND: 2, Layout.VLLM: 3}  # token axis of a [blocks, *block_shape] view


@dataclass(frozen=True)
class EvictionReport:
    """What :func:`evict` did to one sequence.

    Attributes:
        seq_id, partial: the sequence and the mode.
        tokens_before: tokens the sequence stored before.
        tokens_selected: tokens the mask kept (``keep.sum()``).
        tokens_kept: tokens it stores after (``"keep"``: the selected ones plus the dropped tokens of partly kept
            blocks; ``"compact"``: the selected ones).
        blocks_before, blocks_after: its block table's length before and after.
        blocks_released: table entries it gave up (one reference each).
        blocks_freed: of those, blocks whose last reference it was (back in the pool's free queue).
        blocks_allocated: blocks taken from the pool for the packed tokens (``"compact"``).
        tokens_moved: tokens copied to another slot (``"compact"``; a whole block that keeps its place is not).
        bytes_moved: bytes written by those copies (codes of every layer, K and V; in-block scales not counted).
        block_bytes: bytes one block of the sequence's size class occupies (every layer, K and V, padding
            included): ``blocks_* x block_bytes`` is the memory it holds.
        retained: the stored index (before) of each token it stores after, in order.
    """

    seq_id: object
    partial: str
    tokens_before: int
    tokens_selected: int
    tokens_kept: int
    blocks_before: int
    blocks_after: int
    blocks_released: int
    blocks_freed: int
    blocks_allocated: int
    tokens_moved: int
    bytes_moved: int
    block_bytes: int
    retained: tuple[int, ...]

    @property
    def tokens_evicted(self) -> int:
        return self.tokens_before - self.tokens_kept

    @property
    def bytes_before(self) -> int:
        return self.blocks_before * self.block_bytes

    @property
    def bytes_after(self) -> int:
        return self.blocks_after * self.block_bytes

    @property
    def pool_blocks_returned(self) -> int:
        """Net change of the pool's free blocks: freed minus allocated."""
        return self.blocks_freed - self.blocks_allocated

    def summary(self) -> dict:
        return {"tokens_before": self.tokens_before, "tokens_kept": self.tokens_kept,
                "tokens_selected": self.tokens_selected, "blocks_before": self.blocks_before,
                "blocks_after": self.blocks_after, "blocks_freed": self.blocks_freed,
                "blocks_allocated": self.blocks_allocated, "tokens_moved": self.tokens_moved,
                "bytes_before": self.bytes_before, "bytes_after": self.bytes_after}


def check_evictable(cache) -> None:
    """ValueError unless ``cache`` is a PagedKVCache whose scheme :func:`evict` can move exactly."""
    if not isinstance(cache, PagedKVCache):
        raise ValueError(f"cache must be a PagedKVCache, got {type(cache).__name__}")
    scheme = cache.scheme
    if scheme.keeps_residual and scheme.residual > 0:
        raise ValueError(f"cache kv_dtype {scheme.name} keeps each sequence's newest tokens in an fp16 residual "
                         f"outside the blocks: eviction is not supported for it (use a per-token or static scheme)")
    for kind in ("k", "v"):
        for bs in cache.pool_sizes:
            sc = qblocks.block_scales(scheme, kind, bs, cache.num_kv_heads, cache.head_dim)
            if sc is not None and sc.tokens_per_group > 1:
                raise ValueError(f"cache kv_dtype {scheme.name} shares one {kind.upper()} scale among "
                                 f"{sc.tokens_per_group} tokens: a token cannot leave its group, so eviction is not "
                                 f"supported for it")


def _check_keep(keep: object, n: int) -> list[bool]:
    if not isinstance(keep, torch.Tensor):
        raise ValueError(f"keep must be a bool torch tensor [{n}] (the sequence's stored tokens), got "
                         f"{type(keep).__name__}")
    if keep.dtype != torch.bool or tuple(keep.shape) != (n,):
        raise ValueError(f"keep must be a bool tensor of shape ({n},) (the sequence's stored tokens), got "
                         f"{keep.dtype} {tuple(keep.shape)}")
    m = keep.detach().cpu().tolist()
    if not any(m):
        raise ValueError("keep must keep at least one token (free the sequence to drop them all)")
    return m


def _plan(m_keep: list[bool], bs: int, partial: str) -> tuple[list[list[int]], list[int]]:
    """Per new block, the stored indices it holds (in order), and per new block the old block index it reuses in
    place (-1: a fresh block, its tokens copied)."""
    n = len(m_keep)
    nb = -(-n // bs)
    if partial == "keep":
        chunks = [list(range(i * bs, min(n, (i + 1) * bs))) for i in range(nb) if any(m_keep[i * bs:(i + 1) * bs])]
        return chunks, [c[0] // bs for c in chunks]
    kept = [p for p in range(n) if m_keep[p]]
    chunks = [kept[j:j + bs] for j in range(0, len(kept), bs)]
    reuse = []
    for c in chunks:
        i = c[0] // bs  # reuse old block i when the chunk is exactly its valid tokens, in order
        whole = list(range(i * bs, min(n, (i + 1) * bs)))
        reuse.append(i if c == whole else -1)
    return chunks, reuse


def evict(cache, seq_id, keep: torch.Tensor, *, partial: str = "keep") -> EvictionReport:
    """Keep only the ``keep`` tokens of ``seq_id`` in ``cache`` (see the module docstring); atomic.

    Args:
        cache: a :class:`~workbench.cache.PagedKVCache` (any layout; schemes as in the module docstring).
        seq_id: a live sequence.
        keep: bool ``[T]`` over the sequence's ``T`` stored tokens, in order; at least one True.
        partial: ``"keep"`` (partly dropped blocks stay whole) or ``"compact"`` (kept tokens packed).

    Returns:
        An :class:`EvictionReport`.

    Raises:
        ValueError: a bad argument or an unsupported scheme (nothing changed).
        UnknownSequence: no such sequence (nothing changed).
        OutOfBlocks: ``"compact"`` needs more fresh blocks than the pool has, after this sequence's released
            blocks are counted (nothing changed).
    """
    check_evictable(cache)
    if partial not in PARTIAL:
        raise ValueError(f"partial must be one of {PARTIAL}, got {partial!r}")
    manager = cache.manager
    n = manager.num_tokens(seq_id)  # UnknownSequence for a bad id
    bs = manager.block_size(seq_id)
    m_keep = _check_keep(keep, n)
    old_table = manager.block_table(seq_id)
    chunks, reuse = _plan(m_keep, bs, partial)
    block_bytes = 2 * cache.num_layers * cache.block_stride(bs) * cache.dtype.itemsize
    retained = tuple(p for c in chunks for p in c)
    selected = sum(m_keep)
    if len(retained) == n:  # nothing leaves: the sequence is unchanged (and keeps publishing)
        nb = len(old_table)
        return EvictionReport(seq_id, partial, n, selected, n, nb, nb, 0, 0, 0, 0, 0, block_bytes, retained)

    # ---- the new state, on a clone: any failure leaves the cache as it was ----
    pool = manager.pool
    scratch = manager.clone()
    sp = scratch.pool
    sp.evicted = [] if pool.evicted is not None else None  # blocks a fresh allocation evicts, for a tier below
    reused = {i for i in reuse if i >= 0}
    released = [old_table[i] for i in range(len(old_table)) if i not in reused]
    freed = sum(1 for b in released if pool.ref_count(bs, b) == 1)
    sp.decref(bs, list(reversed(released)))  # to the free queue's tail: blocks free before are taken first
    need = sum(1 for i in reuse if i < 0)
    if need > sp.free_blocks(bs):
        raise OutOfBlocks(f"evicting from sequence {seq_id!r} with partial='compact' packs {selected} tokens into "
                          f"{need} fresh blocks of {bs} tokens, {sp.free_blocks(bs)} available after its released "
                          f"blocks (partial='keep' needs none)")
    fresh = sp.allocate(bs, need)
    it = iter(fresh)
    new_table = [old_table[i] if i >= 0 else next(it) for i in reuse]
    for j, c in enumerate(chunks):
        sp.set_valid(bs, new_table[j], len(c))
    tokens = manager.tokens(seq_id)
    unchanged = 0  # leading blocks in their old place with all of their old tokens: still the same prefix
    while unchanged < len(new_table) and new_table[unchanged] == old_table[unchanged] and \
            chunks[unchanged] == list(range(unchanged * bs, min(n, (unchanged + 1) * bs))):
        unchanged += 1
    scratch.rewrite(seq_id, new_table, [tokens[p] for p in retained], unchanged)  # the clone's: nobody sees it yet
    scratch.stop_publishing(seq_id)

    # ---- copy the moved tokens (fresh blocks only), then swap the state in ----
    src = [old_table[p // bs] * bs + p % bs for j, c in enumerate(chunks) if reuse[j] < 0 for p in c]
    dst = [new_table[j] * bs + o for j, c in enumerate(chunks) if reuse[j] < 0 for o in range(len(c))]
    evicted_now, sp.evicted = sp.evicted, pool.evicted
    if evicted_now:
        pool.evicted.extend(evicted_now)
    cache.flush_evictions()  # a tier below copies the evicted cached blocks down before they are overwritten
    if src:
        move_tokens(cache, bs, src, dst)
    manager.adopt(scratch)  # the pool's state and the table of sequences, replaced whole (as compaction does)
    quantized, residual = cache.residual_state(seq_id)
    if quantized is not None:  # packed per-token codes (int4/int2 "token"): every token is in the blocks
        cache.set_residual_state(seq_id, len(retained), residual)
    if src and getattr(cache, "k_bounds", None) is not None:  # Quest's per-block key bounds of the packed blocks
        cache.refresh_key_bounds([seq_id])
    moved_bytes = 2 * cache.num_layers * cache.token_bytes * len(src)
    return EvictionReport(seq_id, partial, n, selected, len(retained), len(old_table), len(new_table),
                          len(released), freed, len(fresh), len(src), moved_bytes, block_bytes, retained)


def move_tokens(cache, block_size: int, src: Sequence[int], dst: Sequence[int]) -> None:
    """Copy the codes (and in-block per-token scales) of slots ``src`` to slots ``dst`` (``block * bs + offset``)
    in every layer, K and V. Each (layer, kind) reads all of its sources before it writes, so ``dst`` may reuse
    blocks among the sources."""
    bs, dev = block_size, cache.device
    s_slot = torch.tensor(list(src), dtype=torch.int64, device=dev)
    d_slot = torch.tensor(list(dst), dtype=torch.int64, device=dev)
    sb, st, db, dt = s_slot // bs, s_slot % bs, d_slot // bs, d_slot % bs
    ax = _TOKEN_AXIS[cache.layout]
    for layer in range(cache.num_layers):
        for kind, view in (("k", cache.k_cache), ("v", cache.v_cache)):
            blocks = view(layer, bs).movedim(ax, 1)  # [num_blocks, block_size, ...]
            blocks[db, dt] = blocks[sb, st]  # the right side is gathered first
            scale, zero = cache.scales(layer, kind, bs)  # [num_blocks, block_size, heads, channel groups]
            for t in (scale, zero):
                if t is not None:
                    t[db, dt] = t[sb, st]


# ---- notebook 07, section 2: a policy's choice freeing blocks of a shared pool -------------------------------------
def _admit(cache, newcomer, tokens: int, block_size: int) -> str:
    """Add the first ``tokens`` of capture ``newcomer`` as sequence ``"c"`` if the pool has room (the allocator
    refuses a request whole otherwise): what happened, as a short phrase."""
    try:
        cache.add("c", newcomer.tokens[:tokens], newcomer.k[:, :tokens].half(), newcomer.v[:, :tokens].half())
    except OutOfBlocks as e:
        return f"refused ({str(e).split(', ')[-1]})"
    return f"placed, {cache.manager.pool.free_blocks(block_size)} blocks left"


def pool_study(evicted, beside, newcomer, keep: torch.Tensor, *, partials: Sequence[str] = PARTIAL,
               pool_blocks: int = 24, block_size: int = 16, newcomer_tokens: int = 112) -> list[dict]:
    """Two captures' real K/V in one fp16 pool of ``pool_blocks`` blocks (``ops="torch"``, CPU), the first
    evicted to ``keep`` under each of ``partials``, and a third request (the first ``newcomer_tokens`` tokens of
    ``newcomer``) asked for before and after (what notebook 07 shows in its section 2).

    Args:
        evicted, beside, newcomer: ``workbench.model.capture.Capture``s (``tokens``, ``k``, ``v`` ``[L, T, Hkv,
            D]``, ``q_last``, ``sm_scale``, ``name``): the sequence evicted, the one sharing the pool, the request.
        keep: bool ``[T]`` of ``evicted``, the token set a policy chose.

    Returns:
        One dict per partial rule: ``partial``, ``report`` (the :class:`EvictionReport`), ``pool_blocks``,
        ``free_before`` / ``free_after`` (free blocks), ``slots_before`` / ``slots_after`` (token slots held),
        ``internal_before`` / ``internal_after`` (internal fragmentation, slots), ``utilization_before`` /
        ``utilization_after``, ``stored_tokens`` (the tokens the sequence attends after), ``decode_error`` (the
        decode path over the evicted blocks against fp32 attention over exactly the stored tokens, the last prompt
        token's query, max relative error over layers: a :class:`workbench.publish.notebook.Bound`), ``error_vs_full``
        (the same query's attention-output error against the full cache), ``newcomer_before`` / ``newcomer_after`` (the
        request placed or refused), and ``tokens_selected``, ``blocks_spread`` (blocks of ``block_size`` the selected
        tokens touch), ``prompt``.
    """
    L, T, H, D = evicted.k.shape
    last = Observation(evicted.k, evicted.v, evicted.q_last[:, -1:], evicted.sm_scale)
    q = evicted.q_last[:, -1].half()
    out = []
    for partial in partials:
        cache = PagedKVCache(L, H, D, pool_blocks, page_tokens=block_size, kv_dtype="fp16", ops="torch", device="cpu")
        cache.add("a", evicted.tokens, evicted.k.half(), evicted.v.half())
        cache.add("b", beside.tokens, beside.k.half(), beside.v.half())
        pool, before = cache.manager.pool, fragmentation.breakdown(cache)
        free0 = pool.free_blocks(block_size)
        fits0 = _admit(cache, newcomer, newcomer_tokens, block_size)
        rep = evict(cache, "a", keep, partial=partial)
        after = fragmentation.breakdown(cache)
        free1 = pool.free_blocks(block_size)
        stored = torch.zeros(T, dtype=torch.bool).index_fill_(0, torch.tensor(rep.retained), True)
        ref = attention_output(last, stored)[:, 0]  # fp32, over exactly the stored tokens
        err = max(float((cache.decode(q[i][None], ["a"], i, sm_scale=evicted.sm_scale)[0].float() - ref[i]).norm()
                        / ref[i].norm()) for i in range(L))
        out.append({"partial": partial, "prompt": evicted.name, "report": rep, "pool_blocks": pool.num_pages,
                    "tokens_selected": int(keep.sum()), "blocks_spread": block_keep(keep, block_size).blocks,
                    "blocks_full": -(-T // block_size), "tokens": T, "free_before": free0, "free_after": free1,
                    "slots_before": before.token, "slots_after": after.token, "internal_before": before.internal,
                    "internal_after": after.internal, "utilization_before": before.block_utilization,
                    "utilization_after": after.block_utilization, "stored_tokens": int(stored.sum()),
                    "decode_error": Bound(err), "error_vs_full": attention_error(last, stored),
                    "newcomer_before": fits0, "newcomer_after": _admit(cache, newcomer, newcomer_tokens, block_size),
                    "newcomer_tokens": newcomer_tokens, "newcomer_blocks": -(-newcomer_tokens // block_size)})
        cache.manager.check_invariants()
    return out


def format_pool_study(rows: Sequence[dict], chosen_by: str = "the policy") -> str:
    """:func:`pool_study`'s rows as the lines notebook 07 prints: the token set (``chosen_by`` names who chose
    it), then per partial rule what the eviction stored, released and copied, the pool and fragmentation before
    and after, the decode check and the third request."""
    r0 = rows[0]
    lines = [f"{chosen_by} keeps {r0['tokens_selected']} of {r0['tokens']} tokens of '{r0['prompt']}', spread over "
             f"{r0['blocks_spread']} of {r0['blocks_full']} blocks"]
    for r in rows:
        rep = r["report"]
        lines += [
            f"\npartial={r['partial']!r}: {rep.tokens_kept} tokens stored in {rep.blocks_after} blocks (was "
            f"{rep.blocks_before}); released {rep.blocks_released}, allocated {rep.blocks_allocated}, "
            f"{rep.tokens_moved} tokens copied ({rep.bytes_moved // 1024} KiB)",
            f"  pool of {r['pool_blocks']} blocks: free {r['free_before']} -> {r['free_after']}; "
            f"{r['slots_before']} -> {r['slots_after']} token slots, internal fragmentation {r['internal_before']} -> "
            f"{r['internal_after']} slots, utilization {r['utilization_before']:.3f} -> {r['utilization_after']:.3f}",
            f"  decode from the evicted blocks vs fp32 attention over the {r['stored_tokens']} stored tokens: "
            f"max rel. error {r['decode_error']} (fp16 storage); vs the full cache: {r['error_vs_full']:.3f}",
            f"  a new {r['newcomer_tokens']}-token request ({r['newcomer_blocks']} blocks): before, "
            f"{r['newcomer_before']}; after, {r['newcomer_after']}"]
    return "\n".join(lines)
