"""Host time of a transcode's launches (issue 34): ``formats.encode`` / ``decode`` of a chunk of blocks, issued
without a sync, and where it goes (cProfile). A chunked swap pays it once a chunk, so it bounds how small a chunk
may be before a move is host-bound (``workbench.tiers.pipeline``)."""

import argparse
import cProfile
import json
import pstats

import torch

from workbench.bench.harness import host_us
from workbench.bench.tier_formats import SHAPE, filled_cache, staged_blocks
from workbench.tiers import formats


def case(name: str, bs: int, n: int) -> dict:
    """Host microseconds a call of encode, decode and the read half for ``n`` blocks of ``bs`` tokens in ``name``."""
    cache = filled_cache(SHAPE, bs, n, "cuda", "kernels")
    fmt = formats.tier_format(cache, name)
    staged = staged_blocks(cache, bs, list(range(n)))
    packed = formats.encode(cache, fmt, bs, staged)
    row = dict(format=name, block_size=bs, blocks=n,
               encode_host_us=host_us(lambda: formats.encode(cache, fmt, bs, staged)),
               decode_host_us=host_us(lambda: formats.decode(cache, fmt, bs, packed)),
               read_host_us=host_us(lambda: formats.read_values(cache, formats.DEVICE, bs, staged)))
    print(row)
    return row


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    rows = [case(name, bs, n) for name in ("int4/token", "fp8_e4m3/token") for bs, n in ((64, 32), (64, 128))]
    cache = filled_cache(SHAPE, 64, 32, "cuda", "kernels")
    fmt = formats.tier_format(cache, "int4/token")
    staged = staged_blocks(cache, 64, list(range(32)))
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(20):
        formats.encode(cache, fmt, 64, staged)
    pr.disable()
    torch.cuda.synchronize()
    pstats.Stats(pr).sort_stats("cumulative").print_stats(30)
    if args.out:
        json.dump({"gpu": torch.cuda.get_device_name(), "rows": rows}, open(args.out, "w"), indent=1)


if __name__ == "__main__":
    main()
