"""The project's own files: dependency lists agree, the CLI behaves, the core needs no UI libraries."""

import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
# conda-forge name -> PyPI name
CONDA_NAMES = {"pytorch": "torch", "playwright-python": "playwright", "python-xxhash": "xxhash"}
NOT_PACKAGES = {"python", "pip"}


def _split(requirement: str) -> tuple[str, str]:
    """``"torch>=2.6"`` -> ``("torch", ">=2.6")``."""
    name = re.split(r"[<>=!~\[; ]", requirement, maxsplit=1)[0].strip()
    return name.lower(), requirement[len(name):].strip()


def test_environment_yml_matches_pyproject():
    """Every dependency and every extra, each once: from conda-forge, or from PyPI in the pip section (ray)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    declared = dict(_split(r) for r in project["dependencies"] + [r for e in extras.values() for r in e])
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    conda = {}
    for dep in env["dependencies"]:
        if isinstance(dep, str):
            name, spec = _split(dep)
            if name not in NOT_PACKAGES:
                conda[CONDA_NAMES.get(name, name)] = spec
        else:  # the pip section: requirement lines besides options such as -e .
            for line in dep["pip"]:
                if not line.startswith("-"):
                    name, spec = _split(line)
                    assert name not in conda, f"environment.yml installs {name} twice"
                    conda[name] = spec
    assert conda == declared, f"environment.yml {conda} != pyproject {declared}"


def test_every_package_of_the_tree_is_listed_for_setuptools():
    """A package missing from ``[tool.setuptools] packages`` still imports in an editable install (the folder is on
    the path) and is absent from a wheel: every folder with an ``__init__.py`` is listed, and nothing else."""
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = set()
    for top, name in (("workbench", "workbench"), ("kernels", "workbench.kernels")):
        for init in (ROOT / top).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / top).parts
            found.add(".".join((name, *rel)))
    assert listed == found, f"missing: {sorted(found - listed)}; listed but absent: {sorted(listed - found)}"


def test_info_prints_backend_and_versions(capsys):
    from workbench.__main__ import main

    assert main(["info"]) == 0
    out = capsys.readouterr().out
    for key in ("backend", "device", "torch", "triton"):
        assert re.search(rf"^\s*{key}: \S", out, re.M), out


def test_unknown_subcommand_prints_usage_and_fails(capsys):
    from workbench.__main__ import main

    code = main(["frobnicate"])
    err = capsys.readouterr().err
    assert code == 2 and "usage:" in err and "frobnicate" in err


def test_unknown_benchmark_lists_the_real_ones(capsys):
    from workbench.__main__ import main

    assert main(["bench", "workloads"]) == 2 and "allocator, cache_kernels, decode" in capsys.readouterr().err


def test_core_imports_without_ui_libraries():
    """The GPU image has no plotly/ipywidgets/jupyter: every module but ``workbench.ui`` and ``workbench.figures``
    imports without them, and the notebooks' pure helpers (committed results, the model inspector) work. One
    interpreter for all of it: each one costs ~5 s of a 2-core machine (torch's import)."""
    code = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, *a):\n"
        "        if name.split('.')[0] in {'plotly', 'ipywidgets', 'anywidget', 'nbformat', 'jupyterlab'}:\n"
        "            raise ImportError('blocked ' + name)\n"
        "sys.meta_path.insert(0, Block())\n"
        "import pkgutil, importlib, workbench, workbench.kernels as K\n"
        "mods = [*pkgutil.walk_packages(workbench.__path__, 'workbench.'),\n"
        "        *pkgutil.walk_packages(K.__path__, 'workbench.kernels.')]\n"
        "for m in mods:\n"
        "    if not m.name.startswith(('workbench.ui', 'workbench.figures')):\n"
        "        importlib.import_module(m.name)\n"
        "from workbench.results import tiers as measured\n"
        "print(measured.bandwidth_map(measured.latest()).at(32768, 64))\n"
        "print(len(mods), 'ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    measured, imported = out.stdout.split()[:2]
    assert measured == "0.737" and int(imported) > 60, out.stdout


def test_backend_is_interpreter_without_gpu():
    import torch

    import workbench

    if not torch.cuda.is_available():
        assert workbench.is_interpreted()
        import os

        assert os.environ.get("TRITON_INTERPRET") == "1"


def test_environment_yml_pip_section_is_valid_for_pip(tmp_path):
    """conda hands the pip section to pip as a requirements file: every line must be one pip accepts
    (``--no-deps`` there was 'Invalid requirement')."""
    import importlib.util

    if importlib.util.find_spec("setuptools") is None:  # pip builds the editable's metadata with it, offline
        pytest.skip("setuptools is not installed in this interpreter: pip cannot build -e . offline to check it")
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    pip_lines = next(d["pip"] for d in env["dependencies"] if isinstance(d, dict) and "pip" in d)
    req = tmp_path / "requirements.txt"
    req.write_text("\n".join(pip_lines) + "\n")
    r = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--no-deps", "--no-build-isolation",
                        "--no-index", "-q", "-r", str(req)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]


def test_make_test_lists_every_test_file_once_in_an_order_pytest_keeps():
    """`make test` hands pytest its files in the order the two workers should take them (the browser test first).
    pytest keeps that order only while no argument holds another (given `tests` after `tests/browser` it collects
    the folder in its own order), so: no argument inside another, every test file and every notebook (nbval checks
    them) listed once."""
    import shutil

    if shutil.which("make") is None:
        pytest.skip("make is not installed: `make test` cannot run here either")
    out = subprocess.run(["make", "-s", "--no-print-directory", "-f", "Makefile", "-f", "-", "print-order"],
                         input="print-order:\n\t@echo $(TEST_ORDER)\n", cwd=ROOT, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    args = out.stdout.split()
    assert args[0] == "tests/browser" and len(args) == len(set(args)), args
    inside = [(a, b) for a in args for b in args if a != b and Path(b).is_relative_to(a)]
    assert not inside, f"pytest would drop the order: {inside}"
    listed = {p for a in args for p in ([*(ROOT / a).rglob("test_*.py")] if (ROOT / a).is_dir() else [ROOT / a])}
    wanted = set(ROOT.joinpath("tests").rglob("test_*.py")) | set(ROOT.joinpath("notebooks").glob("[0-9]*.ipynb"))
    assert listed == wanted, (sorted(map(str, wanted - listed)), sorted(map(str, listed - wanted)))
