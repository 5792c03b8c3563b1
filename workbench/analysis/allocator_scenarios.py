"""Scenarios on the block allocator: a common system prompt, parallel samples, generation; adaptive block sizes.

A pure function of its parameters (no tensors, no GPU), so a notebook slider can rerun it:
``N`` requests share a ``system_len``-token system prompt, each adds ``user_len`` tokens
of its own, forks ``samples`` parallel samples (copy-on-write), and every sample generates
``gen_len`` tokens. The result says where every block went and what sharing saved.

:func:`fork_checks` runs the same fork through a :class:`~workbench.cache.PagedKVCache` with real K/V in every
layout and checks what each sequence reads back, bit for bit.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from workbench.allocator import BlockManager, BlockPool, ByExpectedLength
from workbench.core.layout import Layout

if TYPE_CHECKING:
    from workbench.cache import PagedKVCache


@dataclass(frozen=True)
class SharingResult:
    seq_ids: list[str]
    block_tables: list[list[int]]  # per sequence, physical block ids
    ref_counts: dict[int, int]  # physical block -> sequences holding it
    blocks_used: int  # distinct physical blocks in use
    blocks_unshared: int  # blocks the same sequences would need with no sharing at all
    tokens: int  # token states across all sequences (counting shared ones once per sequence)
    cow_copies: int
    prefix_hits: int  # blocks found in the prefix cache

    @property
    def memory_saved(self) -> float:
        """Fraction of blocks that sharing saved against giving every sequence its own copy."""
        return 1 - self.blocks_used / self.blocks_unshared if self.blocks_unshared else 0.0

    def summary(self) -> str:
        """One line: blocks used (and without sharing), the share saved, copy-on-write copies, prefix hits."""
        return (f"{self.blocks_used} blocks for {len(self.seq_ids)} sequences (unshared: {self.blocks_unshared}), "
                f"saved {100 * self.memory_saved:.0f}%, CoW copies {self.cow_copies}, prefix hits {self.prefix_hits}")


def shared_prompt(num_requests: int = 4, system_len: int = 40, user_len: int = 5, samples: int = 2,
                  gen_len: int = 12, block_size: int = 16, prefix_caching: bool = True) -> SharingResult:
    """Run the scenario on a fresh allocator large enough for it; see the module docstring."""
    for name, v in (("num_requests", num_requests), ("samples", samples), ("block_size", block_size)):
        if v < 1:
            raise ValueError(f"{name} must be >= 1, got {v}")
    for name, v in (("system_len", system_len), ("user_len", user_len), ("gen_len", gen_len)):
        if v < 0:
            raise ValueError(f"{name} must be >= 0, got {v}")
    per_seq = -(-(system_len + user_len + gen_len) // block_size) + 1
    pool = BlockPool(num_requests * samples * per_seq + 1, block_size)
    m = BlockManager(pool, prefix_caching=prefix_caching)
    system = [(7 * i) % 50_000 for i in range(system_len)]  # any fixed token ids
    cow, ids = 0, []
    for r in range(num_requests):
        user = [50_000 + r * 1000 + i for i in range(user_len)]
        m.add(f"r{r}", system + user)
        group = [f"r{r}"] + [f"r{r}.s{s}" for s in range(1, samples)]
        for child in group[1:]:
            m.fork(f"r{r}", child)
        for s, sid in enumerate(group):
            for t in range(gen_len):
                cow += len(m.append(sid, [90_000 + 97 * s + t]).copies)
        ids.extend(group)
    tables = [m.block_table(s) for s in ids]
    refs: dict[int, int] = {}
    for t in tables:
        for b in t:
            refs[b] = refs.get(b, 0) + 1
    return SharingResult(
        seq_ids=ids,
        block_tables=tables,
        ref_counts=refs,
        blocks_used=len(refs),
        blocks_unshared=sum(len(t) for t in tables),
        tokens=sum(m.num_tokens(s) for s in ids),
        cow_copies=cow,
        prefix_hits=pool.hits,
    )


def adaptive_blocks(requests: Sequence[tuple[int, int]], *, num_pages: int = 64, page_tokens: int = 64,
                    small: int = 16, large: int = 64, threshold: int = 512) -> dict:
    """Requests ``(prompt tokens, expected length)`` added to a fresh pool of ``num_pages`` pages of
    ``page_tokens`` slots, carved into ``small``-token blocks for requests expected under ``threshold`` tokens
    and ``large``-token ones for the rest (``ByExpectedLength``); the allocator's invariants are checked.

    Returns:
        ``{"requests": [{"request", "tokens", "block_size", "blocks", "waste"}], "waste", "stats": pool.stats()}``,
        waste being the slots of a request's blocks it does not fill (under one block of its own size) and the
        top-level ``waste`` their sum over the requests.
    """
    pool = BlockPool(num_pages=num_pages, page_tokens=page_tokens, block_sizes=sorted({small, large}))
    m = BlockManager(pool, ByExpectedLength(small=small, large=large, threshold=threshold))
    rows = []
    for i, (prompt, expected) in enumerate(requests):
        m.add(i, [i] * prompt, expected_len=expected)
        bs, blocks = m.block_size(i), len(m.block_table(i))
        rows.append({"request": i, "tokens": prompt, "block_size": bs, "blocks": blocks,
                     "waste": blocks * bs - prompt})
    m.check_invariants()
    return {"requests": rows, "waste": sum(r["waste"] for r in rows), "stats": pool.stats()}


def format_adaptive(result: dict) -> str:
    """:func:`adaptive_blocks`'s result as lines: each request's blocks and waste, then the pool's slots."""
    lines = [f"request {r['request']}: {r['tokens']:5d} tokens -> {r['block_size']}-token blocks, "
             f"{r['blocks']} blocks, waste {r['waste']} slots" for r in result["requests"]]
    s = result["stats"]
    return "\n".join([*lines, f"used {s['used_slots']} free {s['free_slots']} total {s['total_slots']}"])


