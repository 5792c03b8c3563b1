"""The delta-coding study as a command: ``python -m workbench bench compression_delta [--quick] [--out DIR]``.

Lossless ratios per layer and kind (pre-/post-RoPE keys, values) on the committed SmolLM2 captures, the lossy path
after quantization, codec throughput on this CPU, and the break-even of a compressed swap against the links the tiers
benchmark measured (``data/results/tiers-h200-*.json``). The study itself is ``workbench.compress.delta_study``;
this module adds what a command needs: the measured links, progress, metadata and the results file.
"""

from __future__ import annotations

import os
import platform
import sys
import time
from collections.abc import Mapping

import numpy as np
import torch
import zstandard

from workbench.bench.command import BenchParser
from workbench.coding.delta_options import check_level
from workbench.compress import delta_study as study
from workbench.core.argtypes import positive_int
from workbench.model import capture
from workbench.results import provenance, run_files
from workbench.results import tiers as tier_results
from workbench.tiers.link import latest_link_model


def measured_links(run: Mapping | None = None, link_model=None) -> dict:
    """The links of the newest committed ``tiers-h200-*.json`` run: ``{name: (direction of a swap, GB/s or a
    function of the transfer size, which codec stage a tier pays, codec side, source)}``."""
    run = tier_results.latest() if run is None else run
    model = latest_link_model() if link_model is None else link_model
    out = {}
    for direction, stage in (("d2h", "encode"), ("h2d", "decode")):
        out[f"dma_{direction}"] = (lambda b, d=direction: model.gbps(b, "dma", d), stage, "gpu", model.source)
    if run is not None:
        pin = tier_results.pinned(run)
        disk = tier_results.check_summary(run)
        for direction, stage in (("d2h", "encode"), ("h2d", "decode")):
            if f"pageable_{direction}" in pin:
                out[f"pageable_{direction}"] = (pin[f"pageable_{direction}"], stage, "gpu", tier_results.run_name(run))
        if disk["disk_write_gbps"]:
            out["disk_write"] = (disk["disk_write_gbps"], "encode", "cpu", tier_results.run_name(run))
            out["disk_read"] = (disk["disk_read_gbps"], "decode", "cpu", tier_results.run_name(run))
    return out



