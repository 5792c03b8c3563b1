"""One decode step of a batch in a :class:`~workbench.cache.PagedKVCache`, layer by layer, as a serving engine
runs it: reserve a slot for every sequence's new token, then per layer write the token's K/V and attend over
the sequence including it, then publish.

    step = cache.begin_step(seq_ids, tokens)     # slots reserved, copy-on-write done, nothing published
    for layer in range(L):
        step.write(layer, k, v)                  # [B, Hkv, D]: the write kernel, one launch for the batch
        out = step.attend(q, layer)              # [B, Hq, D]: the paged decode kernel (plan made once per step)
    step.commit()                                # blocks join the prefix cache; or step.abort()

Used as a context manager, the step commits on success and aborts on an exception, so a failed step (bad
K/V in layer 17, an interrupted forward pass) leaves the allocator, the tables and the prefix cache exactly as
before (the reserved slots' bytes are garbage in freed blocks, never read). A cache with ``key_bounds=True``
recomputes, in each ``write``, the bounds of the block every sequence writes into (one block per sequence: no
two programs share one). KIVI schemes keep each sequence's
newest tokens in an fp16 residual outside the blocks, so they have no per-layer step: use
:meth:`PagedKVCache.append_batch` after attending with :meth:`PagedKVCache.decode`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from workbench.allocator.errors import token_ids
from workbench.cache.exports import batch_block_size


class DecodeStep:
    """See the module docstring. Made by :meth:`PagedKVCache.begin_step`."""

    def __init__(self, cache, seq_ids: Sequence, tokens: Sequence[int]):
        seq_ids = list(seq_ids) if isinstance(seq_ids, Sequence) and not isinstance(seq_ids, (str, bytes)) else None
        if not seq_ids or len(set(map(repr, seq_ids))) != len(seq_ids):
            raise ValueError("seq_ids must be a non-empty list of distinct sequence ids")
        tokens = token_ids("tokens", tokens)
        if len(tokens) != len(seq_ids):
            raise ValueError(f"tokens must hold one token per sequence ({len(seq_ids)}), got {len(tokens)}")
        bs = batch_block_size(cache.manager, seq_ids)  # validates the ids: one size class, one write per layer
        if cache.scheme.keeps_residual:
            raise ValueError(f"kv_dtype {cache.scheme.name} keeps its newest tokens in an fp16 residual, so it has no "
                             "per-layer decode step: attend with PagedKVCache.decode, then append_batch")
        self.cache, self.seq_ids, self.tokens, self.block_size = cache, seq_ids, tokens, bs
        manager = cache.manager
        self._undo: list = []
        try:
            for s, t in zip(seq_ids, tokens, strict=True):
                cp = manager.checkpoint(s)
                self._undo.append((cp, manager.append(s, [t], publish=False)))
            cache.copy_blocks(bs, [c for _, p in self._undo for c in p.copies])
        except BaseException:
            self._restore()
            raise
        self.placements = [p for _, p in self._undo]
        meta = cache.vllm_metadata(seq_ids)
        self.block_table, self.seq_lens = meta.block_table, meta.seq_lens  # lengths include the new tokens
        self.max_seq_len = max(manager.num_tokens(s) for s in seq_ids)
        self.slots = torch.tensor([p.slots[0] for p in self.placements], dtype=torch.int64, device=cache.device)
        self._touched = cache.written_blocks(bs, self.slots)  # key bounds: each sequence's block, recomputed per write
        self._plans: dict = {}
        self.paths: dict[int, str] = {}  # layer -> how attend read it: "plain", or "shared" (the cascade)
        self.state = "open"  # -> "committed" | "aborted"

    # ---- per layer -----------------------------------------------------------------
    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write the new tokens' K/V ``[B, heads, head_dim]`` of ``layer`` into their reserved slots."""
        self._check_open()
        c = self.cache
        if not 0 <= layer < c.num_layers:
            raise ValueError(f"layer must be in [0, {c.num_layers}), got {layer}")
        c.check_kv(k[None], v[None], len(self.seq_ids), layers=1)
        c.write_layer(layer, self.block_size, self.slots, k, v, self._touched)

    def attend(self, q: torch.Tensor, layer: int, *, sm_scale: float | None = None, shared_prefix: str = "off",
               **launch) -> torch.Tensor:
        """Decode attention of ``q`` ``[B, Hq, head_dim]`` over ``layer`` (the new tokens included, once written),
        with the layer's static scales (``cache.layer_scales``).

        ``shared_prefix``: ``"off"`` (plain paged decode), ``"auto"`` (the blocks the batch's sequences share are found
        from the tables and the allocator's reference counts, and read once per tile of stacked query heads where the
        fitted selector says that wins: ``workbench.shared_prefix.SharedPrefixDecode``) or ``"shared"`` (the cascade
        whenever anything is shared). Planned once per step, like the plain plan."""
        self._check_open()
        c = self.cache
        if not 0 <= layer < c.num_layers:
            raise ValueError(f"layer must be in [0, {c.num_layers}), got {layer}")
        if shared_prefix not in ("off", "auto", "shared"):
            raise ValueError(f"shared_prefix must be 'off', 'auto' or 'shared', got {shared_prefix!r}")
        key = (tuple(q.shape), q.dtype, sm_scale, shared_prefix, tuple(sorted(launch.items())))
        plan = self._plans.get(key)
        if plan is None:  # planned on this layer's views and scales; each layer's run passes its own
            plan = c.decode_plan(self.block_table, self.seq_lens, layer, self.block_size, num_q_heads=q.shape[1],
                                 q_dtype=q.dtype, max_seq_len=self.max_seq_len, sm_scale=sm_scale,
                                 shared_prefix=shared_prefix, ref_counts=self._ref_counts, **launch)
            self._plans[key] = plan
        self.paths[layer] = getattr(plan, "path", "plain")  # SharedPrefixDecode says which path it chose
        k_scale, v_scale = c.layer_scales(layer)  # static scales: this layer's (per-layer scales), run's argument
        return plan.run(q, c.k_cache(layer, self.block_size), c.v_cache(layer, self.block_size), k_scale=k_scale,
                        v_scale=v_scale)

    def _ref_counts(self) -> torch.Tensor:
        """The allocator's holder count of every block this step's sequences hold (0 for the others)."""
        manager = self.cache.manager
        pool, bs = manager.pool, self.block_size
        refs = torch.zeros(pool.num_blocks(bs), dtype=torch.int64)
        for b in {b for s in self.seq_ids for b in manager.block_table(s)}:
            refs[b] = pool.ref_count(bs, b)
        return refs

    # ---- end -----------------------------------------------------------------------
    def commit(self) -> None:
        """Publish the new full blocks (all layers must have been written)."""
        self._check_open()
        for s in self.seq_ids:
            self.cache.manager.publish(s)
        self.state = "committed"

    def abort(self) -> None:
        """Undo the reservation: the cache is as it was before :meth:`PagedKVCache.begin_step`."""
        self._check_open()
        self._restore()
        self.state = "aborted"

    def _restore(self) -> None:
        for cp, p in reversed(self._undo):
            self.cache.manager.restore(cp, p)
        self._undo = []

    def _check_open(self) -> None:
        if self.state != "open":
            raise RuntimeError(f"this decode step is {self.state}")

    def __enter__(self) -> DecodeStep:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if self.state == "open":
            self.abort() if exc_type is not None else self.commit()

