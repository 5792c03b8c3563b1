"""Quest page selection against full paged decode on the GPU, and its recall on real activations.

``python -m workbench bench quest [--smoke] [--context 32768] [--batches 8,1] [--budgets 2048,4096,1024,8192]
[--page-sizes 16,32] [--reduce sum] [--select one,split] [--no-sweep] [--out DIR]``

Workload: ``--context`` tokens per sequence (32k), batches 8 and 1, GQA 32 query / 8 kv heads, head_dim 128,
pages of ``--page-sizes`` tokens (16 and 32: 32-token pages halve the bounds the scores read) handed out by a random
permutation of the pool (``workloads.build_paged``), fp16, random normal K/V. The key bounds of every block are
computed once with ``kernels/quest.key_bounds`` (as the cache does on write).

Per page size, batch and budget (tokens; ``budget / page_size`` pages, the sink page and the last page among them),
in one run:

- ``full``: our paged decode over the whole context (:class:`~workbench.kernels.DecodePlan`, planned outside the
  timed call, as once per decode step).
- ``quest``: page scores (``quest_page_scores``) + the top pages and the compacted table (``quest_select``, one
  launch) + the same paged decode over it: the whole per-layer path, planned once on the table buffers.
- ``quest_scores``, ``quest_select``, ``quest_attend``: its three parts alone.

``quest`` and ``quest_select`` rows come once per select kernel of ``--select`` (``select``: ``one``, one program per
sequence; ``split``, the multi-program kernel, ``kernels/quest/select_split.py``); ``select_default`` marks the one
``split_select``'s rule picks for the shape (what ``QuestDecode`` runs), the rows ``workbench.results.compress``
reads. ``select_match_after``: the table still the reference's after the timed (and graph-replayed) runs, which
reuse the split kernel's scratch.

Every row: ``page_size``, ``time_us`` (the lower of two ``do_bench`` medians, CUDA events), ``time_us_graph``
(CUDA-graph replay), ``bytes`` (what the call must read and write: the K/V of the attended tokens, the bounds of every
page, scores, tables, q and out), ``gbps``; ``quest`` rows ``speedup`` / ``speedup_graph`` (full's time over
quest's), ``rel_err`` (against a float32 attention restricted to the chosen pages) and ``recall_random`` (the share
of the true attention mass inside the chosen pages). On random keys every page's bound is about the same, so that recall
is about ``budget / context`` and says nothing about Quest: ``section="recall_real"`` rows give the recall on real
SmolLM2-135M keys and queries (``data/activations``, ``workbench.compress.page_selection.quest_recall``, 16-token pages)
per ``reduce`` (``max``, ``sum``, ``softmax``) and budget, with the per-head selection (Quest's own, which a paged cache
cannot use) and the oracle shared set (the true attention mass) beside it.

Unless ``--no-sweep``, ``section="sweep"`` rows (graph times only) time launch variants of each part at the first
budget (``launch`` names them): ``quest_scores`` per ``block_p`` / ``num_stages``, ``quest_select`` per
``select_warps`` / ``select_radix`` (the split kernel's per ``select_warps`` / ``select_block_s``), and
``quest_attend`` per ``num_splits`` (half, the heuristic's, double), ``BLOCK_N`` and ``num_stages``: the data for
their heuristics; and ``section="select_rule"`` rows time the two select kernels alone per batch (1, 8, 32, 128)
and row width (512 to 8192 pages), the data of ``split_select``'s rule.

``--smoke`` runs tiny shapes through the interpreter on a CPU: correctness only (no times).

Eager times carry the host work of each call: the plans' metadata checks of q and the bounds and one Triton launch per
kernel (scores, select, decode and, with splits, its reduce); no torch op, allocation or device sync is left on the
path (the argument checks and launch arguments are the plans', made once).
"""

from __future__ import annotations

import argparse
import gc
import math
import sys

import torch

