"""The storage formats the conformance suite builds caches in, and the error each may show.

Names are ``workbench.quant`` scheme names: a cast (``fp16``), static scales per kv head (``fp8_e4m3/head``,
``int8/head``: the op's ``k_scale`` / ``v_scale``), or scales kept in the blocks (``int8_asym/token``: the op's
``quant``). The reference reads the same stored values, so the tolerance bounds the kernel's arithmetic only.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from workbench import quant


class SuiteFormat(NamedTuple):
    q_dtype: torch.dtype  # queries (and write sources) of a case in this format
    tol: float  # bound on the norm-wise relative error of decode against the float64 reference
    poison: int  # the byte that fills unwritten slots, padding and spare blocks: NaN where the format has one


SUITE_FORMATS: dict[str, SuiteFormat] = {
    "fp16": SuiteFormat(torch.float16, 1e-2, 0xFF),
    "bf16": SuiteFormat(torch.bfloat16, 1e-2, 0xFF),
    "fp32": SuiteFormat(torch.float32, 1e-4, 0xFF),
    "fp8_e4m3/head": SuiteFormat(torch.float16, 1e-2, 0xFF),
    "fp8_e5m2/head": SuiteFormat(torch.float16, 1e-2, 0xFF),
    "int8/head": SuiteFormat(torch.float16, 1e-2, 0x7F),  # int8 has no NaN: the largest code
    "fp8_e4m3/token": SuiteFormat(torch.float16, 1e-2, 0xFF),  # NaN codes and NaN fp16 scales
    "int8_asym/token": SuiteFormat(torch.float16, 1e-2, 0xFF),
}

# the suite's formats by what the op is given beside the caches (each scheme's family answers)
CAST = tuple(f for f in SUITE_FORMATS if not quant.get(f).quantized)
STATIC = tuple(f for f in SUITE_FORMATS if quant.get(f).needs_static_scales)  # k_scale / v_scale
IN_BLOCKS = tuple(f for f in SUITE_FORMATS if quant.get(f).scales_on_write)  # quant=; scales in the blocks
WRITE_FORMATS = CAST + STATIC  # the write op's cases (formats with scales computed on write: see docs/byo_kernel.md)
