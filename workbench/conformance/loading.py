"""A user's implementations come in files and modules: :func:`load_module` imports one so that its ``register``
calls run, and remembers what it imported (:data:`LOADED`, which an isolated worker imports again) and which
implementations each registered (:data:`SOURCES`, so that :func:`command_name` prints a command that runs as printed:
``python -m workbench check FILE.py:NAME``).
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path

from workbench.conformance import implementations

LOADED: list[str] = []  # the files and modules load_module imported here, in order (an isolated worker imports them)
SOURCES: dict[tuple[str, str], str] = {}  # (op, name) -> the file or module whose import registered it


def load_module(spec: str) -> None:
    """Import a ``.py`` file or a dotted module, so that its ``register`` calls run; remember which
    implementations it registered (:func:`command_name`)."""
    path = Path(spec)
    if spec.endswith(".py") and not path.is_file():
        raise ValueError(f"no such file: {spec}")
    before = implementations.registered()  # the built-ins loaded first: they are not the file's
    if spec.endswith(".py"):
        mod_spec = importlib.util.spec_from_file_location(path.stem, path)
        module = importlib.util.module_from_spec(mod_spec)
        sys.modules[path.stem] = module
        mod_spec.loader.exec_module(module)
    else:
        importlib.import_module(spec)
    if spec not in LOADED:
        LOADED.append(spec)
    for key, impl in implementations.registered().items():
        if before.get(key) is not impl:
            SOURCES[key] = spec


def command_name(impl) -> str:
    """How ``python -m workbench check`` names ``impl`` so that a printed command runs as printed: ``FILE.py:NAME``
    for one a file registered, else its name."""
    spec = SOURCES.get((impl.op, impl.name))
    return f"{spec}:{impl.name}" if spec else impl.name
