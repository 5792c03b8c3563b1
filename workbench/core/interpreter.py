"""The Triton interpreter without its repeated patching: ``triton.language`` patched once a launch, not once a call.

A launch under the interpreter swaps ``triton.language``'s builtins for numpy ones for its duration (triton's
``_patch_lang``), and so does every call of a ``@triton.jit`` helper inside the kernel, though the launch already did
it: ``inspect.getmembers`` over ``tl``, ``tl.tensor`` and ``tl.math`` at each call, finding nothing left to swap. That
was 38% of the interpreted time of a shared-prefix decode (745 patchings for its 5 launches) and of the CPU test
command's kernel tests. :func:`install` lets a helper's call skip it when the language modules the helper sees were
patched for the launch running (a helper that sees another one, such as triton's own ``tl.core`` helpers, patches it
once a launch, as before). What the kernels compute is untouched: the same numpy operations, the same outputs, bit
for bit (``tests/test_interpreter.py``).

``workbench.kernels`` installs it under the interpreter. It wraps private names of triton's interpreter
(``_patch_lang``, ``_LangPatchScope``, ``GridExecutor.__call__``: read in triton 3.9); a triton without them keeps its
own behaviour (``install`` returns False). Launches are assumed to run one at a time, as triton's patching of the
module-wide ``triton.language`` already assumes.
"""

from __future__ import annotations

_RUNNING: list[frozenset[int] | None] = []  # per launch running: ids of the language modules patched (None: not yet)
_ORIGINAL: dict[str, object] = {}  # what install() replaced, for uninstall()


def _language_modules(fn) -> frozenset[int]:
    """The ids of ``triton.language`` and ``triton.language.core`` among ``fn``'s globals (what triton patches)."""
    import triton.language as tl

    return frozenset(id(v) for v in fn.__globals__.values() if v is tl or v is tl.core)


def install() -> bool:
    """Patch ``triton.language`` once a launch instead of once a helper call; True when installed (or already)."""
    if _ORIGINAL:
        return True
    import triton.runtime.interpreter as interp

    if not all(hasattr(interp, name) for name in ("_patch_lang", "_LangPatchScope", "GridExecutor")):
        return False
    patch_lang, launch = interp._patch_lang, interp.GridExecutor.__call__

    def _patch_lang(fn):
        langs = _language_modules(fn)
        if _RUNNING and _RUNNING[-1] is not None and langs <= _RUNNING[-1]:
            return interp._LangPatchScope()  # already patched for this launch: nothing to do, nothing to restore
        scope = patch_lang(fn)
        if _RUNNING:
            _RUNNING[-1] = (_RUNNING[-1] or frozenset()) | langs
        return scope

    def __call__(self, *args, **kwargs):
        _RUNNING.append(None)  # the launch's own _patch_lang comes first
        try:
            return launch(self, *args, **kwargs)
        finally:
            _RUNNING.pop()

    _ORIGINAL.update(_patch_lang=patch_lang, launch=launch)
    interp._patch_lang, interp.GridExecutor.__call__ = _patch_lang, __call__
    return True


def uninstall() -> None:
    """Triton's own patching back (a no-op when not installed)."""
    if not _ORIGINAL:
        return
    import triton.runtime.interpreter as interp

    interp._patch_lang, interp.GridExecutor.__call__ = _ORIGINAL["_patch_lang"], _ORIGINAL["launch"]
    _ORIGINAL.clear()


def installed() -> bool:
    return bool(_ORIGINAL)
