"""What a generation does to the paged cache, as plain data: block-table snapshots taken while a
:class:`~workbench.model.Runner` runs, the grid a figure draws from one, and the sharing counts over a run.

    rec = record(model, [tok.chat("Name a fruit."), tok.chat("Name a colour.")], 16, n=2, temperature=0.8)
    rec.snapshots[-1].tables            # every sequence's block table after the last decode step
    block_grid(rec.snapshots[3])        # sequences x logical blocks: physical id, ref count, fill, what changed
    timeline(rec.snapshots)             # per snapshot: blocks in use, shared, copy-on-write copies, prefix hits

A snapshot is taken after every prefill (``"prefill"``), every fork (``"fork"``: ``n > 1`` samples of a prompt)
and every decode step (``"step"``). Ref counts are recomputed from the tables (a block's users are exactly the
sequences whose table holds it: the prefix cache holds no reference), so a snapshot needs nothing but the
manager's tables. No plotting here: ``workbench.figures.model`` draws these. A quantized cache's greedy run
against fp16's is :mod:`workbench.model.agreement`.
"""

from __future__ import annotations

import json
import statistics
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from workbench.cache import PagedKVCache
from workbench.model import capture  # capture_kv and kv_stats looked up at call time (tests replace them)
from workbench.model.kv import PagedKV
from workbench.model.runner import Generation, Runner

EVENTS = ("prefill", "fork", "step")


@dataclass(frozen=True)
class Snapshot:
    """The block manager's tables at one moment of a run.

    Attributes:
        index: position in the run (0 = after the first prefill).
        event: ``"prefill"``, ``"fork"`` or ``"step"``: what just happened.
        seq_ids: every sequence in the cache, in the order they were added (``(prompt, sample)`` ids).
        tables: each sequence's block table (physical block ids, logical order).
        tokens: each sequence's tokens in the cache (prompt, then the generated tokens fed back so far).
        block_size: tokens per block.
        prefix_hit_blocks: prefix-cache hits so far (full blocks a prompt found already cached).
    """

    index: int
    event: str
    seq_ids: tuple
    tables: tuple[tuple[int, ...], ...]
    tokens: tuple[tuple[int, ...], ...]
    block_size: int
    prefix_hit_blocks: int

    @property
    def num_tokens(self) -> tuple[int, ...]:
        return tuple(len(t) for t in self.tokens)


def snapshot(manager, event: str, index: int = 0) -> Snapshot:
    """The tables of a :class:`~workbench.allocator.BlockManager` now (one block size per snapshot)."""
    if event not in EVENTS:
        raise ValueError(f"event must be one of {EVENTS}, got {event!r}")
    ids = tuple(manager.seq_ids)
    sizes = {manager.block_size(s) for s in ids}
    if len(sizes) > 1:
        raise ValueError(f"sequences use several block sizes {sorted(sizes)}: a snapshot draws one")
    bs = sizes.pop() if sizes else manager.pool.block_sizes[0]
    return Snapshot(index, event, ids, tuple(tuple(manager.block_table(s)) for s in ids),
                    tuple(tuple(manager.tokens(s)) for s in ids), bs, manager.pool.hits)


def ref_counts(snap: Snapshot) -> dict[int, int]:
    """Physical block -> the sequences holding it."""
    return dict(Counter(b for t in snap.tables for b in t))


def seq_label(seq_id) -> str:
    """``(prompt, sample)`` -> ``"p0 s1"``; other ids as ``str``."""
    if isinstance(seq_id, tuple) and len(seq_id) == 2:
        return f"p{seq_id[0]} s{seq_id[1]}"
    return str(seq_id)


@dataclass(frozen=True)
class Grid:
    """One snapshot as a sequences x logical blocks grid (``None`` past a sequence's last block, and in the whole
    row of a sequence that does not exist yet).

    Attributes:
        rows: a label per sequence (:func:`seq_label`).
        block: ``[rows][width]`` physical block id.
        refs: ``[rows][width]`` that block's ref count (2 or more: shared).
        fill: ``[rows][width]`` tokens of this sequence in the block (``block_size`` when full).
        new: ``[rows][width]`` True where the block is in no table of the previous snapshot: just allocated, or
            the destination of a copy-on-write (a fork or a prefix hit only adds users to existing blocks); all
            False without a previous snapshot.
        block_size: tokens per block.
    """

    rows: list[str]
    block: list[list[int | None]]
    refs: list[list[int | None]]
    fill: list[list[int | None]]
    new: list[list[bool]]
    block_size: int

    @property
    def width(self) -> int:
        return len(self.block[0]) if self.block else 0


