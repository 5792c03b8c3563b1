"""Quantized K/V: the schemes, one class per storage family (``families``), their names (``names``), by name
(:func:`get`), where blocks keep their scales (``blocks``), static scales from a calibration pass
(:class:`Calibrator`, per cache or per layer; a cache's table of them: ``scale_table``), and the error study
(``error_study``) on synthetic K/V (``synthetic``) or captured ones.

``get("fp8_e4m3/token")``, ``get("int4", group=32, residual=128)``; :data:`SCHEMES` lists every name.
The kernels (``workbench.kernels``) quantize on write and dequantize inside paged decode for every scheme;
``workbench.quant`` is their plain PyTorch definition. docs/quant_families.md: the families and how to add one.
"""

from __future__ import annotations

from workbench.core import kv_formats

from . import names
from .calibration import Calibrator
from .families import (
    FAMILY_CLASSES,
    CastScheme,
    GroupScheme,
    NonFiniteError,
    Quantized,
    Scheme,
    StaticScheme,
    TokenScheme,
    check_finite,
    pack,
    to_fp16,
    unpack,
)
from .names import ALIASES
from .scale_table import ScaleTable, scale_table


def _registry() -> dict[str, Scheme]:
    return {e.name: FAMILY_CLASSES[e.family](e.name, e.format_name, e.granularity, **dict(e.params))
            for e in names.ENTRIES}


SCHEMES: dict[str, Scheme] = _registry()


def get(name: str | Scheme, **params) -> Scheme:
    """The scheme called ``name`` (or an alias: ``"fp8"`` is ``"fp8_e4m3/tensor"``, ``"int4"`` is
    ``"int4/kivi"``), with its family's parameters (``group`` / ``value_group`` / ``residual`` / ``key_mode`` of
    the groups family) overridden by ``params``."""
    if isinstance(name, Scheme):
        scheme = name
    else:
        key = ALIASES.get(name, name) if isinstance(name, str) else name
        if key not in SCHEMES:
            raise ValueError(f"quantization scheme must be one of {sorted(SCHEMES)} (or the aliases "
                             f"{sorted(ALIASES)}), got {name!r}")
        scheme = SCHEMES[key]
    if params:
        if not scheme.param_names:
            raise ValueError(f"{scheme.name} takes no parameters (group, value_group, residual, key_mode are for "
                             f"the int4/int2 group schemes), got {sorted(params)}")
        unknown = set(params) - set(scheme.param_names)
        if unknown:
            raise ValueError(f"unknown parameters {sorted(unknown)} for {scheme.name}; it takes "
                             f"{', '.join(scheme.param_names)}")
        scheme = scheme.with_params(**params)
    return scheme


def one_group_a_head(name: str, head_dim: int | None) -> Scheme:
    """The scheme ``<scheme>@head`` (``names.ONE_GROUP_A_HEAD``): a per-token groups scheme with one group a head
    (``value_group = head_dim``: one scale and zero point a token and head, the bytes issue 31 states its limits in),
    labelled with that name. ``ValueError`` naming the name for anything else or without a ``head_dim``."""
    base, at, _ = name.partition("@")
    s = get(base) if base in SCHEMES else None
    if (not at or base + names.ONE_GROUP_A_HEAD != name or s is None or "value_group" not in s.param_names
            or head_dim is None):
        raise ValueError(f"scheme {name!r}: '@head' takes a groups scheme and the workload's head_dim "
                         f"(e.g. int4/token@head), got head_dim={head_dim!r}")
    return s.with_params(value_group=head_dim, label=name)


def resolve(kv_dtype, name: str = "kv_dtype") -> Scheme:
    """The scheme a storage argument names: a :class:`Scheme`, a scheme name or alias, a ``workbench.core.kv_formats``
    format name or a torch dtype (its plain reading: a cast, or fp8 / int8 with static scales). ``uint8``
    codes are refused: int8_asym, int4 and int2 all store them, so only the scheme says which."""
    if isinstance(kv_dtype, Scheme):
        return kv_dtype
    if isinstance(kv_dtype, str) and (kv_dtype in SCHEMES or kv_dtype in ALIASES):
        return get(kv_dtype)
    try:
        fmt = kv_formats.get(kv_dtype)
    except ValueError:
        raise ValueError(f"{name} must be a quantization scheme (workbench.quant.SCHEMES: {sorted(SCHEMES)}), "
                         f"a storage format {sorted(kv_formats.FORMATS)} or a torch dtype, got {kv_dtype!r}") from None
    if fmt.name == "uint8":
        raise ValueError(f"{name} holds uint8 codes, which int8_asym, int4 and int2 all store: name the scheme "
                         f"(quant=, or kv_dtype='int8_asym/token', 'int4/kivi', ...)")
    return get(fmt.name)


__all__ = ["ALIASES", "FAMILY_CLASSES", "SCHEMES", "Calibrator", "CastScheme", "GroupScheme", "NonFiniteError",
           "Quantized", "ScaleTable", "Scheme", "StaticScheme", "TokenScheme", "check_finite", "get", "names", "pack",
           "resolve", "scale_table", "to_fp16", "unpack"]
