"""The GPU test list and its results file (issue 30 item 2), on the CPU: every test file that runs a kernel carries
the ``kernels`` marker (the static half here; ``tests/kernel_launches.py`` fails any unmarked test that launches
one), ``scripts/gpu_run.sh tests`` selects by the marker, and ``workbench.results.gpu_tests`` turns pytest's JUnit XML
(a fake one, and one pytest writes) into the stamped results file."""

import ast
import json
import textwrap
from pathlib import Path

import pytest

from workbench.results import gpu_tests

# The pytest runs below are in-process (pytester): a subprocess each cost ~3-12 s of a busy 2-core machine (a fresh
# interpreter importing torch, triton and every plugin) for what runs here in well under a second.
pytest_plugins = ["pytester"]

TESTS = Path(__file__).parent
ROOT = TESTS.parent
META = {"gpu": "NVIDIA H200", "torch": "2.11.0", "triton": "3.6.0", "cuda": "13.0", "python": "3.12.3",
        "commit": "abc123", "date": "2026-12-03T10:00:00Z", "run": "r1"}


GPU_ONLY = "not torch.cuda." + "is_available()"  # split: this file's own text needs no marker
REFERENCE = "reference"  # an op's PyTorch reference (workbench.kernels.<op>.reference): no launch


def marked(tree: ast.Module) -> bool:
    """The module sets ``pytestmark`` to ``pytest.mark.kernels`` (alone or in a list)."""
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "pytestmark" for t in node.targets):
            values = node.value.elts if isinstance(node.value, (ast.List, ast.Tuple)) else [node.value]
            if any(ast.unparse(v) == "pytest.mark.kernels" for v in values):
                return True
    return False


def _kernel_module(name: str | None) -> bool:
    parts = (name or "").split(".")
    return (parts[:2] == ["workbench", "kernels"] or parts[0] == "kernels") and parts[-1] != REFERENCE


def needs_marker(tree: ast.Module) -> str | None:
    """Why a test module must be marked, read off its source: it imports a kernel module, or has a test that runs only
    on a GPU (``skipif(not torch.cuda.is_available())``, ``device="cuda"``), which is never seen launching a kernel
    here. The rest of the rule is watched at run time (tests/kernel_launches.py)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and _kernel_module(node.module):
            return f"imports {node.module}"
        if isinstance(node, ast.Import) and any(_kernel_module(a.name) for a in node.names):
            return "imports workbench.kernels"
        if isinstance(node, ast.Call) and ast.unparse(node.func) == "pytest.mark.skipif" and node.args and (
                ast.unparse(node.args[0]) == GPU_ONLY):
            return "has a GPU-only test"
        if isinstance(node, ast.keyword) and node.arg == "device" and ast.unparse(node.value) == "'cuda'":
            return "has a GPU-only test"
    return None


def test_every_test_file_that_runs_kernels_is_marked():
    missing = []
    for path in sorted(TESTS.glob("test_*.py")):
        tree = ast.parse(path.read_text())
        why = needs_marker(tree)
        if why and not marked(tree):
            missing.append(f"{path.name} ({why})")
    assert missing == [], f"add `pytestmark = pytest.mark.kernels` to: {missing}"


def test_the_rule_reads_markers_and_reasons():
    assert marked(ast.parse("import pytest\npytestmark = pytest.mark.kernels\n"))
    assert marked(ast.parse("import pytest\npytestmark = [pytest.mark.slow, pytest.mark.kernels]\n"))
    assert not marked(ast.parse("import pytest\npytestmark = pytest.mark.usefixtures('x')\n"))
    for src, why in [("from workbench.kernels import write_kv", "imports workbench.kernels"),
                     ("import workbench.kernels.decode", "imports workbench.kernels"),
                     ("from kernels.write import api", "imports kernels.write"),
                     ("from workbench.kernels.write.reference import write_kv_ref", None),
                     ("from workbench.kernels.decode.reference import paged_decode_ref", None),
                     (f"@pytest.mark.skipif({GPU_ONLY}, reason='GPU')\ndef test(): pass", "has a GPU-only test"),
                     ("x = torch.zeros(1, device='cuda')", "has a GPU-only test"),
                     ("NO_GPU = not torch.cuda.is_available()", None), ("import torch", None)]:
        assert needs_marker(ast.parse(src)) == why, src


def test_gpu_run_selects_by_the_marker_without_stopping():
    script = (ROOT / "scripts" / "gpu_run.sh").read_text()
    assert "-m kernels" in script and " -x " not in script and "--junitxml" in script
    assert "workbench.results.gpu_tests" in script and "gpu_tests.json" in script
    assert "test_gather.py" not in script  # no hand-kept list


FAKE = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest" errors="1" failures="1" skipped="1" tests="5" time="3.2">
<testcase classname="tests.test_a" name="test_ok[fp16]" file="tests/test_a.py" line="3" time="0.5"/>
<testcase classname="tests.test_a.TestGroup" name="test_in_class" file="tests/test_a.py" line="9" time="0.1"/>
<testcase classname="tests.test_b" name="test_bad" file="tests/test_b.py" line="1" time="1.0">
  <failure message="ValueError: Pointer argument (at 0) cannot be accessed from Triton (cpu tensor?)&#10;more">
  trace</failure></testcase>
<testcase classname="tests.test_b" name="test_gpu_only" file="tests/test_b.py" line="5" time="0">
  <skipped type="pytest.skip" message="needs a GPU">skip</skipped></testcase>
<testcase classname="" name="tests.test_c" time="0"><error message="collection failure">ImportError</error></testcase>
</testsuite></testsuites>
"""


