"""The what-if's quality column: what a configuration costs in output quality, from the committed real-model
studies (SmolLM2-135M on real text), each number with the file and rows it came from.

Three sources, reported side by side and never multiplied into one number (their effects are not independent,
and no run measured them together):

- the K/V scheme: ``bench model_quality`` (``model-quality-*.json``): greedy agreement with the fp16 cache, mean
  KL of the next-token distributions, perplexity change; a static scheme's row with per-layer scales where the
  run has one;
- an eviction policy and budget (``keep`` < 1): ``bench compression_model`` (``compression-model-*.json``), its
  summary row of that policy at the nearest budget, blocks kept whole (``partial="keep"``);
- a lossy host format for swapped blocks: ``workbench.results.format_quality`` (tier rows where committed, else the
  scheme's own rows as a stand-in, which it says).
"""

from __future__ import annotations

import json
from pathlib import Path

from workbench.results import compress as compress_results
from workbench.results import format_quality
from workbench.whatif.profile import RESULTS


def _quality(agreement, kl, ppl, ref, source: str) -> dict:
    return {"agreement": float(agreement), "mean_kl": float(kl),
            "ppl_change": float(ppl) / float(ref) - 1 if ref else float("nan"), "source": source}


def scheme_quality(scheme: str, results_dir: Path | str | None = None) -> dict | None:
    """Quality of ``scheme`` against the fp16 cache from the newest full run with rows of it (a run of other
    sections only, such as ``--sections tiers``, is passed over); None when no run measured it."""
    d = Path(results_dir) if results_dir is not None else RESULTS
    for path in reversed(sorted(d.glob("model-quality-*.json"))):
        doc = json.loads(path.read_text())
        rows = [r for r in doc["rows"] if r.get("scheme") == scheme and "agreement" in r]
        if doc.get("mode") != "full" or not rows:
            continue
        by_layer = [r for r in rows if r.get("static_scales_by") == "layer"]
        r = (by_layer or rows)[-1]
        return _quality(r["agreement"], r["mean_kl"], r["perplexity"], r["ref_perplexity"],
                        f"{path.name}: scheme {scheme}")
    return None


def eviction_quality(policy: str, keep: float, results_dir: Path | str | None = None) -> dict | None:
    """Quality of evicting to ``keep`` of the prompt with ``policy`` (the nearest measured budget)."""
    if keep >= 1:
        return _quality(1.0, 0.0, 1.0, 1.0, "no eviction")
    run = compress_results.latest("model", results_dir)
    if run is None:
        return None
    doc = json.loads(Path(run["path"]).read_text())
    rows = [r for r in doc.get("summary", []) if r["policy"] == policy and r.get("partial") in ("keep", "-")]
    if not rows:
        return None
    r = min(rows, key=lambda r: abs(r["budget"] - keep))
    return _quality(r["agreement"], r["mean_kl"], r["perplexity"], r["ref_perplexity"],
                    f"{Path(run['path']).name}: {policy} at budget {r['budget']:g} (asked {keep:g})")


def host_format_quality(fmt: str | None, device_scheme: str) -> dict | None:
    """Quality of blocks that went through a host tier in ``fmt`` and came back (None: lossless, or unmeasured)."""
    if fmt is None or fmt == device_scheme:
        return None
    table = format_quality.quality_costs()
    q = table.get(fmt)
    if q is None:
        return None
    return {"agreement": q.agreement, "mean_kl": q.mean_kl, "ppl_change": q.ppl_change,
            "source": f"{table.source}: {fmt}, {table.describe()}"}


def quality_column(scheme: str, *, keep: float = 1.0, policy: str = "full", host_format: str | None = None,
                   results_dir: Path | str | None = None) -> dict[str, dict | None]:
    """``{"kv_scheme": ..., "eviction": ..., "host_format": ...}``, each a quality dict with its source or None."""
    return {"kv_scheme": scheme_quality(scheme, results_dir),
            "eviction": eviction_quality(policy, keep, results_dir),
            "host_format": host_format_quality(host_format, scheme)}
