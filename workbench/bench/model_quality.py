"""Quantized K/V caches against the fp16 cache on real text: ``python -m workbench bench model_quality``.

SmolLM2-135M (fp32, CPU) decodes through a :class:`~workbench.cache.PagedKVCache` of every scheme of
``workbench.quant.SCHEMES`` with the kernels' PyTorch references (``ops="torch"``); one row per scheme
(:func:`workbench.model.quality.evaluate_all`): greedy agreement with the fp16 cache on prompts from the text
(``agreement``, ``first_divergence_mean``/``_min``), teacher-forced log-prob drift and KL(fp16 || scheme) of
the next-token distributions (``mean_abs_drift``, ``max_abs_drift``, ``mean_kl``, ``max_kl``), ``perplexity``
(and the fp16 cache's, ``ref_perplexity``) on the scored tokens, and stored ``bytes_per_token`` (one layer, K and
V, scales counted, at a ``--chunk``-token context; ``bytes_per_token_long``: the long-context limit).

Text: ``data/text`` (the Declaration of Independence and chapter 1 of Pride and Prejudice; static schemes are
calibrated on the Gettysburg Address, each twice (``--static-scales``, the row's ``scales``): ONE k_scale/v_scale
pair for all 30 layers (``cache``), and one pair per layer (``layer``), which the cache takes as ``[L]`` / ``[L, H]``).
``--sections tiers`` (issue 34): rows of a lossy host tier instead of (``schemes,tiers``: beside) the scheme rows:
per format of ``--tier-formats`` (default ``workbench.quant.names.TIER_FORMATS``), ``--prompts`` prompts of
``--tier-prompt-tokens`` tokens whose prefix went down to a host tier in that format and came back through a
``TieredCache``, then ``--new-tokens`` decoded: agreement, KL and perplexity against the fp16 tier
(:mod:`workbench.model.tier_quality`; rows of ``section`` ``tier``, named by ``host_format``).
``--smoke``: three schemes on a few tokens (under a minute, most of it loading the model); with ``--sections
tiers``, every tier format on two 40-token prompts.
"""

from __future__ import annotations

import platform
import sys
import time

import torch

from workbench import quant
from workbench.bench.command import BenchParser
from workbench.core.argtypes import positive_int
from workbench.model import gguf_weights, quality, tier_quality
from workbench.quant.names import QUALITY_SMOKE_SCHEMES as SMOKE_SCHEMES
from workbench.quant.names import TIER_FORMATS
from workbench.results import provenance, run_files

COLUMNS = ["scheme", "scales", "bytes_per_token", "agreement", "first_divergence_mean", "mean_abs_drift",
           "max_abs_drift", "mean_kl", "perplexity", "seconds"]
TIER_COLUMNS = ["host_format", "bytes_per_token", "prefix_tokens", "agreement", "first_divergence_mean",
                "mean_abs_drift", "max_abs_drift", "mean_kl", "perplexity", "ref_perplexity", "roundtrip_equal",
                "seconds"]
SECTIONS = ("schemes", "tiers")
HEADERS = {"bytes_per_token": "bytes/tok", "first_divergence_mean": "1st_div", "mean_abs_drift": "|drift|",
           "max_abs_drift": "max|drift|", "perplexity": "ppl", "seconds": "s"}


def prompts_from(text_tokens: list[int], n: int, length: int) -> list[list[int]]:
    """``n`` prompts of ``length`` tokens from evenly spaced places of the text."""
    if len(text_tokens) < length:
        raise ValueError(f"the text has {len(text_tokens)} tokens, fewer than --prompt-tokens {length}")
    step = (len(text_tokens) - length) // max(n - 1, 1)
    return [text_tokens[i * step:i * step + length] for i in range(n)]