def test_results_file_from_a_fake_junit(tmp_path):
    xml = tmp_path / "r.xml"
    xml.write_text(FAKE)
    out = tmp_path / "gpu_tests.json"
    doc = gpu_tests.write(out, [xml], META, command="pytest -m kernels tests/")
    assert json.loads(out.read_text()) == doc
    assert doc["counts"] == {"passed": 2, "failed": 1, "errors": 1, "skipped": 1}
    assert doc["failed"] == [{"id": "tests/test_b.py::test_bad",
                              "message": "ValueError: Pointer argument (at 0) cannot be accessed from Triton (cpu "
                                         "tensor?)"}]
    assert doc["errors"] == [{"id": "tests.test_c", "message": "collection failure"}]
    assert doc["meta"]["gpu"] == "NVIDIA H200" and doc["meta"]["commit"] == "abc123"
    assert doc["meta"]["command"] == "pytest -m kernels tests/"
    assert {f["file"]: f["passed"] for f in doc["files"]} == {"tests.test_c": 0, "tests/test_a.py": 2,
                                                               "tests/test_b.py": 0}
    rows = gpu_tests.read_junit(xml)
    assert rows[1]["id"] == "tests/test_a.py::TestGroup::test_in_class"
    two = gpu_tests.write(tmp_path / "two.json", [xml, xml], META)  # a run split over two calls
    assert two["counts"]["passed"] == 4 and two["junit"] == ["r.xml", "r.xml"]


def test_results_file_cli_and_bad_input(tmp_path, capsys):
    xml = tmp_path / "r.xml"
    xml.write_text(FAKE)
    assert gpu_tests.main([str(tmp_path / "o.json"), str(xml)]) == 1  # a failure: exit 1
    assert "FAILED tests/test_b.py::test_bad" in capsys.readouterr().out
    (tmp_path / "bad.xml").write_text("<html/>")
    assert gpu_tests.main([str(tmp_path / "o.json"), str(tmp_path / "bad.xml")]) == 2
    assert "not a JUnit XML file (root <html>)" in capsys.readouterr().err
    gpu = tmp_path / "gpu.json"
    gpu_tests.write(gpu, [xml], META)
    assert gpu_tests.main([str(tmp_path / "m.json"), str(xml), str(xml), "--meta-from", str(gpu)]) == 1
    merged = json.loads((tmp_path / "m.json").read_text())
    assert merged["meta"]["gpu"] == "NVIDIA H200" and merged["counts"]["passed"] == 4  # the GPU's stamp kept
    assert gpu_tests.main([str(tmp_path / "m.json"), str(xml), "--meta-from", str(xml)]) == 2
    assert "is not a gpu_tests results file" in capsys.readouterr().err
    with pytest.raises(ValueError, match="is not a readable JUnit XML file"):
        gpu_tests.read_junit(tmp_path / "missing.xml")
    with pytest.raises(ValueError, match="junit must name"):
        gpu_tests.write(tmp_path / "o.json", [], META)


