"""`hvd-scale advise` (issue #24, 4): a synthetic log, written by the adapters' MetricsLogger,
ranked by goodput as hvd_scale.goodput ranks the same grid."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hvd_scale import goodput
from hvd_scale.adapters.log import MetricsLogger
from hvd_scale.launch import advise as advise_mod, cli
from hvdrun import WORKERS_DIR, requires_horovod, run_horovod

HVD_SCALE = Path(sys.executable).parent / "hvd-scale"

W, K, S = 4, 2, 8.0  # the logged run: m = S / (W K) = 1 baseline batch
PASS, ALLREDUCE, UPDATE = 0.010, 0.004, 0.002  # seconds, steady after the warm-up
SIGMA2, MU2 = 20.0, 1.0  # the latest statistics
STEPS, BUDGET = 100, 3000.0


def write_log(log_dir, *, policy="adascale", statistics=True, timings=True, overhead=None,
              workers=None, host=None):
    """host: run.json's host facts (default: one worker on each host)."""
    logger = MetricsLogger(log_dir, run_info={"policy": policy, "scale": S, "workers": W,
                                              "backward_passes_per_step": K,
                                              **({"host_cpus": 8, "workers_on_host": 1}
                                                 if host is None else host)},
                           budget=BUDGET, progress_bar=False, tensorboard=False)
    for step in range(1, STEPS + 1):
        row = {"step": step, "progress": step * S, "scale": S, "passes": K}
        if statistics:  # the noise grows through training, as it does
            row.update(sigma2=SIGMA2 * step / STEPS, mu2=MU2)
        if timings:  # the first steps are slow (warm-up): advise must leave them out
            slow = 50.0 if step <= 3 else 1.0
            row.update(pass_time=PASS * slow, allreduce_time=ALLREDUCE, update_time=UPDATE,
                       step_time=K * PASS * slow + ALLREDUCE + UPDATE + (overhead or 0.0))
            if overhead is not None:  # a pass timed alone (k >= 2), and the step's own work
                row.update(overhead_time=overhead)
        if workers is not None:
            row.update(workers=workers)
        logger.log(row)
    logger.close()
    return log_dir


def expected_best(workers=(1, 2, 4, 8), passes=(1, 2, 4, 8, 16), max_gain=math.inf):
    model = goodput.fit_step_time([K], [S / (W * K)], [K * PASS], [ALLREDUCE], [UPDATE], workers=W)
    grid = goodput.candidates(model, SIGMA2, MU2, workers=workers, passes=passes,
                              micro_batches=[S / (W * K)], base_batch=1.0, max_gain=max_gain)
    return goodput.best(grid)


def marked(out, mark):
    """(W, k, m) of the table rows marked ``mark``."""
    return [tuple(float(v.rstrip("*")) for v in line.split()[:3]) for line in out.splitlines()
            if "<-" in line and mark in line.split("<-")[1]]


@pytest.mark.timeout(120)
def test_advise_ranks_the_grid_as_goodput_does(tmp_path):
    log_dir = write_log(tmp_path / "run")
    proc = subprocess.run([str(HVD_SCALE), "advise", str(log_dir)], capture_output=True,
                          text=True, timeout=100)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "policy adascale, W = 4, k = 2, m = 1 baseline batches (S = 8)" in out
    assert "pass 10.00 ms, allreduce wait 4.00 ms, update 2.00 ms, fit error 0.0%" in out
    # One k and no pass timed alone: the step's own work cannot be told apart, and it says so.
    assert "per step 0.00 ms" in out and "charged to the passes" in out
    # Other W are extrapolated from the one measured, and marked.
    assert "extrapolated for W other than 4 (marked W*)" in out
    assert "2(W-1)/W" in out and "time to T" in out  # the assumption; the run's budget
    top = expected_best()
    assert (top.workers, top.passes) != (W, K)  # the test means something
    assert marked(out, "recommended") == [(top.workers, top.passes, top.micro_batch)]
    assert marked(out, "measured") == [(W, K, 1.0)]
    assert f"recommended: W = {top.workers}, k = {top.passes}, m = {top.micro_batch:g} " in out
    assert "shown: the top 15 of 20 configurations by goodput" in out
    # #32 item 8: the goodput column says its unit; workers this machine lacks are named.
    assert "goodput in baseline steps of progress (tau) per second" in out
    assert ("more workers than this machine's" in out) == (top.workers > os.cpu_count())


