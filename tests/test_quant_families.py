"""Issue 31, storage families: every scheme is an object of its family's class, which owns its behaviour; one name
registry (``workbench.quant.names``) that every list of schemes comes from; no code in ``workbench/`` or
``kernels/`` outside the families tests which kind a scheme is."""

from __future__ import annotations

import ast
import copy
import dataclasses
import hashlib
import pickle
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from workbench import quant
from workbench.quant import blocks as qblocks
from workbench.quant import families, names

pytestmark = pytest.mark.kernels  # reads the kernels' family tables (workbench.kernels): the GPU run covers it too

ROOT = Path(__file__).resolve().parent.parent
FAMILY_DIR = ROOT / "workbench" / "quant" / "families"


def _small(scheme):
    """The scheme at parameters small enough for 8-token sequences of 16 channels."""
    return scheme.with_params(group=4, value_group=8, residual=3) if scheme.param_names else scheme


def _x(T: int = 11, H: int = 2, D: int = 16) -> torch.Tensor:
    """Deterministic values without a random generator (the same bits on every machine): rationals in [-10, 10]."""
    i = torch.arange(T * H * D, dtype=torch.int64)
    return (((i * 7919) % 2003 - 1001).float() / 97.0).reshape(T, H, D)


# ---- the registry ------------------------------------------------------------------------------------------------
def test_every_registered_scheme_is_an_object_of_its_familys_class():
    assert tuple(quant.SCHEMES) == names.SCHEME_NAMES
    assert set(families.FAMILY_CLASSES) == set(names.STORAGE_FAMILIES)
    for e in names.ENTRIES:
        s = quant.SCHEMES[e.name]
        cls = families.FAMILY_CLASSES[e.family]
        assert type(s) is cls and isinstance(s, quant.Scheme) and s.family == e.family, e
        assert (s.name, s.format_name, s.granularity) == (e.name, e.format_name, e.granularity)
        assert {k: getattr(s, k) for k, _ in e.params} == dict(e.params)
        assert s.granularity in cls.granularities
    for alias, target in names.ALIASES.items():
        assert quant.get(alias) is quant.SCHEMES[target]


def test_named_lists_name_registered_schemes_and_formats():
    stems = {n.split("/")[0] for n in names.SCHEME_NAMES}
    for key, lst in names.SCHEME_LISTS.items():  # a bench's '<scheme>@head' is that scheme with one group a head
        bare = [n.removesuffix(names.ONE_GROUP_A_HEAD) for n in lst]
        assert lst and set(bare) <= set(names.SCHEME_NAMES) and len(set(lst)) == len(lst), key
    for key, lst in names.FORMAT_LISTS.items():
        assert lst and set(lst) <= stems and len(set(lst)) == len(lst), key
    # what the study's panel offers, as it offered it before the registry
    assert names.STUDY_FAMILIES == ("fp16", "bf16", "fp8_e4m3", "fp8_e5m2", "int8", "int8_asym", "int4", "int2")
    assert names.STUDY_SCALED_FAMILIES == ("fp8_e4m3", "fp8_e5m2", "int8")
    assert names.STUDY_GROUP_FAMILIES == ("int4", "int2")
    assert names.AGREEMENT_SCHEMES == tuple(n for n in quant.SCHEMES if n != "fp16")


def test_the_copies_import_the_registry():
    from workbench.bench import model_quality, quant_decode
    from workbench.compress import delta_study
    from workbench.quant import error_study
    from workbench.studies.model import AGREEMENT
    from workbench.studies.quant import QUANT

    assert error_study.FAMILIES is names.STUDY_FAMILIES and QUANT.param("family").choices is names.STUDY_FAMILIES
    assert error_study.SCALED_FAMILIES is names.STUDY_SCALED_FAMILIES
    assert error_study.GROUP_FAMILIES is names.STUDY_GROUP_FAMILIES
    assert AGREEMENT.param("scheme").choices is names.AGREEMENT_SCHEMES and delta_study.SCHEMES is names.DELTA_SCHEMES
    assert quant_decode.DECODE_SCHEMES is names.DECODE_BENCH_SCHEMES
    assert quant_decode.SMOKE_SCHEMES is names.DECODE_SMOKE_SCHEMES
    assert quant_decode.WRITE_SCHEMES is names.WRITE_BENCH_SCHEMES
    assert model_quality.SMOKE_SCHEMES is names.QUALITY_SMOKE_SCHEMES


