"""The command line as a new user meets it: where results go, bad paths and numbers refused before any
work, help listings, --version, no-GPU exits, and the simulator's "nothing fit" warnings.

Every test runs ``workbench.__main__.main`` in-process; results go to ``tmp_path`` (the default output
folder is pointed there too), and the committed ``data/results`` must be untouched.
"""

import json

import pytest
import torch

import workbench
from workbench.__main__ import main
from workbench.bench import BENCHMARKS, allocator
from workbench.commands.sim import COMMANDS
from workbench.results import decode, provenance, run_files

pytestmark = pytest.mark.kernels  # smoke benchmarks and `check` run Triton kernels (compiled on a GPU)

NO_GPU = not torch.cuda.is_available()
REAL_DEFAULT_OUT = run_files.DEFAULT_OUT  # before the fixture below points it at tmp_path


def _listing(folder):
    return sorted(p.name for p in folder.iterdir()) if folder.is_dir() else []


@pytest.fixture(autouse=True)
def default_out(tmp_path, monkeypatch):
    """Point the default output folder at tmp_path/results and check data/results is left alone."""
    before = _listing(run_files.RESULTS)
    out = tmp_path / "results"
    monkeypatch.setattr(run_files, "DEFAULT_OUT", out)
    yield out
    assert _listing(run_files.RESULTS) == before, "a run wrote into the committed data/results"


# ------------------------------------------------------------------------------------------------ where results go
def test_default_output_folder_is_git_ignored_and_not_the_committed_one():
    assert REAL_DEFAULT_OUT == provenance.ROOT / "results" != run_files.RESULTS
    assert "/results/" in (provenance.ROOT / ".gitignore").read_text().split()


def test_bench_writes_to_the_default_folder_and_says_where(default_out, capsys):
    assert main(["bench", "allocator", "--seconds", "0.01"]) == 0
    (path,) = default_out.glob("allocator-*.json")
    assert str(path) in capsys.readouterr().out
    data = json.loads(path.read_text())
    assert data["seconds"] == 0.01 and data["meta"]["gpu"].startswith("cpu-")


def test_two_runs_never_overwrite_each_other(tmp_path):
    meta = {"gpu": "NVIDIA H200", "torch": "t", "triton": "x", "commit": "c", "date": "2026-01-02T03:04:05Z"}
    paths = [run_files.write_results("decode", [{"i": i}], meta, tmp_path) for i in range(3)]
    assert len(set(paths)) == 3 and [p.name for p in paths] == [
        "decode-h200-20260102T030405.json", "decode-h200-20260102T030405-2.json", "decode-h200-20260102T030405-3.json"]
    assert [json.loads(p.read_text())["rows"][0]["i"] for p in paths] == [0, 1, 2]


def test_one_run_checkpointing_keeps_one_file(tmp_path):
    meta = provenance.machine_meta()  # carries this run's id
    first = run_files.write_results("probe", [{"i": 0}], meta, tmp_path)
    again = run_files.write_results("probe", [{"i": 0}, {"i": 1}], meta, tmp_path)
    assert again == first and len(json.loads(first.read_text())["rows"]) == 2
    other = run_files.write_results("probe", [{"i": 0}], {**meta, "run": "another"}, tmp_path)
    assert other != first and len(list(tmp_path.glob("probe-*.json"))) == 2


def test_two_cli_runs_in_a_row_give_two_files(tmp_path):
    for _ in range(2):
        assert main(["bench", "allocator", "--seconds", "0.01", "--out", str(tmp_path)]) == 0
    assert len(list(tmp_path.glob("allocator-*.json"))) == 2


# ------------------------------------------------------------------------------------------------ refused up front


def _bad_dirs(tmp_path):
    afile = tmp_path / "a-file"
    afile.write_text("x")
    return [afile, afile / "below"]