def main(argv: list[str] | None = None) -> int:
    ap = BenchParser("model_quality", __doc__, smoke="a tiny run (three schemes, a few tokens)")
    ap.add_argument("--schemes", default=None,
                    help="comma separated scheme names (default every one of workbench.quant.SCHEMES; --smoke: "
                         f"{','.join(SMOKE_SCHEMES)})")
    ap.add_argument("--new-tokens", type=positive_int, default=None,
                    help="greedy tokens per prompt for agreement (default 32; --smoke 4)")
    ap.add_argument("--chunk", type=positive_int, default=None,
                    help=f"tokens per teacher-forced sequence (default {quality.CHUNK}; --smoke 24)")
    ap.add_argument("--prefill", type=positive_int, default=None,
                    help=f"of each chunk, tokens prefilled before stepping (default {quality.PREFILL}; --smoke 16)")
    ap.add_argument("--chunks", type=positive_int, default=None,
                    help="teacher-forced chunks of the text at most (default 8; --smoke 2)")
    ap.add_argument("--batch", type=positive_int, default=None,
                    help=f"chunks decoded as one batch (default {quality.BATCH}; --smoke 2)")
    ap.add_argument("--prompts", type=positive_int, default=None,
                    help="agreement prompts taken from the text (default 4; --smoke 2)")
    ap.add_argument("--prompt-tokens", type=positive_int, default=None,
                    help="tokens per agreement prompt (default 256; --smoke 16)")
    ap.add_argument("--static-scales", default=",".join(quality.SCALES_BY),
                    help="static schemes' scales, comma separated: cache (one pair for all layers), layer (one pair "
                         "per layer); a row each (default both)")
    ap.add_argument("--sections", default="schemes",
                    help="comma separated: schemes (every scheme's cache against fp16), tiers (a prompt's prefix "
                         "through a lossy host tier, per --tier-formats); default schemes")
    ap.add_argument("--tier-formats", default=",".join(TIER_FORMATS),
                    help="the tiers section's host formats, comma separated, the first the reference (default "
                         f"{','.join(TIER_FORMATS)})")
    ap.add_argument("--tier-prompt-tokens", type=positive_int, default=None,
                    help=f"the tiers section's prompt tokens (default {tier_quality.PROMPT_TOKENS}; --smoke 40)")
    ap.add_argument("--threads", type=positive_int, default=None,
                    help="torch CPU threads (default torch's; on a busy 2-core CPU 1 is several times faster)")
    args = ap.parse_args(argv)
    smoke = args.smoke
    pick = lambda v, full, tiny: v if v is not None else (tiny if smoke else full)  # noqa: E731
    new_tokens, chunk = pick(args.new_tokens, 32, 4), pick(args.chunk, quality.CHUNK, 24)
    prefill, n_chunks = pick(args.prefill, quality.PREFILL, 16), pick(args.chunks, 8, 2)
    batch, n_prompts = pick(args.batch, quality.BATCH, 2), pick(args.prompts, 4, 2)
    prompt_tokens = pick(args.prompt_tokens, 256, 16)
    tier_prompt_tokens = pick(args.tier_prompt_tokens, tier_quality.PROMPT_TOKENS, 40)
    sections = [x.strip() for x in args.sections.split(",")]
    if not sections or any(x not in SECTIONS for x in sections) or len(set(sections)) != len(sections):
        ap.error(f"argument --sections: must list distinct entries of {','.join(SECTIONS)}, got {args.sections!r}")
    tier_formats = [f.strip() for f in args.tier_formats.split(",")]
    try:
        static = [f for f in tier_formats if quality.get_scheme(f).needs_static_scales]
    except ValueError as e:
        ap.error(f"argument --tier-formats: {e}")
    if static or len(set(tier_formats)) != len(tier_formats):
        ap.error(f"argument --tier-formats: distinct casts or schemes with scales computed on write (a tier has no "
                 f"calibration), got {args.tier_formats!r}")
    if "tiers" in sections and tier_prompt_tokens <= tier_quality.PAGE_TOKENS:
        ap.error(f"argument --tier-prompt-tokens: must exceed a block ({tier_quality.PAGE_TOKENS} tokens), got "
                 f"{tier_prompt_tokens}")
    names = args.schemes.split(",") if args.schemes else list(SMOKE_SCHEMES if smoke else quant.SCHEMES)
    try:
        names = [quality.get_scheme(n.strip()).name for n in names]
    except ValueError as e:
        ap.error(f"argument --schemes: {e}")
    scales_by = [b.strip() for b in args.static_scales.split(",")]
    if not scales_by or any(b not in quality.SCALES_BY for b in scales_by) or len(set(scales_by)) != len(scales_by):
        ap.error(f"argument --static-scales: must list distinct entries of {','.join(quality.SCALES_BY)}, got "
                 f"{args.static_scales!r}")
    if chunk - prefill < 2:
        ap.error(f"argument --prefill: must leave at least 2 tokens of --chunk {chunk} to step, got {prefill}")
    out = ap.start(args)  # checked before the work, not after
    if (why := gguf_weights.model_available()) is not None:
        print(f"bench model_quality needs SmolLM2-135M: {why}", file=sys.stderr)
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    start = time.perf_counter()
    model, tok = quality.smollm2()
    load_s = time.perf_counter() - start
    text = tok.encode(quality.load_text())
    meta = provenance.machine_meta()
    meta["gpu"] = "cpu-" + (platform.machine() or "unknown")  # ops="torch": no GPU involved
    meta["command"] = " ".join(["python -m workbench bench model_quality", *(argv if argv is not None else
                                                                              sys.argv[1:])])
    extra = {
        "mode": "smoke" if smoke else "full", "model": "SmolLM2-135M-Instruct (Q4_1 GGUF, fp32 on the CPU)",
        "ops": "torch", "threads": torch.get_num_threads(), "reference": quality.REFERENCE,
        "texts": list(quality.EVAL_TEXTS), "text_tokens": len(text), "sections": sections, "prompts": n_prompts,
        "new_tokens": new_tokens, "page_tokens": quality.PAGE_TOKENS,
    }
    rows: list[dict] = []
    if "schemes" in sections:
        if len(text) < chunk:
            ap.error(f"argument --chunk: the text has {len(text)} tokens, fewer than {chunk}")
        try:
            prompts = prompts_from(text, n_prompts, prompt_tokens)
        except ValueError as e:
            ap.error(f"argument --prompt-tokens: {e}")
        rows += _scheme_rows(model, tok, text, prompts, names, new_tokens, chunk, batch, prefill, n_chunks, scales_by,
                             extra)
    if "tiers" in sections:
        if len(text) < tier_prompt_tokens + new_tokens:
            ap.error(f"argument --tier-prompt-tokens: the text has {len(text)} tokens, fewer than "
                     f"{tier_prompt_tokens} + --new-tokens {new_tokens}")
        t0 = time.perf_counter()
        tier_rows = tier_quality.evaluate_tiers(
            model, text, host_formats=tier_formats, prompts=n_prompts, prompt_tokens=tier_prompt_tokens,
            new_tokens=new_tokens, progress=lambda f: print(f"[tier {tier_formats.index(f) + 1}/{len(tier_formats)}] "
                                                            f"{f} ({time.perf_counter() - t0:.0f} s)",
                                                            file=sys.stderr, flush=True))
        run_files.print_table(tier_rows, TIER_COLUMNS, HEADERS)
        rows += tier_rows
        extra["tiers"] = {"host_formats": tier_formats, "reference": tier_formats[0], "prompts": n_prompts,
                          "prompt_tokens": tier_prompt_tokens, "new_tokens": new_tokens,
                          "page_tokens": tier_quality.PAGE_TOKENS, "how": tier_quality.HOW}
    total_s = time.perf_counter() - start
    extra.update(load_seconds=load_s, total_seconds=total_s)
    path = run_files.write_results("model-quality", rows, meta, out, extra=extra)
    print(f"{len(rows)} rows ({', '.join(sections)}) in {total_s:.0f} s; wrote {path}")
    return 0


