"""Write-to-cache, arranged as fla's ``ops/<op>/``: ``kernel`` (the Triton kernels and the storage
conventions, in its docstring), ``config`` (the launch choice and the measured prefill table), ``api``
(``write_kv``, ``check_write_kv``, ``write_kv_blocks``); ``dynamic`` (scales computed on write, per family), its
kernels ``token`` and ``groups`` and their arithmetic ``qmath``; ``reference`` (the plain PyTorch versions, and the
values a cache's blocks hold)."""

from .api import _PLANS, check_write_kv, write_kv, write_kv_blocks, write_launches
from .config import (
    _QUANT_MATH,
    PREFILL_DEFAULTS,
    PREFILL_MIN_ROWS,
    Launch,
    WriteConfig,
    default_launch,
    launch_config,
    prefill_defaults,
    quant_mode,
    rows_launch,
)
from .kernel import FP8_DTYPES, QUANT_MATHS, SCHEMES

__all__ = ["FP8_DTYPES", "PREFILL_DEFAULTS", "PREFILL_MIN_ROWS", "QUANT_MATHS", "SCHEMES", "Launch", "WriteConfig",
           "_PLANS", "_QUANT_MATH", "check_write_kv", "default_launch", "launch_config", "prefill_defaults",
           "quant_mode", "rows_launch", "write_kv", "write_kv_blocks", "write_launches"]
