"""Tiered KV storage: the device pool (the cache), pinned host memory and disk, with batched moves and prefetch.

- :mod:`~workbench.tiers.tiered`: :class:`TieredCache`, a ``PagedKVCache`` whose evicted prefix blocks are
  demoted (device -> host -> disk) and promoted back on a prefix hit, with preemption by swap.
- :mod:`~workbench.tiers.promote`: a prompt's prefix found below the device brought back before it is added.
- :mod:`~workbench.tiers.swap`: preemption by swap, a batch down and back with its sharing kept (a shared block
  travels once and comes back shared), all or nothing.
- :mod:`~workbench.tiers.host_disk_store`: the host and disk pools as one store of blocks keyed by digest (what moves
  down, in which order, and back; a corrupt disk block dropped and counted).
- :mod:`~workbench.tiers.transfer`: batched device <-> host moves, the copy-engine (staging + one DMA) and the
  SM-copy paths, with accounting; :mod:`~workbench.tiers.host` the pinned pool; :mod:`~workbench.tiers.disk`
  the crash-safe disk pool, :mod:`~workbench.tiers.disk_format` its files; :mod:`~workbench.tiers.eviction` LRU /
  LFU / priority; :mod:`~workbench.tiers.errors`.
- :mod:`~workbench.tiers.link`: how long a transfer takes (measured H200 curves, or DESIGN.md's figures).
- :mod:`~workbench.tiers.access`, :mod:`~workbench.tiers.prefetch`, :mod:`~workbench.tiers.replay`: access
  traces (full, sliding window, top-k sparse, real SmolLM2 attention), prefetch strategies behind one interface,
  and a replay simulator reporting hit rate, bytes per tier and stall time.
"""

from workbench.tiers.access import AccessTrace, full_trace, sliding_window_trace, topk_trace, trace_from_capture
from workbench.tiers.errors import CorruptBlock, DiskFull, HostFull, NotInTier, NotResident, TierError, TierFull
from workbench.tiers.link import LinkModel, latest_link_model
from workbench.tiers.prefetch import PREFETCH
from workbench.tiers.prefetch import get as get_prefetch
from workbench.tiers.replay import ReplayResult, compare  # replay() itself: workbench.tiers.replay (its module's name)
from workbench.tiers.tiered import BlockRef, TieredCache

__all__ = [
    "PREFETCH", "AccessTrace", "BlockRef", "CorruptBlock", "DiskFull", "HostFull", "LinkModel", "NotInTier",
    "NotResident", "ReplayResult", "TierError", "TierFull", "TieredCache", "compare", "full_trace", "get_prefetch",
    "latest_link_model", "sliding_window_trace", "topk_trace", "trace_from_capture",
]