def test_names_module_imports_nothing_heavy():
    tree = ast.parse((ROOT / "workbench" / "quant" / "names.py").read_text())
    mods = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    mods |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert mods <= {"__future__", "typing"}, mods


# ---- the interface -----------------------------------------------------------------------------------------------
CAPABILITIES = ("quantized", "needs_static_scales", "scales_on_write", "keeps_residual", "supports_key_bounds")


@pytest.mark.parametrize("family", names.STORAGE_FAMILIES)
def test_each_family_implements_the_whole_interface(family):
    cls = families.FAMILY_CLASSES[family]
    for method in ("bytes_per_token", "_quantize", "dequantize"):
        assert getattr(cls, method) is not getattr(quant.Scheme, method), (family, method)
    for cap in CAPABILITIES:
        assert isinstance(getattr(cls, cap), bool), (family, cap)
    for s in (_small(quant.SCHEMES[e.name]) for e in names.ENTRIES if e.family == family):
        T, H, D, bs = 11, 2, 16, 8
        x = _x(T, H, D)
        s.check()
        s.check_shape(H, D)
        assert isinstance(s.title(), str) and isinstance(s.scales_label(), str)
        assert s.quantized_tokens(T) + s.residual_tokens(T) == T and s.quantized_tokens(T) % s.write_group == 0
        assert s.head_dim_of(s.code_dim(D)) == D
        assert s.bytes_per_token(H, D) > 0 and s.bytes_per_token(H, D, context=T) > 0
        assert s.without_residual().residual_tokens(T) == T % s.write_group
        for kind in "kv":
            qz = s.quantize(x, kind)
            assert qz.codes.shape == (s.quantized_tokens(T), H, s.code_dim(D)) and qz.codes.dtype == s.format.storage
            assert torch.equal(s.store_codes(s.code_values(qz.codes)).view(torch.uint8), qz.codes.view(torch.uint8))
            back = s.dequantize(qz, kind)
            assert back.shape == x.shape and back.dtype == torch.float32
            assert torch.equal(s.roundtrip(x, kind), back)
            sc = s.block_scales(kind, bs, H, D)
            assert (sc is not None) == s.scales_on_write, s.name
            if sc is not None:
                assert sc.offset >= qblocks.code_bytes(s, bs, H, D) and sc.offset % qblocks.SCALE_ALIGN == 0
        cal = s.calibrate(x)
        assert (cal is not None) == s.needs_static_scales
        if s.needs_static_scales:
            assert torch.equal(s.scales_from_amax(x.abs().amax(dim=(0, 2))), cal.reshape(-1))
        else:
            with pytest.raises(ValueError, match="takes no static scales"):
                s.scales_from_amax(torch.ones(H))


@settings(max_examples=60, deadline=None)
@given(name=st.sampled_from(names.SCHEME_NAMES), heads=st.integers(1, 4), head_dim=st.sampled_from([16, 32, 64, 128]),
       blocks_of=st.integers(1, 4), group=st.sampled_from([1, 2, 4, 8, 16]), value_group=st.sampled_from([4, 8, 16]))
def test_bytes_per_token_is_what_the_blocks_hold(name, heads, head_dim, blocks_of, group, value_group):
    """The family's accounting and its block layout agree: at long context a token's K and V take the codes of a
    row plus its share of the block's scales and zero points (static scales: none per token)."""
    s = quant.SCHEMES[name]
    if s.param_names:
        s = s.with_params(group=group, value_group=value_group)
    bs = group * blocks_of * 4
    per_kind = []
    for kind in "kv":
        sc = s.block_scales(kind, bs, heads, head_dim)
        per_kind.append(qblocks.code_bytes(s, bs, heads, head_dim) + (sc.nbytes if sc is not None else 0))
    assert s.bytes_per_token(heads, head_dim) == pytest.approx(sum(per_kind) / bs, rel=1e-12)


