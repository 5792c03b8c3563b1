"""tests/pairwise.py, the covering designs the kernel tests are parametrized with: every pair of values meets, every
value and every ``each`` configuration keeps a case, the same cases on every run."""

from itertools import combinations, product

import pytest
import torch

from workbench.conformance.pairwise import cover, pairwise
from workbench.core.layout import Layout


def pairs_met(cases, axes) -> bool:
    return all(any(repr(c[a]) == repr(u) and repr(c[b]) == repr(v) for c in cases)
               for a, b in combinations(axes, 2) for u in axes[a] for v in axes[b])


@pytest.mark.parametrize("axes", [
    {"layout": list(Layout), "dtype": [torch.float16, torch.bfloat16, torch.float32], "splits": [1, 2, 3],
     "gqa": [1, 4, 8], "page": [1, 16]},
    {"a": [0, 1], "b": ["x", "y", "z"], "c": [True, False], "d": [dict(k=1), dict(k=2)]},
    {"only": [3, 1, 2]},
])
def test_pairwise_meets_every_pair_in_fewer_cases(axes):
    cases = pairwise(axes)
    assert pairs_met(cases, axes) and all({repr(c[a]) for c in cases} == {repr(v) for v in axes[a]} for a in axes)
    full = 1
    for v in axes.values():
        full *= len(v)
    assert len(cases) <= full and cases == pairwise(axes)  # deterministic
    if len(axes) > 2:
        assert len(cases) < full


def test_pairwise_respects_allowed():
    axes = {"layout": ["nhd", "vllm"], "k3d": [True, False], "bs": [8, 16]}
    cases = pairwise(axes, allowed=lambda c: not (c.get("layout") == "nhd" and c.get("k3d")))
    assert not any(c["layout"] == "nhd" and c["k3d"] for c in cases)
    assert any(c["layout"] == "vllm" and c["k3d"] for c in cases)


def test_cover_keeps_every_configuration_and_every_pair():
    configs = [dict(bs=16, dtype="fp16"), dict(bs=1, dtype="fp16"), dict(bs=16, dtype="fp32", split=True),
               dict(bs=1, dtype="fp32")]
    cands = [{**c, "layout": lay, "config": i} for lay, (i, c) in product(["nhd", "hnd", "vllm"], enumerate(configs))]
    chosen = cover(cands, each=["config"])
    assert {c["config"] for c in chosen} == {0, 1, 2, 3} and len(chosen) < len(cands)
    keys = ["bs", "dtype", "split", "layout"]
    want = {(a, repr(r.get(a)), b, repr(r.get(b))) for r in cands for a, b in combinations(keys, 2)}
    got = {(a, repr(r.get(a)), b, repr(r.get(b))) for r in chosen for a, b in combinations(keys, 2)}
    assert want == got
    assert chosen == [c for c in cands if c in chosen]  # in the candidates' order
