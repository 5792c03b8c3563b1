"""Quest's recall on captured prompts: how much of the attention the chosen pages hold, per prompt, layer, page
size and budget (:func:`quest_recall_rows`), and averaged as ``python -m workbench bench quest`` measures it
(:func:`quest_recall_curves`, printed by :func:`format_recall_curves`).

Each observed query attends to the keys before it (a decode step); the page choice is
:mod:`workbench.compress.page_selection`'s. Pure functions returning tidy rows; no plots.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from workbench.compress.observation import observations
from workbench.compress.page_selection import page_key_bounds, page_upper_bounds, quest_recall, select_pages
from workbench.compress.policies import resolve_budget


def quest_recall_rows(captures: Sequence, page_sizes: Iterable[int] = (8, 16, 32),
                      page_budgets: Iterable[int | float] = (0.1, 0.25, 0.5), *, reduce: str = "max",
                      keep_first: int = 1, keep_last: int = 1, top_k: int = 16) -> list[dict]:
    """Quest's recall on every capture, per (prompt, layer, page size, page budget): the mean over the observed
    queries (each over the keys up to its position, a decode step) and query heads.

    A page budget is pages (int) or a share of the sequence's pages (float,
    :func:`~workbench.compress.policies.resolve_budget`), at least ``keep_first + keep_last``. Columns from
    ``workbench.compress.page_selection.quest_recall`` (the share of a head's attention mass inside the chosen pages):
    ``recall_per_head`` (each head its own pages, Quest's original), ``recall`` (one page set per query for all heads,
    ``reduce``: what a paged cache reads) and ``recall_oracle`` (the best single set: the true mass summed over heads);
    and ``recall_topk``, the issue's measure: the share of the true top-``top_k`` keys' attention mass inside the shared
    set (``page_selection.select_pages`` on the ``reduce`` scores).
    """
    rows = []
    for prompt, layers, obs in observations(captures):
        L, T, H, D = obs.k.shape
        W, G = obs.num_queries, obs.q.shape[2] // H
        for ps in page_sizes:
            for pb in page_budgets:
                acc = torch.zeros(L, 4, dtype=torch.float64)
                pages = []
                for i_w in range(W):
                    p = T - W + i_w
                    num_pages = -(-(p + 1) // ps)
                    n = max(resolve_budget(pb, num_pages), keep_first + keep_last)
                    pages.append(min(n, num_pages))
                    for i_l in range(L):
                        q, k = obs.q[i_l, i_w], obs.k[i_l, :p + 1]  # [Hq, D], [p + 1, Hkv, D]
                        kw = dict(keep_first=keep_first, keep_last=keep_last)
                        r = quest_recall(q, k, ps, n, reduce=reduce, sm_scale=obs.sm_scale, **kw)
                        scores = page_upper_bounds(q, page_key_bounds(k, ps), reduce, sm_scale=obs.sm_scale)
                        table, _ = select_pages(scores[None], torch.tensor([p + 1]), torch.arange(num_pages)[None],
                                                n, page_size=ps, **kw)
                        m_page = torch.zeros(num_pages, dtype=torch.bool)
                        m_page[table[0].long()] = True
                        m_tok = m_page.repeat_interleave(ps)[:p + 1]  # [p + 1]
                        attn = (torch.einsum("hd,thd->ht", q.float(), k.float().repeat_interleave(G, 1))
                                * obs.sm_scale).softmax(-1)  # [Hq, p + 1]
                        top = attn.topk(min(top_k, p + 1), -1)
                        topk = (top.values * m_tok[top.indices]).sum(-1) / top.values.sum(-1)  # [Hq]
                        acc[i_l] += torch.stack([r.per_head.mean(), r.shared.mean(), r.oracle.mean(),
                                                 topk.mean()]).double()
                acc /= W
                for i_l in range(L):
                    rows.append({"prompt": prompt, "layer": layers[i_l], "page_size": ps, "page_budget": pb,
                                 "pages": sum(pages) / W, "num_pages": -(-T // ps), "tokens": T,
                                 "recall_per_head": float(acc[i_l, 0]), "recall": float(acc[i_l, 1]),
                                 "recall_oracle": float(acc[i_l, 2]), "recall_topk": float(acc[i_l, 3])})
    return rows


def quest_recall_curves(captures: Sequence, page_sizes: Sequence[int] = (8, 16, 32, 64),
                        shares: Sequence[float] = (0.05, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5),
                        reduce: str = "sum") -> list[dict]:
    """Quest's recall on the captures as ``python -m workbench bench quest`` measures it (``real_recall_rows``): each
    prompt's 16 saved queries attend to the keys before them (``workbench.compress.page_selection.quest_recall``), a
    budget is a share of those keys' pages (at least the sink page and the newest), and everything is averaged over
    prompts, layers, queries and heads.

    Returns:
        Rows ``{page_size, share, pages (mean), read (mean share of the keys in the pages read), recall (one page
        set for all heads, ``reduce``), recall_per_head, recall_oracle, samples ((prompt, layer) pairs)}``.
    """
    rows = []
    for ps in page_sizes:
        for share in shares:
            acc = []
            for c in captures:
                n = c.k.shape[1] - c.q_last.shape[1]  # keys before the queries (decode-like)
                P = -(-n // ps)
                pages = min(P, max(2, resolve_budget(share, P)))
                read = n if pages >= P else (pages - 1) * ps + n - (P - 1) * ps  # the newest (partial) page is read
                for i in range(len(c.layers)):
                    r = quest_recall(c.q_last[i], c.k[i, :n], ps, pages, reduce=reduce, sm_scale=c.sm_scale)
                    acc.append((float(r.shared.mean()), float(r.per_head.mean()), float(r.oracle.mean()), pages,
                                read / n))
            m = [sum(a[j] for a in acc) / len(acc) for j in range(5)]
            rows.append({"page_size": ps, "share": share, "recall": m[0], "recall_per_head": m[1],
                         "recall_oracle": m[2], "pages": m[3], "read": m[4], "samples": len(acc)})
    return rows


def format_recall_curves(curves: Sequence[dict]) -> str:
    """:func:`quest_recall_curves`' rows as a text grid: a line per page size, a column per budget share, each
    cell ``read recall`` (the share of the keys read, the attention they hold)."""
    sizes = list(dict.fromkeys(r["page_size"] for r in curves))
    shares = list(dict.fromkeys(r["share"] for r in curves))
    lines = [f"{'pages of':>9}" + "".join(f"{s:>13.0%}" for s in shares)]
    for ps in sizes:
        lines.append(f"{ps:9d}" + "".join(f"  {r['read']:.2f} {r['recall']:.3f}" for r in curves
                                          if r["page_size"] == ps))
    return "\n".join(lines)
