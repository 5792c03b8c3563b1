"""GPU: a transcoding tier move per chunk size (``workbench.tiers.pipeline``): tokens a second of a batch moved down
and up through ``TieredCache``'s mover, SmolLM2-135M's K/V shape, an fp16 device, beside fp16's own move in the same
run. What the default chunk size (``pipeline.CHUNK_BYTES``) is chosen from.

    python scripts/probe_tier_chunks.py --out $OUT/tier-chunks.json
"""

import argparse
import json

import torch

from workbench.bench import tier_formats as tf
from workbench.results import provenance
from workbench.tiers import TieredCache, formats

CHUNK_MIB = (None, 24, 48, 96, 160)  # None: the batch in one piece
CASES = (("fp16", 64, 1024), ("fp16", 64, 256), ("int4/token", 64, 1024), ("int4/token", 64, 256),
         ("int2/token", 64, 1024), ("fp8_e4m3/token", 64, 1024))


def case(name: str, bs: int, n: int, timer) -> list[dict]:
    """Rows of one format, block size and batch: each chunk size (one for fp16: nothing to transcode), both ways."""
    cache = tf.filled_cache(tf.SHAPE, bs, n, "cuda", "kernels")
    fmt = formats.tier_format(cache, name)
    tc = TieredCache(cache, host_bytes=n * formats.block_bytes(cache, fmt, bs), host_format=name, fsync=False,
                     path="dma")
    mover, ids = tc.lower.mover, list(range(n))
    starts = tc.lower.host.allocate([mover.units(bs)] * n)
    rows = []
    try:
        for mib in (CHUNK_MIB[:1] if not fmt.transcodes else CHUNK_MIB):
            mover.chunk_bytes = None if mib is None else mib << 20
            for d in ("d2h", "h2d"):
                t = timer(tf.swap(mover, bs, ids, starts, d))
                rows.append(dict(format=name, block_size=bs, blocks=n, chunk_mib=mib, chunks=len(mover.chunks(n, bs)),
                                 direction=d, time_us=t, tokens_per_s=n * bs / t * 1e6))
                print(rows[-1])
    finally:
        tc.close()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("probe_tier_chunks.py times CUDA streams: it needs a CUDA GPU")
    timer = tf.Timer(True)
    rows = [r for name, bs, n in CASES for r in case(name, bs, n, timer)]
    ref = {(r["block_size"], r["blocks"], r["direction"]): r["tokens_per_s"] for r in rows if r["format"] == "fp16"}
    for r in rows:
        base = ref.get((r["block_size"], r["blocks"], r["direction"]))
        r["tokens_ratio"] = r["tokens_per_s"] / base if base else None  # over fp16's at the same batch
    json.dump({"meta": provenance.machine_meta(), "rows": rows}, open(args.out, "w"), indent=1)


if __name__ == "__main__":
    main()
