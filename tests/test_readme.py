"""The README stays true and legible: its core-API example runs and prints what its comment says, no line of it is
longer than 300 characters, and docs/modules.md lists every module of the package and the kernels in one line each."""

import contextlib
import io
import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.kernels  # the example writes and attends through the cache's kernels

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
MODULES = (ROOT / "docs" / "modules.md").read_text()


def example() -> str:
    blocks = re.findall(r"```python\n(.*?)```", README, flags=re.S)
    assert blocks, "README.md has no ```python example"
    return blocks[0]


def test_the_core_api_example_runs_and_prints_its_comment():
    code = example()
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(code, "README.md", "exec"), {"__name__": "readme_example"})
    last = code.strip().splitlines()[-1]
    promised = last.split("#", 1)[1].split(":", 1)[0].strip()  # "[0, 1, 2] [0, 1, 3]"
    assert printed.getvalue().strip() == promised


def test_readme_opens_with_the_two_commands_and_keeps_lines_short():
    first = README.split("```", 2)[1]
    assert "make tour" in first and "make test" in first
    long = [n for n, line in enumerate(README.splitlines(), 1) if len(line) >= 300]
    assert not long, f"README.md lines {long} are 300 characters or longer"


def test_modules_catalogue_lists_every_module_once_in_short_lines():
    sections = dict(re.findall(r"^## `([^`]+)/`\n\n((?:- .*\n?)+)", MODULES, flags=re.M))
    listed = {f"{folder}/{name}" for folder, body in sections.items() for name in re.findall(r"^- `([^`]+)`:", body,
                                                                                             flags=re.M)}
    on_disk = {str(p.relative_to(ROOT)) for base in ("workbench", "kernels") for p in (ROOT / base).rglob("*.py")
               if "__pycache__" not in p.parts}
    assert sorted(on_disk - listed) == [], "modules missing from docs/modules.md"
    assert sorted(listed - on_disk) == [], "docs/modules.md lists modules that do not exist"
    assert [line for line in MODULES.splitlines() if len(line) > 120] == []
