"""Quantized K/V: the schemes (``schemes``), by name (:func:`get`), where blocks keep their scales (``blocks``),
static scales from a calibration pass (:class:`Calibrator`), and the error study (``study``).

``get("fp8_e4m3/token")``, ``get("int4", group=32, residual=128)``; :data:`SCHEMES` lists every name.
The kernels (``workbench.kernels``) quantize on write and dequantize inside paged decode for every scheme;
``workbench.quant`` is their plain PyTorch definition.
"""

from __future__ import annotations

from .calibration import Calibrator
from .schemes import NonFiniteError, Quantized, Scheme, check_finite, pack, to_fp16, unpack


def _registry() -> dict[str, Scheme]:
    out = [Scheme("fp32", "fp32", "none"), Scheme("fp16", "fp16", "none"), Scheme("bf16", "bf16", "none")]
    for fp8 in ("fp8_e4m3", "fp8_e5m2"):
        out += [Scheme(f"{fp8}/{g}", fp8, g) for g in ("tensor", "head", "token")]
    out += [Scheme(f"int8/{g}", "int8", g) for g in ("tensor", "head", "token")]
    out.append(Scheme("int8_asym/token", "uint8", "token", symmetric=False))
    for bits in (4, 2):
        out.append(Scheme(f"int{bits}/kivi", f"int{bits}", "group", symmetric=False, group=32, value_group=32,
                          residual=128, key_mode="channel"))
        out.append(Scheme(f"int{bits}/token", f"int{bits}", "group", symmetric=False, group=32, value_group=32,
                          residual=0, key_mode="token"))
    return {s.name: s for s in out}


SCHEMES: dict[str, Scheme] = _registry()
ALIASES = {"fp8": "fp8_e4m3/tensor", "fp8_e4m3": "fp8_e4m3/tensor", "fp8_e5m2": "fp8_e5m2/tensor",
           "int8": "int8/tensor", "int8_asym": "int8_asym/token", "int4": "int4/kivi", "int2": "int2/kivi",
           "float16": "fp16", "half": "fp16", "bfloat16": "bf16", "float32": "fp32", "float": "fp32"}


def get(name: str | Scheme, **params) -> Scheme:
    """The scheme called ``name`` (or an alias: ``"fp8"`` is ``"fp8_e4m3/tensor"``, ``"int4"`` is
    ``"int4/kivi"``), with ``group`` / ``value_group`` / ``residual`` / ``key_mode`` overridden by ``params``."""
    if isinstance(name, Scheme):
        scheme = name
    else:
        key = ALIASES.get(name, name) if isinstance(name, str) else name
        if key not in SCHEMES:
            raise ValueError(f"quantization scheme must be one of {sorted(SCHEMES)} (or the aliases "
                             f"{sorted(ALIASES)}), got {name!r}")
        scheme = SCHEMES[key]
    if params:
        if not scheme.packed:
            raise ValueError(f"{scheme.name} takes no parameters (group, value_group, residual, key_mode are for "
                             f"the int4/int2 group schemes), got {sorted(params)}")
        unknown = set(params) - {"group", "value_group", "residual", "key_mode"}
        if unknown:
            raise ValueError(f"unknown parameters {sorted(unknown)} for {scheme.name}; it takes group, value_group, "
                             f"residual, key_mode")
        scheme = scheme.with_params(**params)
    return scheme


def resolve(kv_dtype, name: str = "kv_dtype") -> Scheme:
    """The scheme a storage argument names: a :class:`Scheme`, a scheme name or alias, a ``workbench.formats``
    format name or a torch dtype (its plain reading: a cast, or fp8 / int8 with static scales). ``uint8``
    codes are refused: int8_asym, int4 and int2 all store them, so only the scheme says which."""
    from workbench import formats

    if isinstance(kv_dtype, Scheme):
        return kv_dtype
    if isinstance(kv_dtype, str) and (kv_dtype in SCHEMES or kv_dtype in ALIASES):
        return get(kv_dtype)
    try:
        fmt = formats.get(kv_dtype)
    except ValueError:
        raise ValueError(f"{name} must be a quantization scheme (workbench.quant.SCHEMES: {sorted(SCHEMES)}), "
                         f"a storage format {sorted(formats.FORMATS)} or a torch dtype, got {kv_dtype!r}") from None
    if fmt.name == "uint8":
        raise ValueError(f"{name} holds uint8 codes, which int8_asym, int4 and int2 all store: name the scheme "
                         f"(quant=, or kv_dtype='int8_asym/token', 'int4/kivi', ...)")
    return get(fmt.name)


__all__ = ["ALIASES", "SCHEMES", "Calibrator", "NonFiniteError", "Quantized", "Scheme", "check_finite", "get", "pack",
           "resolve", "to_fp16", "unpack"]