def test_adascale_adam_caps_the_gain_and_the_measured_row_outside_the_grid_is_shown(tmp_path,
                                                                                    capsys):
    log_dir = write_log(tmp_path / "run", policy="adascale_adam")
    assert cli.main(["advise", str(log_dir), "--workers", "4,8", "--passes", "1,4,16",
                     "--budget", "100"]) == 0
    out = capsys.readouterr().out
    assert "gain capped at 8" in out
    assert "the top 6 of 6 configurations by goodput (baseline steps of progress per second), " \
           "and the measured one" in out
    gains = [float(line.split()[4]) for line in out.splitlines()
             if line[:3].strip().rstrip("*").isdigit()]
    assert len(gains) == 7 and max(gains) == 8.0
    assert marked(out, "measured") == [(W, K, 1.0)]
    top = expected_best(workers=(4, 8), passes=(1, 4, 16), max_gain=8.0)
    assert marked(out, "recommended") == [(top.workers, top.passes, top.micro_batch)]


def test_a_run_without_statistics_exits_2(tmp_path, capsys):
    log_dir = write_log(tmp_path / "linear", policy="linear", statistics=False)
    assert cli.main(["advise", str(log_dir)]) == 2
    err = capsys.readouterr().err
    assert str(log_dir) in err and "statistics" in err and "measure=True" in err


def test_a_run_without_timings_exits_2(tmp_path, capsys):
    log_dir = write_log(tmp_path / "old_keras", timings=False)  # as Keras's were before #31
    assert cli.main(["advise", str(log_dir)]) == 2
    err = capsys.readouterr().err
    assert str(log_dir) in err and "no step has timings" in err and "second step" in err


def test_a_missing_directory_or_log_exits_2(tmp_path, capsys):
    assert cli.main(["advise", str(tmp_path / "nowhere")]) == 2
    assert "nowhere: no such directory" in capsys.readouterr().err
    assert cli.main(["advise", str(tmp_path)]) == 2
    assert "no metrics.csv" in capsys.readouterr().err


def test_plot_writes_a_png(tmp_path, capsys):
    log_dir = write_log(tmp_path / "run")
    png = tmp_path / "eff.png"
    assert cli.main(["advise", str(log_dir), "--plot", str(png)]) == 0
    assert f"wrote {png}" in capsys.readouterr().out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000


@pytest.mark.timeout(120)
def test_the_steps_own_work_is_not_charged_to_the_passes(tmp_path, capsys):
    """#30 item 9: per-step work (zero_grad, evaluation, the adapt decision) was charged to the
    passes, so k = 1 / 4 / 8 came out +36 / +22 / +37% off a k = 2 fit. With a pass timed alone
    the model keeps o apart: here 5 ms a step, 10 ms a pass, predicted exactly at every k."""
    log_dir = write_log(tmp_path / "run", overhead=0.005)
    assert cli.main(["advise", str(log_dir), "--workers", "4", "--passes", "1,2,4,8"]) == 0
    out = capsys.readouterr().out
    assert "per step 5.00 ms, pass 10.00 ms" in out and "charged to the passes" not in out
    times = {int(line.split()[1]): float(line.split()[6]) for line in out.splitlines()
             if line[:3].strip().rstrip("*").isdigit()}
    for k in (1, 2, 4, 8):
        assert times[k] == pytest.approx(1e3 * (0.005 + k * PASS + ALLREDUCE + UPDATE), abs=0.01)


@pytest.mark.timeout(120)
def test_w_is_read_from_the_rows_not_run_json(tmp_path, capsys):
    """#30 item 9: advise took W from run.json, wrong after an elastic resize: the rows say W."""
    log_dir = write_log(tmp_path / "run", workers=2)  # run.json says 4
    assert cli.main(["advise", str(log_dir), "--workers", "2", "--passes", "2"]) == 0
    out = capsys.readouterr().out
    assert "at W = 2)" in out and "W = 2, k = 2" in out
    assert marked(out, "measured") == [(2, K, S / (2 * K))]


