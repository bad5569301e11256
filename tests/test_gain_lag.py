"""The benchmarks' shared parts: the machine record (benchmarks/machine.py), the suite's entry point
(benchmarks/run.py), and the gain-lag study's estimators against the engine (benchmarks/gain_lag.py).
numpy only, one process, a few seconds."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import gain_lag  # noqa: E402
import machine  # noqa: E402
import run as suite  # noqa: E402

from hvd_scale.estimate import EstimatorState, default_smoothing, ema_update  # noqa: E402
from hvd_scale.spec import make_policy  # noqa: E402


def test_machine_record_names_the_cpu_its_instruction_set_and_load():
    record = machine.machine(torch=False)
    assert record["cpu"] and record["cpu"] != "unknown"
    assert record["cpus"] >= 1 and len(record["load"]) == 3
    assert set(record["isa"]) <= set(machine.ISA_FLAGS)
    if record["arch"] == "x86_64":
        assert "sse4_2" in record["isa"]
    assert "torch_threads" not in record  # not imported for a numpy benchmark
    json.dumps(record)  # storable as it is
    assert record["cpu"] in machine.describe(record)


def test_machine_record_reads_torchs_threads_when_asked():
    torch = pytest.importorskip("torch")
    record = machine.machine(torch=True)
    assert record["torch_threads"] == torch.get_num_threads()
    assert f"{record['torch_threads']} threads" in machine.describe(record)


def test_suite_lists_every_entry_and_its_scripts_exist():
    text = suite.listing()
    for name, (_, script, _, _, results) in suite.SUITE.items():
        assert name in text and results in text
    # the maintained benchmarks are in the tree, at the top of benchmarks/
    for name in ("b1", "b2", "b3", "b4", "b5", "cost", "gain-lag", "warm-in"):
        assert (ROOT / "benchmarks" / suite.SUITE[name][1][0]).exists(), name
    cmd = suite.command("gain-lag", quick=True, extra=["--seeds", "2"])
    assert cmd[1].endswith("benchmarks/gain_lag.py") and cmd[-2:] == ["--seeds", "2"]
    with pytest.raises(SystemExit, match="unknown suite entry 'nope'"):
        suite.command("nope", quick=False, extra=[])
    with pytest.raises(SystemExit, match="no quick mode"):
        suite.command("cost", quick=True, extra=[])


def test_suite_run_records_the_machine(tmp_path, monkeypatch):
    log = tmp_path / "runs.jsonl"
    monkeypatch.setattr(suite, "LOG", log)
    monkeypatch.setitem(suite.SUITE, "probe", ("probe", ["machine.py"], None, "1 s", "-"))
    assert suite.main(["probe"]) == 0
    record = json.loads(log.read_text().splitlines()[-1])
    assert record["entry"] == "probe" and record["exit"] == 0
    assert record["command"] == "benchmarks/machine.py"
    assert record["machine"]["cpu"] and "torch_threads" in record["machine"]


def test_the_study_drives_the_engine_as_the_policy_does():
    # gain_lag's 'default' (fold, then estimated_gain at 0.999^S) is adascale's transition.
    policy, state = make_policy("adascale"), make_policy("adascale").init()
    engine = gain_lag.Engine(16)
    rng = np.random.default_rng(0)
    for _ in range(30):
        sqsum, q = float(rng.uniform(20, 40)), float(rng.uniform(0.5, 1.0))
        state, info = policy.transition(state, sqsum, q, 16, scale=16, samples=2)
        assert engine.step(sqsum, q, None) == pytest.approx(info.gain, rel=1e-12)


def test_split_horizons_bias_weight_follows_from_the_slow_one():
    # theta_mu = theta^f at every S: the fast EMA's bias weight is 1 - (1 - u)^f exactly, through
    # changes of S (what lets one EstimatorState hold both; gain_lag.Split).
    slow = fast = EstimatorState()
    one = np.array([1.0])
    for scale in (2, 2, 16, 16, 16, 64, 4, 4):
        theta = default_smoothing(scale)
        slow, fast = ema_update(slow, one, one, theta), ema_update(fast, one, one, theta ** 4)
        assert fast.bias_weight == pytest.approx(1 - (1 - slow.bias_weight) ** 4, rel=1e-12)


def test_the_lagged_truth_runs_below_the_oracle_while_mu2_falls():
    oracle, lagged = gain_lag.Oracle(16), gain_lag.LaggedTruth(16)
    for t in range(200):
        moments = (1.0, 10.0 * 0.97 ** t)
        r_true = oracle.step(0, 0, lambda: moments)
        r_lag = lagged.step(0, 0, lambda: moments)
        assert r_lag <= r_true + 1e-12
    assert r_lag < 0.8 * r_true  # the EMA's ~62 steps hold mu2 several times too high


def test_gain_lag_quick_run_writes_its_report(tmp_path, monkeypatch):
    monkeypatch.setattr(gain_lag, "RESULTS", tmp_path)
    for name in ("LR", "T", "SHAPES", "SCALES"):  # main() sets them from its arguments
        monkeypatch.setattr(gain_lag, name, getattr(gain_lag, name))
    assert gain_lag.main(["--seeds", "2", "--digits-seeds", "0", "--shapes", "isotropic",
                          "--scales", "16", "--budget", "300", "--out", "q"]) == 0
    data = json.loads((tmp_path / "q.json").read_text())
    assert data["machine"]["cpu"] and data["rows"][0]["S"] == 16
    text = (tmp_path / "q.md").read_text()
    assert "| isotropic | 16 |" in text and data["machine"]["cpu"] in text


def test_digits_full_moments_equal_the_per_sample_gradients():
    pytest.importorskip("sklearn")
    x, y = gain_lag.digits_data()
    x, y = x[:50], y[:50]
    p = gain_lag.mlp_init(0)
    full = gain_lag.per_sample_grads(p, x, y)
    mean = full.mean(axis=0)
    mu2 = float(mean @ mean)
    sigma2 = (float(np.mean(np.sum(full * full, axis=1))) - mu2) / gain_lag.B0
    assert gain_lag.full_moments(p, x, y) == pytest.approx((sigma2, mu2), rel=1e-10)
    # and the per-sample gradient is the loss's: a finite difference along one weight
    e = np.zeros_like(p)
    e[5] = 1e-6
    fd = (gain_lag.mlp_loss(p + e, x, y) - gain_lag.mlp_loss(p - e, x, y)) / 2e-6
    assert fd == pytest.approx(mean[5], rel=1e-4, abs=1e-9)


def test_every_benchmark_script_named_in_the_docs_exists():
    # benchmarks/ arranged: the suite at the top, one-off studies in investigations/; a page that
    # names a script names where it is.
    pages = [ROOT / "README.md", ROOT / "benchmarks" / "README.md",
             *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "benchmarks" / "results").glob("*.md"))]
    import re

    missing = {}
    for page in pages:
        if page.name == "changelog.md":  # history names scripts where they were
            continue
        for path in re.findall(r"benchmarks/(?:investigations/)?\w+\.py", page.read_text()):
            if not (ROOT / path).exists():
                missing.setdefault(path, page.relative_to(ROOT).as_posix())
    assert not missing, missing
    for name in ("hook_probe", "floor", "host_profile", "step_breakdown", "keras_breakdown",
                 "stats_timeline", "momentum_horizon", "adam_resize", "gain_trajectory"):
        assert (ROOT / "benchmarks" / "investigations" / f"{name}.py").exists()
        assert not (ROOT / "benchmarks" / f"{name}.py").exists()
