"""What a decode kernel costs per byte, read from its machine code: no GPU needed.

A kernel that should stream K/V at copy bandwidth is limited by one of three things: bytes (it is at the limit),
issue slots (its loop runs more instructions per byte than the SMs can issue in the time the bytes take) or
occupancy (too few warps in flight to hide the loads: registers, shared memory). The first needs a GPU to
measure; the other two are in the compiled kernel. This module builds a decode plan as it would be built on the
GPU (``WORKBENCH_BACKEND=compile``: constexprs, launch defaults and the kernel it picks), compiles it ahead of time
for a target (sm_90a, the H100/H200) with the Triton in this environment, and reads the cubin with the
``cuobjdump`` that Triton's package carries: registers, spills, shared memory, and the SASS of the main loop (the
longest backward branch that holds the tile's MMAs) by instruction class. Then

- ``bytes_per_tile``: stored K/V bytes (codes, scales, zero points) a program's loop iteration reads (``BLOCK_N``
  tokens of one kv head);
- ``warp_instr_per_byte``: the loop's instructions times the program's warps, over ``bytes_per_tile``;
- ``issue_budget``: the warp instructions per byte the SMs can issue while the bytes arrive at copy bandwidth
  (``SMs x 4 schedulers x clock / bandwidth``: 132 x 4 x 1.98 GHz / 4.0 TB/s = 0.26 on the H200 at its measured
  copy rate); ``issue_fraction = warp_instr_per_byte / issue_budget`` above ~0.7 means the loop, not memory,
  sets the pace (the schedulers also need slack for the loads' latency).

``--kernel write``: the quantize-on-write of ``bench quant_decode``'s write section (a 32k-token fp16 chunk, 8 kv
heads of 128, into 16-token NHD pages; ``write_kv``'s launches, from ``kernels.write.write_launches``). A write
kernel has no main loop (one program per tile of tokens): :func:`hot_path` counts the instructions a program runs
when no rare path is taken (not the slow paths' calls, not the rare branch that counts non-finite inputs), and a
row sums them over every launch's programs and warps against the bytes the bench counts (the fp16 source read,
codes, scales and zero points written): the same ``warp_instr_per_byte`` and ``issue_fraction``.

``python -m workbench bench anatomy`` prints one row per scheme and workload; ``--out`` writes them. Compiler
versions differ (this machine's Triton against the GPU's): the counts are the design's shape, the GPU run is the
measure.
"""

from __future__ import annotations

import collections
import math
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import triton

from workbench import quant
from workbench.bench.command import BenchParser
from workbench.bench.quant_decode import PAGE, bench_scheme
from workbench.core.backend import is_interpreted
from workbench.core.workloads import WORKLOADS
from workbench.kernels import DecodePlan
from workbench.kernels.write import write_launches as launches_of
from workbench.quant import blocks as qblocks
from workbench.quant.names import ANATOMY_SCHEMES as SCHEMES
from workbench.quant.names import WRITE_BENCH_SCHEMES as WRITE_SCHEMES
from workbench.results import provenance, run_files

H200 = dict(sms=132, schedulers=4, clock_ghz=1.98, copy_tbps=4.0)  # copy rate: bench decode's measured ~4.0 TB/s
CLASSES = {  # SASS opcode -> what it spends issue slots on
    "mma": ("HMMA", "HGMMA", "IMMA", "QGMMA", "WARPGROUP"),
    "global": ("LDG", "LDGSTS", "STG", "UTMALDG", "LDGDEPBAR", "DEPBAR"),
    "shared": ("LDS", "STS", "LDSM", "STSM", "BAR", "SYNCS"),
    "convert": ("F2F", "I2F", "F2I", "F2FP", "I2FP", "F2IP"),
    "int": ("LOP3", "PRMT", "SHF", "IADD3", "IMAD", "LEA", "ISETP", "SEL", "IABS", "IMNMX", "BMSK", "SGXT", "LOP"),
    "fp": ("HFMA2", "HADD2", "HMUL2", "FFMA", "FMUL", "FADD", "FMNMX", "FSETP", "FSEL", "HMNMX2", "VHMNMX", "HSETP2"),
    "special": ("MUFU",),
    "move": ("MOV", "SHFL", "S2R", "S2UR", "R2UR", "UMOV", "ULDC", "CS2R", "R2P", "P2R"),
    "branch": ("BRA", "BSYNC", "BSSY", "WARPSYNC", "EXIT", "NOP", "YIELD"),
}