def test_other_w_is_said_to_be_extrapolated_and_a_shared_host_is_warned_of(tmp_path, capsys):
    """#48 item 2: on a log of 2 workers sharing 2 cores, advise carried their per-pass time to
    W = 1 (1m07s predicted, 20 s when run) and said only "extrapolated". Now the W* rows say
    their basis; where the workers shared a host, or the log does not say, a warning says the
    per-pass time at another W is not measured; one worker a host: no warning."""
    def advice(name, host):
        log_dir = write_log(tmp_path / name, host=host)
        if not host:  # a log written before run.json held the host's facts
            info = json.loads((log_dir / "run.json").read_text())
            del info["host_cpus"], info["workers_on_host"]
            (log_dir / "run.json").write_text(json.dumps(info))
        assert cli.main(["advise", str(log_dir), "--workers", "1,4", "--passes", "2"]) == 0
        return capsys.readouterr().out

    out = advice("shared", {"host_cpus": 2, "workers_on_host": 4})
    assert "extrapolated for W other than 4 (marked W*), not measured: their times come from " \
           "the run at W = 4: allreduce wait" in out
    assert ("warning: the per-pass time at W = 4 was measured with its workers sharing a host "
            "(4 workers on 2 CPUs): at another W it is not measured.") in out
    assert "a pass at W = 1 can be several times faster" in out
    assert "1*" in [line.split()[0] for line in out.splitlines() if line[:3].strip()[:1].isdigit()]
    old = advice("old", {})
    assert "run.json does not say whether the W = 4 workers shared a host" in old
    alone = advice("alone", {"host_cpus": 8, "workers_on_host": 1})
    assert "warning" not in alone and "(marked W*), not measured" in alone
    # Only the measured W asked for: nothing extrapolated, nothing to warn of.
    log_dir = write_log(tmp_path / "only", host={"host_cpus": 2, "workers_on_host": 4})
    assert cli.main(["advise", str(log_dir), "--workers", "4"]) == 0
    out = capsys.readouterr().out
    assert "warning" not in out and "W*" not in out


@requires_horovod
@pytest.mark.timeout(300)
def test_a_real_two_worker_log_records_its_shared_host_and_advise_warns(tmp_path, capsys):
    """#48 item 2, for real: horovodrun -np 2 on this one host; run.json records the two workers
    on it (the launcher's HOROVOD_LOCAL_SIZE) and its CPUs, and advise warns for W = 1."""
    log_dir = tmp_path / "log"
    run_horovod([sys.executable, str(WORKERS_DIR / "log_loss_worker.py"), str(tmp_path / "c.pt"),
                 "--steps", "12"], np=2, timeout=120, env={"HVD_SCALE_LOG_DIR": str(log_dir)})
    info = json.loads((log_dir / "run.json").read_text())
    assert info["workers"] == 2 and info["workers_on_host"] == 2
    assert info["host_cpus"] == os.cpu_count()
    assert cli.main(["advise", str(log_dir), "--workers", "1,2", "--passes", "1"]) == 0
    out = capsys.readouterr().out
    assert (f"warning: the per-pass time at W = 2 was measured with its workers sharing a host "
            f"(2 workers on {os.cpu_count()} CPUs)") in out


@pytest.mark.parametrize("variables, expected", [
    ({"HOROVOD_LOCAL_SIZE": "2"}, 2),            # horovodrun (Gloo), horovod.ray, horovod.spark
    ({"OMPI_COMM_WORLD_LOCAL_SIZE": "3"}, 3),    # mpirun
    ({"LOCAL_WORLD_SIZE": "4"}, 4),              # torchrun: a DDP log wrote null
    ({}, None),                                  # no launcher said
])
def test_run_json_records_the_workers_on_the_host_under_every_launcher(monkeypatch, tmp_path,
                                                                       variables, expected):
    from hvd_scale.adapters.log import LOCAL_SIZE_VARIABLES

    for name in LOCAL_SIZE_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    for name, value in variables.items():
        monkeypatch.setenv(name, value)
    logger = MetricsLogger(tmp_path, run_info={"policy": "adascale", "workers": 2},
                           progress_bar=False, tensorboard=False)
    logger.log({"step": 1, "progress": 2.0})
    logger.close()
    info = json.loads((tmp_path / "run.json").read_text())
    assert info["workers_on_host"] == expected and info["host_cpus"] == os.cpu_count()


# -- #48 item 2: runs at several W, each W from its own steps -------------------------------------

SHARED_PASS, ALONE_PASS = 0.030, 0.010  # 2 workers on 2 cores: 3x the pass of one process alone


