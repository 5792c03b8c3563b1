"""Where KV memory goes: token states vs waste, for contiguous and paged allocation.

Pure functions of request lengths; the tour's memory panel plots them (the fragmentation
notebook uses the serving simulator instead). Shares follow the vLLM paper (Figure 2):
*token states* hold real K/V; *reservation* is memory held for tokens not generated yet;
*internal fragmentation* is memory that will never be used inside an allocation.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence


def blocks_for(tokens: int, block_size: int) -> int:
    """Blocks needed for ``tokens`` tokens."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    return -(-tokens // block_size)


def contiguous_breakdown(
    current: Sequence[int], final: Sequence[int], max_len: int, bytes_per_token: float
) -> dict[str, float]:
    """Bytes of a contiguous cache that reserves ``max_len`` slots per request.

    ``current[i]`` tokens are stored now; ``final[i]`` is the length the request will reach.
    Slots up to ``final`` are reservation, the rest up to ``max_len`` are internal fragmentation.
    """
    _check_lengths(current, final, max_len)
    tokens = sum(current)
    reserved = sum(f - c for c, f in zip(current, final, strict=True))
    internal = sum(max_len - f for f in final)
    return _bytes(tokens, reserved, internal, bytes_per_token)


def paged_breakdown(current: Sequence[int], block_size: int, bytes_per_token: float) -> dict[str, float]:
    """Bytes of a paged cache that allocates blocks on demand: waste is the last block's tail."""
    _check_lengths(current, current, math.inf)
    tokens = sum(current)
    internal = sum(blocks_for(c, block_size) * block_size - c for c in current)
    return _bytes(tokens, 0, internal, bytes_per_token)


def _check_lengths(current, final, max_len) -> None:
    if len(current) != len(final):
        raise ValueError(f"current and final must have the same length, got {len(current)} and {len(final)}")
    for c, f in zip(current, final, strict=True):
        if not 0 <= c <= f <= max_len:
            raise ValueError(f"need 0 <= current <= final <= max_len, got {c}, {f}, {max_len}")


def _bytes(tokens: int, reserved: int, internal: int, bpt: float) -> dict[str, float]:
    total = tokens + reserved + internal
    return {
        "token_states": tokens * bpt,
        "reservation": reserved * bpt,
        "internal_fragmentation": internal * bpt,
        "total": total * bpt,
        "token_share": tokens / total if total else 1.0,
    }


# Request lengths (prompt + output) come from the workload, not from the server: a log-normal with this
# median and log-spread has mean ~495 tokens, ShareGPT's 161 + 338 (vLLM paper), and a long tail.
MEDIAN_LEN = 300
LEN_SIGMA = 1.0


def random_batch(
    num_requests: int, max_len: int, seed: int = 0, *, median: float = MEDIAN_LEN, sigma: float = LEN_SIGMA
) -> tuple[list[int], list[int]]:
    """A batch caught mid-generation on a server that caps requests at ``max_len`` tokens.

    Each request's length is drawn log-normal (``median``, log-spread ``sigma``), independent of
    ``max_len``, then cut at ``max_len`` (the server stops it there): ``final``. Each has done a
    uniform fraction of it so far: ``current`` in ``[1, final]``. The same seed gives the same
    requests at every ``max_len``, so only the server's reservation changes with it. A stand-in for
    a real trace (``workbench.sim`` has fitted ones); enough to show the effect.
    """
    if num_requests < 0 or max_len < 1:
        raise ValueError(f"need num_requests >= 0 and max_len >= 1, got {num_requests}, {max_len}")
    if median <= 0 or sigma < 0:
        raise ValueError(f"need median > 0 and sigma >= 0, got {median}, {sigma}")
    rng = random.Random(seed)
    wanted = [rng.lognormvariate(math.log(median), sigma) for _ in range(num_requests)]
    progress = [rng.random() for _ in range(num_requests)]  # a fraction: as far along at every max_len
    final = [min(max_len, max(1, round(n))) for n in wanted]
    current = [max(1, math.ceil(u * f)) for u, f in zip(progress, final, strict=True)]
    return current, final


def compare_allocation(
    current: Sequence[int], final: Sequence[int], max_len: int, block_size: int, bytes_per_token: float
) -> dict[str, dict[str, float]]:
    """Contiguous reserve-max vs paged, for one batch: ``{scheme: breakdown}``."""
    return {
        "contiguous (reserve max_len)": contiguous_breakdown(current, final, max_len, bytes_per_token),
        f"paged ({block_size}-token blocks)": paged_breakdown(current, block_size, bytes_per_token),
    }


def max_len_rows(num_requests: int, max_lens: Sequence[int], seed: int, bytes_per_token: float) -> list[dict]:
    """The same requests (``random_batch`` with ``seed``) on servers capping them at each of ``max_lens``: per cap
    the contiguous breakdown's token share and how many requests the cap cuts off (``final == max_len``)."""
    rows = []
    for max_len in max_lens:
        current, final = random_batch(num_requests, max_len, seed)
        b = contiguous_breakdown(current, final, max_len, bytes_per_token)
        rows.append({"max_len": max_len, "token_share": b["token_share"],
                     "cut_off": sum(f == max_len for f in final), "num_requests": num_requests})
    return rows


def format_comparison(compared: dict[str, dict[str, float]]) -> str:
    """One line per scheme of :func:`compare_allocation`'s result: its GiB and token-state share."""
    return "\n".join(f"{scheme:30s} {b['total'] / 2**30:6.2f} GiB, token states {100 * b['token_share']:5.1f}%"
                     for scheme, b in compared.items())


def format_max_len_rows(rows: Sequence[dict]) -> str:
    """One line per cap of :func:`max_len_rows`: the contiguous token-state share and the requests cut off."""
    return "\n".join(f"max_len {r['max_len']:4d}: contiguous token states {100 * r['token_share']:4.1f}%, "
                     f"{r['cut_off']} of {r['num_requests']} requests cut off at max_len" for r in rows)
