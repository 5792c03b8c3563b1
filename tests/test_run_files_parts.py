"""A run split over GPU calls joined into one result file (``run_files.join_parts``)."""

import pytest

from workbench.results import run_files


def _part(date, rows, **meta):
    base = {"gpu": "NVIDIA H200", "torch": "2.11", "triton": "3.6", "commit": "abc", "date": date}
    return {"meta": {**base, **meta}, "copy_gbps": len(rows) * 1000.0, "mode": "gpu", "rows": rows}


def test_parts_join_in_order_and_keep_what_each_measured():
    a = _part("2026-12-05T11:00:00Z", [{"workload": "W1"}, {"workload": "W2"}])
    b = _part("2026-12-05T11:09:00Z", [{"workload": "W3"}])
    doc = run_files.join_parts([a, b])
    assert [r["workload"] for r in doc["rows"]] == ["W1", "W2", "W3"]
    assert doc["meta"]["date"] == "2026-12-05T11:09:00Z" and doc["meta"]["commit"] == "abc"
    assert doc["copy_gbps"] == 2000.0 and doc["mode"] == "gpu"  # the first part's fields
    assert [p["copy_gbps"] for p in doc["parts"]] == [2000.0, 1000.0] and [p["rows"] for p in doc["parts"]] == [2, 1]
    assert a["rows"] == [{"workload": "W1"}, {"workload": "W2"}]  # the parts unchanged


@pytest.mark.parametrize("field, value", [("gpu", "NVIDIA H100 80GB HBM3"), ("commit", "def"), ("triton", "3.5")])
def test_parts_of_other_runs_are_refused(field, value):
    a = _part("2026-12-05T11:00:00Z", [{}])
    b = _part("2026-12-05T11:09:00Z", [{}], **{field: value})
    with pytest.raises(ValueError, match=rf"docs\[1\].*{field}"):
        run_files.join_parts([a, b])
    with pytest.raises(ValueError, match="at least one"):
        run_files.join_parts([])


def test_the_latest_whole_run_and_the_schemes_runs_after_it(tmp_path):
    """latest_with_updates: the newest run without a ``schemes`` field, and the --schemes runs after it (one before
    it is left out); none without a whole run."""
    import json

    def write(name, date, schemes=None):
        doc = {"meta": {"date": date}, "rows": [], **({"schemes": schemes} if schemes else {})}
        (tmp_path / f"bench-{name}.json").write_text(json.dumps(doc))

    assert run_files.latest_with_updates("bench-*.json", tmp_path) == (None, [])
    write("early", "2026-12-01T00:00:00Z", ["a"])
    assert run_files.latest_with_updates("bench-*.json", tmp_path) == (None, [])
    write("whole", "2026-12-02T00:00:00Z")
    write("late", "2026-12-03T00:00:00Z", ["b"])
    run, updates = run_files.latest_with_updates("bench-*.json", tmp_path)
    assert run["path"].name == "bench-whole.json" and [u["path"].name for u in updates] == ["bench-late.json"]
    write("newer-whole", "2026-12-04T00:00:00Z")
    assert run_files.latest_with_updates("bench-*.json", tmp_path)[1] == []