def test_results_file_from_pytests_own_junit(pytester):
    """The XML pytest itself writes (xunit1, as gpu_run.sh asks), not only the fake above."""
    tmp_path = pytester.path
    sub = tmp_path / "tests"
    sub.mkdir()
    (sub / "test_sample.py").write_text(textwrap.dedent("""
        import pytest

        @pytest.mark.parametrize("x", [1, 2])
        def test_param(x):
            assert x == 1

        def test_skip():
            pytest.skip("no GPU")

        class TestC:
            def test_m(self):
                pass
    """))
    xml = tmp_path / "r.xml"
    pytester.runpytest_inprocess("-q", "-p", "no:cacheprovider", "-o", "junit_family=xunit1", f"--junitxml={xml}",
                                 "tests")
    doc = gpu_tests.summarize(gpu_tests.read_junit(xml))
    assert doc["counts"] == {"passed": 2, "failed": 1, "errors": 0, "skipped": 1}
    assert [f["id"] for f in doc["failed"]] == ["tests/test_sample.py::test_param[2]"]
    ids = {r["id"] for r in gpu_tests.read_junit(xml)}
    assert "tests/test_sample.py::TestC::test_m" in ids


KERNEL_TEST = """
import pytest
import torch
import triton
import triton.language as tl
{mark}

@triton.jit
def _copy(src, dst, N: tl.constexpr):
    o = tl.arange(0, N)
    tl.store(dst + o, tl.load(src + o))


def test_launches():
    x = torch.arange(8.0)
    y = torch.empty_like(x)
    _copy[(1,)](x, y, N=8)
    assert torch.equal(x, y)


def test_no_launch():
    pass
"""


# the hooks of tests/kernel_launches.py, as tests/conftest.py installs them, for a pytest run in a folder of its own
HOOKS = f"import sys\nsys.path.insert(0, {str(TESTS)!r})\nfrom kernel_launches import *  # noqa\n"


@pytest.mark.kernels  # the run inside launches one, in this process: the rule holds this test to it too
def test_an_unmarked_test_that_launches_a_kernel_fails(pytester, monkeypatch):
    """The dynamic half of the rule (tests/kernel_launches.py), in a pytest of its own: an unmarked test that launched
    a kernel fails naming the marker; a marked one passes; a test that launched none passes unmarked."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # read when a kernel is decorated (the modules written below)
    pytester.makeconftest(HOOKS)
    pytester.makeini("[pytest]\nmarkers =\n    kernels: runs a kernel\n")
    pytester.makepyfile(test_unmarked=KERNEL_TEST.format(mark=""),
                        test_marked=KERNEL_TEST.format(mark="pytestmark = pytest.mark.kernels"))
    res = pytester.runpytest_inprocess("-q", "-p", "no:cacheprovider", "-rf")
    out = res.stdout.str()
    assert res.ret == 1 and "1 failed, 3 passed" in out, out[-2000:]
    assert "FAILED test_unmarked.py::test_launches" in out
    assert "launched 1 Triton kernel(s) but is not marked 'kernels'" in out


def test_a_module_missing_a_package_is_skipped_on_the_gpu_box(pytester, monkeypatch):
    """WORKBENCH_SKIP_MISSING=1 (gpu_run.sh): a module importing an absent package is a skip naming it, not an
    error; this repository's own modules still error."""
    pytester.makeconftest(HOOKS)
    pytester.makepyfile(test_m="import not_a_package_here\n\ndef test_x():\n    pass\n",
                        test_own="import workbench.not_a_module\n\ndef test_y():\n    pass\n",
                        test_ok="def test_z():\n    pass\n\n\ndef test_lazy():\n    import plotly_absent\n")

    def run(flag):
        monkeypatch.setenv("WORKBENCH_SKIP_MISSING", flag)  # read by the hooks while the run collects and reports
        return pytester.runpytest_inprocess("-q", "-rs", "-p", "no:cacheprovider",
                                            "--continue-on-collection-errors").stdout.str()

    on, off = run("1"), run("0")
    assert "1 passed, 2 skipped, 1 error" in on and "needs not_a_package_here" in on, on[-2000:]
    assert "needs plotly_absent" in on  # imported inside a test: skipped too
    assert "1 failed, 1 passed, 2 errors" in off, off[-2000:]
