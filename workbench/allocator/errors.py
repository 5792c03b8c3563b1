"""The allocator's exceptions and the argument checks every entry point shares.

Every check runs before an operation changes anything, so an exception always leaves the
pool and the block tables exactly as they were. Messages name the argument and what was
expected.
"""

from __future__ import annotations

import operator


class AllocatorError(Exception):
    """Base of the allocator's errors; the allocator is unchanged when one is raised."""


class OutOfBlocks(AllocatorError):
    """Not enough free memory for the request."""


class UnknownSequence(AllocatorError, KeyError):
    """No live sequence has this id."""

    def __str__(self) -> str:  # KeyError quotes its message; keep it readable
        return str(self.args[0])


class SequenceExists(AllocatorError):
    """A live sequence already has this id."""


def positive(name: str, value: object) -> int:
    """``value`` as an int >= 1 (bools refused)."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


def as_index(name: str, value: object) -> int:
    """An integer-like ``value`` (int, numpy or 0-d torch integer) as a plain int."""
    if type(value) is int:
        return value
    if isinstance(value, bool):
        raise ValueError(f"{name} must be an int, got {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise ValueError(f"{name} must be an int, got {type(value).__name__} {value!r}") from None


def token_ids(name: str, tokens: object) -> list[int]:
    """Token ids as a new list of plain ints, whatever integer container holds them.

    Torch tensors and numpy arrays become lists of ints, and so does any iterable of integer-likes
    (numpy scalars, 0-d integer tensors): a list of 0-d tensors would otherwise hash by identity
    and silently defeat prefix caching. Floats, strings, None and nested lists are refused.
    """
    if hasattr(tokens, "tolist") and hasattr(tokens, "dtype"):  # torch tensor / numpy array
        dtype = str(tokens.dtype)
        if "int" not in dtype or getattr(tokens, "ndim", 1) != 1:
            raise ValueError(f"{name} must be a 1-D sequence of integer token ids, got a {dtype} "
                             f"array of shape {tuple(tokens.shape)}")
        return tokens.tolist()
    if isinstance(tokens, (str, bytes)) or not hasattr(tokens, "__iter__"):
        raise ValueError(f"{name} must be a sequence of integer token ids, got {type(tokens).__name__}")
    try:
        return list(map(operator.index, tokens))  # one C-speed pass: plain ints out, anything else refused
    except TypeError:
        bad = next((t for t in tokens if not _int_like(t)), None)
        raise ValueError(f"{name} must hold integer token ids, got {type(bad).__name__} {bad!r}") from None


def _int_like(t: object) -> bool:
    try:
        operator.index(t)
        return True
    except TypeError:
        return False


def hashable(name: str, value: object) -> object:
    try:
        hash(value)
    except TypeError:
        raise ValueError(f"{name} must be hashable, got {type(value).__name__}") from None
    return value
