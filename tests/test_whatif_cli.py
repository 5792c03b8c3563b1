"""``python -m workbench whatif`` (issue 35): the knobs as flags, a table with units, sources and shares, ``--json``
parsed back to the whatif() dict, bad flags refused naming the flag, and a profile folder in place of the
committed one. Each run is in-process (the command's ``main(argv)``) on a small trace."""

import json
import shutil

import numpy as np
import pytest

from workbench.__main__ import main as workbench_main
from workbench.commands import whatif as cli
from workbench.whatif.profile import RESULTS
from workbench.whatif.report import default_profile

FAST = ["--requests", "40", "--rate", "20"]


def run(argv, capsys):
    rc = cli.main(argv)
    out, err = capsys.readouterr()
    return rc, out, err


def test_the_table_has_units_the_why_with_shares_and_sources_and_the_quality_column(capsys):
    rc, out, err = run(["--model", "llama-3.1-8b", "--scheme", "int4/token", *FAST], capsys)
    assert rc == 0, err
    for text in ("tokens/s", "requests/s", "TTFT p50/p90/p99", " ms", "sequences", "GiB", "why: one decode step",
                 "weights", "attention", "overhead", "quant-decode-h200-", "fitted: model-decode-h200-",
                 "model-quality-", "no eviction", "files: "):
        assert text in out, text
    why = out.split("why: one decode step")[1].split("a prefill")[0]
    shares = [float(line.split("%")[0].split()[-1]) for line in why.splitlines()[2:] if "%" in line]
    assert len(shares) == 4 and sum(shares) == pytest.approx(100, abs=0.3)


def test_json_is_the_whatif_dict_and_the_flags_reach_its_config(capsys):
    rng = np.random.default_rng(35)
    block, budget, prefix = int(rng.choice([8, 16, 32])), int(rng.integers(512, 4096)), int(rng.integers(1, 200))
    rate = float(rng.uniform(5, 40))
    rc, out, err = run(["--model", "qwen2.5-7b", "--scheme", "int8/token", "--trace", "alpaca", "--requests", "50",
                        "--rate", f"{rate}", "--seed", "3", "--block-size", str(block), "--kv-gib", "1.5",
                        "--max-batch", "48", "--token-budget", str(budget), "--shared-prefix", str(prefix),
                        "--preemption", "swap", "--host-gib", "4", "--host-format", "int4/token", "--keep", "0.25",
                        "--policy", "h2o", "--frac", "max", "--json"], capsys)
    assert rc == 0, err
    d = json.loads(out)
    assert set(d) == {"config", "summary", "why", "quality", "memory", "sources"}
    c = d["config"]
    assert (c["model"], c["scheme"], c["requests"], c["rate"], c["frac"]) == ("qwen2.5-7b", "int8/token", 50, rate,
                                                                               "max")
    assert (c["block_size"], c["kv_gib"], c["max_batch"], c["token_budget"], c["shared_prefix"]) == (
        block, 1.5, 48, budget, prefix)
    assert (c["preemption"], c["host_gib"], c["host_format"], c["keep"], c["policy"], c["prefix_caching"]) == (
        "swap", 4.0, "int4/token", 0.25, "h2o", True)
    assert d["summary"]["completed"] == 50 and d["summary"]["prefix_hits"] > 0
    assert "h2o at budget 0.25" in d["quality"]["eviction"]["source"]
    assert d["quality"]["host_format"]["source"]


def test_sensitivity_is_printed_as_a_table_and_joins_the_json(capsys):
    rc, out, err = run([*FAST, "--requests", "20", "--sensitivity"], capsys)
    assert rc == 0, err
    assert "sensitivity:" in out and "launch_us" in out and "decode_frac" in out
    rc, out, err = run([*FAST, "--requests", "20", "--sensitivity", "--json"], capsys)
    rows = json.loads(out)["sensitivity"]
    assert rc == 0 and {r["input"] for r in rows} >= {"decode_frac", "copy_gbps", "launch_us"}


def test_a_config_json_and_a_jsonl_trace(tmp_path, capsys):
    rng = np.random.default_rng(7)
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"vocab_size": 32000, "hidden_size": 2048, "intermediate_size": 5632,
                               "num_hidden_layers": 22, "num_attention_heads": 32, "num_key_value_heads": 4}))
    arrivals = np.cumsum(rng.exponential(0.05, 30))
    trace = tmp_path / "mine.jsonl"
    trace.write_text("\n".join(json.dumps({"id": i, "arrival_s": float(a), "prompt": int(rng.integers(5, 300)),
                                           "output": int(rng.integers(2, 100))}) for i, a in enumerate(arrivals)))
    rc, out, err = run(["--model", str(cfg), "--trace", str(trace), "--json"], capsys)
    assert rc == 0, err
    d = json.loads(out)
    assert d["config"]["trace"] == "mine" and d["summary"]["completed"] == 30 and d["config"]["rate"] is None