def test_scheme_built_from_its_fields_is_the_registrys():
    for s in quant.SCHEMES.values():
        rebuilt = quant.Scheme(**{f.name: getattr(s, f.name) for f in dataclasses.fields(s)})
        assert type(rebuilt) is type(s) and rebuilt == s and hash(rebuilt) == hash(s)
        assert pickle.loads(pickle.dumps(s)) == s and copy.deepcopy(s) == s
    with pytest.raises(ValueError, match="granularity must be one of"):
        quant.Scheme("x", "int8", "block")
    with pytest.raises(ValueError, match="granularity of a token scheme"):
        families.TokenScheme("x", "int8", "tensor")
    with pytest.raises(ValueError, match="takes no parameters"):
        quant.get("int8/token", group=16)
    assert quant.get("int4/token", group=16).group == 16 and isinstance(quant.get("int4", residual=0),
                                                                          families.GroupScheme)


# ---- the old numbers ---------------------------------------------------------------------------------------------
# sha256 of every registered scheme's codes, scales, zero points, residual and read-back (K, then V) for
# _x(160, 2, 64) (KIVI: 32 tokens quantized, 128 in the residual), computed with the implementation before the
# families (commit 0507265): the refactor stores the same bytes
OLD_DIGESTS = {
    "fp32": "4becea6f068ef72b", "fp16": "7f32bc70e60753a8", "bf16": "61bd4cf5bdd5064b",
    "fp8_e4m3/tensor": "a2663e8bbbeec71d", "fp8_e4m3/head": "5d1f0e28caae289b", "fp8_e4m3/token": "395904480c4eda89",
    "fp8_e5m2/tensor": "3bdad9c69acc8d02", "fp8_e5m2/head": "23604bd17ffd51cc", "fp8_e5m2/token": "833ac2192aa84440",
    "int8/tensor": "37faab68cc62d9b7", "int8/head": "7367b795afebfb76", "int8/token": "a837aacd0f4cc54b",
    "int8_asym/token": "c3bab8841d600943", "int4/kivi": "7b659f32bfdae5d8", "int4/token": "2fe5fd352986107b",
    "int2/kivi": "c8687d9a8a48c3d2", "int2/token": "841b012f4bdfecb1",
}


def _digest(s) -> str:
    h = hashlib.sha256()
    x = _x(160, 2, 64)
    for kind in "kv":
        qz = s.quantize(x, kind)
        for t in (qz.codes, qz.scale, qz.zero, qz.residual, s.dequantize(qz, kind)):
            h.update(b"-" if t is None else t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


@pytest.mark.parametrize("name", list(OLD_DIGESTS))  # the schemes of before the families (a new one needs none)
def test_stored_bytes_equal_the_implementation_before_the_families(name):
    assert _digest(quant.SCHEMES[name]) == OLD_DIGESTS[name]


# ---- no kind tests outside the families, no copied lists ---------------------------------------------------------
KIND_FLAGS = {"packed", "static", "scales_in_blocks"}


def _package_files():
    for top in ("workbench", "kernels"):
        for p in sorted((ROOT / top).rglob("*.py")):
            if FAMILY_DIR not in p.parents:
                yield p


def _kind_tests(tree: ast.AST) -> list[tuple[int, str]]:
    """Uses of the old kind flags, and of ``.granularity`` anywhere but as data (a dict value, a call's argument,
    a label's f-string)."""
    parents = {c: n for n in ast.walk(tree) for c in ast.iter_child_nodes(n)}
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute):
            continue
        if node.attr in KIND_FLAGS:
            out.append((node.lineno, node.attr))
        elif node.attr == "granularity":
            parent = parents.get(node)
            data = (isinstance(parent, ast.Dict) and node in parent.values or isinstance(parent, ast.keyword)
                    or isinstance(parent, ast.Call) and node in parent.args or isinstance(parent, ast.FormattedValue))
            if not data:
                out.append((node.lineno, "granularity"))
    return out


