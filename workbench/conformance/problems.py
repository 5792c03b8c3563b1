"""One conformance case, and the problem it builds: caches, tables, queries and the reference answer.

A :class:`Case` is data (op, layout, block size, head dim, heads, format, lengths, block-stride padding, seed) with a
one-line id that :meth:`Case.parse` reads back, so a failure can be replayed exactly. :meth:`Case.build` makes the
problem on a device, adversarially:

- the pool is filled with a poison byte (NaN where the format has one) and only the tokens of the batch are written:
  a kernel that reads past a sequence's end, a spare block or the block padding reads poison;
- blocks are handed out by a random permutation (a fragmented pool), and table entries past a sequence's blocks
  point at a poisoned block;
- the block stride may be padded (``pad`` elements, poisoned) and misaligned;
- ``out`` is pre-filled with NaN, so an element a kernel forgot to write is caught;
- the softmax scale is not ``1/sqrt(D)``.

The reference is float64 over the values the cache stores (dequantized), so the tolerance measures arithmetic only.
"""

from __future__ import annotations

import functools
import math
from dataclasses import asdict, dataclass, fields

import torch

from workbench import quant
from workbench.conformance.ops import OPS
from workbench.conformance.suite_formats import SUITE_FORMATS
from workbench.core.layout import Layout, block_view
from workbench.quant import blocks as qblocks

# The references (workbench.kernels.<op>.reference) are imported by the builders that use them: workbench.kernels
# imports Triton (0.36 s), which importing the conformance package does not otherwise need (builtin.py does the same)
SM_SCALE_FACTOR = 0.87  # the suite's softmax scale is this times 1/sqrt(D): an impl that ignores sm_scale fails


@dataclass(frozen=True)
class Case:
    """One case. ``lens``: context lengths (decode) or tokens written (write: one entry); ``shared``: leading
    blocks every sequence shares (shared_prefix); ``layers``: the copy op's pool layers; ``pairs``: copies."""

    op: str
    layout: str = "nhd"
    block_size: int = 16
    head_dim: int = 64
    num_kv_heads: int = 2
    group: int = 1
    kv_format: str = "fp16"
    lens: tuple[int, ...] = (37, 0, 1, 150)
    pad: int = 0
    seed: int = 0
    shared: int = 0
    layers: int = 1
    pairs: int = 0

    _SHORT = {"layout": "", "block_size": "bs", "head_dim": "d", "num_kv_heads": "hkv", "group": "g",
              "kv_format": "", "lens": "lens=", "pad": "pad", "seed": "seed", "shared": "shared", "layers": "L",
              "pairs": "pairs"}

    @property
    def id(self) -> str:
        """``decode/nhd/bs16/d64/hkv2/g4/fp16/lens=37,0,1,150/pad0/seed3`` (defaults of op-specific fields left out)."""
        parts = [self.op]
        for f in fields(self):
            if f.name == "op" or (f.name in ("shared", "layers", "pairs") and getattr(self, f.name) == f.default):
                continue
            v = getattr(self, f.name)
            v = ",".join(map(str, v)) if isinstance(v, tuple) else str(v)
            parts.append(self._SHORT[f.name] + v.replace("/", ":"))
        return "/".join(parts)

    @classmethod
    def parse(cls, case_id: str) -> Case:
        """The case of an :attr:`id` (ValueError naming the part it cannot read)."""
        if not isinstance(case_id, str):
            raise ValueError(f"case id must be a string, got {type(case_id).__name__}")
        parts = case_id.strip().split("/")
        if parts[0] not in OPS:
            raise ValueError(f"case id {case_id!r} must start with an op of {list(OPS)}")
        if len(parts) < 3:
            raise ValueError(f"case id {case_id!r} needs at least the op, the layout and the format")
        Layout.parse(parts[1])
        kw: dict = {"op": parts[0], "layout": parts[1]}
        by_prefix = sorted(((p, n) for n, p in cls._SHORT.items() if p), key=lambda t: -len(t[0]))
        for part in parts[2:]:
            for prefix, name in by_prefix:
                if part.startswith(prefix) and (name == "lens" or part[len(prefix):].lstrip("-").isdigit()):
                    val = part[len(prefix):]
                    try:
                        value = tuple(int(x) for x in val.split(",") if x) if name == "lens" else int(val)
                    except ValueError:
                        raise ValueError(f"case id part {part!r}: {name} must be integers") from None
                    break
            else:
                name, value = "kv_format", part.replace(":", "/")
                if value not in SUITE_FORMATS:
                    raise ValueError(f"case id part {part!r} is neither a field (bs16, d64, hkv2, g4, lens=..., "
                                     f"pad0, seed1, shared1, L1, pairs1) nor a format of {list(SUITE_FORMATS)}")
            if name in kw:
                raise ValueError(f"case id {case_id!r} gives {name} twice")
            kw[name] = value
        if "kv_format" not in kw:
            raise ValueError(f"case id {case_id!r} names no format")
        return cls(**kw)

    def replay(self) -> str:
        return f"python -m workbench check <impl> --op {self.op} --case '{self.id}'"

    def as_dict(self) -> dict:
        d = asdict(self)
        d["lens"] = list(self.lens)
        return d

    @property
    def num_q_heads(self) -> int:
        return self.num_kv_heads * self.group

    def check(self) -> None:
        """ValueError naming the first field a problem cannot be built from."""
        for name in ("block_size", "head_dim", "num_kv_heads", "group", "layers"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"case {name} must be an int >= 1, got {v!r}")
        for name in ("pad", "seed", "shared", "pairs"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"case {name} must be an int >= 0, got {v!r}")
        if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in self.lens):
            raise ValueError(f"case lens must be ints >= 0, got {self.lens!r}")
        if self.op != "copy" and not self.lens:
            raise ValueError("case lens must name at least one sequence (decode) or a token count (write)")
        Layout.parse(self.layout)
        _scheme(self)

    def build(self, device) -> dict:
        """The problem: the op's inputs by name (as the registry hands them out) plus ``"ref"`` (see the module)."""
        self.check()
        if self.op in ("decode", "shared_prefix"):
            return build_decode(self, device)
        if self.op == "write":
            return build_write(self, device)
        if self.op == "copy":
            return build_copy(self, device)
        raise ValueError(f"case op must be decode, shared_prefix, write or copy, got {self.op!r}")


