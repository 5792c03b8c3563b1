"""The sweeps of notebooks 02 (the decode kernel on a GPU), 06 (the real model) and 09 (conformance): each default
point returns its plotted columns, is deterministic and agrees with the package function its panel calls; the GPU
sweep is refused on a machine without one, before anything is written; the real model's is skipped when the
``model`` extra is not installed."""

from __future__ import annotations

import math

import pytest

from workbench import sweeps
from workbench.sweeps import runner

# conftest: small tensors, one torch thread on a busy CPU; runs Triton kernels (scripts/gpu_run.sh runs it compiled)
pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.kernels]
MODEL_SWEEP_POINT_TOKENS = 4  # new tokens of the model points run here (the sweep's default is 8)


def flat(row: dict) -> bool:
    return all(isinstance(v, int | float | str | bool) for v in row.values())


# ---- decode: a GPU sweep --------------------------------------------------------------------------------------------
def test_decode_needs_a_gpu_and_is_refused_without_one(tmp_path, monkeypatch):
    import torch

    s = sweeps.get("decode")
    assert s.needs_gpu(s.defaults()) and s.notebook == "02_layouts_and_kernels" and s.panel == "decode_results_panel"
    assert "decode [GPU]:" in sweeps.listing()
    assert len(sweeps.plan("decode")[1]) == 15  # 3 layouts x 5 page sizes
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match="need a GPU"):
        runner.run("decode", out=tmp_path, progress=False)
    assert list(tmp_path.iterdir()) == []


def test_decode_row_assembly_on_a_tiny_workload_with_stub_timers(monkeypatch):
    """The measurement's row on this machine's device (the interpreter on a CPU): a smoke-sized W1, the launch
    heuristic's interpreter configuration, timers that call once and return fixed times; what a GPU point computes
    besides the times."""
    import workbench
    from workbench.bench import decode_timing, harness
    from workbench.core.workloads import WORKLOADS
    from workbench.studies import kernels

    times = iter([10.0, 12.0, 30.0, 40.0])  # ours' two eager medians, then the baseline's
    monkeypatch.setattr(harness, "time_us", lambda fn, warmup_ms=25, rep_ms=200: (fn(), next(times))[1])
    monkeypatch.setattr(harness, "time_us_graph", lambda fn, calls_per_graph=10, rep_ms=200: (fn(), 5.0)[1])
    # the heuristic's SM count only (torch.cuda.get_device_properties stubbed broke Triton's own launch on a GPU)
    monkeypatch.setattr(decode_timing, "_num_sms", lambda device: 0)
    monkeypatch.setattr(kernels, "_copy_gbps", lambda: 100.0)
    s = sweeps.get("decode")
    row = kernels._measure(WORKLOADS["W1"].smoke(), layout="nhd", block_size=16, kv_dtype="fp16", pad=0, change={},
                           baseline="sdpa_contiguous", rep_ms=1.0, graph=True, seed=0,
                           device=str(workbench.device()))  # compiled kernels read GPU memory only
    assert flat(row) and set(s.y) <= set(row) and not set(row) & {p.name for p in s.params}
    assert row["time_us"] == 10.0 and row["time_us_graph"] == 5.0 and row["baseline_time_us"] == 30.0
    assert row["x_baseline"] == row["x_sdpa_contiguous"] == 3.0 and row["baseline_error"] == ""
    assert row["rel_err"] < 1e-2 and row["baseline_rel_err"] < 1e-2
    assert math.isclose(row["frac_copy_bw"], row["bytes"] / 10e-6 / 1e9 / 100.0)
    assert row["variant"] == "heuristic" and row["BLOCK_N"] == 32  # decode_config on the interpreter
    seen = {}
    monkeypatch.setattr(kernels, "_measure", lambda w, **kw: seen.update(w=w, **kw) or {})
    s.point(**{**s.defaults(), "workload": "W5", "block_n": 64, "stages": 3})  # nonzero: overrides the heuristic
    assert seen["w"] is WORKLOADS["W5"] and seen["change"] == {"BLOCK_N": 64, "num_stages": 3}