def _scheme_lists(tree: ast.AST) -> list[tuple[int, tuple]]:
    """Literal tuples / lists / sets of scheme names: two or more registered names with a family suffix
    (``int8/token``), or a copy of one of the registry's named lists."""
    copies = {frozenset(v) for v in (*names.SCHEME_LISTS.values(), *names.FORMAT_LISTS.values())}
    out = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)) and len(node.elts) >= 2:
            vals = tuple(e.value for e in node.elts if isinstance(e, ast.Constant) and isinstance(e.value, str))
            suffixed = [v for v in vals if "/" in v and v in names.FAMILY_OF]
            if len(suffixed) >= 2 or (len(vals) == len(node.elts) and frozenset(vals) in copies):
                out.append((node.lineno, vals))
    return out


def test_no_kind_tests_and_no_copied_scheme_lists_outside_the_families():
    kinds, lists = {}, {}
    for p in _package_files():
        tree = ast.parse(p.read_text())
        rel = str(p.relative_to(ROOT))
        if found := _kind_tests(tree):
            kinds[rel] = found
        if rel != "workbench/quant/names.py" and (found := _scheme_lists(tree)):
            lists[rel] = found
    assert not kinds, f"ask the scheme (needs_static_scales, scales_on_write, keeps_residual, ...): {kinds}"
    assert not lists, f"import the list from workbench.quant.names: {lists}"


def test_the_detectors_find_what_they_look_for():
    src = ("if s.packed: pass\nx = s.static\nif s.granularity == 'token': pass\nrow = {'g': s.granularity}\n"
           "f(s.granularity)\nL = ('int8/token', 'int4/kivi')\nM = ('int4', 'int2')\nN = ('fp16', 'bf16')\n")
    tree = ast.parse(src)
    assert _kind_tests(tree) == [(1, "packed"), (2, "static"), (3, "granularity")]
    assert [line for line, _ in _scheme_lists(tree)] == [6, 7]


# ---- the kernels' tables cover the families ----------------------------------------------------------------------
def test_kernel_tables_cover_each_family():
    from workbench.kernels import common
    from workbench.kernels.decode import quant as dquant
    from workbench.kernels.quest.bounds import BOUNDS_FAMILIES
    from workbench.kernels.write import dynamic

    reps = {e.family: quant.SCHEMES[e.name] for e in names.ENTRIES}
    assert set(dquant.DECODE_FAMILIES) == set(names.STORAGE_FAMILIES)
    assert set(dynamic.WRITE_MODES) == {f for f, s in reps.items() if s.scales_on_write}
    assert set(BOUNDS_FAMILIES) == {f for f, s in reps.items() if s.supports_key_bounds}
    assert set(common.KERNEL_SHAPE_CHECKS) <= set(names.STORAGE_FAMILIES)
    assert dquant.DECODE_FAMILIES["groups"].fixed == {"k3d": False}


def test_decode_launch_defaults_by_family_are_the_measured_ones():
    """Only a GPU plan reads them (the interpreter keeps its own launch): pinned here as they were before the
    families (docs/quant_tuning.md)."""
    from workbench.kernels.decode import quant as dquant

    want = {"cast": {}, "static": {"num_warps": 2, "BLOCK_N": 64, "num_stages": 3}, "groups": {"BLOCK_N": 32}}
    for name, s in quant.SCHEMES.items():
        expected = want.get(s.family, {"num_warps": 2, "BLOCK_N": 64, "num_stages": 3})
        assert dquant.launch_defaults(s, 128) == expected, name
    # one scale a token-head (keys per token, a group the whole head): int4 on the streams kernel (its tile by context,
    # kernels/decode/streams.py streams_tile), int2 on the planes kernel
    for name, want_one in (("int4/token", {"planes": True, "num_warps": 4}),
                           ("int2/token", {"planes": True, "streams": 0, "BLOCK_N": 128})):
        for head_dim in (64, 128):
            one = quant.get(name).with_params(value_group=head_dim)
            assert dquant.launch_defaults(one, head_dim) == want_one, (name, head_dim)
            assert dquant.launch_defaults(one, head_dim * 2) == {"BLOCK_N": 32}, (name, head_dim)  # two groups a head
    assert dquant.launch_defaults(quant.get("int4/kivi").with_params(value_group=128), 128) == {"BLOCK_N": 32}
