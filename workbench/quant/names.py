"""Every K/V scheme's name, storage family and format, and the named lists of schemes the workbench shows,
sweeps and times: defined here once and imported everywhere (this module imports nothing heavy: no torch).

``workbench.quant.SCHEMES`` builds each entry as an object of its family's class
(``workbench.quant.families``). Adding a scheme of an existing family is one :data:`ENTRIES` line
(docs/quant_families.md).
"""

from __future__ import annotations

from typing import NamedTuple

#: The storage families, in the order of their bytes' sophistication (``workbench.quant.families.<family>``).
STORAGE_FAMILIES = ("cast", "static", "token", "groups")


class Entry(NamedTuple):
    """One registered scheme: its name, family, storage format (``workbench.core.kv_formats``), where its scales live
    and the family's parameters (``(field, value)`` pairs of ``workbench.quant.Scheme``)."""

    name: str
    family: str
    format_name: str
    granularity: str
    params: tuple[tuple[str, object], ...] = ()


_ASYM = (("symmetric", False),)
_KIVI = (("symmetric", False), ("group", 32), ("value_group", 32), ("residual", 128), ("key_mode", "channel"))
_GROUPS_PER_TOKEN = (("symmetric", False), ("group", 32), ("value_group", 32), ("residual", 0), ("key_mode", "token"))

#: Every scheme, in the order tables and sweeps list them.
ENTRIES: tuple[Entry, ...] = (
    Entry("fp32", "cast", "fp32", "none"),
    Entry("fp16", "cast", "fp16", "none"),
    Entry("bf16", "cast", "bf16", "none"),
    Entry("fp8_e4m3/tensor", "static", "fp8_e4m3", "tensor"),
    Entry("fp8_e4m3/head", "static", "fp8_e4m3", "head"),
    Entry("fp8_e4m3/token", "token", "fp8_e4m3", "token"),
    Entry("fp8_e5m2/tensor", "static", "fp8_e5m2", "tensor"),
    Entry("fp8_e5m2/head", "static", "fp8_e5m2", "head"),
    Entry("fp8_e5m2/token", "token", "fp8_e5m2", "token"),
    Entry("int8/tensor", "static", "int8", "tensor"),
    Entry("int8/head", "static", "int8", "head"),
    Entry("int8/token", "token", "int8", "token"),
    Entry("int8_asym/token", "token", "uint8", "token", _ASYM),
    Entry("int4/kivi", "groups", "int4", "group", _KIVI),
    Entry("int4/token", "groups", "int4", "group", _GROUPS_PER_TOKEN),
    Entry("int2/kivi", "groups", "int2", "group", _KIVI),
    Entry("int2/token", "groups", "int2", "group", _GROUPS_PER_TOKEN),
)

SCHEME_NAMES = tuple(e.name for e in ENTRIES)  #: every registered name (``workbench.quant.SCHEMES``' keys)
FAMILY_OF = {e.name: e.family for e in ENTRIES}  #: scheme name -> storage family

#: Other names ``workbench.quant.get`` takes: a format alone means its first scheme, dtype spellings their cast.
ALIASES = {"fp8": "fp8_e4m3/tensor", "fp8_e4m3": "fp8_e4m3/tensor", "fp8_e5m2": "fp8_e5m2/tensor",
           "int8": "int8/tensor", "int8_asym": "int8_asym/token", "int4": "int4/kivi", "int2": "int2/kivi",
           "float16": "fp16", "half": "fp16", "bfloat16": "bf16", "float32": "fp32", "float": "fp32"}

REFERENCE = "fp16"  #: what quantized schemes are compared with (agreement, quality)


def _stem(name: str) -> str:
    return name.split("/")[0]


# ---- notebook 03's quant panel and the ``quant`` sweep: a reader picks a format, the knobs finish the scheme ------
#: The formats a reader picks from (``study.scheme_for``); fp32 is the error study's reference, not a choice.
STUDY_FAMILIES = tuple(dict.fromkeys(_stem(n) for n in SCHEME_NAMES if n != "fp32"))
#: Those that take tensor / head / token scales (the ``granularity`` knob).
STUDY_SCALED_FAMILIES = tuple(f for f in STUDY_FAMILIES if all(f"{f}/{g}" in FAMILY_OF for g in ("tensor", "head",
                                                                                                  "token")))
#: Those of the groups family (KIVI's knobs: group size, residual, key mode).
STUDY_GROUP_FAMILIES = tuple(dict.fromkeys(_stem(e.name) for e in ENTRIES if e.family == "groups"))
QUANT_SWEEP_GRID = ("fp8_e4m3", "int8", "int4", "int2")  #: the ``quant`` sweep's default grid of formats

# ---- notebook 06's agreement panel and the ``agreement`` sweep: a quantized cache's greedy run against fp16's ------
AGREEMENT_SCHEMES = tuple(n for n in SCHEME_NAMES if n != REFERENCE)  #: every scheme but the reference
AGREEMENT_GRID = ("fp8_e4m3/tensor", "int4/token", "int2/token")  #: the ``agreement`` sweep's default grid