# ---- conformance: notebook 09 -------------------------------------------------------------------------------------
def test_conformance_default_point_agrees_with_the_panels_check():
    from workbench.conformance.suite import check_quietly
    from workbench.ui import conformance_panels

    s = sweeps.get("conformance")
    assert not s.needs_gpu(s.defaults()) and s.default_grid() == {"impl": ("reference", "starter", "ours")}
    row = s.point(**s.defaults())
    assert flat(row) and set(s.y) <= set(row) and not set(row) & {p.name for p in s.params}
    assert row == s.point(**s.defaults())  # deterministic (seeded cases, float64 reference)
    report = check_quietly("reference", level="smoke")
    assert conformance_panels.check_quietly is check_quietly  # the ui's name for it
    assert (row["cases"], row["failed_cases"], row["all_passed"]) == (len(report.results), 0, True)
    assert row["pass_rate"] == 1.0 and row["first_failure"] == "" and 0 < row["worst_error_over_tol"] < 1
    assert row["worst_error"] == max(r.error for r in report.results)
    assert row["worst_error_fp16"] == report.worst_by()["fp16"][0]


def test_conformance_point_names_an_unknown_impl_and_counts_failures():
    from workbench import conformance

    s = sweeps.get("conformance")
    with pytest.raises(ValueError, match="no decode implementation named 'nope'.*reference"):
        s.point(impl="nope", level="smoke", op="decode")

    def zeros(q, k_cache, v_cache, layout, block_table, seq_lens, sm_scale, out):  # right only for empty sequences
        out.zero_()

    conformance.register("decode", "_sweep_zeros", zeros, layouts=("nhd",), formats=("fp32",), replace=True)
    try:
        row = s.point(impl="_sweep_zeros", level="smoke", op="decode")
    finally:
        conformance.unregister("decode", "_sweep_zeros")
    assert row["failed_cases"] > 0 and not row["all_passed"] and row["pass_rate"] < 1
    assert row["first_failure"] and "relative error" in row["first_failure_reason"]
    assert row["passed_cases"] + row["failed_cases"] == row["cases"] == row["cases_fp32"]
    assert row["worst_error"] == row["worst_error_fp32"] == 1.0 and row["worst_error_over_tol"] == 1e4


# ---- agreement: notebook 06, the real model -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def smol():
    pytest.importorskip("gguf", reason="the model extra (pip install -e '.[model]') is not installed")
    pytest.importorskip("tokenizers", reason="the model extra (pip install -e '.[model]') is not installed")
    from workbench.model.gguf_weights import model_available

    why = model_available()
    if why is not None:
        pytest.skip(f"SmolLM2-135M: {why}")
    from workbench.studies import model

    return model


def test_agreement_lists_its_schemes_and_prompts():
    from workbench import quant
    from workbench.model.capture import PROMPTS
    from workbench.studies import model

    s = sweeps.get("agreement")
    assert tuple(n for n in quant.SCHEMES if n != "fp16") == s.param("scheme").choices
    assert model.PROMPTS == tuple(p.name for p in PROMPTS)
    assert not s.needs_gpu(s.defaults()) and s.needs_gpu({**s.defaults(), "device": "cuda"})


def test_agreement_point_is_the_panels_result(smol):
    from workbench.model import agreement

    s = sweeps.get("agreement")
    params = {**s.defaults(), "new_tokens": MODEL_SWEEP_POINT_TOKENS}
    row = s.point(**params)
    assert flat(row) and set(s.y) <= set(row) and not set(row) & {p.name for p in s.params}
    assert row == s.point(**params)  # deterministic: one thread, greedy
    model, tok, ops = smol._model("cpu")
    tokens = smol._tokens("cpu", "chat_question")
    with smol.one_thread():  # as the point runs
        r = agreement.agreement_result(model, tok, tokens, MODEL_SWEEP_POINT_TOKENS, "int4/token", ops=ops)  # new fp16
    assert (row["equal"], row["max_drift"], row["bytes_per_token"]) == (r["equal"], r["max_drift"], r["bytes"])
    assert row["equal_share"] == r["equal"] / MODEL_SWEEP_POINT_TOKENS and row["bytes_ratio"] < 1
    assert row["first_divergence"] == (MODEL_SWEEP_POINT_TOKENS if r["first_divergence"] is None
                                       else r["first_divergence"])


def test_agreement_is_refused_clearly_without_the_model(monkeypatch):
    from workbench.model.gguf_weights import ModelUnavailable
    from workbench.studies import model

    monkeypatch.setattr("workbench.model.gguf_weights.model_available", lambda: "not installed here")
    monkeypatch.setattr(model, "_model", model._model.__wrapped__)  # not the process's cached model
    s = sweeps.get("agreement")
    with pytest.raises(ModelUnavailable, match="SmolLM2-135M.*not installed here"):
        s.point(**s.defaults())