def write_run(log_dir, *, workers, scale, pass_time, allreduce=ALLREDUCE, statistics=True,
              host=None, stretches=None):
    """A log of a run at ``workers`` (k = 1, m = 1 baseline batch, S = ``scale``) in the format
    the adapters' MetricsLogger writes. ``stretches``: (first step, W, pass time) of an elastic
    run's changes of W; the first steps of each are slow (Horovod re-forms its ring)."""
    logger = MetricsLogger(log_dir, run_info={"policy": "adascale", "scale": scale,
                                              "workers": workers, "backward_passes_per_step": 1,
                                              **(host or {"host_cpus": 2,
                                                          "workers_on_host": workers})},
                           budget=BUDGET, progress_bar=False, tensorboard=False)
    stretches = stretches or [(1, workers, pass_time)]
    for step in range(1, STEPS + 1):
        start, w, p = [s for s in stretches if s[0] <= step][-1]
        s = float(w)  # S = W k m with k = 1, m = 1
        row = {"step": step, "progress": step * s, "scale": s, "passes": 1, "workers": w}
        if statistics:
            row.update(sigma2=SIGMA2 * step / STEPS, mu2=MU2)
        slow = 50.0 if step - start < 3 else 1.0
        a = allreduce if w > 1 else 0.0
        row.update(pass_time=p * slow, allreduce_time=a, update_time=UPDATE,
                   step_time=p * slow + a + UPDATE)
        logger.log(row)
    logger.close()
    return log_dir


def table(out):
    """{(W as printed, k): (step ms, marks)} of the report's table."""
    rows = {}
    for line in out.splitlines():
        if line[:3].strip()[:1].isdigit():
            words = line.split("<-")[0].split()
            rows[(words[0], int(words[1]))] = (float(words[6]), line.partition("<-")[2].strip())
    return rows


def test_each_w_is_predicted_from_its_own_log(tmp_path, capsys):
    """#48 item 2: on a log of 2 workers sharing 2 cores advise carried their per-pass time
    (144 ms) to W = 1, where a pass took ~45 ms, and answered W = 1 against W = 2 backwards.
    Given a W = 1 run's log beside it, W = 1's rows come from the W = 1 run's steps: here a pass
    of 10 ms against the 30 ms two sharing workers took, and W = 1 is recommended, not W = 2."""
    two = write_run(tmp_path / "w2", workers=2, scale=2.0, pass_time=SHARED_PASS)
    one = write_run(tmp_path / "w1", workers=1, scale=1.0, pass_time=ALONE_PASS,
                    statistics=False)  # one process at S = 1: nothing to measure
    grid = ["--workers", "1,2", "--passes", "1,2"]

    assert cli.main(["advise", str(two), *grid]) == 0  # W = 2 alone: W = 1 carries its pass
    alone = capsys.readouterr().out
    carried = table(alone)
    assert carried[("1*", 1)][0] == pytest.approx(1e3 * (SHARED_PASS + UPDATE), abs=0.01)
    assert "warning: the per-pass time at W = 2 was measured with its workers sharing a host " \
           "(2 workers on 2 CPUs)" in alone
    assert "recommended: W = 2, " in alone  # the backwards answer

    assert cli.main(["advise", str(two), str(one), *grid]) == 0
    out = capsys.readouterr().out
    rows = table(out)
    # W = 1 from the W = 1 log's own steps (no allreduce at one worker), 3x faster per pass.
    assert rows[("1", 1)][0] == pytest.approx(1e3 * (ALONE_PASS + UPDATE), abs=0.01)
    assert rows[("1", 2)][0] == pytest.approx(1e3 * (2 * ALONE_PASS + UPDATE), abs=0.01)
    assert rows[("1", 1)][0] < carried[("1*", 1)][0] / 2
    # W = 2 from its own (shared) steps, as before; neither measured W is marked extrapolated.
    assert rows[("2", 1)][0] == pytest.approx(1e3 * (SHARED_PASS + ALLREDUCE + UPDATE), abs=0.01)
    assert rows[("2", 1)][0] == carried[("2", 1)][0]
    assert "pass 10.00 ms, allreduce wait 0.00 ms" in out and "pass 30.00 ms" in out
    assert f"steps 82-100 of {one} (19 steps at W = 1)" in out  # each W its own latest 20%
    assert f"steps 82-100 of {two} (19 steps at W = 2)" in out
    assert "measured: W = 1 and 2, each W's rows from its own steps" in out
    # Each measured configuration is marked with its log; the statistics are the W = 2 run's.
    assert rows[("1", 1)][1] == f"measured in {one}"
    assert rows[("2", 1)][1] == f"measured in {two}"
    assert f"statistics at step {STEPS} of {two}:" in out
    assert f"run {one}: policy adascale, W = 1, {STEPS} steps logged; its step times only" in out
    # Both measured: nothing extrapolated, nothing to warn of.
    assert "W*" not in out and "extrapolated" not in out and "warning" not in out
    # The answer turns: one process alone does more per second than two sharing its cores.
    assert f"recommended: W = 1, k = 2, m = 1 (S = 2): 1.64x the measured goodput of W = 2, " \
           f"k = 1 ({two})" in out
    assert rows[("1", 2)][1] == "recommended"
    # The order of the logs does not matter: the first with statistics is the run advised on.
    assert cli.main(["advise", str(one), str(two), *grid]) == 0
    assert table(capsys.readouterr().out) == rows

    # W = 4 and 8, which no log measured, are extrapolated from the nearest W above 1, named, and
    # that W's workers shared a host: the warning stays.
    assert cli.main(["advise", str(two), str(one), "--workers", "1,2,4,8", "--passes", "1"]) == 0
    out = capsys.readouterr().out
    rows = table(out)
    assert rows[("4*", 1)][0] == pytest.approx(
        1e3 * (SHARED_PASS + ALLREDUCE * (3 / 4) / (1 / 2) + UPDATE), abs=0.01)
    assert ("1", 1) in rows and ("2", 1) in rows and ("8*", 1) in rows
    assert ("extrapolated for W other than 1 and 2 (marked W*), not measured: W = 4 and 8 from "
            "the rows at W = 2: allreduce wait") in out
    assert "warning: the per-pass time at W = 2 was measured with its workers sharing a host" in out
    recommended = [w for (w, _), (_, marks) in rows.items() if "recommended" in marks]
    if recommended[0].endswith("*"):
        assert (f"(W = {recommended[0][:-1]} extrapolated from W = 2, not measured, whose "
                f"workers shared a host: see the warning above)") in out