def main(argv: list[str] | None = None) -> int:
    ap = BenchParser("compression_delta", __doc__)
    ap.add_argument("--captures", default=None, help="folder of capture .npz files (default data/activations)")
    ap.add_argument("--level", type=int, default=3, help="zstd level of the ratio and break-even rows")
    ap.add_argument("--levels", default="-3,1,3,9,19", help="levels of the speed/ratio sweep (block16/30layers)")
    ap.add_argument("--reps", type=positive_int, default=5, help="timed repetitions (median)")
    ap.add_argument("--quick", action="store_true", help="one prompt, fewer stages, 1 rep (a smoke run)")
    args = ap.parse_args(argv)
    try:
        levels = [int(v) for v in args.levels.split(",") if v.strip()]
        for v in [args.level, *levels]:
            check_level(v)
    except ValueError as e:
        ap.error(f"argument --levels/--level: {e}")
    out = ap.start(args)
    try:
        caps = capture.load(args.captures)
    except FileNotFoundError as e:
        ap.error(f"argument --captures: {e}")
    torch.set_num_threads(1)
    load0 = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    start = time.perf_counter()
    reps = 1 if args.quick else args.reps
    configs = [study.DEFAULT, "shuffle", "zstd"] if args.quick else list(study.CONFIGS)
    ratio_caps = caps[:1] if args.quick else caps
    rows = study.layer_ratios(ratio_caps, configs=configs, level=args.level)
    schemes = study.SCHEMES[:1] if args.quick else study.SCHEMES
    qrows = study.quantized_ratios(ratio_caps, schemes=schemes, level=args.level)
    tp_configs = [study.DEFAULT, study.BEST] + ([] if args.quick else ["zstd"])
    tp = study.throughput(caps, dtypes=("fp16",) if args.quick else ("fp16", "bf16"), configs=tp_configs,
                          levels=[args.level], reps=reps, min_seconds=0.002 if args.quick else 0.1)
    others = [v for v in levels if v != args.level]
    sweep = [] if args.quick else study.throughput(caps, configs=[study.DEFAULT], levels=others,
                                                   chunk_names=["block16/30layers"], reps=reps)
    for r in sweep:
        r["section"] = "level"
    links = measured_links()
    be = [r for c in (study.DEFAULT, study.BEST)
          for r in study.break_even_rows(tp + sweep, links=links, config=c, level=None)]
    wall = time.perf_counter() - start

    print("lossless ratio (raw / stored bytes, bytes-weighted over prompts and layers; bound: order-0 entropy)")
    summ = study.summarize(rows)
    run_files.print_table([r for r in summ if r["config"] in (study.DEFAULT, "shuffle", "zstd", "xor+shuffle")],
                          ["kind", "dtype", "config", "ratio", "min", "max", "entropy_ratio"],
                          {"entropy_ratio": "bound"})
    print("\nlossy: quantized codes, delta-coded (ratio vs fp16; plain = the scheme without entropy coding)")
    run_files.print_table(study.summarize(qrows, ("kind", "scheme", "delta")),
                          ["kind", "scheme", "delta", "ratio", "plain_ratio", "rel_err"])
    print("\nthroughput on this CPU (one thread), GB/s of raw bytes")
    run_files.print_table(tp + sweep, ["chunk", "dtype", "config", "level", "raw_bytes", "ratio", "encode_gbps",
                                       "decode_gbps", "encode_best_gbps", "decode_best_gbps"],
                          {"encode_best_gbps": "enc_best", "decode_best_gbps": "dec_best"})
    print("\nbreak-even, fp16, one-way (a tier stores blocks compressed: encode on the way out, decode on the way "
          "in); needed = codec GB/s at which compressed ties raw (serial / pipelined); speedup = raw / compressed "
          "time at the measured CPU speed")
    run_files.print_table(study.verdicts(be), ["chunk", "config", "level", "link", "link_gbps", "ratio", "cpu_gbps",
                                         "cpu_best_gbps", "needed_serial", "needed_overlap", "speedup_serial",
                                         "speedup_overlap", "wins"],
                          {"cpu_best_gbps": "cpu_best", "needed_serial": "need_ser", "needed_overlap": "need_ovl",
                           "speedup_serial": "x_ser", "speedup_overlap": "x_ovl"})
    meta = provenance.machine_meta()
    meta["gpu"] = "cpu-" + (platform.machine() or "unknown")  # a CPU codec: no GPU involved
    meta["command"] = " ".join(["python -m workbench bench compression_delta",
                                *(argv if argv is not None else sys.argv[1:])])
    extra = {"mode": "quick" if args.quick else "full", "level": args.level, "levels": levels, "reps": reps,
             "threads": 1, "cpu_count": os.cpu_count(), "loadavg_start": load0,
             "loadavg_end": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
             "zstandard": zstandard.__version__, "zstd": zstandard.ZSTD_VERSION, "numpy": np.__version__,
             "captures": str(args.captures or capture.DEFAULT_PATH), "prompts": [c.name for c in caps],
             "layers": list(caps[0].layers), "configs": {n: study.CONFIGS[n] for n in configs},
             "links": {n: {"stage": v[1], "codec_side": v[2], "source": v[3]} for n, v in links.items()},
             "choice": study.default_choice(rows), "verdicts": study._json_safe(study.verdicts(be)), "wall_s": wall}
    all_rows = study._json_safe(rows + qrows + tp + sweep + be)
    path = run_files.write_results("compression-delta", all_rows, meta, out, extra=extra)
    print(f"\n{len(all_rows)} rows in {wall:.0f} s; wrote {path}")
    return 0


