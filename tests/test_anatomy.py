"""The anatomy of a decode kernel (workbench.bench.anatomy): SASS parsed into instructions, the main loop found as
the backward branch around the MMAs, instructions classed, resources read; and one run that compiles the fp16 and
the packed-groups kernels for sm_90a on this machine (no GPU) and writes rows, the planes kernel among them (so a
kernel that only the interpreter accepts fails here, not on the GPU)."""

import json
import subprocess
import sys

from workbench.bench import anatomy

SASS = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
        /*0010*/                   LDG.E.128 R4, desc[UR4][R2.64] ;
        /*0020*/                   HMMA.16816.F32 R8, R4, R6, R8 ;
        /*0030*/                   PRMT R9, R4, 0x5140, R7 ;
        /*0040*/               @P0 BRA 0x20 ;
        /*0050*/                   FFMA R2, R3, R4, R5 ;
        /*0060*/                   ISETP.GE.AND P1, PT, R2, R3, PT ;
        /*0070*/              @!P1 BRA 0x50 ;
        /*0080*/                   EXIT ;
"""


def test_the_main_loop_is_the_backward_branch_around_the_mmas():
    instrs = anatomy.instructions(SASS)
    assert [op for _, op, _ in instrs][:3] == ["MOV", "LDG.E.128", "HMMA.16816.F32"]
    assert len(instrs) == 9
    body = anatomy.main_loop(instrs)  # the loop at 0x50 is longer by nothing and holds no MMA
    assert [a for a, _, _ in body] == [0x20, 0x30, 0x40]
    assert anatomy.classify(body) == {"mma": 1, "int": 1, "branch": 1}
    assert anatomy.main_loop(anatomy.instructions("/*0000*/ EXIT ;")) == []


def test_resources_are_read_from_cuobjdump():
    text = "Function _k:\n REG:168 STACK:0 SHARED:1024 LOCAL:8 CONSTANT[0]:592 TEXTURE:0"
    assert anatomy.resources(text) == {"reg": 168, "stack": 0, "shared": 1024, "local": 8}


def test_compiles_the_planes_and_streams_kernels_for_sm90_and_writes_rows(tmp_path):
    run = subprocess.run([sys.executable, "-m", "workbench", "bench", "anatomy", "--schemes", "fp16,int4/token",
                          "--planes", "on", "--out", str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    (path,) = tmp_path.glob("anatomy-*.json")
    rows = json.loads(path.read_text())["rows"]
    kinds = {(r["scheme"], r["kernel"]) for r in rows}
    assert kinds == {("fp16", "generic"), ("int4/token", "planes"), ("int4/token", "streams")}
    for r in rows:
        assert r["registers"] > 0 and r["loop_instructions"] > 0 and r["loop_mma"] > 0, r
        assert 0 < r["issue_fraction"] < 20 and r["bytes_per_tile"] == r["BLOCK_N"] * r["bytes_per_token"]
    fp16 = next(r for r in rows if r["scheme"] == "fp16")
    assert fp16["bytes_per_token"] == 512  # K and V of one 128-dim head in fp16


# A write kernel's shape: a slow-path call skipped by a predicated branch, a rare path (its count's atomic) that
# ends by jumping over the fast path, the fast path, a plain branch whose two arms both count, the end.
WRITE_SASS = """
        /*0000*/                   LDG.E.128 R4, desc[UR4][R2.64] ;
        /*0010*/              @!P0 BRA 0x40 ;
        /*0020*/                   CALL.REL.NOINC 0x200 ;
        /*0030*/                   MOV R9, R8 ;
        /*0040*/              @!P1 BRA 0x90 ;
        /*0050*/                   FFMA R1, R2, R3, R4 ;
        /*0060*/                   ATOMG.E.ADD.STRONG.GPU PT, RZ, desc[UR4][R6.64], R9 ;
        /*0070*/              @!P2 BRA 0xb0 ;
        /*0080*/                   BRA 0xb0 ;
        /*0090*/                   FMUL R1, R2, R3 ;
        /*00a0*/                   FFMA R1, R1, R3, R4 ;
        /*00b0*/               @P3 BRA 0xd0 ;
        /*00c0*/                   HADD2.F32 R5, -RZ, R4.H0_H0 ;
        /*00d0*/                   STG.E.128 desc[UR4][R2.64], R4 ;
        /*00e0*/                   EXIT ;
        /*0200*/                   MUFU.RCP R1, R2 ;
        /*0210*/                   RET.REL.NODEC R20 0x0 ;
"""


def test_the_hot_path_skips_slow_calls_and_rare_paths_but_not_the_fast_path_after_them():
    hot = [a for a, _, _ in anatomy.hot_path(WRITE_SASS)]
    assert hot == [0x00, 0x10, 0x40, 0x90, 0xa0, 0xb0, 0xc0, 0xd0, 0xe0]
    assert anatomy.classify(anatomy.hot_path(WRITE_SASS)) == {"global": 2, "branch": 4, "fp": 3}


def test_compiles_the_write_kernels_for_sm90_and_writes_rows(tmp_path):
    run = subprocess.run([sys.executable, "-m", "workbench", "bench", "anatomy", "--kernel", "write", "--schemes",
                          "fp8_e4m3/tensor,int4/kivi", "--out", str(tmp_path)], capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    (path,) = tmp_path.glob("anatomy-*.json")
    rows = {r["scheme"]: r for r in json.loads(path.read_text())["rows"]}
    assert [p["kernel"] for p in rows["int4/kivi"]["launches"]] == ["_write_key_groups_kernel",
                                                                    "_write_groups_kernel"]
    assert [p["kernel"] for p in rows["fp8_e4m3/tensor"]["launches"]] == ["_write_kv_kernel"]
    for r in rows.values():
        assert r["workload"] == "write-32k" and r["counted"] == "hot path"
        assert all(p["registers"] > 0 and p["instructions"] > 0 and p["programs"] > 0 for p in r["launches"]), r
        assert 0 < r["issue_fraction"] < 5 and r["loop_instructions"] == sum(p["instructions"] for p in r["launches"])
    assert rows["fp8_e4m3/tensor"]["bytes"] == 32768 * 8 * 128 * (2 * 2 + 2)  # fp16 K and V read, fp8 codes written