# ---- fork and copy-on-write through the cache, in every layout (notebook 01) -----------------------------------
@dataclass(frozen=True)
class ForkCheck:
    """What :func:`fork_checks` found in one layout: the cache it built (parent ``"a"``, child ``"b"``), the
    copy-on-write copies of the child's append, whether both sequences read back exactly what was written, and
    the pool's size and per-block padding."""

    layout: str
    cache: PagedKVCache
    copies: list[tuple[int, int]]
    exact: bool
    total_bytes: int
    padding_bytes: dict[int, int]

    def summary(self) -> str:
        return (f"{self.layout:5s} CoW copies {self.copies}, gathered K/V exact: {self.exact}, "
                f"pool {self.total_bytes // 1024} KiB, padding per block {self.padding_bytes}")


def fork_checks(layouts: Sequence[str] = tuple(Layout), num_layers: int = 2, num_kv_heads: int = 2,
                head_dim: int = 64, prompt_len: int = 21, new_tokens: int = 3, num_pages: int = 16,
                page_tokens: int = 16, seed: int = 0) -> dict[str, ForkCheck]:
    """In each layout, a fresh :class:`PagedKVCache`: sequence ``"a"`` gets ``prompt_len`` tokens of random fp16
    K/V, is forked into ``"b"``, and ``"b"`` appends ``new_tokens`` more (copy-on-write of the shared, partly
    filled last block); both are gathered back and compared with what was written, bit for bit.

    One seeded generator draws every layout's K/V in turn. Returns ``{layout: ForkCheck}``.
    """
    import torch  # here: the scenarios above stay free of tensors

    from workbench.cache import PagedKVCache  # here: the cache loads the kernels (Triton, +0.3 s), which they skip

    g = torch.Generator().manual_seed(seed)

    def kv(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        return (torch.randn(num_layers, n, num_kv_heads, head_dim, generator=g).half(),
                torch.randn(num_layers, n, num_kv_heads, head_dim, generator=g).half())

    out = {}
    for layout in layouts:
        cache = PagedKVCache(num_layers, num_kv_heads, head_dim, num_pages=num_pages, page_tokens=page_tokens,
                             layout=layout)
        dev = cache.device  # drawn on the CPU (the same numbers on every machine), written on the cache's device
        k, v = kv(prompt_len)
        cache.add("a", list(range(prompt_len)), k.to(dev), v.to(dev))
        cache.fork("a", "b")
        k2, v2 = kv(new_tokens)
        placed = cache.append("b", [prompt_len + i for i in range(new_tokens)], k2.to(dev), v2.to(dev))
        (kb, vb), (ka, va) = cache.gather("b"), cache.gather("a")
        exact = (torch.equal(kb.cpu(), torch.cat([k, k2], 1)) and torch.equal(vb.cpu(), torch.cat([v, v2], 1))
                 and torch.equal(ka.cpu(), k) and torch.equal(va.cpu(), v))
        out[str(layout)] = ForkCheck(str(layout), cache, list(placed.copies), exact, cache.total_bytes,
                                     dict(cache.padding_bytes))
    return out


def format_fork_checks(checks: dict[str, ForkCheck]) -> str:
    """One :meth:`ForkCheck.summary` line per layout."""
    return "\n".join(c.summary() for c in checks.values())
