"""The eviction study on the real SmolLM2-135M (workbench.compress.model_study, run by ``bench compression_model``),
at its smoke size: the full-cache reference scores itself perfectly, compaction keeps exactly the budget in the
fewest blocks, partial="keep" holds
whole blocks, and the JSON carries the results' metadata. Needs the optional model packages (``scripts/setup.sh``);
without them the module is skipped, saying how to install them."""

import json
import math

import pytest

from workbench.model.gguf_weights import model_available

why = model_available()
if why is not None:
    pytest.skip(f"SmolLM2-135M is not available: {why}", allow_module_level=True)

from workbench.bench import compression_model  # noqa: E402
from workbench.compress import policies  # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def _threads(one_thread):
    """One torch thread: two stall each other on a busy 2-core CPU."""


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out = tmp_path_factory.mktemp("study")
    assert compression_model.main(["--smoke", "--out", str(out)]) == 0
    (path,) = out.glob("compression-model-*.json")
    return json.loads(path.read_text())


def test_the_smoke_study_writes_tidy_rows_with_metadata(smoke):
    meta = smoke["meta"]
    for key in ("gpu", "torch", "triton", "commit", "date"):
        assert meta[key]
    assert smoke["mode"] == "smoke" and smoke["summary"]
    rows = smoke["rows"]
    assert {(r["policy"], r["partial"]) for r in rows} == {
        ("full", "-"), ("streaming", "keep"), ("streaming", "compact"), ("h2o", "keep"), ("h2o", "compact")}
    for r in rows:
        assert r["scored_tokens"] == 3 and r["prompt_tokens"] == 64 and r["commit"] == meta["commit"]
        assert 0 <= r["agreement"] <= 1 and r["mean_abs_drift"] >= 0 and r["mean_kl"] >= -1e-6
        assert math.isfinite(r["perplexity"]) and r["bytes_kept"] == r["blocks_kept"] * r["bytes_full"] // r[
            "blocks_full"]


def test_the_reference_scores_itself_and_the_budgets_hold(smoke):
    rows = {(r["policy"], r["partial"]): r for r in smoke["rows"]}
    full = rows["full", "-"]
    assert (full["agreement"], full["mean_abs_drift"], full["mean_kl"], full["memory_kept"]) == (1.0, 0.0, 0.0, 1.0)
    T, bs = full["prompt_tokens"], full["page_tokens"]
    n = policies.resolve_budget(0.25, T)
    for name in ("streaming", "h2o"):
        compact, keep = rows[name, "compact"], rows[name, "keep"]
        assert compact["kept_tokens"] == n and compact["blocks_kept"] == -(-n // bs)  # exactly the budget, packed
        assert keep["kept_tokens"] == keep["blocks_kept"] * bs >= n  # whole blocks (64 tokens: all full)
        assert keep["tokens_moved"] == 0 and compact["memory_kept"] <= keep["memory_kept"] < 1