def _scheme_rows(model, tok, text, prompts, names, new_tokens, chunk, batch, prefill, n_chunks, scales_by,
                 extra) -> list[dict]:
    """The schemes section: every scheme's cache against fp16 (``quality.evaluate_all``); its fields into
    ``extra``."""
    forced = text[:chunk * min(n_chunks, len(text) // chunk)]
    sample = quality.capture_kv(model, tok.encode(quality.load_text([quality.CALIBRATION_TEXT])))
    t0 = time.perf_counter()

    def progress(name: str) -> None:
        print(f"[{names.index(name) + 1}/{len(names)}] {name} ({time.perf_counter() - t0:.0f} s)", file=sys.stderr,
              flush=True)

    rows = quality.evaluate_all(model, forced, prompts, calibration=sample, schemes=names, new_tokens=new_tokens,
                                chunk=chunk, batch=batch, prefill=prefill, static_scales_by=scales_by,
                                progress=progress)
    run_files.print_table(rows, COLUMNS, HEADERS)
    amax = sample.layer_amax()
    extra.update({
        "forced_tokens": len(forced), "chunk": chunk, "prefill": prefill, "batch": batch,
        "scored_tokens_per_chunk": chunk - prefill - 1, "prompt_tokens": len(prompts[0]),
        "calibration_text": quality.CALIBRATION_TEXT,
        "calibration_tokens": int(sample.k.shape[1]), "calibration_layer_amax": amax,
        "static_scales": {"cache": "one k_scale and one v_scale (scalar or per kv head) for all layers",
                          "layer": "one k_scale and one v_scale per layer ([L] or [L, H]), calibrated per layer"},
        "static_scales_by": scales_by,
    })
    spread = {n: max(a) / min(a) for n, a in amax.items()}
    print(f"calibration |K| max per layer {min(amax['k']):.3g}..{max(amax['k']):.3g} ({spread['k']:.1f}x), "
          f"|V| {min(amax['v']):.3g}..{max(amax['v']):.3g} ({spread['v']:.1f}x); static scales by "
          f"{' and '.join(scales_by)}")
    return rows


if __name__ == "__main__":
    raise SystemExit(main())