# ---- benchmarks -----------------------------------------------------------------------------------------------------
#: ``bench quant_decode``: the schemes whose decode is timed, those of ``--smoke``, those whose write is timed.
#: fp32 right after fp16 (its speed-up over fp16, below 1: the seed's "FP32 costs twice the bytes", re-measured).
DECODE_BENCH_SCHEMES = ("fp16", "fp32", "bf16", "fp8_e4m3/tensor", "fp8_e4m3/head", "fp8_e4m3/token",
                        "fp8_e5m2/tensor", "int8/tensor", "int8/token", "int8_asym/token", "int4/token", "int4/kivi",
                        "int2/token", "int2/kivi", "int4/token@head", "int2/token@head")
#: ``bench quant_decode``'s name of a per-token groups scheme with one group a head (``<scheme>@head``)
ONE_GROUP_A_HEAD = "@head"
#: the one-group-a-head variants ``bench quant_decode`` times (``workbench.quant.one_group_a_head``): notebook 03
#: studies their error beside the registry's schemes
ONE_GROUP_A_HEAD_SCHEMES = tuple(n for n in DECODE_BENCH_SCHEMES if ONE_GROUP_A_HEAD in n)
DECODE_SMOKE_SCHEMES = ("fp16", "fp32", "fp8_e4m3/tensor", "int8/token", "int8_asym/token", "int4/kivi", "int2/token")
WRITE_BENCH_SCHEMES = ("fp16", "fp8_e4m3/tensor", "fp8_e4m3/token", "int8/token", "int8_asym/token", "int4/token",
                       "int4/kivi", "int2/kivi")
QUALITY_SMOKE_SCHEMES = ("fp16", "int8/tensor", "int4/token")  #: ``bench model_quality --smoke``
TIER_BENCH_SCHEMES = ("fp16", "int8/token", "fp8_e4m3/token")  #: ``bench tiers``: swap paths per stored format
#: A tier's formats below an fp16 device (``TieredCache(host_format=...)``): ``bench tiers``' formats section and
#: ``bench model_quality``'s tier rows; "fp16" is the device's own bytes (nothing transcoded), the reference.
TIER_FORMATS = ("fp16", "fp8_e4m3/token", "int8/token", "int4/token", "int4/kivi", "int2/token")
TIER_FORMAT_GRID = ("fp16", "int8/token", "int4/token", "int2/token")  #: the ``tier_formats`` sweep's default grid
#: ``python -m workbench profile``: what a GPU profile times, one scheme of each storage family the what-if offers.
PROFILE_SCHEMES = ("fp16", "fp8_e4m3/tensor", "fp8_e4m3/token", "int8/token", "int4/token", "int4/kivi", "int2/token",
                   "int2/kivi")
#: The what-if's K/V schemes: those the committed H200 ``bench quant_decode`` run timed (fp32 and the one-group-a-head
#: variants came after it).
WHATIF_SCHEMES = tuple(s for s in DECODE_BENCH_SCHEMES if s != "fp32" and ONE_GROUP_A_HEAD not in s)
WHATIF_GRID = ("fp16", "fp8_e4m3/head", "int8/token", "int4/token")  #: the ``whatif`` sweep's and frontier's schemes
#: ``workbench.compress.delta_study``: quantized codes whose lossless compression is measured.
DELTA_SCHEMES = ("int8/token", "fp8_e4m3/token", "int4/token", "int4/kivi")
#: ``bench anatomy``: the schemes whose compiled decode kernel is read (registers, SASS per byte of the loop).
ANATOMY_SCHEMES = ("fp16", "fp8_e4m3/tensor", "int8/token", "int8_asym/token", "int4/token", "int4/kivi", "int2/token",
                   "int2/kivi", "int4/token@head", "int2/token@head")

#: Every named list above, by name (the registry test checks each names registered schemes or formats).
SCHEME_LISTS = {"AGREEMENT_SCHEMES": AGREEMENT_SCHEMES, "AGREEMENT_GRID": AGREEMENT_GRID,
                "DECODE_BENCH_SCHEMES": DECODE_BENCH_SCHEMES, "DECODE_SMOKE_SCHEMES": DECODE_SMOKE_SCHEMES,
                "WRITE_BENCH_SCHEMES": WRITE_BENCH_SCHEMES, "QUALITY_SMOKE_SCHEMES": QUALITY_SMOKE_SCHEMES,
                "TIER_BENCH_SCHEMES": TIER_BENCH_SCHEMES, "TIER_FORMATS": TIER_FORMATS, "DELTA_SCHEMES": DELTA_SCHEMES,
                "ANATOMY_SCHEMES": ANATOMY_SCHEMES, "TIER_FORMAT_GRID": TIER_FORMAT_GRID,
                "PROFILE_SCHEMES": PROFILE_SCHEMES, "WHATIF_SCHEMES": WHATIF_SCHEMES, "WHATIF_GRID": WHATIF_GRID}
FORMAT_LISTS = {"STUDY_FAMILIES": STUDY_FAMILIES, "STUDY_SCALED_FAMILIES": STUDY_SCALED_FAMILIES,
                "STUDY_GROUP_FAMILIES": STUDY_GROUP_FAMILIES, "QUANT_SWEEP_GRID": QUANT_SWEEP_GRID}
