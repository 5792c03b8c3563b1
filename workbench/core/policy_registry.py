"""One pattern for every pluggable policy (block sizes, serving strategies; later eviction, prefetch,
sparsification, quantization): a frozen, validated config dataclass with a ``label`` and a
``build(ctx)`` that returns the state object doing the work, kept by name in a registry dict.

:func:`lookup` is the registries' shared ``get``: a name or a config in, a config out, with fields
overridden (``get("paged", block_size=32)``).
"""

from __future__ import annotations

from dataclasses import fields, is_dataclass, replace
from typing import Any


def lookup(registry: dict[str, Any], kind: str, choice: object, **overrides) -> Any:
    """The config named ``choice`` in ``registry`` (or ``choice`` itself, a config of a registered type),
    with ``overrides`` applied; ``kind`` names the argument in error messages."""
    if isinstance(choice, str):
        if choice not in registry:
            raise ValueError(f"{kind} must be one of {sorted(registry)} or a config, got {choice!r}")
        choice = registry[choice]
    elif not isinstance(choice, tuple({type(c) for c in registry.values()})):
        names = sorted({type(c).__name__ for c in registry.values()})
        raise ValueError(f"{kind} must be a name in {sorted(registry)} or a {'/'.join(names)} config, got {choice!r}")
    if overrides:
        known = {f.name for f in fields(choice)} if is_dataclass(choice) else set()
        bad = sorted(set(overrides) - known)
        if bad:
            raise ValueError(f"{kind} {type(choice).__name__} has no option {bad}; its options: {sorted(known)}")
        choice = replace(choice, **overrides)
    return choice
