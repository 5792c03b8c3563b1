"""Analyses of the cache's memory, each a pure function of its parameters (or of a live allocator), that notebooks
00-04 and their studies show:

- ``allocation_waste``: where KV memory goes for contiguous and paged allocation (token states, reservation,
  internal fragmentation), from request lengths;
- ``allocator_scenarios``: a shared system prompt, parallel samples and generation on the block allocator, adaptive
  block sizes, and forks checked bit for bit through a real cache;
- ``coalescing``: the 128-byte lines and 32-byte sectors a warp touches reading K or V of a layout;
- ``fragmentation``: where a live cache's slots go (token, reservation, internal, external, free) and its page map.

Nothing is imported here.
"""