def _scheme(case: Case) -> quant.Scheme:
    if case.kv_format not in SUITE_FORMATS:
        raise ValueError(f"kv_format must be one of {list(SUITE_FORMATS)}, got {case.kv_format!r}")
    return quant.get(case.kv_format)


def empty_pool(scheme: quant.Scheme, case: Case, kind: str, num_blocks: int, device) -> torch.Tensor:
    """One layer's poisoned K (or V) cache in the case's layout: blocks of codes (and scales) ``pad`` elements apart
    beyond their own size."""
    dtype = scheme.format.storage
    stride = qblocks.block_stride_bytes(scheme, case.block_size, case.num_kv_heads, case.head_dim) // dtype.itemsize
    if not scheme.scales_on_write:  # no scales: the block's own size, then the padding (misaligned if pad is odd)
        stride = qblocks.code_bytes(scheme, case.block_size, case.num_kv_heads, case.head_dim) // dtype.itemsize
    plane = torch.empty((num_blocks, stride + case.pad), dtype=dtype, device=device)
    plane.view(torch.uint8).fill_(SUITE_FORMATS[case.kv_format].poison)
    return block_view(plane, case.layout, kind, case.block_size, case.num_kv_heads,
                      qblocks.code_dim(scheme, case.head_dim))


@functools.lru_cache(maxsize=4096)
def row_alignment(case: Case) -> int:
    """The bytes every K/V row of the case's pools starts at a multiple of: the largest power of two (at most 256)
    dividing every stride of both views but the unit one, over the dimensions longer than 1 (a dimension of size 1,
    one token a block or one head, moves no row start). Unpadded fp16 rows of 64 give 128; a block stride padded
    by 3 fp16 elements gives 2, which a kernel loading 16 bytes at a time (FlashInfer) cannot read."""
    scheme = _scheme(case)
    g = 256
    for kind in "kv":
        view = empty_pool(scheme, case, kind, 2, "meta")  # strides only: nothing is allocated
        for size, stride in zip(view.shape, view.stride(), strict=True):
            if stride != 1 and size > 1:
                g = math.gcd(g, stride * view.element_size())
    return g & -g


