"""Encapsulation (issue 32): no module reads another class's private fields or methods.

The private names of a class family are collected from its own modules (every ``self._x`` it assigns and every
``_x`` method it defines); outside those modules, ``<anything but self or cls>._x`` for one of those names fails.
The cache's privates belong to the ``workbench/cache/`` package (its parts and the class): the tiers, eviction and
the model's decoders use its public surface. The block pool's privates belong to its modules in
``workbench/allocator/`` (the manager asks the pool's methods), the manager's to ``manager.py`` (a plan made on a
clone is adopted whole: ``BlockManager.adopt``).
"""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "workbench"

# what -> the modules that own its private names, relative to workbench/ (a folder: every module in it)
OWNERS = {
    "BlockPool": ["allocator/pool.py", "allocator/prefix_map.py", "allocator/moves.py", "allocator/invariants.py"],
    "BlockManager": ["allocator/manager.py"],
    "PagedKVCache": ["cache/"],
}


def owned_modules(paths: list[str]) -> set[Path]:
    return {f for p in paths for f in ((PACKAGE / p).rglob("*.py") if p.endswith("/") else [PACKAGE / p])}


def _is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def private_names(files: list[Path]) -> set[str]:
    """``self._x`` assigned and ``_x`` methods defined in the classes of ``files``."""
    names = set()
    for f in files:
        for node in ast.walk(ast.parse(f.read_text(), str(f))):
            if isinstance(node, ast.ClassDef):
                names.update(item.name for item in node.body
                             if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef) and _is_private(item.name))
            elif (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and _is_private(node.attr)
                  and isinstance(node.value, ast.Name) and node.value.id == "self"):
                names.add(node.attr)
    return names


def reads_of(names: set[str], tree: ast.AST) -> list[ast.Attribute]:
    """``x._name`` for ``name`` in ``names``, any ``x`` but ``self``/``cls``."""
    return [node for node in ast.walk(tree) if isinstance(node, ast.Attribute) and node.attr in names
            and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))]


def foreign_reads(names: set[str], own: set[Path]) -> list[str]:
    """:func:`reads_of` in every module of workbench/ outside ``own``."""
    found = []
    for f in sorted(PACKAGE.rglob("*.py")):
        if f not in own:
            found += [f"{f.relative_to(PACKAGE.parent)}:{n.lineno}: {ast.unparse(n)}"
                      for n in reads_of(names, ast.parse(f.read_text(), str(f)))]
    return found


@pytest.mark.parametrize("owner", sorted(OWNERS))
def test_no_private_reads_from_outside(owner):
    own = owned_modules(OWNERS[owner])
    names = private_names(sorted(own))
    assert names, f"{owner}: no private names found (moved modules?)"
    found = foreign_reads(names, own)
    assert not found, f"{owner}'s private fields read from outside its modules:\n" + "\n".join(found)


def test_the_walk_finds_a_private_read(tmp_path):
    """The check itself: a foreign read of an assigned private name is found, a read through self is not."""
    owner = tmp_path / "owner.py"
    owner.write_text("class A:\n    def __init__(self):\n        self._x = 1\n\n    def _m(self):\n"
                     "        return self._x\n")
    names = private_names([owner])
    assert names == {"_x", "_m"}
    user = ast.parse("def f(a):\n    return a._x + a._m() + a.x + a._y\n")
    assert sorted(n.attr for n in reads_of(names, user)) == ["_m", "_x"]
    assert reads_of(names, ast.parse(owner.read_text())) == []