def test_bench_bad_out_fails_before_measuring(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(allocator, "measure", lambda *a: pytest.fail("measured before checking --out"))
    for bad in _bad_dirs(tmp_path):
        assert main(["bench", "allocator", "--seconds", "0.01", "--out", str(bad)]) == 2
        err = capsys.readouterr().err
        assert "--out" in err and str(bad) in err and "Traceback" not in err


@pytest.mark.parametrize("bench", ["cache_kernels", "decode"])
def test_bench_smoke_bad_out_fails_before_running(tmp_path, monkeypatch, capsys, bench):
    import importlib

    mod = importlib.import_module(f"workbench.bench.{bench}")
    monkeypatch.setattr(mod, "run" if bench == "cache_kernels" else "run_smoke",
                        lambda *a, **k: pytest.fail("ran before checking --out"))
    assert main(["bench", bench, "--smoke", "--out", str(_bad_dirs(tmp_path)[0])]) == 2
    assert "--out" in capsys.readouterr().err


def test_tour_checks_paths_before_running_the_notebook(tmp_path, monkeypatch, capsys):
    import nbclient

    monkeypatch.setattr(nbclient.NotebookClient, "execute", lambda self: pytest.fail("executed before the checks"))
    for bad in _bad_dirs(tmp_path):
        assert main(["tour", "--out", str(bad)]) == 2
        assert "--out" in capsys.readouterr().err
    assert main(["tour", "--notebook", str(provenance.ROOT / "README.md"), "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "not a Jupyter notebook" in err and "Traceback" not in err
    assert main(["tour", "--notebook", str(tmp_path / "missing.ipynb"), "--out", str(tmp_path)]) == 2
    assert "not found" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------------ GPU benchmarks
@pytest.mark.skipif(not NO_GPU, reason="checks the no-GPU message")
@pytest.mark.parametrize("bench", ["cache_kernels", "decode"])
def test_gpu_bench_without_a_gpu_says_so_and_exits_2(default_out, capsys, bench):
    assert main(["bench", bench]) == 2
    captured = capsys.readouterr()
    assert f"bench {bench} needs a CUDA GPU (found none); use --smoke" in captured.err
    assert _listing(default_out) == []  # nothing ran, nothing written


def test_cache_kernels_smoke_still_runs_on_a_cpu(tmp_path):
    assert main(["bench", "cache_kernels", "--smoke", "--only", "copy", "--out", str(tmp_path)]) == 0
    (path,) = tmp_path.glob("cache_kernels-*.json")
    assert json.loads(path.read_text())["smoke"] is True


# ------------------------------------------------------------------------------------------------ help and version
def test_version(capsys):
    assert main(["--version"]) == 0
    assert workbench.__version__ in capsys.readouterr().out


def test_bench_help_lists_the_benchmarks(capsys):
    assert main(["bench", "--help"]) == 0
    out = capsys.readouterr().out
    for name, text in BENCHMARKS.items():
        assert name in out and text in out
    assert "results/" in out


def test_sim_help_lists_its_commands(capsys):
    assert main(["sim", "--help"]) == 0
    out = capsys.readouterr().out
    for name, text in COMMANDS.items():
        assert name in out and text in out


@pytest.mark.parametrize("argv, needle", [(["bench"], "allocator"), (["bench", "nosuch"], "unknown benchmark"),
                                          (["sim"], "seed-table"), (["sim", "nosuch"], "invalid choice")])
def test_missing_or_unknown_names_exit_2(capsys, argv, needle):
    assert main(argv) == 2
    assert needle in capsys.readouterr().err


def test_benchmark_own_help_still_works(capsys):
    assert main(["bench", "allocator", "--help"]) == 0
    assert "--seconds" in capsys.readouterr().out


# ------------------------------------------------------------------------------------------------ simulator warnings
def test_sim_run_that_completes_nothing_warns(capsys):
    assert main(["sim", "run", "--kv-gib", "0.001", "--requests", "30"]) == 0
    err = capsys.readouterr().err
    assert err.startswith("warning: nothing fit") and "30 of 30 rejected" in err


def test_sim_run_that_completes_something_does_not_warn(capsys):
    assert main(["sim", "run", "--requests", "30"]) == 0
    assert "warning" not in capsys.readouterr().err


def test_fig2_with_a_block_larger_than_the_pool_warns(capsys):
    assert main(["sim", "fig2", "--block-size", "100000", "--requests", "200"]) == 0
    err = capsys.readouterr().err
    assert err.startswith("warning: nothing fit: vLLM") and "100000-token blocks" in err


def test_fig2_alpaca_is_not_compared_with_the_sharegpt_bars(capsys):
    assert main(["sim", "fig2", "--trace", "alpaca", "--requests", "200"]) == 0
    out = capsys.readouterr().out
    assert "ShareGPT only" in out and "largest difference" not in out and "20.4" not in out
    assert main(["sim", "fig2", "--trace", "alpaca", "--requests", "200", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["max_abs_diff_pp"] is None and d["within_5pp"] is None and not d["setup"]["compared_with_paper"]
    assert all(v["paper"] is None and v["diff_pp"] == {} for v in d["systems"].values())
    assert d["systems"]["Orca (Pow2)"]["paper_batch"] == 43.24  # Figure 13 does have Alpaca


# ------------------------------------------------------------------------------------------------ picking result files
def _meta(gpu, date):
    return {"gpu": gpu, "torch": "t", "triton": "x", "commit": "c", "date": date}


def test_matches():
    info = {"gpu": "NVIDIA H200", "mode": "full", "smoke": False}
    assert run_files.matches(info, None) and run_files.matches(info, {})
    assert run_files.matches(info, {"gpu": "NVIDIA H200", "mode": ("full", "quick"), "smoke": False})
    assert run_files.matches(info, {"gpu": lambda g: "H200" in g})
    assert not run_files.matches(info, {"mode": "smoke"})
    assert not run_files.matches(info, {"missing": "x"}) and run_files.matches(info, {"missing": lambda v: v is None})


def test_notebook_selection_ignores_newer_smoke_and_cpu_runs(tmp_path):
    row = {"workload": "W1", "impl": "ours", "time_us": 10.0}
    gpu = run_files.write_results("decode", [row], _meta("NVIDIA H200", "2026-01-01T00:00:00Z"), tmp_path,
                                  extra={"mode": "full"})
    run_files.write_results("decode", [row], _meta("cpu", "2026-06-01T00:00:00Z"), tmp_path, extra={"mode": "smoke"})
    run_files.write_results("decode", [row], _meta("NVIDIA H200", "2026-07-01T00:00:00Z"), tmp_path,
                            extra={"mode": "quick"})
    where = {"gpu": "NVIDIA H200", "mode": "full"}
    rows = decode.load_decode(results_dir=tmp_path, where=where, latest=True)
    assert [r["date"] for r in rows] == ["2026-01-01T00:00:00Z"]
    (run,) = run_files.load_runs("decode-*.json", tmp_path, where)
    assert run["path"] == gpu and run["info"]["mode"] == "full"
    assert len(run_files.load_results("decode-*.json", tmp_path)) == 3  # no filter: every file


def test_committed_results_are_found_by_their_metadata():
    """What notebooks 01 and 02 select from data/results (a non-empty, single run each)."""
    for pattern, where in [("allocator-*.json", {"gpu": "cpu-x86_64"}),
                           ("cache_kernels-*.json", {"gpu": "NVIDIA H200", "smoke": False}),
                           ("decode-*.json", {"gpu": "NVIDIA H200", "mode": "full"})]:
        rows = run_files.load_results(pattern, where=where, latest=True)
        assert rows and len({r["date"] for r in rows}) == 1, pattern


def test_bench_results_skips_smoke_runs(tmp_path, capsys):
    run_files.write_results("decode", [{"workload": "W1", "impl": "ours", "time_us": None}],
                            _meta("cpu", "2026-06-01T00:00:00Z"), tmp_path, extra={"mode": "smoke"})
    assert main(["bench", "results", "--dir", str(tmp_path)]) == 0
    assert "no decode results" in capsys.readouterr().out


# ------------------------------------------------------------------------------------------------ progress
def test_fig2_sensitivity_shows_progress_on_stderr_and_keeps_json_on_stdout(monkeypatch, capsys):
    import functools

    from workbench.sim import fig2

    monkeypatch.setattr(fig2, "sensitivity", functools.partial(fig2.sensitivity, n=60))  # seconds, not 15
    assert main(["sim", "fig2", "--sensitivity", "--json", "--requests", "60"]) == 0
    captured = capsys.readouterr()
    rows = json.loads(captured.out)["sensitivity"]
    assert "sensitivity" in captured.err and f"{len(rows)}/{len(rows)}" in captured.err


@pytest.mark.parametrize("bench, argv", [("allocator", ["--seconds", "0.01"]),
                                         ("cache_kernels", ["--smoke", "--only", "copy"])])
def test_bench_progress_goes_to_stderr(tmp_path, capsys, bench, argv):
    assert main(["bench", bench, *argv, "--out", str(tmp_path)]) == 0
    captured = capsys.readouterr()
    assert "%|" in captured.err and "%|" not in captured.out  # a tqdm bar, on stderr only


def test_tour_prints_a_line_per_cell_and_writes_an_offline_report(tmp_path, monkeypatch, capsys):
    """``tour`` with a stand-in for nbclient (no kernel): the hooks it passes print progress, the report inlines
    plotly.js for the panel's snapshot, and neither file keeps widget state."""
    import nbclient
    import nbformat
    import plotly.graph_objects as go
    from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook, new_output

    from workbench.publish.page import PLOTLY_MIME, WIDGET_MIME

    class FakeClient:
        def __init__(self, nb, **kwargs):
            self.nb, self.kwargs = nb, kwargs

        def execute(self):
            assert self.kwargs["store_widget_state"] is False
            for i, cell in enumerate(self.nb.cells):
                if cell.cell_type == "code":
                    self.kwargs["on_cell_execute"](cell=cell, cell_index=i)
                    cell.outputs = [new_output("display_data", data={
                        WIDGET_MIME: {"version_major": 2, "version_minor": 0, "model_id": "m"},
                        PLOTLY_MIME: json.loads(go.Figure(go.Bar(y=[1, 2])).to_json()), "text/plain": "panel"})]
                    self.kwargs["on_cell_executed"](cell=cell, cell_index=i, execute_reply={"content": {}})
            self.nb.metadata["widgets"] = {"application/vnd.jupyter.widget-state+json": {"state": {}}}
            return self.nb

    monkeypatch.setattr(nbclient, "NotebookClient", FakeClient)
    src = tmp_path / "t.ipynb"
    nbformat.write(new_notebook(cells=[new_markdown_cell("# t"), new_code_cell("panel")]), src)
    assert main(["tour", "--notebook", str(src), "--out", str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out
    html = tmp_path / "out" / "t.html"
    assert "[1/1] cell 1 ... " in out and f"report: {html} (" in out and " MB" in out
    page = html.read_text()
    assert "Plotly.newPlot" in page and "<script src" not in page and WIDGET_MIME not in page
    assert "widgets" not in nbformat.read(tmp_path / "out" / "t.ipynb", as_version=4).metadata


# ------------------------------------------------------------------------------------------------ issue 30, item 7
@pytest.mark.parametrize("argv, needle", [
    (["bench", "allocator", "--seconds", "0"], "--seconds"),
    (["bench", "allocator", "--seconds", "-1"], "--seconds"),
    (["bench", "allocator", "--seconds", "nan"], "--seconds"),
    (["tour", "--timeout", "0"], "--timeout"),
    (["tour", "--timeout", "-5"], "--timeout"),
    (["check", "ours", "--stop-after", "0"], "--stop-after"),
    (["check", "ours", "--stop-after", "-1"], "--stop-after"),
    (["check", "ours", "--timeout", "0"], "--timeout"),
    (["generate", "--temperature", "nan"], "--temperature"),
    (["generate", "--temperature", "-0.5"], "--temperature"),
    (["generate", "--seed", "-1"], "--seed"),
    (["generate", "--threads", "0"], "--threads"),
    (["generate", "--quest-budget", "0"], "--quest-budget"),
    (["generate", "--shared-prefix", "always"], "--shared-prefix"),
    (["bench", "decode", "--smoke", "--impl", "starter", "--timeout", "0"], "--timeout"),
])
def test_numbers_that_must_be_positive_are_refused_before_any_work(capsys, monkeypatch, argv, needle):
    """Zero, negative or NaN where a positive number is meant: refused up front (``check ours --stop-after 0`` ran
    one case and exited 0)."""
    from workbench.conformance import suite

    monkeypatch.setattr(suite, "run_case", lambda *a, **k: pytest.fail("a case ran"))
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err


def test_output_paths_that_are_files_are_refused_first(tmp_path, monkeypatch, capsys):
    """``check --export README.md`` and ``capture --out README.md`` ended in a FileExistsError traceback (capture
    after 23 s of work); every output path of check is now checked before anything runs."""
    import workbench.model as wm
    from workbench.conformance import exchange

    monkeypatch.setattr(exchange, "export_problems", lambda *a, **k: pytest.fail("exported before the check"))
    monkeypatch.setattr(wm, "load_smollm2", lambda *a, **k: pytest.fail("the model loaded before the check"))
    readme = str(provenance.ROOT / "README.md")
    for argv, flag in ((["check", "--export", readme, "--level", "smoke"], "--export"),
                       (["capture", "--out", readme], "--out"),
                       (["check", "ours", "--case", "decode/nhd/bs16/d64/hkv2/g1/fp16/lens=1/pad0/seed1",
                         "--json", str(tmp_path)], "--json"),
                       (["check", "ours", "--case", "decode/nhd/bs16/d64/hkv2/g1/fp16/lens=1/pad0/seed1",
                         "--journal", readme + "/j.jsonl"], "--journal")):
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert flag in err and "Traceback" not in err and len(err.strip().splitlines()) <= 3, err


def test_a_failure_reports_replay_hint_runs_as_printed_for_a_kernel_from_a_file(tmp_path, capsys):
    """The hint named only the implementation, which a fresh shell does not have: it now names FILE.py:NAME."""
    import shlex

    from workbench import conformance

    src = tmp_path / "broken.py"
    src.write_text("import functools\nfrom workbench import conformance\n"
                   "from workbench.conformance.starter import starter_decode\n"
                   "conformance.register('decode', 'broken_mask_t', functools.partial(starter_decode, mistake='mask'),"
                   " layouts=('nhd',))\n")
    case = "decode/nhd/bs16/d64/hkv1/g1/fp32/lens=1/pad0/seed3"
    try:
        assert main(["check", f"{src}:broken_mask_t", "--case", case, "-q"]) == 1
        out = capsys.readouterr().out
        (hint,) = [line.split("replay ", 1)[1] for line in out.splitlines() if line.strip().startswith("replay ")]
        argv = shlex.split(hint)
        assert argv[:4] == ["python", "-m", "workbench", "check"] and argv[4] == f"{src}:broken_mask_t"
        conformance.unregister("decode", "broken_mask_t")  # as a fresh shell: nothing registered
        assert main(argv[3:]) == 1  # it runs, and the same case fails again
        assert f"FAIL {case}" in capsys.readouterr().out
    finally:
        if "broken_mask_t" in conformance.names("decode"):
            conformance.unregister("decode", "broken_mask_t")


def test_report_notebooks_accepts_names_relative_to_notebooks(tmp_path, capsys):
    from workbench.__main__ import notebook_paths

    nbdir = provenance.ROOT / "notebooks"
    assert notebook_paths(["00*"]) == [nbdir / "00_tour.ipynb"]  # said "no notebook matches" before
    assert notebook_paths(["00_tour"]) == notebook_paths(["notebooks/00_tour.ipynb"]) == [nbdir / "00_tour.ipynb"]
    names = [p.name for p in notebook_paths(["0[0-1]*", "00_tour"])]  # a name twice: once
    assert names == ["00_tour.ipynb", "01_allocator_and_sharing.ipynb"]
    assert main(["report", "--notebooks", "zz*", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "no notebook matches 'zz*'" in err and str(nbdir) in err and ".ipynb added" in err


def test_generate_names_a_file_that_is_not_gguf(capsys):
    pytest.importorskip("gguf")
    assert main(["generate", "--gguf", str(provenance.ROOT / "README.md")]) == 2
    err = capsys.readouterr().err
    assert "README.md is not a GGUF file" in err and "GGUF magic invalid" in err and "Traceback" not in err


def test_generate_uses_one_thread_on_a_cpu_and_info_says_so(capsys):
    from workbench.commands.generate import CPU_THREADS, cpu_threads

    assert cpu_threads("cpu") == CPU_THREADS == 1 and cpu_threads("cuda") is None and cpu_threads("cpu", 3) == 3
    assert main(["info"]) == 0
    assert f"generate uses {cpu_threads(workbench.device().type) or 'torch'}" in capsys.readouterr().out


@pytest.mark.skipif(not NO_GPU, reason="the CPU default")
def test_generate_runs_with_one_torch_thread(capsys):
    from workbench.model.gguf_weights import model_available

    if model_available() is not None:
        pytest.skip(f"SmolLM2-135M: {model_available()}")
    n = torch.get_num_threads()
    try:
        assert main(["generate", "--prompt", "a", "--prompt", "b", "--max-new-tokens", "2"]) == 0
        assert "cpu (torch, 1 torch threads)" in capsys.readouterr().out
    finally:
        torch.set_num_threads(n)


@pytest.mark.skipif(not NO_GPU, reason="the CPU default")
def test_generate_decodes_long_prompts_through_quest_and_says_how_it_attended(capsys):
    """Issue 33: a Quest budget for long prompts; the closing line counts how each (step, layer) was attended."""
    from workbench.model.gguf_weights import model_available

    if model_available() is not None:
        pytest.skip(f"SmolLM2-135M: {model_available()}")
    n = torch.get_num_threads()
    try:
        assert main(["generate", "--prompt", "Name three fruits and say one thing about each.", "--n", "2",
                     "--max-new-tokens", "3", "--quest-budget", "2"]) == 0
        assert "decode attended (steps x layers): 60 Quest pages" in capsys.readouterr().out  # 2 steps x 30 layers
    finally:
        torch.set_num_threads(n)


def test_bench_decode_help_shows_impl(capsys):
    assert main(["bench", "decode", "--help"]) == 0
    out = capsys.readouterr().out
    assert "--impl NAME" in out and "--load MODULE" in out


def _readme_commands():
    """``(command words, --flags)`` of each row of the README's command table and of docs/commands.md's."""
    import re

    rows = []
    text = "\n".join((provenance.ROOT / f).read_text() for f in ("README.md", "docs/commands.md"))
    for line in text.splitlines():
        m = re.match(r"\| `python -m workbench ([^`]*)` \|(.*)\|\s*$", line)
        if not m:
            continue
        words = []
        for w in m.group(1).split():
            if w.startswith(("-", "[", '"')) or w.isupper():
                break
            words.append(w)
        if words and words[0] == "sweep":
            words = ["sweep", "memory"]  # NAME: any sweep, one parser
        rows.append((words, sorted(set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", line)))))
    return rows


@pytest.mark.parametrize("words, flags", _readme_commands(), ids=lambda v: " ".join(v) if isinstance(v, list) else "")
def test_every_option_the_readme_documents_is_in_the_commands_help(words, flags, capsys):
    """``bench decode --help`` did not show ``--impl``, which the README's row documents."""
    assert words, "a README row without a command"
    assert main([*words, "--help"]) == 0
    text = capsys.readouterr().out
    missing = [f for f in flags if f not in text]
    assert not missing, f"README documents {missing} for `{' '.join(words)}`, its --help does not show them"