def _tables(case: Case, g: torch.Generator) -> tuple[list[list[int]], int, int]:
    """Block lists per sequence (the first ``shared`` blocks common to all), the pool size and the poison block."""
    bs = case.block_size
    own = [max(0, -(-n // bs) - case.shared) for n in case.lens]
    used = case.shared + sum(own)
    num_blocks = used + 2  # a spare block, and the poisoned block that pads the table
    perm = torch.randperm(num_blocks, generator=g).tolist()
    common, pos, lists = perm[: case.shared], case.shared, []
    for n in own:
        lists.append(common + perm[pos: pos + n])
        pos += n
    return lists, num_blocks, perm[-1]


def csr_export(block_lists, lens, block_size: int, device) -> dict[str, torch.Tensor]:
    """FlashInfer's page-table CSR of a batch: ``kv_indptr`` [B + 1], ``kv_indices`` (every sequence's blocks in
    order) and ``kv_last_page_len`` (tokens in each last block; 0 for an empty sequence), int32."""
    indptr = [0]
    for blocks in block_lists:
        indptr.append(indptr[-1] + len(blocks))
    return {"kv_indptr": torch.tensor(indptr, dtype=torch.int32, device=device),
            "kv_indices": torch.tensor([int(x) for blocks in block_lists for x in blocks], dtype=torch.int32,
                                       device=device),
            "kv_last_page_len": torch.tensor([(n - 1) % block_size + 1 if n else 0 for n in lens], dtype=torch.int32,
                                             device=device)}


def build_decode(case: Case, device) -> dict:
    if case.shared and any(n < case.shared * case.block_size for n in case.lens):
        raise ValueError(f"lens must each cover the {case.shared} shared blocks, got {case.lens}")
    scheme = _scheme(case)
    g = torch.Generator().manual_seed(case.seed)
    B, H, D, bs = len(case.lens), case.num_kv_heads, case.head_dim, case.block_size
    lists, num_blocks, poison_block = _tables(case, g)
    width = max((len(x) for x in lists), default=0) + 1
    table = torch.full((B, width), poison_block, dtype=torch.int32)
    for b, blocks in enumerate(lists):
        table[b, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
    slots = sorted({blocks[p // bs] * bs + p % bs for blocks, n in zip(lists, case.lens, strict=True)
                    for p in range(n)})
    slots_t = torch.tensor(slots, dtype=torch.int64)
    fmt = SUITE_FORMATS[case.kv_format]
    k = (torch.randn(len(slots), H, D, generator=g) * 2.0).to(fmt.q_dtype)
    v = torch.randn(len(slots), H, D, generator=g).to(fmt.q_dtype)
    k_cache, v_cache = (empty_pool(scheme, case, kind, num_blocks, device) for kind in "kv")
    k_scale = v_scale = None
    if scheme.needs_static_scales:
        k_scale = scheme.calibrate(k if len(slots) else torch.ones(1, H, D)).reshape(-1).to(device)
        v_scale = scheme.calibrate(v if len(slots) else torch.ones(1, H, D)).reshape(-1).to(device)
    from workbench.kernels.decode.reference import paged_decode_ref
    from workbench.kernels.write.reference import dequantize_cache_ref, write_cache_ref

    if slots:
        write_cache_ref(scheme, k.to(device), v.to(device), k_cache, v_cache, case.layout, slots_t.to(device),
                        k_scale, v_scale)
    q = torch.randn(B, H * case.group, D, generator=g).to(fmt.q_dtype).to(device)
    sm_scale = SM_SCALE_FACTOR / math.sqrt(D)
    lens_t = torch.tensor(case.lens, dtype=torch.int32, device=device)
    table = table.to(device)
    kd, vd = (dequantize_cache_ref(scheme, c, case.layout, kind, D).double() for c, kind in ((k_cache, "k"),
                                                                                         (v_cache, "v")))
    if k_scale is not None:
        kd, vd = kd * k_scale.double().reshape(1, 1, -1, 1), vd * v_scale.double().reshape(1, 1, -1, 1)
    ref = paged_decode_ref(q, kd, vd, "nhd", table, lens_t, sm_scale=sm_scale)
    counts = torch.zeros(num_blocks, dtype=torch.int32)
    for blocks in lists:
        counts[blocks] += 1
    return {
        "q": q, "k_cache": k_cache, "v_cache": v_cache, "layout": case.layout, "block_size": bs,
        "block_table": table, "seq_lens": lens_t,
        **csr_export(lists, case.lens, bs, device),
        "max_seq_len": max(case.lens, default=0), "sm_scale": sm_scale, "k_scale": k_scale, "v_scale": v_scale,
        "quant": case.kv_format if scheme.scales_on_write else None, "kv_format": case.kv_format,
        "ref_counts": counts.to(device),
        "out": torch.full_like(q, float("nan")), "ref": ref,
    }


def build_write(case: Case, device) -> dict:
    """``lens[0]`` new tokens to random distinct slots of a pool filled with random bytes; ``ref``: the caches after
    the reference write, then both planes before it."""
    from workbench.kernels.write.reference import write_kv_ref

    scheme = _scheme(case)
    if scheme.scales_on_write:
        raise ValueError(f"the write op's cases take formats with static scales, got {case.kv_format!r}")
    g = torch.Generator().manual_seed(case.seed)
    T, H, D, bs = case.lens[0], case.num_kv_heads, case.head_dim, case.block_size
    num_blocks = max(2, -(-T // bs) + 2)
    slots = torch.randperm(num_blocks * bs, generator=g)[:T].to(torch.int64)
    fmt = SUITE_FORMATS[case.kv_format]
    key = (torch.randn(T, H, D, generator=g) * 2.0).to(fmt.q_dtype).to(device)
    value = torch.randn(T, H, D, generator=g).to(fmt.q_dtype).to(device)
    caches = []
    for kind in "kv":
        c = empty_pool(scheme, case, kind, num_blocks, device)
        raw = qblocks.plane_of(c).view(torch.uint8)
        raw.copy_(torch.randint(0, 256, raw.shape, generator=g, dtype=torch.uint8).to(device))
        if c.dtype.is_floating_point:  # random bytes hold NaNs; keep them only where nothing is written
            c.copy_(torch.nan_to_num(c.float(), nan=0.5).to(c.dtype))
        caches.append(c)
    k_scale = v_scale = None
    if scheme.needs_static_scales:
        k_scale = scheme.calibrate(key if T else torch.ones(1, H, D)).reshape(-1).to(device)
        v_scale = scheme.calibrate(value if T else torch.ones(1, H, D)).reshape(-1).to(device)
    ref_planes = [qblocks.plane_of(c).clone() for c in caches]
    before = [p.clone() for p in ref_planes]
    kr, vr = (block_view(p, case.layout, kind, bs, H, qblocks.code_dim(scheme, D))
              for p, kind in zip(ref_planes, "kv", strict=True))
    write_kv_ref(key, value, kr, vr, case.layout, slots.to(device), k_scale, v_scale)
    return {"key": key, "value": value, "k_cache": caches[0], "v_cache": caches[1], "layout": case.layout,
            "block_size": bs, "slot_mapping": slots.to(device), "k_scale": k_scale, "v_scale": v_scale,
            "kv_format": case.kv_format, "ref": (kr, vr, *before)}


def build_copy(case: Case, device) -> dict:
    """A ``[layers, 2, blocks, stride]`` pool of random bytes and ``pairs`` copies (one source forked twice when
    there are three or more); ``ref``: the pool after the reference copy."""
    from workbench.kernels.copy.reference import copy_blocks_ref

    g = torch.Generator().manual_seed(case.seed)
    dtype = quant.get(case.kv_format).format.storage
    stride = case.block_size * case.num_kv_heads * case.head_dim + case.pad
    n = case.pairs
    num_blocks = 2 * n + 3
    perm = torch.randperm(num_blocks, generator=g)
    src, dst = perm[:n].clone(), perm[n: 2 * n].clone()
    if n >= 3:
        src[2] = src[1]  # a fork: one block copied to two places
    raw = torch.randint(0, 256, (case.layers, 2, num_blocks, stride * dtype.itemsize), generator=g, dtype=torch.uint8)
    pool = raw.view(dtype).to(device)
    ref = pool.clone()
    copy_blocks_ref(ref, src.to(device), dst.to(device))
    return {"pool": pool, "src": src.to(torch.int32).to(device), "dst": dst.to(torch.int32).to(device), "ref": ref}