def test_an_elastic_runs_rows_give_each_w_its_own_step_time(tmp_path, capsys):
    """An elastic run 2 -> 1 -> 2 carries both W in its rows: W = 1 is measured (its stretch's
    steps, the slow first ones after the change left out), not carried over from W = 2."""
    log_dir = write_run(tmp_path / "elastic", workers=2, scale=2.0, pass_time=SHARED_PASS,
                        stretches=[(1, 2, SHARED_PASS), (40, 1, ALONE_PASS),
                                   (70, 2, SHARED_PASS)])
    assert cli.main(["advise", str(log_dir), "--workers", "1,2,8", "--passes", "1"]) == 0
    out = capsys.readouterr().out
    rows = table(out)
    assert rows[("1", 1)][0] == pytest.approx(1e3 * (ALONE_PASS + UPDATE), abs=0.01)
    assert rows[("2", 1)][0] == pytest.approx(1e3 * (SHARED_PASS + ALLREDUCE + UPDATE), abs=0.01)
    assert rows[("1", 1)][1] == "measured" and rows[("2", 1)][1].startswith("measured")
    assert "W = 8 from the rows at W = 2" in out and ("8*", 1) in rows


def test_a_w_between_or_beyond_is_extrapolated_from_the_nearest_measured(tmp_path, capsys):
    assert advise_mod.basis(1, [2, 4]) == 2       # one worker: any W will do, the nearest
    assert advise_mod.basis(4, [1, 2]) == 2       # above 1: a W that had an allreduce
    assert advise_mod.basis(3, [2, 4]) == 4       # by ratio
    assert advise_mod.basis(16, [1, 2, 8]) == 8
    assert advise_mod.basis(2, [1]) is None       # no allreduce measured to scale from
    # Two one-worker logs and no statistics anywhere: said, naming both.
    a = write_run(tmp_path / "a", workers=1, scale=1.0, pass_time=ALONE_PASS, statistics=False)
    b = write_run(tmp_path / "b", workers=1, scale=1.0, pass_time=ALONE_PASS, statistics=False)
    assert cli.main(["advise", str(a), str(b)]) == 2
    err = capsys.readouterr().err
    assert f"{a} and {b}: no step has statistics" in err


# -- the batch schedule for a trainer of one's own (launch/batch_schedule.py) --------------------

B0, SEQ = 32, 1024  # the baseline batch in samples; tokens per sample