def _ensure_compile_backend(argv: list[str]) -> int | None:
    """Kernels decorated for the interpreter cannot be compiled: rerun this command in a process whose backend
    is ``compile`` (None when this one already compiles: a GPU, or ``WORKBENCH_BACKEND=compile``)."""
    if not is_interpreted():
        return None
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["WORKBENCH_BACKEND"] = "compile"
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton 3.9's default, said (it warns when unset)
    return subprocess.call([sys.executable, "-m", "workbench.bench.anatomy", *argv], env=env)


def decode_plan(scheme_name: str, workload: str = "W1", **launch):
    """``(plan, q, k_cache, v_cache)``: the plan a GPU would build for ``scheme_name`` on ``workload`` (its shape,
    lengths and batch), over a one-block cache (the plan trusts its table; nothing is launched)."""
    w = WORKLOADS[workload]
    scheme = bench_scheme(scheme_name, w.head_dim)
    page, H, D = 16, w.num_kv_heads, w.head_dim
    k_cache, v_cache = (qblocks.empty_cache(scheme, "nhd", kind, 1, page, H, D) for kind in "kv")
    sample = torch.ones(page, H, D)
    k_scale = scheme.calibrate(sample) if isinstance(scheme, quant.Scheme) else None
    v_scale = k_scale if k_scale is None else k_scale.clone()
    table = torch.zeros((w.batch, -(-w.context // page)), dtype=torch.int32)
    lens = torch.full((w.batch,), w.context, dtype=torch.int32)
    q_dtype = torch.bfloat16 if scheme.format.storage == torch.bfloat16 else torch.float16
    plan = DecodePlan(table, lens, layout="nhd", k_cache=k_cache, v_cache=v_cache, num_q_heads=w.num_q_heads,
                      q_dtype=q_dtype, max_seq_len=w.context, validate=False, quant=scheme, k_scale=k_scale,
                      v_scale=v_scale, **launch)
    q = torch.empty((w.batch, w.num_q_heads, D), dtype=q_dtype)
    return plan, q, k_cache, v_cache


def compile_call(kernel, args, constexprs, arch: int = 90):
    """Compile ``kernel`` for ``args`` / ``constexprs`` as its launcher would specialize them (pointers and ints
    divisible by 16 marked so, ints equal to 1 made constants) for ``sm_<arch>``; the compiled kernel."""
    # Triton's compiler internals, here: they move between Triton versions, and the SASS parsing needs none of them
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend, GPUTarget
    from triton.compiler import ASTSource

    options = {k: constexprs[k] for k in ("num_warps", "num_stages") if k in constexprs}
    names = kernel.arg_names
    values = dict(zip(names, args, strict=False))  # the rest: constexprs and defaults
    values.update({k: v for k, v in constexprs.items() if k not in options})
    signature, consts, attrs = {}, {}, {}
    for i, (name, param) in enumerate(zip(names, kernel.params, strict=True)):
        value = values[name] if name in values else param.default
        if param.is_constexpr:
            signature[name], consts[name] = "constexpr", value
            continue
        kind, spec = native_specialize_impl(BaseBackend, value, False, True, True)
        if kind == "constexpr":  # an int equal to 1
            signature[name], consts[name] = "constexpr", spec
            continue
        signature[name] = kind
        if isinstance(spec, str) and spec:
            attrs[(i,)] = BaseBackend.parse_attr(spec)
    src = ASTSource(kernel, signature, consts, attrs)
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options)


def _tool(name: str) -> str:
    path = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name
    if not path.exists():
        raise RuntimeError(f"{name} is not in this Triton's package ({path}): it ships with Triton's NVIDIA backend")
    return str(path)


def sass_of(cubin: bytes) -> tuple[str, str]:
    """``(sass, resource usage)`` text of a cubin, from cuobjdump."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        sass = subprocess.run([_tool("cuobjdump"), "-sass", f.name], capture_output=True, text=True, check=True)
        res = subprocess.run([_tool("cuobjdump"), "-res-usage", f.name], capture_output=True, text=True, check=True)
    return sass.stdout, res.stdout


_LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)([^;]*);")


def instructions(sass: str) -> list[tuple[int, str, str]]:
    """``(address, opcode, operands)`` of every instruction of the SASS text."""
    return [(int(m.group(1), 16), m.group(3), m.group(4).strip()) for m in _LINE.finditer(sass)]


_RARE = ("ATOM", "ATOMG", "RED", "REDG")  # a rare path's mark: a count of non-finite inputs
_SLOW_CALL = 16  # a predicated branch over a CALL in at most this many instructions skips a slow path's call


def hot_path(sass: str) -> list[tuple[int, str, str]]:
    """The instructions a program of a loop-less kernel runs when no rare path is taken: those reachable from the
    entry through the branches, not following a CALL (IEEE division's and 64-bit division's slow paths), nor the
    side of a predicated forward branch that holds an atomic before the two sides meet (a rare path's count of
    non-finite inputs), nor the fall-through of one that skips a CALL within a few instructions (a slow path).
    Both sides of other branches are counted: an upper bound where a kernel branches on its data."""
    lines = [(int(m.group(1), 16), bool(m.group(2)), m.group(3), m.group(4).strip()) for m in _LINE.finditer(sass)]
    index = {a: i for i, (a, _, _, _) in enumerate(lines)}
    base = [op.split(".")[0] for _, _, op, _ in lines]

    def target(i):
        m = re.search(r"0x([0-9a-f]+)", lines[i][3])
        return index.get(int(m.group(1), 16)) if m else None

    def region(lo, hi):  # instructions lo..hi-1, or from lo to the next unconditional BRA/EXIT when hi is None
        out = []
        for j in range(lo, len(lines) if hi is None else hi):
            out.append(base[j])
            if hi is None and base[j] in ("BRA", "EXIT", "RET") and not lines[j][1]:
                break
        return out

    seen, todo = set(), [0]
    while todo:
        i = todo.pop()
        if i is None or i in seen or i >= len(lines):
            continue
        seen.add(i)
        a, pred, op, _ = lines[i]
        if base[i] in ("EXIT", "RET"):
            todo += [i + 1] if pred else []
        elif base[i] == "BRA":
            t = target(i)
            if not pred:
                todo.append(t)
                continue
            if t is not None and t > i:
                fall, taken = region(i + 1, t), region(t, None)
                if any(o in _RARE for o in fall) or (len(fall) <= _SLOW_CALL and "CALL" in fall):
                    todo.append(t)
                    continue
                if any(o in _RARE for o in taken):
                    todo.append(i + 1)
                    continue
            todo += [t, i + 1]
        else:
            todo.append(i + 1)
    return [(lines[i][0], lines[i][2], lines[i][3]) for i in sorted(seen)]


def main_loop(instrs: list[tuple[int, str, str]]) -> list[tuple[int, str, str]]:
    """The instructions of the main loop: of the backward branches, the one whose body holds the most MMAs (then the
    longest). Empty when there is none."""
    best, best_key = [], (0, 0)
    addr = [a for a, _, _ in instrs]
    for i, (a, op, rest) in enumerate(instrs):
        if not op.startswith("BRA"):
            continue
        m = re.search(r"0x([0-9a-f]+)", rest)
        if not m or int(m.group(1), 16) > a:
            continue
        start = addr.index(int(m.group(1), 16)) if int(m.group(1), 16) in addr else None
        if start is None:
            continue
        body = instrs[start:i + 1]
        key = (sum(op.split(".")[0] in CLASSES["mma"] for _, op, _ in body), len(body))
        if key > best_key:
            best, best_key = body, key
    return best


def classify(body) -> dict[str, int]:
    """Instruction counts of ``body`` by class (``CLASSES``; ``other`` for the rest)."""
    out = collections.Counter()
    for _, op, _ in body:
        base = op.split(".")[0]
        out[next((c for c, ops in CLASSES.items() if base in ops), "other")] += 1
    return dict(out)


def resources(res: str) -> dict[str, int]:
    """``REG``, ``STACK``, ``SHARED``, ``LOCAL`` of the kernel from cuobjdump's resource usage."""
    out = {}
    for key in ("REG", "STACK", "SHARED", "LOCAL"):
        m = re.search(rf"\b{key}:(\d+)", res)
        out[key.lower()] = int(m.group(1)) if m else None
    return out


def anatomy(scheme_name: str, workload: str = "W1", arch: int = 90, gpu: dict = H200, **launch) -> dict:
    """One row: the plan's kernel and configuration, its resources and its main loop's cost per stored byte."""
    plan, q, k_cache, v_cache = decode_plan(scheme_name, workload, **launch)
    kernel, args, constexprs = plan.kernel_call(q, k_cache, v_cache)
    compiled = compile_call(kernel, args, constexprs, arch)
    sass, res = sass_of(compiled.asm["cubin"])
    body = main_loop(instructions(sass))
    r = resources(res)
    scheme = plan.quant
    D, block_n, warps = plan.head_dim, plan.config["BLOCK_N"], plan.config["num_warps"]
    per_token = scheme.bytes_per_token(1, D)  # K and V of one kv head, scales counted
    tile = block_n * per_token
    budget = gpu["sms"] * gpu["schedulers"] * gpu["clock_ghz"] * 1e9 / (gpu["copy_tbps"] * 1e12)
    per_byte = len(body) * warps / tile if body else None
    smem_kb = (r["shared"] or 0) + compiled.metadata.shared
    by_regs = 65536 // max(1, (r["reg"] or 1) * 32 * warps)
    return {
        "scheme": scheme_name, "workload": workload, "kernel": plan.config.get("kernel", "generic"),
        "arch": f"sm_{arch}",
        "BLOCK_N": block_n, "num_warps": warps, "num_stages": plan.config["num_stages"],
        "registers": r["reg"], "spill_bytes": r["local"], "shared_bytes": smem_kb,
        "programs_per_sm_by_registers": by_regs,
        "programs_per_sm_by_shared": (233472 // smem_kb) if smem_kb else None,
        "loop_instructions": len(body), **{f"loop_{k}": v for k, v in sorted(classify(body).items())},
        "bytes_per_token": per_token, "bytes_per_tile": tile,
        "warp_instr_per_byte": None if per_byte is None else round(per_byte, 4),
        "issue_budget": round(budget, 4),
        "issue_fraction": None if per_byte is None else round(per_byte / budget, 3),
    }


def write_launches(scheme_name: str, tokens: int = 32768, heads: int = 8, head_dim: int = 128, **launch):
    """``(scheme, launches, nbytes)``: the launches ``bench quant_decode``'s write section makes for ``scheme_name``
    (a ``tokens``-token fp16 chunk into 16-token NHD pages, all of it written; nothing launched) and the bytes it
    counts for them (the source read, codes, scales and zero points written)."""
    scheme = bench_scheme(scheme_name, head_dim)
    nb = -(-tokens // PAGE)
    caches = [qblocks.empty_cache(scheme, "nhd", kind, nb, PAGE, heads, head_dim) for kind in "kv"]
    key = torch.empty(tokens, heads, head_dim, dtype=torch.float16)
    slots = torch.arange(tokens)  # int64, as the bench's
    kw = dict(launch)
    if scheme.needs_static_scales:
        sample = torch.ones(PAGE, heads, head_dim)
        kw.update(k_scale=scheme.calibrate(sample), v_scale=scheme.calibrate(sample))
    elif scheme.quantized:
        kw.update(quant=scheme)
    launches = launches_of(key, key, caches[0], caches[1], "nhd", slots, launch=False, **kw)
    nbytes = 2 * key.numel() * key.element_size() + scheme.bytes_per_token(heads, head_dim) * tokens
    return scheme, launches, int(nbytes)


def write_anatomy(scheme_name: str, tokens: int = 32768, arch: int = 90, gpu: dict = H200, **launch) -> dict:
    """One row for a write (``bench quant_decode``'s write section, compiled): every launch's program compiled,
    its hot path (:func:`hot_path`: a write kernel has no main loop) times its warps and programs, over the bytes
    the write moves; the same columns as :func:`anatomy` (``loop_*``: the hot path, summed over the launches)."""
    scheme, launches, nbytes = write_launches(scheme_name, tokens, **launch)
    warp_instr, counts, per = 0, collections.Counter(), []
    for ln in launches:
        compiled = compile_call(ln.kernel, ln.args, ln.consts, arch)
        sass, res = sass_of(compiled.asm["cubin"])
        body, r = hot_path(sass), resources(res)
        warps, programs = ln.consts.get("num_warps", 4), math.prod(ln.grid)
        warp_instr += len(body) * warps * programs
        counts.update(classify(body))
        per.append(dict(kernel=ln.kernel.__name__, programs=programs, num_warps=warps, registers=r["reg"],
                        spill_bytes=r["local"], shared_bytes=(r["shared"] or 0) + compiled.metadata.shared,
                        instructions=len(body)))
    budget = gpu["sms"] * gpu["schedulers"] * gpu["clock_ghz"] * 1e9 / (gpu["copy_tbps"] * 1e12)
    per_byte = warp_instr / nbytes
    regs = max(p["registers"] for p in per)
    warps = max(p["num_warps"] for p in per)
    return {
        "scheme": scheme_name, "workload": f"write-{tokens // 1024}k", "kernel": "+".join(p["kernel"] for p in per),
        "arch": f"sm_{arch}", "counted": "hot path", "launches": per,
        "num_warps": warps, "registers": regs, "spill_bytes": max(p["spill_bytes"] or 0 for p in per),
        "shared_bytes": max(p["shared_bytes"] for p in per),
        "programs_per_sm_by_registers": 65536 // max(1, regs * 32 * warps),
        "loop_instructions": sum(p["instructions"] for p in per),
        **{f"loop_{k}": v for k, v in sorted(counts.items())},
        "bytes": nbytes, "bytes_per_tile": round(nbytes / sum(p["programs"] for p in per), 1),
        "warp_instr_per_byte": round(per_byte, 4), "issue_budget": round(budget, 4),
        "issue_fraction": round(per_byte / budget, 3),
    }


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = BenchParser("anatomy", __doc__)
    parser.add_argument("--kernel", choices=("decode", "write"), default="decode",
                        help="the decode plan's kernel (per workload), or the quantize-on-write of a 32k-token chunk")
    parser.add_argument("--schemes", default=None,
                        help=f"comma-separated scheme names (default: {','.join(SCHEMES)}; --kernel write: "
                             f"{','.join(WRITE_SCHEMES)})")
    parser.add_argument("--workloads", default="W1", help="comma-separated workloads (W1..W5)")
    parser.add_argument("--arch", type=int, default=90, help="the target's compute capability (90: sm_90a)")
    parser.add_argument("--planes", choices=("on", "off", "both"), default="both",
                        help="packed schemes: the planes and streams kernels (128-token tiles, 4 warps: bench "
                             "quant_decode's variants), the generic one, or all three")
    args = parser.parse_args(argv)
    out = parser.start(args)
    rerun = _ensure_compile_backend(argv)
    if rerun is not None:
        return rerun
    rows = []
    if args.kernel == "write":
        for name in (args.schemes or ",".join(WRITE_SCHEMES)).split(","):
            row = write_anatomy(name, arch=args.arch)
            rows.append(row)
            print(f"write {name:18s} {row['kernel']:40s} warps {row['num_warps']} regs {row['registers']} spill "
                  f"{row['spill_bytes']} {row['loop_instructions']:5d} instr ({row.get('loop_int', 0)} int, "
                  f"{row.get('loop_fp', 0)} fp, {row.get('loop_convert', 0)} cvt) {row['warp_instr_per_byte']} "
                  f"warp-instr/B = {row['issue_fraction']} of the issue budget", flush=True)
    for w in args.workloads.split(",") if args.kernel == "decode" else ():
        for name in (args.schemes or ",".join(SCHEMES)).split(","):
            packed = [dict(planes=True, streams=0), dict(planes=True, BLOCK_N=128, num_warps=4)]
            variants = {"on": packed, "off": [dict(planes=False)], "both": [*packed, dict(planes=False)]}[args.planes]
            seen = set()
            for launch in variants:
                row = anatomy(name, w, args.arch, **launch)
                if row["kernel"] in seen:
                    continue  # a scheme the planes or streams kernel does not take: one row each
                seen.add(row["kernel"])
                rows.append(row)
                print(f"{w} {name:18s} {row['kernel']:8s} BLOCK_N {row['BLOCK_N']:4d} warps {row['num_warps']} "
                      f"regs {row['registers']} spill {row['spill_bytes']} loop {row['loop_instructions']:5d} instr "
                      f"({row.get('loop_mma', 0)} mma, {row.get('loop_int', 0)} int, {row.get('loop_fp', 0)} fp, "
                      f"{row.get('loop_convert', 0)} cvt) {row['warp_instr_per_byte']} warp-instr/B = "
                      f"{row['issue_fraction']} of the issue budget", flush=True)
    meta = dict(provenance.machine_meta(), gpu=f"sm_{args.arch}a-ahead-of-time")  # compiled here, run nowhere
    path = run_files.write_results("anatomy", rows, meta, out)
    print(f"rows: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