def block_grid(snap: Snapshot, prev: Snapshot | None = None, width: int | None = None,
               seq_ids: Sequence | None = None) -> Grid:
    """``snap`` as a :class:`Grid` ``width`` logical blocks wide (default: the longest table).

    Args:
        prev: the snapshot before it, for the ``new`` mask.
        width: columns (at least the longest table: a run's longest keeps the grid still while it is replayed).
        seq_ids: the rows (default ``snap``'s sequences; a run's last snapshot's keeps every row in place, those not
            created yet empty).
    """
    longest = max((len(t) for t in snap.tables), default=0)
    width = longest if width is None else width
    if width < longest:
        raise ValueError(f"width must be at least the longest block table ({longest}), got {width}")
    tables = dict(zip(snap.seq_ids, zip(snap.tables, snap.num_tokens, strict=True), strict=True))
    seq_ids = list(snap.seq_ids) if seq_ids is None else list(seq_ids)
    missing = [s for s in snap.seq_ids if s not in seq_ids]
    if missing:
        raise ValueError(f"seq_ids must hold every sequence of the snapshot, {missing} missing")
    refs = ref_counts(snap)
    before = set(ref_counts(prev)) if prev is not None else None
    bs = snap.block_size
    out = {"block": [], "refs": [], "fill": [], "new": []}
    for s in seq_ids:
        table, n = tables.get(s, ((), 0))
        pad = [None] * (width - len(table))
        out["block"].append(list(table) + pad)
        out["refs"].append([refs[b] for b in table] + pad)
        out["fill"].append([min(bs, n - i * bs) for i in range(len(table))] + pad)
        out["new"].append([before is not None and b not in before for b in table] + [False] * len(pad))
    return Grid([seq_label(s) for s in seq_ids], block_size=bs, **out)


def copies_between(prev: Snapshot, snap: Snapshot) -> int:
    """Copy-on-write copies from ``prev`` to ``snap``: entries of a sequence's table that now name another block
    (during generation only copy-on-write rewrites an entry; appends only extend a table)."""
    before = dict(zip(prev.seq_ids, prev.tables, strict=True))
    n = 0
    for s, table in zip(snap.seq_ids, snap.tables, strict=True):
        old = before.get(s, ())
        n += sum(1 for a, b in zip(old, table, strict=False) if a != b)
    return n


def counts(snap: Snapshot) -> dict[str, int]:
    """``sequences``, ``tokens`` (in all tables), ``blocks_in_use`` (distinct physical blocks), ``blocks_unshared``
    (what the tables would take with no sharing), ``shared_blocks`` (ref count 2 or more) and
    ``prefix_hit_tokens`` (prompt tokens found in the prefix cache so far)."""
    refs = ref_counts(snap)
    return {"sequences": len(snap.seq_ids), "tokens": sum(snap.num_tokens), "blocks_in_use": len(refs),
            "blocks_unshared": sum(len(t) for t in snap.tables),
            "shared_blocks": sum(1 for r in refs.values() if r > 1),
            "prefix_hit_tokens": snap.prefix_hit_blocks * snap.block_size}


def timeline(snaps: Sequence[Snapshot]) -> list[dict]:
    """Per snapshot: ``index``, ``event``, :func:`counts` and ``cow_copies`` (copy-on-write copies so far)."""
    out, cow = [], 0
    for i, s in enumerate(snaps):
        if i:
            cow += copies_between(snaps[i - 1], s)
        out.append({"index": s.index, "event": s.event, **counts(s), "cow_copies": cow})
    return out


class Recorder:
    """``observe`` for a :class:`~workbench.model.Runner` (and forks, through :class:`RecordingKV`): a
    :class:`Snapshot` of ``manager`` after each event; ``on_snapshot(snap)`` sees each as it is taken."""

    def __init__(self, manager, on_snapshot: Callable[[Snapshot], None] | None = None):
        self.manager, self.on_snapshot = manager, on_snapshot
        self.snapshots: list[Snapshot] = []

    def __call__(self, event: str, runner=None, seq_ids=None) -> None:
        snap = snapshot(self.manager, event, len(self.snapshots))
        self.snapshots.append(snap)
        if self.on_snapshot is not None:
            self.on_snapshot(snap)


class RecordingKV(PagedKV):
    """A :class:`~workbench.model.PagedKV` that also reports every fork to ``recorder`` (the runner reports
    prefills and steps)."""

    def __init__(self, cache, recorder: Recorder, q_dtype=None):
        super().__init__(cache, q_dtype)
        self.recorder = recorder

    def fork(self, parent, child) -> None:
        super().fork(parent, child)
        self.recorder("fork", None, [child])


