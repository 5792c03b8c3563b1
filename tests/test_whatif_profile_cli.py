"""``python -m workbench profile`` (issue 35) on the CPU: --dry-run prints the benchmarks a GPU profile is made from
(each one's arguments accepted by that benchmark's own parser), a CPU run is refused with exit 2, and a folder of
result files (copies of the committed ones) is a profile ``GpuProfile.from_results`` and the what-if read."""

import json
import shutil

import numpy as np
import pytest
import torch

from workbench.__main__ import main as workbench_main
from workbench.commands import profile as cli
from workbench.quant.names import DECODE_BENCH_SCHEMES
from workbench.results import run_files
from workbench.whatif import PRESETS, GpuProfile, fit_layer_overhead
from workbench.whatif.profile import RESULTS
from workbench.whatif.report import default_profile


@pytest.fixture
def no_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def test_dry_run_prints_the_three_benchmarks_and_how_to_use_the_folder(no_cuda, tmp_path, capsys):
    out = tmp_path / "prof"
    assert cli.main(["--out", str(out), "--dry-run"]) == 0
    text = capsys.readouterr().out
    for _, argv in cli.steps(out):
        assert cli.command_line(argv) in text
    assert "bench quant_decode --sections decode,write --schemes fp16," in text
    assert "bench tiers --quick --only link" in text and "--batches 1,16,64 --compile" in text
    assert f'GpuProfile.from_results("{out}", name="NAME")' in text and f"--profile {out}" in text
    assert not out.exists()  # a dry run writes nothing


def test_each_step_is_accepted_by_its_benchmark(no_cuda, tmp_path, capsys):
    assert set(cli.PROFILE_SCHEMES) <= set(DECODE_BENCH_SCHEMES)
    for _, argv in cli.steps(tmp_path):
        assert workbench_main(argv) == 2  # parsed, then the benchmark's own GPU check
        assert "needs a CUDA GPU" in capsys.readouterr().err


def test_a_cpu_run_is_refused(no_cuda, tmp_path, capsys):
    assert cli.main(["--out", str(tmp_path / "p")]) == 2
    err = capsys.readouterr().err
    assert "needs a CUDA GPU" in err and "--dry-run" in err
    assert workbench_main(["profile", "--out", str(tmp_path / "p")]) == 2
    assert cli.main([]) == 2 and "--out" in capsys.readouterr().err


def test_the_files_a_run_writes_are_found_under_the_gpus_name(tmp_path):
    rng = np.random.default_rng(0)
    meta = {"gpu": "NVIDIA H100 80GB HBM3", "torch": "t", "triton": "x", "commit": "c", "date": "2026-12-06T01:02:03Z"}
    for bench in ("quant-decode", "tiers", "model-decode", "decode"):
        run_files.write_results(bench, [{"x": float(v)} for v in rng.random(3)], meta, tmp_path)
    files = cli.profile_files(tmp_path)
    assert set(files) == set(cli.PREFIXES)
    assert files["quant-decode"].name.startswith(f"quant-decode-{cli.gpu_name(meta['gpu'])}-")
    assert cli.gpu_name("NVIDIA H200") == "h200" and cli.profile_files(tmp_path, since=4e9) == {}


def test_a_folder_of_result_files_is_a_profile(tmp_path):
    for name in default_profile().files:  # the full quant-decode run and a later --schemes one, the tiers run, ...
        shutil.copy(RESULTS / name, tmp_path)
    files = cli.profile_files(tmp_path)
    prof = GpuProfile.from_results(tmp_path, name="h200")
    prof = fit_layer_overhead(prof, PRESETS["smollm2-135m"], run=files["model-decode"])
    ref = default_profile()
    assert prof.copy_gbps == ref.copy_gbps and prof.decode == ref.decode and prof.write == ref.write
    assert prof.launch_us == ref.launch_us and prof.files == ref.files
    assert prof.link.source == ref.link.source
    doc = json.loads(files["quant-decode"].read_text())
    assert prof.copy_gbps.value == doc["copy_gbps"]