def write_noise_log(log_dir, *, interval=True):
    """Rows whose noise scale's low end is 0.15 x step baseline batches (tau = 8 x step): it
    passes 2 at step 14, 4 at step 27, 8 at step 54, 16 never (100 steps)."""
    logger = MetricsLogger(log_dir, run_info={"policy": "adascale", "scale": S, "workers": W},
                           budget=BUDGET, progress_bar=False, tensorboard=False)
    for step in range(1, STEPS + 1):
        low = 0.15 * step
        row = {"step": step, "progress": step * S, "scale": S, "passes": K, "sigma2": low,
               "mu2": 0.8, "noise_scale": low / 0.8, "pass_time": PASS,
               "allreduce_time": ALLREDUCE, "update_time": UPDATE,
               "step_time": K * PASS + ALLREDUCE + UPDATE}
        if interval:
            row.update(noise_scale_low=low, noise_scale_high=low / 0.64)
        logger.log(row)
    logger.close()
    return log_dir


EXPECTED = [(0, 32), (14 * 8 * B0, 64), (27 * 8 * B0, 128), (54 * 8 * B0, 256)]  # samples, batch


def _megatron_parse(schedule: str):
    """Megatron-LM's documented syntax (StepBatchsizeNumMicroBatchesCalculator._parse_schedule
    and _validate_schedule): "THRESHOLD:BS ...", spaces or commas, K/M/B/T suffixes; the first
    threshold 0, strictly increasing; batch sizes > 0."""
    units = {"K": 10 ** 3, "M": 10 ** 6, "B": 10 ** 9, "T": 10 ** 12}

    def number(text):
        text = text.strip().upper()
        scale = units.get(text[-1:], 1)
        return int(float(text[:-1] if scale > 1 else text) * scale)

    pairs = []
    for entry in schedule.strip().replace(",", " ").split():
        assert ":" in entry, entry
        threshold, batch = entry.split(":", 1)
        pairs.append((number(threshold), number(batch)))
    assert pairs and pairs[0][0] == 0
    assert all(b[0] > a[0] for a, b in zip(pairs, pairs[1:]))
    assert all(batch > 0 for _, batch in pairs)
    return pairs


def test_schedule_megatron_follows_its_documented_syntax(tmp_path, capsys):
    log_dir = write_noise_log(tmp_path / "run")
    assert cli.main(["advise", str(log_dir), "--schedule", "megatron", "--base-batch", str(B0),
                     "--seq-len", str(SEQ)]) == 0
    out = capsys.readouterr().out
    # the noise scale with its interval in the report
    assert "noise scale (baseline batches) 18.8 [15, 23.4] (95%)" in out
    flag = [line for line in out.splitlines() if line.startswith("--step-batch-size-schedule")]
    assert len(flag) == 1
    pairs = _megatron_parse(flag[0].split(" ", 1)[1].strip().strip('"'))
    assert pairs == [(samples * SEQ, batch) for samples, batch in EXPECTED]  # thresholds: tokens
    assert "low end of the noise scale's 95% interval" in out
    assert "--global-batch-size" in out  # said to be left out


def test_schedule_olmo_core_follows_its_documented_syntax(tmp_path, capsys):
    log_dir = write_noise_log(tmp_path / "run")
    target = tmp_path / "batch.json"
    assert cli.main(["advise", str(log_dir), "--schedule", "olmo-core", "--base-batch", str(B0),
                     "--seq-len", str(SEQ), "--max-batch", "200",
                     "--schedule-out", str(target)]) == 0
    assert f"wrote {target} (olmo-core)" in capsys.readouterr().out
    config = json.loads(target.read_text())
    # BatchSizeSchedulerCallback.__post_init__'s checks, as documented in its source
    sizes, schedule = config["batch_sizes"], config["schedule"]
    assert set(config) == {"batch_sizes", "schedule"} and len(sizes) == len(schedule)
    assert {d["unit"] for d in schedule} == {"tokens"} and schedule[0]["value"] == 0
    assert all(set(d) == {"value", "unit"} and isinstance(d["value"], int) for d in schedule)
    assert all(b["value"] > a["value"] for a, b in zip(schedule, schedule[1:]))
    for before, after in zip(sizes, sizes[1:]):
        assert after != before and (after % before == 0 if after > before else
                                    before % after == 0)
    # global batch sizes in tokens; --max-batch 200 samples stops at 128
    assert sizes == [batch * SEQ for _, batch in EXPECTED[:3]]
    assert [d["value"] for d in schedule] == [samples * SEQ for samples, _ in EXPECTED[:3]]