@dataclass
class Recorded:
    """A generation and the snapshots taken while it ran (the cache's sequences are freed at the end)."""

    generation: Generation
    snapshots: list[Snapshot]
    prompts: list[list[int]]
    kv_dtype: str
    page_tokens: int
    ops: str
    seconds: float
    params: dict = field(default_factory=dict)  # max_new_tokens, n, temperature, seed
    quantized_tokens: dict = field(default_factory=dict)  # seq_id -> tokens stored as codes at the end (KIVI: the
    # newest ones stay in an fp16 residual; other schemes: all of them)
    prefilled: list | None = None  # per prompt, the workbench.model.quality.Prefilled the run started from (if given)

    def generated(self, snap: Snapshot) -> dict:
        """Sequence id -> the generated tokens already in the cache at ``snap`` (the newest chosen token is fed,
        and so stored, at the next step)."""
        return {s: list(t[len(self.prompts[s[0]]):]) for s, t in zip(snap.seq_ids, snap.tokens, strict=True)}


def pages_needed(prompts: Sequence[Sequence[int]], max_new_tokens: int, n: int, page_tokens: int) -> int:
    """Pages for every sample of every prompt to own all its blocks, plus one copy-on-write block each."""
    return sum(n * (-(-(len(p) + max_new_tokens) // page_tokens) + 1) for p in prompts) + 1


def record(model, prompts: Sequence[Sequence[int]], max_new_tokens: int, *, n: int = 1, temperature: float = 0.0,
           seed: int = 0, kv_dtype: str = "fp16", page_tokens: int = 16, ops: str | None = None,
           k_scale=None, v_scale=None, on_snapshot: Callable[[Snapshot], None] | None = None,
           prefilled: Sequence | None = None) -> Recorded:
    """Generate through a fresh :class:`~workbench.cache.PagedKVCache` sized for the run, recording its tables.

    Args:
        model: a :class:`~workbench.model.Llama`; the cache lives on its device.
        prompts: token ids per prompt; ``n`` samples of each (forked after its prefill).
        max_new_tokens, temperature, seed: as :meth:`Runner.generate` (greedy at ``temperature=0``).
        kv_dtype: a ``workbench.quant`` scheme name (static ones need ``k_scale``/``v_scale``; KIVI needs
            ``page_tokens`` a multiple of 32).
        ops: ``"kernels"`` (Triton) or ``"torch"`` (the references); default kernels on a GPU, torch elsewhere.
        on_snapshot: called with each :class:`Snapshot` as it is taken (a notebook draws the run live).
        prefilled: per prompt, its prefill made before (``workbench.model.quality.prefill_all``) or None, as
            :meth:`Runner.generate` takes it: the same run without computing those prefills again.
    """
    cfg = model.config
    prompts = [[int(t) for t in p] for p in prompts]
    ops = ops or ("kernels" if model.device.type == "cuda" else "torch")
    cache = PagedKVCache(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim,
                         pages_needed(prompts, max_new_tokens, n, page_tokens), page_tokens=page_tokens,
                         kv_dtype=kv_dtype, device=model.device, ops=ops, k_scale=k_scale, v_scale=v_scale)
    rec = Recorder(cache.manager, on_snapshot)
    runner = Runner(model, RecordingKV(cache, rec), observe=rec)
    t0 = time.perf_counter()
    g = runner.generate(prompts, max_new_tokens, n=n, temperature=temperature, seed=seed, free=False,
                        prefilled=prefilled)
    seconds = time.perf_counter() - t0
    quantized = {s: cache.quantized_tokens(s) for s in cache.manager.seq_ids}
    for s in list(cache.manager.seq_ids):
        cache.free(s)
    return Recorded(g, rec.snapshots, prompts, cache.scheme.name, page_tokens, ops, seconds,
                    {"max_new_tokens": max_new_tokens, "n": n, "temperature": temperature, "seed": seed}, quantized,
                    None if prefilled is None else list(prefilled))


def chat_prompts(tok, text: str, system: str | None = None) -> list[list[int]]:
    """One prompt per non-empty line of ``text``, each in SmolLM2's chat template (``tok.chat``): the prompts
    share the template's system prompt, so the second and later ones find its full blocks in the prefix cache.
    ``system=None`` keeps the tokenizer's default system prompt."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return [tok.chat(line) if system is None else tok.chat(line, system) for line in lines]


# ---- K/V statistics of the captured prompts (workbench.model.capture) ----------------------------------------------
def kv_stats_sources(path=None) -> dict[str, dict]:
    """The statistics ``python -m workbench capture`` saved (``stats.json`` in ``path``, default
    ``data/activations``), by source: ``"average of N prompts"`` then each prompt by name, each
    ``{"layers": [...], "tokens": T or None}`` with layers as :func:`workbench.model.capture.kv_stats` gives them
    (``absmax`` per channel included: a prompt's comes from its ``.npz``; a prompt without it is left out).
    ``{}`` when there is no ``stats.json``."""
    root = Path(path) if path is not None else capture.DEFAULT_PATH
    f = root / "stats.json"
    if not f.is_file():
        return {}
    stats = json.loads(f.read_text())
    out = {}
    avg = stats.get("average")
    if avg and all("absmax" in d["k_pre"] for d in avg["layers"]):
        out[f"average of {avg.get('prompts', len(stats.get('prompts', [])))} prompts"] = {"layers": avg["layers"],
                                                                                          "tokens": None}
    npz = {p.stem.split("_", 1)[-1]: p for p in sorted(root.glob("[0-9][0-9]_*.npz"))}
    for p in stats.get("prompts", []):
        layers = p["layers"]
        if not all("absmax" in d["k_pre"] for d in layers):
            if p["name"] not in npz:
                continue
            with np.load(npz[p["name"]]) as z:
                if "absmax" not in z.files:
                    continue
                a = z["absmax"].astype(np.float32)  # [k_pre / k / v, L, H, D]
            layers = [{**d, **{n: {**d[n], "absmax": a[i, li].tolist()} for i, n in enumerate(("k_pre", "k", "v"))}}
                      for li, d in enumerate(layers)]
        out[p["name"]] = {"layers": layers, "tokens": p.get("tokens")}
    return out


# ---- what notebook 06 prints: plain text of the runs and statistics above ----------------------------------------
def common_prefix(*seqs: Sequence[int]) -> int:
    """How many leading tokens every sequence of ``seqs`` shares (the shortest's length when one is a prefix of
    the others; 0 for no sequence)."""
    if not seqs:
        return 0
    n = 0
    for column in zip(*seqs, strict=False):
        if any(t != column[0] for t in column[1:]):
            break
        n += 1
    return n


def describe_layout(cfg, cache, page_tokens: int = 16) -> str:
    """Two lines: one token's K and V bytes per layer and in all layers (fp16), then the cache's pool shape and
    a ``page_tokens``-token block's bytes per layer and plane and in all layers and both planes."""
    row = cfg.num_key_value_heads * cfg.head_dim * 2  # bytes of one token's K (or V) in one layer, fp16
    block = cache.block_stride(page_tokens) * 2  # fp16 elements -> bytes, one layer, one plane
    return (f"{cfg.num_hidden_layers} layers x {cfg.num_key_value_heads} kv heads x {cfg.head_dim} dims "
            f"({cfg.num_attention_heads} query heads): {row} B of K and {row} B of V per token and layer, "
            f"{cfg.kv_bytes_per_token} B per token in all layers\n"
            f"pool {tuple(cache.pool.shape)} (layers, K/V, pages, elements); a {page_tokens}-token block: "
            f"{block} B per layer and plane, {block * 2 * cfg.num_hidden_layers} B in all")


def describe_prompts(tok, text: str, prompts: Sequence[Sequence[int]], page_tokens: int = 16) -> str:
    """Per prompt line of ``text`` (as :func:`chat_prompts` splits it), its tokens as full blocks and the rest,
    then how many leading tokens the prompts share and the text of the first block."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if len(lines) != len(prompts):
        raise ValueError(f"prompts must hold one token list per non-empty line of text: {len(lines)} lines, "
                         f"{len(prompts)} prompts")
    out = [f"{line!r:18}: {len(p)} tokens = {len(p) // page_tokens} full blocks + {len(p) % page_tokens} tokens "
           f"in block {len(p) // page_tokens}" for line, p in zip(lines, prompts, strict=True)]
    out.append(f"the prompts agree on their first {common_prefix(*prompts)} tokens: "
               f"{tok.decode(list(prompts[0][:page_tokens]))!r} fills block 0")
    return "\n".join(out)


def describe_tokens(tok, tokens: dict) -> str:
    """One line per sequence of a generation's ``tokens`` (``{(prompt, sample): ids}``): its id, the token ids
    and their text."""
    return "\n".join(f"{s} {list(t)} {tok.decode(list(t))!r}" for s, t in tokens.items())


def same_tokens(a: Generation, b: Generation, sample: int = 0) -> bool:
    """Whether sample ``sample`` of every prompt of ``b`` has the same tokens in ``a`` (a paged run against the
    contiguous baseline: False when ``a`` lacks one)."""
    keys = [k for k in b.tokens if k[1] == sample]
    return bool(keys) and all(k in a.tokens and list(a.tokens[k]) == list(b.tokens[k]) for k in keys)


def format_timeline(snaps: Sequence[Snapshot], upto: int = 5) -> str:
    """A table of :func:`timeline`: every snapshot up to index ``upto``, then only prefills, forks and the last
    (decode steps in between change little), each with every sequence's block table."""
    lines = [f"{'#':>2} {'event':8} {'seqs':>4} {'tokens':>6} {'in use':>6} {'unshared':>8} {'shared':>6} "
             f"{'CoW':>3}  tables"]
    rows = timeline(snaps)
    for i, (row, snap) in enumerate(zip(rows, snaps, strict=True)):
        if row["event"] != "step" or row["index"] <= upto or i == len(snaps) - 1:
            lines.append(f"{row['index']:2d} {row['event']:8} {row['sequences']:4d} {row['tokens']:6d} "
                         f"{row['blocks_in_use']:6d} {row['blocks_unshared']:8d} {row['shared_blocks']:6d} "
                         f"{row['cow_copies']:3d}  {[list(t) for t in snap.tables]}")
    return "\n".join(lines)


def kv_stats_or_capture(model, tokens: Sequence[int], name: str, path=None) -> dict[str, dict]:
    """:func:`kv_stats_sources` (the committed ``stats.json``), or, when there is none, the statistics of one
    prompt captured now (a prefill: a second or two), as ``{"<name> (captured now)": {"layers", "tokens"}}``."""
    sources = kv_stats_sources(path)
    if sources:
        return sources
    st = capture.kv_stats(capture.capture_kv(model, tokens, name=name))
    return {f"{name} (captured now)": {"layers": st["layers"], "tokens": st["tokens"]}}


def format_kv_stats(stats: dict, every: int = 4) -> str:
    """A table of one source's statistics, every ``every``-th layer and the last: each kv head's largest key
    channel over the median one before RoPE, its top channel, the same ratio after RoPE, and the attention sink
    (the last query's share on token 0 and on tokens 0-3)."""
    layers = stats["layers"]
    shown = layers[::every] + ([layers[-1]] if (len(layers) - 1) % every else [])
    lines = [f"{'layer':>5} {'k_pre max/med (heads)':>22} {'top ch':>8} {'k max/med':>16} {'sink0':>6} {'sink0-3':>7}"]
    for d in shown:
        lines.append(f"{d['layer']:5d} {' '.join(f'{x:4.1f}' for x in d['k_pre']['ratio']):>22} "
                     f"{' '.join(str(t[0]) for t in d['k_pre']['top3']):>8} "
                     f"{' '.join(f'{x:4.1f}' for x in d['k']['ratio']):>16} {d['sink0']:6.2f} {d['sink4']:7.2f}")
    return "\n".join(lines)


def kv_stats_summary(stats: dict, channels: Sequence[int] = ()) -> dict:
    """What one source's statistics come to, over every layer and kv head: ``layer_heads``, ``top_in_channels``
    (layer-heads whose largest pre-RoPE key channel is one of ``channels``), the largest-over-median key channel
    ratio before RoPE (``ratio_min``, ``ratio_max``), how much lower it is after RoPE (``rope_drop_median``,
    ``rope_drop_max``: 1 - after / before), and the largest attention sink on token 0 (``sink0_max``) and its
    layer (``sink0_max_layer``). Floats rounded to 3 digits."""
    layers = stats["layers"]
    pre = [r for d in layers for r in d["k_pre"]["ratio"]]
    post = [r for d in layers for r in d["k"]["ratio"]]
    drop = [1 - b / a for a, b in zip(pre, post, strict=True)]
    top = [t[0] for d in layers for t in d["k_pre"]["top3"]]
    sink = max(layers, key=lambda d: d["sink0"])
    return {"layer_heads": len(pre), "top_in_channels": sum(t in set(channels) for t in top),
            "ratio_min": round(min(pre), 3), "ratio_max": round(max(pre), 3),
            "rope_drop_median": round(statistics.median(drop), 3), "rope_drop_max": round(max(drop), 3),
            "sink0_max": round(sink["sink0"], 3), "sink0_max_layer": sink["layer"]}
