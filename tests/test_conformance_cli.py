"""``python -m workbench check``, the problem files for kernels outside Python, and ``bench decode --impl``."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from workbench import conformance as C
from workbench.__main__ import main
from workbench.conformance import exchange

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.kernels]

CASE = "decode/nhd/bs8/d80/hkv2/g4/bf16/lens=16,8/pad3/seed2"  # the case that caught the gqa starter on the H200


def test_check_lists_impls_and_absent_peers(capsys):
    assert main(["check", "--list"]) == 0
    out = capsys.readouterr().out
    assert "decode         ours" in out and "write          ours" in out and "starter" in out
    for peer in ("flashinfer", "vllm_triton"):
        if peer in C.names("decode"):
            continue  # installed here: registered, not absent
        assert f"{peer}" in out and "absent" in out


def test_check_one_case_of_a_file_that_registers(tmp_path, capsys):
    src = tmp_path / "mykernels.py"
    src.write_text("import functools\nfrom workbench import conformance\n"
                   "from workbench.conformance.starter import starter_decode\n"
                   "conformance.register('decode', 'cli_gqa', functools.partial(starter_decode, mistake='gqa'),"
                   " layouts=('nhd',))\n")
    report = tmp_path / "r.json"
    try:
        assert main(["check", f"{src}:cli_gqa", "--case", CASE, "-q", "--json", str(report)]) == 1
        out = capsys.readouterr().out
        assert "0/1 cases passed" in out and CASE in out and "relative error" in out
        saved = json.loads(report.read_text())
        assert saved["passed"] is False and saved["cases"][0]["case"] == CASE and "gpu" in saved["meta"]
        assert main(["check", "starter", "--case", CASE, "-q"]) == 0
    finally:
        C.unregister("decode", "cli_gqa")


@pytest.mark.parametrize("argv, message", [
    (["check", "nobody"], "no implementation 'nobody'"),
    (["check", "ours", "--case", "decode/nhd/bs16/oops/fp16"], "neither a field"),
    (["check", "ours", "--op", "write", "--case", CASE], "is of op 'decode'"),
    (["check", "missing_file.py:mine"], "no such file"),
    (["check", "--outputs", "/nonexistent-dir"], "no manifest.json"),
])
def test_check_bad_input_exits_2_with_a_message(argv, message, capsys):
    assert main(argv) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("op", ["decode", "write", "copy"])
def test_exported_problems_judge_outside_outputs(op, tmp_path, capsys):
    """Export, answer with the reference (an outside program's role), judge: passes; one corrupted answer fails."""
    assert main(["check", "--export", str(tmp_path), "--op", op, "--level", "smoke"]) == 0
    manifest = json.loads((tmp_path / "manifest.json").read_text())["problems"]
    assert manifest and all((tmp_path / p["file"]).is_file() for p in manifest)
    exchange.write_outputs("reference", tmp_path)
    assert main(["check", "--outputs", str(tmp_path), "-q"]) == 0
    victim = next(p for p in manifest if "lens=0" not in p["case"] and "pairs0" not in p["case"])
    path = tmp_path / victim["output"]
    got = load_file(str(path))
    key = next(iter(got))
    flat = got[key].view(-1)
    flat[flat.numel() // 2] = flat[flat.numel() // 2 - 1] + 1 if flat.dtype.is_floating_point else flat[0] ^ 1
    save_file(got, str(path))
    capsys.readouterr()
    assert main(["check", "--outputs", str(tmp_path), "-q"]) == 1
    assert victim["case"] in capsys.readouterr().out


def test_problem_file_is_self_contained(tmp_path):
    """Everything a kernel outside Python needs: inputs by name, cache planes with their views, the reference."""
    from safetensors import safe_open

    case = C.Case.parse(CASE)
    (path,) = exchange.export_problems([case], tmp_path)
    with safe_open(str(path), framework="pt") as f:
        meta, keys = f.metadata(), set(f.keys())  # noqa: SIM118
    assert {"q", "k_cache", "v_cache", "block_table", "seq_lens", "kv_indptr", "kv_indices", "ref"} <= keys
    views = json.loads(meta["views"])
    assert views["k_cache"]["stride"][0] == 80 * 2 * 8 + 3  # the padded block stride travels with the view
    assert meta["case"] == CASE and json.loads(meta["scalars"])["sm_scale"] == pytest.approx(0.87 / 80**0.5)
    loaded_case, inputs, ref = exchange.load_problem(path)
    built = case.build("cpu")
    assert loaded_case == case and torch.equal(ref, built["ref"].float().double())  # stored as float32
    assert torch.equal(inputs["k_cache"].view(torch.int16), built["k_cache"].view(torch.int16))


def test_bench_decode_impl_smoke(tmp_path, capsys):
    assert main(["bench", "decode", "--smoke", "--impl", "starter", "--out", str(tmp_path)]) == 0
    (path,) = tmp_path.glob("byok-decode-*.json")
    rows = json.loads(path.read_text())["rows"]
    by = {(r["workload"], r["impl"]): r for r in rows}
    for w in ("W1", "W2", "W3", "W4", "W5"):
        assert by[(w, "ours")]["status"] == by[(w, "starter")]["status"] == "ok"
        assert by[(w, "starter")]["rel_err"] < 2e-2
        for peer in ("flashinfer", "vllm_triton"):
            if peer not in C.names("decode"):
                assert by[(w, peer)]["status"] == "absent" and "No module" in by[(w, peer)]["error"]


@pytest.mark.skipif(torch.cuda.is_available(),
                    reason="isolate forks a child per case: a CPU tool (CUDA does not survive a fork)")
def test_isolate_turns_a_crash_into_a_failed_case(capsys):
    """A kernel that kills its process (as a read outside its tensors can, under the interpreter) fails its case and
    the suite goes on; --isolate from the shell does the same."""
    import os
    import signal

    def crashes(q, sm_scale, out, seq_lens):
        if int(seq_lens.numel()) > 1:
            os.kill(os.getpid(), signal.SIGSEGV)
        return out.zero_()

    cases = [C.Case.parse(CASE), C.Case.parse("decode/nhd/bs16/d64/hkv2/g1/fp16/lens=0/pad0/seed1")]
    try:
        C.register("decode", "t_crashes", crashes, layouts=("nhd",))
        report = C.check("t_crashes", cases=cases, isolate=True)
        assert [r.passed for r in report.results] == [False, True]
        assert "crashed the process (signal SIGSEGV)" in report.results[0].reason
    finally:
        C.unregister("decode", "t_crashes")


@pytest.mark.parametrize("fields, message", [
    ({"lens": (-1,)}, "lens must be ints >= 0"), ({"block_size": 0}, "block_size must be an int >= 1"),
    ({"group": True}, "group must be an int >= 1"), ({"pad": -3}, "pad must be an int >= 0"),
    ({"kv_format": "fp4"}, "kv_format must be one of"), ({"layout": "xyz"}, "layout must be one of"),
    ({"lens": ()}, "at least one sequence"),
])
def test_case_build_names_the_bad_field(fields, message):
    with pytest.raises(ValueError, match=message):
        C.Case("decode", **fields).build("cpu")