import workbench  # noqa: F401  (backend first)
from workbench.bench import harness
from workbench.bench.command import SMOKE_HELP, BenchParser
from workbench.compress.page_selection import quest_recall, select_pages
from workbench.core.argtypes import positive_float, positive_int, positive_int_list
from workbench.core.workloads import PagedKV, Workload, build_paged
from workbench.kernels import DecodePlan
from workbench.kernels.decode.config import _num_sms
from workbench.kernels.decode.reference import paged_decode_ref
from workbench.kernels.quest import QuestPlan, key_bounds, quest_page_scores
from workbench.kernels.quest.reference import quest_page_scores_ref
from workbench.kernels.quest.select_split import split_select
from workbench.model import capture
from workbench.results import provenance, run_files

REAL_PAGE = 16  # the captured prompts' recall rows
COLUMNS = ["section", "workload", "batch", "context", "page_size", "impl", "select", "budget_tokens", "reduce",
           "launch", "time_us", "time_us_graph", "gbps", "speedup", "speedup_graph", "rel_err", "recall_random",
           "recall", "recall_per_head", "recall_oracle"]
REDUCES = ("max", "sum", "softmax")
REAL_BUDGETS = (3, 4, 6, 8)  # pages of 16 tokens: the captured prompts hold 135-284 keys (9-18 pages)
SCORES_SWEEP = [dict(block_p=bp, num_stages=st) for bp in (16, 32, 64) for st in (2, 3, 4)]
SELECT_SWEEP = ([dict(select_split=False, select_warps=w) for w in (4, 8, 16)] + [dict(select_split=False,
                                                                                   select_radix=2)]
                + [dict(select_split=True, select_warps=w) for w in (4, 8)]
                + [dict(select_split=True, select_block_s=bs) for bs in (64, 256)])
SELECTS = ("one", "split")  # the select kernels: one program per sequence, many (kernels/quest/select_split.py)
RULE_BATCHES, RULE_WIDTHS = (1, 8, 32, 128), (512, 1024, 2048, 4096, 8192)  # the select_rule rows' shapes


def workload(batch: int, context: int, page_size: int = 16) -> Workload:
    return Workload(f"quest-b{batch}-l{context // 1024}k-p{page_size}", f"gqa-b{batch}-l{context}", batch, context,
                    32, 8, 128)


def page_bounds(p: PagedKV) -> torch.Tensor:
    """``[num_blocks, Hkv, 2, D]`` fp16 key bounds of every block of ``p`` (each full, or its sequence's tail)."""
    nb = p.k_cache.shape[0]
    hkv, d = p.k_cache.shape[2], p.k_cache.shape[3]
    bounds = torch.empty((nb, hkv, 2, d), dtype=torch.float16, device=p.q.device)
    counts = torch.full((nb,), p.block_size, dtype=torch.int32, device=p.q.device)
    for b, n in enumerate(p.lens):  # the last block of a sequence holds its tail
        if n % p.block_size:
            counts[p.block_table[b, p.blocks_per_seq[b] - 1].long()] = n % p.block_size
    key_bounds(p.k_cache, "nhd", bounds, torch.arange(nb, device=p.q.device), counts)
    return bounds


