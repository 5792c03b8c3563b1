"""The exceptions of the tiered KV storage (device, pinned host, disk), in one place so that the tier manager and
every pool raise and catch the same classes.

``TierError`` is the base (a ``RuntimeError``: something went wrong moving or keeping blocks, not a bad argument,
which stays a ``ValueError``). ``TierFull`` and its kinds say a tier has no room; ``NotInTier`` is also a
``KeyError`` so a pool reads like a mapping to code that only knows dicts.
"""

from __future__ import annotations


class TierError(RuntimeError):
    """A tier could not keep, move or return blocks (full, corrupt, missing, an I/O error)."""


class TierFull(TierError):
    """A tier has no room for the blocks asked for; nothing was stored."""


class HostFull(TierFull):
    """The pinned host pool has no free slot for the blocks asked for."""


class DiskFull(TierFull):
    """The disk pool's capacity (or the file system) has no room for the blocks asked for."""


class CorruptBlock(TierError):
    """A block read back does not match the checksum it was written with (or its file is cut short); ``key``
    names it (None when unknown), so a tier above can drop that entry and go on."""

    def __init__(self, message: str, key: bytes | None = None):
        super().__init__(message)
        self.key = key


class NotInTier(TierError, KeyError):
    """A key asked for is not stored in this tier."""

    # KeyError's str() is the repr of its argument (quotes around the message); show the message as written.
    __str__ = BaseException.__str__


class NotResident(TierError):
    """A decode step needs blocks that are not in device memory."""