@pytest.mark.parametrize("flag,value", [
    ("--block-size", "0"), ("--requests", "-3"), ("--rate", "0"), ("--rate", "nan"), ("--kv-gib", "x"),
    ("--keep", "1.5"), ("--keep", "0"), ("--scheme", "int3/token"), ("--host-format", "int5"), ("--model", "gpt-9"),
    ("--trace", "no_such_trace.jsonl"), ("--preemption", "drop"), ("--policy", "lru"), ("--host-gib", "-1"),
    ("--shared-prefix", "-1"), ("--seed", "x"), ("--frac", "mean"), ("--max-batch", "0"), ("--token-budget", "1.5"),
    ("--reserve", "lru"), ("--max-len", "1"),
])
def test_a_bad_flag_is_refused_naming_it(flag, value, capsys):
    rc, out, err = run([flag, value], capsys)
    assert rc == 2 and out == ""
    assert err.startswith("whatif: ") and flag in err and "Traceback" not in err


def test_combinations_and_inputs_that_cannot_work_are_refused_naming_the_flag(tmp_path, capsys):
    rc, _, err = run(["--keep", "0.5"], capsys)
    assert rc == 2 and "--policy" in err
    rc, _, err = run(["--scheme", "fp8_e5m2/head"], capsys)  # a scheme the profile's run did not time
    assert rc == 2 and "--scheme" in err and "not timed" in err
    bad = tmp_path / "config.json"
    bad.write_text("{}")
    rc, _, err = run(["--model", str(bad)], capsys)
    assert rc == 2 and "--model" in err and "missing" in err
    empty = tmp_path / "t.jsonl"
    empty.write_text('{"arrival_s": 0}\n')
    rc, _, err = run(["--trace", str(empty)], capsys)
    assert rc == 2 and "--trace" in err
    rc, _, err = run(["--profile", str(tmp_path / "none")], capsys)
    assert rc == 2 and "--profile" in err
    rc, _, err = run(["--model", "llama-3.1-70b"], capsys)  # 140 GB of weights leave no KV memory on 141 GiB
    assert rc == 2 and "--kv-gib" in err


def test_an_orca_style_reservation_holds_fewer_sequences_than_paged_blocks(capsys):
    flags = ["--model", "llama-13b", "--kv-gib", "12", "--requests", "200", "--rate", "1000", "--json"]
    held = {}
    for reserve in ("paged", "max"):
        rc, out, err = run([*flags, "--reserve", reserve, "--max-len", "2048"], capsys)
        assert rc == 0, err
        d = json.loads(out)
        assert d["config"]["reserve"] == reserve and d["config"]["max_len"] == 2048
        held[reserve] = d["summary"]["max_concurrency"]
    assert held["max"] < held["paged"]


def test_flags_that_change_nothing_are_warned_of(capsys):
    rc, _, err = run([*FAST, "--host-gib", "8"], capsys)
    assert rc == 0 and "warning: --host-gib is used by --preemption swap only" in err


def test_a_profile_folder_gives_the_committed_answer(tmp_path, capsys):
    for name in default_profile().files:  # the full quant-decode run and a later --schemes one, the tiers run, ...
        shutil.copy(RESULTS / name, tmp_path)
    rc, out, err = run([*FAST, "--json"], capsys)
    assert rc == 0, err
    rc2, out2, err2 = run([*FAST, "--json", "--profile", str(tmp_path), "--gpu", "h200"], capsys)
    assert rc2 == 0, err2
    a, b = json.loads(out), json.loads(out2)
    assert a["summary"] == b["summary"] and a["sources"]["launch_us"] == b["sources"]["launch_us"]
    rc, _, err = run([*FAST, "--profile", str(tmp_path), "--gpu", "h100"], capsys)
    assert rc == 2 and "--profile" in err and "quant-decode-h100" in err


def test_python_m_workbench_dispatches_to_it(capsys):
    assert workbench_main(["whatif", *FAST, "--requests", "10"]) == 0
    assert "what-if: smollm2-135m on h200" in capsys.readouterr().out
    assert workbench_main(["whatif", "--help"]) == 0
    assert "--no-prefix-caching" in capsys.readouterr().out