def selected_lens(lens, page: int, k: int) -> list[int]:
    """Each sequence's length over its ``k`` chosen pages, on the host (the last page is always among them)."""
    return [n if -(-n // page) <= k else (k - 1) * page + (n - 1) % page + 1 for n in lens]


class QuestRun:
    """The timed callables of one problem: buffers and plans made here, once (as once per decode step): a
    :class:`~workbench.kernels.quest.QuestPlan` (scores and select) and a :class:`~workbench.kernels.DecodePlan` on
    its table buffers.

    ``quest_launch``: the QuestPlan's launch overrides (the scores kernel's ``block_p`` / ``num_stages``, the select
    kernel's ``select_warps`` / ``select_radix``); ``**launch``: the attend's DecodePlan options (``num_splits``,
    ``BLOCK_N``, ...)."""

    def __init__(self, p: PagedKV, bounds: torch.Tensor, budget_pages: int, reduce: str,
                 quest_launch: dict | None = None, **launch):
        B, W = p.block_table.shape
        self.p, self.bounds, self.reduce, self.budget, self.page = p, bounds, reduce, budget_pages, p.block_size
        Hq, D = p.q.shape[1:]
        self.sel = QuestPlan(p.block_table, p.seq_lens, budget_pages, page_size=self.page, num_q_heads=Hq,
                             num_kv_heads=p.k_cache.shape[2], head_dim=D, q_dtype=p.q.dtype, reduce=reduce,
                             keep_first=1, keep_last=1, **(quest_launch or {}))
        self.scores, self.table, self.lens = self.sel.scores, self.sel.block_table_out, self.sel.seq_lens_out
        self.table.zero_()  # a valid table before the first select (the plan below never reads it on the host)
        self.lens.zero_()
        self.out = torch.empty_like(p.q)
        self.sel_lens = sel = selected_lens(p.lens, self.page, self.table.shape[1])
        self.plan = DecodePlan(self.table, self.lens, layout="nhd", k_cache=p.k_cache, v_cache=p.v_cache,
                               num_q_heads=Hq, q_dtype=p.q.dtype, max_seq_len=max(sel), mean_seq_len=sum(sel) / B,
                               validate=False, **launch)

    def score(self):
        return self.sel.score(self.p.q, self.bounds)

    def select(self):
        return self.sel.select()

    def attend(self):
        return self.plan.run(self.p.q, self.p.k_cache, self.p.v_cache, self.out)

    def __call__(self):
        self.score()
        self.select()
        return self.attend()

    def bytes(self) -> dict[str, int]:
        """Bytes each part must move (reads + writes)."""
        p = self.p
        B, Hq, D = p.q.shape
        hkv = p.k_cache.shape[2]
        W = p.block_table.shape[1]
        k = self.table.shape[1]
        qo = 2 * B * Hq * D * p.q.element_size()
        pages = sum(p.blocks_per_seq)
        scores = pages * hkv * 2 * D * 2 + B * W * (4 + 4) + B * Hq * D * p.q.element_size()  # bounds, table, q
        select = pages * 4 + B * k * (4 + 4) + B * 8  # the sequences' scores, chosen table entries, new table
        attend = sum(self.sel_lens) * hkv * D * 2 * p.k_cache.element_size() + B * k * 4 + qo
        return {"quest_scores": scores, "quest_select": select, "quest_attend": attend,
                "quest": scores + select + attend}


def restricted_ref(p: PagedKV, table: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
    """Float32 decode attention over the compacted table (the chosen pages only), on the device."""
    B, Hq, D = p.q.shape
    hkv = p.k_cache.shape[2]
    page = p.block_size
    out = torch.empty((B, Hq, D), dtype=torch.float32, device=p.q.device)
    for b, n in enumerate(lens.tolist()):
        pos = torch.arange(n, device=p.q.device)
        blk = table[b, pos // page].long()
        k = p.k_cache[blk, pos % page].float()  # [n, Hkv, D]
        v = p.v_cache[blk, pos % page].float()
        qq = p.q[b].float().view(hkv, Hq // hkv, D)
        s = torch.einsum("hgd,nhd->hgn", qq, k) / math.sqrt(D)
        out[b] = torch.einsum("hgn,nhd->hgd", s.softmax(-1), v).reshape(Hq, D)
    return out


def random_recall(p: PagedKV, table: torch.Tensor) -> float:
    """Mean over sequences and heads of the true attention mass (all of the context) inside the chosen blocks."""
    B, Hq, D = p.q.shape
    hkv = p.k_cache.shape[2]
    vals = []
    for b, n in enumerate(p.lens):
        blocks = p.block_table[b, :p.blocks_per_seq[b]].long()
        k = p.k_cache[blocks].reshape(-1, hkv, D)[:n].float()  # [n, Hkv, D]
        qq = p.q[b].float().view(hkv, Hq // hkv, D)
        prob = (torch.einsum("hgd,nhd->hgn", qq, k) / math.sqrt(D)).softmax(-1)  # [Hkv, G, n]
        chosen = torch.isin(blocks, table[b].long())  # [pages]
        m = chosen.repeat_interleave(p.block_size)[:n]
        vals.append(float((prob * m).sum(-1).mean()))
    return sum(vals) / len(vals)


def _time(fn, rep_ms: float) -> tuple[float, float | None]:
    t = min(harness.time_us(fn, rep_ms=rep_ms) for _ in range(2))
    return t, _time_graph(fn, rep_ms)


def _time_graph(fn, rep_ms: float) -> float | None:
    try:
        return harness.time_us_graph(fn, rep_ms=rep_ms)
    except Exception as err:  # noqa: BLE001  (a part that cannot be captured keeps its eager time)
        print(f"graph capture failed: {type(err).__name__}: {str(err)[:160]}", file=sys.stderr)
        return None


def _row(w: Workload, impl: str, budget_tokens: int | None, reduce: str | None, t, tg, nbytes, page: int = 16,
         **extra) -> dict:
    row = {"section": "timing", "workload": w.key, "batch": w.batch, "context": w.context, "impl": impl,
           "budget_tokens": budget_tokens, "reduce": reduce, "page_size": page, "num_q_heads": w.num_q_heads,
           "num_kv_heads": w.num_kv_heads, "head_dim": w.head_dim, "kv_dtype": "fp16", "time_us": t,
           "time_us_graph": tg, "bytes": nbytes}
    if t or tg:
        row["gbps"] = nbytes / ((t or tg) * 1e-6) / 1e9
    row.update(extra)
    return row


def _launch_name(kw: dict) -> str:
    return "-".join(f"{k}{v}" for k, v in kw.items()) or "default"


def select_rule_rows(rep_ms: float, page: int = 16, batches=RULE_BATCHES, widths=RULE_WIDTHS) -> list[dict]:
    """Graph times of the two select kernels alone (each through a :class:`QuestPlan`'s ``select``) per batch and
    row width, on scores like the timing rows' (a sum over 32 heads of random keys' bounds: about 513 +- 2.3, so a
    16-bit bucket holds many pages; the first and last pages forced), every row full, a budget of 1/16 of the row:
    the data of ``split_select``'s rule (``rule``: the kernel it picks)."""
    rows = []
    sms = _num_sms(torch.device("cuda"))
    for batch in batches:
        for width in widths:
            g = torch.Generator().manual_seed(batch * width)
            scores = (513 + 2.3 * torch.randn(batch, width, generator=g)).cuda()
            scores[:, [0, -1]] = float("inf")
            table = torch.randperm(2 * batch * width, generator=g)[:batch * width].view(batch, width)
            table = table.to(torch.int32).cuda()
            lens = torch.full((batch,), width * page, dtype=torch.int32, device="cuda")
            for sel in SELECTS:
                plan = QuestPlan(table, lens, width // 16, page_size=page, num_q_heads=1, num_kv_heads=1, head_dim=16,
                                 q_dtype=torch.float16, scores=scores, select_split=sel == "split")
                row = {"section": "select_rule", "impl": "quest_select", "select": sel, "batch": batch,
                       "width": width, "budget_pages": width // 16, "page_size": page,
                       "time_us_graph": _time_graph(plan.select, rep_ms),
                       "rule": "split" if split_select(batch, width, sms) else "one"}
                rows.append(row)
                print_row(row)
    return rows


def sweep_rows(w: Workload, p: PagedKV, bounds: torch.Tensor, budget: int, reduce: str, rep_ms: float,
               copy_gbps: float) -> list[dict]:
    """Graph times of the scores kernel per tile / stages, of the select kernel per warps / radix and of the attend
    per split / tile / stages."""
    page = p.block_size
    qr = QuestRun(p, bounds, max(2, budget // page), reduce)
    qr()  # the table the attend variants read
    nb = qr.bytes()
    rows = []
    for part, sweep in (("quest_scores", SCORES_SWEEP), ("quest_select", SELECT_SWEEP)):
        for kw in sweep:
            run = QuestRun(p, bounds, qr.budget, reduce, quest_launch=kw)
            run.score()
            tg = _time_graph(run.score if part == "quest_scores" else run.select, rep_ms)
            rows.append(_row(w, part, budget, reduce, None, tg, nb[part], page, section="sweep",
                             launch=_launch_name(kw), copy_gbps=copy_gbps))
            print_row(rows[-1])
    s = qr.plan.num_splits
    variants = [{}, {"num_splits": max(1, s // 2)}, {"num_splits": 2 * s}, {"BLOCK_N": 64, "num_stages": 2},
                {"BLOCK_N": 64, "num_stages": 3}, {"num_stages": 2}, {"num_stages": 4}]
    for kw in variants:
        plan = DecodePlan(qr.table, qr.lens, layout="nhd", k_cache=p.k_cache, v_cache=p.v_cache,
                          num_q_heads=p.q.shape[1], q_dtype=p.q.dtype, max_seq_len=max(qr.sel_lens),
                          mean_seq_len=sum(qr.sel_lens) / w.batch, validate=False, **kw)
        fn = lambda plan=plan: plan.run(p.q, p.k_cache, p.v_cache, qr.out)  # noqa: E731
        tg = _time_graph(fn, rep_ms)
        rows.append(_row(w, "quest_attend", budget, reduce, None, tg, nb["quest_attend"], page, section="sweep",
                         launch=_launch_name({"num_splits": plan.num_splits, **kw}), config=dict(plan.config),
                         copy_gbps=copy_gbps))
        print_row(rows[-1])
    return rows


def run_gpu(batches, context: int, budgets, reduce: str, rep_ms: float, page_sizes=(16, 32),
            sweep: bool = True, selects=SELECTS) -> tuple[list[dict], dict]:
    copy_gbps = harness.copy_bandwidth_gbps()
    print(f"copy bandwidth {copy_gbps:.0f} GB/s", flush=True)
    rows = []
    for page in page_sizes:
        for batch in batches:
            rows += _run_one(workload(batch, context, page), page, budgets, reduce, rep_ms, copy_gbps, sweep, selects)
            gc.collect()
            torch.cuda.empty_cache()
    if sweep:
        rows += select_rule_rows(rep_ms)
    return rows, {"copy_gbps": copy_gbps}


def _run_one(w: Workload, page: int, budgets, reduce: str, rep_ms: float, copy_gbps: float, sweep: bool,
             selects=SELECTS) -> list:
    rows = []
    p = build_paged(w, layout="nhd", block_size=page, kv_dtype=torch.float16, device="cuda")
    rule = "split" if split_select(w.batch, p.block_table.shape[1], _num_sms(p.q.device)) else "one"
    bounds = page_bounds(p)
    out_full = torch.empty_like(p.q)
    full = DecodePlan(p.block_table, p.seq_lens, layout="nhd", k_cache=p.k_cache, v_cache=p.v_cache,
                      num_q_heads=p.q.shape[1], q_dtype=p.q.dtype, max_seq_len=p.max_seq_len,
                      mean_seq_len=sum(p.lens) / w.batch, validate=False)
    full_fn = lambda: full.run(p.q, p.k_cache, p.v_cache, out_full)  # noqa: E731
    full_bytes = sum(p.lens) * w.num_kv_heads * w.head_dim * 2 * 2 + 2 * p.q.numel() * 2 + p.block_table.numel() * 4
    t_full, tg_full = _time(full_fn, rep_ms)
    rows.append(_row(w, "full", None, None, t_full, tg_full, full_bytes, page, copy_gbps=copy_gbps))
    print_row(rows[-1])
    for budget in budgets:
        for i, sel in enumerate(selects):  # the whole path and the select alone per select kernel; the rest once
            qr = QuestRun(p, bounds, max(2, budget // page), reduce, quest_launch={"select_split": sel == "split"})
            qr()
            torch.cuda.synchronize()
            err = harness.rel_err(qr.out, restricted_ref(p, qr.table, qr.lens))
            t_ref, l_ref = select_pages(qr.scores, p.seq_lens, p.block_table, qr.budget, page_size=page)
            same = bool(torch.equal(qr.table, t_ref) and torch.equal(qr.lens, l_ref))
            rec = random_recall(p, qr.table)
            nb = qr.bytes()
            tag = dict(select=sel, select_default=sel == rule)
            t, tg = _time(qr, rep_ms)
            row = _row(w, "quest", budget, reduce, t, tg, nb["quest"], page, copy_gbps=copy_gbps, rel_err=err,
                       select_match=same, recall_random=rec, speedup=t_full / t if t else None,
                       speedup_graph=tg_full / tg if tg and tg_full else None, bytes_full=full_bytes,
                       bytes_ratio=full_bytes / nb["quest"], attend_config=dict(qr.plan.config), **tag)
            rows.append(row)
            print_row(row)
            parts = (("quest_scores", qr.score), ("quest_select", qr.select), ("quest_attend", qr.attend))
            for name, fn in parts if i == 0 else parts[1:2]:
                t_p, tg_p = _time(fn, rep_ms)
                rows.append(_row(w, name, budget, reduce, t_p, tg_p, nb[name], page, copy_gbps=copy_gbps,
                                 **(tag if name == "quest_select" else {})))
                print_row(rows[-1])
            torch.cuda.synchronize()  # the table again after the timed and replayed runs (the scratch reused)
            row["select_match_after"] = bool(torch.equal(qr.table, t_ref) and torch.equal(qr.lens, l_ref))
            del qr
    if sweep and budgets:
        rows += sweep_rows(w, p, bounds, budgets[0], reduce, rep_ms, copy_gbps)
    return rows


def real_recall_rows(budgets=REAL_BUDGETS, reduces=REDUCES, prompts=None, layers=None) -> list[dict]:
    """Recall of Quest's page choice on the captured SmolLM2-135M activations, averaged over prompts, layers and
    queries (each query attends to the prompt tokens before the last 16: ``workbench.model.capture.real_kv``)."""
    caps = capture.load()
    caps = caps if prompts is None else caps[:prompts]
    acc: dict[tuple, list] = {}
    for c in caps:
        n = c.k.shape[1] - c.q_last.shape[1]  # keys before the queries (decode-like)
        rows = range(len(c.layers)) if layers is None else range(min(layers, len(c.layers)))
        for i in rows:
            for budget in budgets:
                for red in reduces:
                    r = quest_recall(c.q_last[i], c.k[i, :n], REAL_PAGE, budget, reduce=red, sm_scale=c.sm_scale)
                    acc.setdefault((budget, red), []).append((r.shared.mean().item(), r.per_head.mean().item(),
                                                              r.oracle.mean().item(), n))
    out = []
    for (budget, red), v in acc.items():
        m = [sum(x[j] for x in v) / len(v) for j in range(4)]
        out.append({"section": "recall_real", "impl": "quest", "reduce": red, "budget_pages": budget,
                    "budget_tokens": budget * REAL_PAGE, "page_size": REAL_PAGE, "recall": m[0],
                    "recall_per_head": m[1], "recall_oracle": m[2], "mean_context": m[3], "samples": len(v),
                    "model": "SmolLM2-135M"})
    return out


def run_smoke(page_sizes=(16, 32), selects=SELECTS) -> list[dict]:
    """Tiny shapes through the active backend (the interpreter on a CPU): kernels against their references and
    Quest at a full budget against full decode, per page size (both reduces at the first) and select kernel.
    Correctness only."""
    dev = workbench.device()
    rows = []
    w = Workload("quest-smoke", "gqa-b2-l70", 2, 70, 8, 2, 64, min_context=20, seed=3)
    for i, page in enumerate(page_sizes):
        p = build_paged(w, layout="nhd", block_size=page, device=dev, seed=1)
        bounds = page_bounds(p)
        full = paged_decode_ref(p.q, p.k_cache, p.v_cache, "nhd", p.block_table, p.seq_lens)
        for reduce in ("max", "sum") if i == 0 else ("sum",):
            s = quest_page_scores(p.q, bounds, p.block_table, p.seq_lens, page_size=page, reduce=reduce,
                                  keep_first=1, keep_last=1)
            ref = quest_page_scores_ref(p.q, bounds, p.block_table, p.seq_lens, page, reduce, keep_first=1,
                                        keep_last=1)
            fin = torch.isfinite(ref)
            score_err = float((s.double()[fin] - ref[fin]).abs().max()) if fin.any() else 0.0
            same_inf = bool(torch.equal(torch.isinf(s), torch.isinf(ref)))
            for budget in (2, 3, 8) if i == 0 else (2, 8):
                for sel in selects:
                    qr = QuestRun(p, bounds, budget, reduce, quest_launch={"select_split": sel == "split"})
                    qr()
                    t_ref, l_ref = select_pages(s, p.seq_lens, p.block_table, budget, page_size=page)
                    same = bool(torch.equal(qr.table, t_ref) and torch.equal(qr.lens, l_ref))
                    err = harness.rel_err(qr.out, restricted_ref(p, qr.table, qr.lens))
                    row = _row(w, "quest", budget * page, reduce, None, None, qr.bytes()["quest"], page, rel_err=err,
                               score_err=score_err, scores_inf_match=same_inf, select_match=same, sweep="smoke",
                               select=sel)
                    if budget * page >= max(p.lens):
                        row["err_vs_full"] = harness.rel_err(qr.out, full)
                    rows.append(row)
    rows += real_recall_rows(budgets=(3,), reduces=("max", "sum"), prompts=1, layers=1)
    return rows


def print_row(row: dict) -> None:
    keys = ["section", "workload", "impl", "select", "batch", "width", "budget_tokens", "reduce", "launch", "time_us",
            "time_us_graph", "gbps", "speedup", "speedup_graph", "rel_err", "recall_random", "recall", "error"]
    print(" ".join(f"{k}={row[k]:.4g}" if isinstance(row[k], float) else f"{k}={row[k]}" for k in keys
                   if row.get(k) is not None), flush=True)


def select_list(text: str) -> list[str]:
    """``--select``: comma-separated names of :data:`SELECTS`, each once."""
    vals = [x.strip() for x in text.split(",") if x.strip()]
    if not vals or any(v not in SELECTS for v in vals) or len(set(vals)) != len(vals):
        raise argparse.ArgumentTypeError(f"expected comma-separated names among {', '.join(SELECTS)}, each once, "
                                         f"got {text!r}")
    return vals


def parser() -> BenchParser:
    ap = BenchParser("quest", __doc__, smoke=SMOKE_HELP, gpu=True)
    ap.add_argument("--context", type=positive_int, default=32768, help="tokens per sequence")
    ap.add_argument("--batches", type=positive_int_list, default=[8, 1], help="batch sizes, comma-separated")
    ap.add_argument("--budgets", type=positive_int_list, default=[2048, 4096, 1024, 8192], help="token budgets")
    ap.add_argument("--page-sizes", type=positive_int_list, default=[16, 32], help="tokens per page, comma-separated")
    ap.add_argument("--reduce", choices=("max", "sum"), default="sum", help="aggregate of the heads' bounds")
    ap.add_argument("--select", type=select_list, default=list(SELECTS),
                    help="select kernels to time, comma-separated: one (a program per sequence), split (many)")
    ap.add_argument("--rep-ms", type=positive_float, default=100.0, help="do_bench repetition time")
    ap.add_argument("--no-real", action="store_true", help="skip the recall on real activations")
    ap.add_argument("--no-sweep", action="store_true", help="skip the launch sweeps of the scores and the attend")
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = parser()
    args = ap.parse_args(argv)
    out = ap.start(args)  # checked before the run, not after
    if out is None:
        return 2
    meta = provenance.machine_meta()
    if args.smoke:
        rows, extra = run_smoke(args.page_sizes, args.select), {"mode": "smoke"}
    else:
        rows, extra = run_gpu(args.batches, args.context, args.budgets, args.reduce, args.rep_ms, args.page_sizes,
                              sweep=not args.no_sweep, selects=args.select)
        if not args.no_real:
            try:
                rows += real_recall_rows()
            except Exception as e:  # noqa: BLE001  (missing captures: the timings still get written)
                rows.append({"section": "recall_real", "impl": "quest", "error": f"{type(e).__name__}: {e}"[:200]})
        extra["mode"] = "full"
    run_files.print_table(rows, COLUMNS)
    path = run_files.write_results("quest", rows, meta, out, extra=extra)
    print(f"wrote {path}")
    bad = [r for r in rows if r.get("impl") == "quest" and r.get("section") == "timing"
           and (r.get("rel_err") is None or r["rel_err"] > 2e-2 or r.get("select_match") is False
                or r.get("select_match_after") is False or r.get("scores_inf_match") is False
                or (r.get("err_vs_full") or 0) > 2e-2)]
    return 1 if bad else 0