def test_schedule_levanter_follows_its_documented_syntax(tmp_path, capsys):
    yaml = pytest.importorskip("yaml")
    log_dir = write_noise_log(tmp_path / "run")
    assert cli.main(["advise", str(log_dir), "--schedule", "levanter", "--base-batch",
                     str(B0)]) == 0
    out = capsys.readouterr().out
    text = out[out.index("levanter:\n") + len("levanter:\n"):]
    steps = yaml.safe_load(text)["trainer"]["train_batch_size"]
    # ScheduleStep(start, value): validate_schedule_sorted's checks
    assert all(set(s) == {"start", "value"} for s in steps) and steps[0]["start"] == 0
    assert all(b["start"] >= a["start"] for a, b in zip(steps, steps[1:]))
    assert [s["value"] for s in steps] == [batch for _, batch in EXPECTED]
    # BatchSchedule's offsets: each segment starts where the samples reach its threshold, within
    # one step of the previous batch
    offset = 0
    for before, step, (threshold, _) in zip(steps, steps[1:], EXPECTED[1:]):
        offset += (step["start"] - before["start"]) * before["value"]
        assert threshold <= offset < threshold + before["value"]


def test_schedule_from_an_older_log_and_what_is_refused(tmp_path, capsys):
    log_dir = write_noise_log(tmp_path / "old", interval=False)  # no interval columns
    assert cli.main(["advise", str(log_dir), "--schedule", "levanter", "--base-batch",
                     str(B0)]) == 0
    out = capsys.readouterr().out
    assert "point estimate" in out
    assert "noise scale (baseline batches) 18.8 (no interval yet)\n" in out
    assert cli.main(["advise", str(log_dir), "--schedule", "megatron",
                     "--base-batch", str(B0)]) == 2
    assert "--schedule megatron counts tokens: give --seq-len" in capsys.readouterr().err
    assert cli.main(["advise", str(log_dir), "--schedule", "levanter"]) == 2
    assert "--base-batch must be a whole number of samples >= 1" in capsys.readouterr().err
    no_noise = write_log(tmp_path / "no_noise")  # sigma2 and mu2, no noise_scale column
    assert cli.main(["advise", str(no_noise), "--schedule", "levanter", "--base-batch",
                     str(B0)]) == 2
    assert "the log has no noise scale" in capsys.readouterr().err


def test_plot_draws_the_noise_scale_with_its_interval_and_per_group(tmp_path):
    pytest.importorskip("matplotlib")
    from matplotlib.collections import PolyCollection

    from hvd_scale.launch.plot import noise_text, plot_runs, read_run
    from hvd_scale.metrics import group_metric

    log_dir = tmp_path / "two_groups"
    logger = MetricsLogger(log_dir, run_info={"policy": "adascale", "scale": S, "workers": W},
                           progress_bar=False, tensorboard=False)
    for step in range(1, 21):
        row = {"step": step, "progress": step * S, "noise_scale": 2.0 + step,
               "noise_scale_low": 1.5 + step, "noise_scale_high": math.inf if step < 5 else
               3.0 + step}
        for j in (0, 1):
            row.update({group_metric("noise_scale", j): (j + 1) * step,
                        group_metric("noise_scale_low", j): (j + 0.5) * step,
                        group_metric("noise_scale_high", j): (j + 1.5) * step})
        logger.log(row)
    logger.close()
    _, columns = read_run(log_dir)
    assert noise_text(columns, 19) == ("22 [21.5, 23] (95%); per group: 0: 20 [10, 30] (95%), "
                                       "1: 40 [30, 50] (95%)")
    assert noise_text(columns, 0).startswith("3 [2.5, inf] (95%)")
    fig = plot_runs([str(log_dir)], str(tmp_path / "p.png"))
    whole, groups = fig.axes[4], fig.axes[5]
    assert len(whole.lines) == 1 and len(groups.lines) == 2
    assert sum(isinstance(c, PolyCollection) for c in whole.collections) == 1
    assert sum(isinstance(c, PolyCollection) for c in groups.collections) == 2
    assert whole.get_yscale() == "log"
    # a one-group log: the group panel says why it is empty
    fig = plot_runs([str(write_noise_log(tmp_path / "one"))], str(tmp_path / "q.png"))
    assert not fig.axes[5].lines and "one parameter group" in fig.axes[5].texts[0].get_text()
