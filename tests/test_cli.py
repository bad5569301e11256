"""The `hvd-scale` command: parsing and errors in-process, one real end-to-end run."""

import csv
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hvd_scale.launch import cli
from hvd_scale.metrics import METRICS
from hvdrun import REPO_ROOT, requires_horovod, run_process, worker_env

HVD_SCALE = Path(sys.executable).parent / "hvd-scale"


def test_bad_policy_exits_2_before_anything_starts(capsys):
    assert cli.main(["run", "-np", "2", "--policy", "linaer", "--", "false"]) == 2
    err = capsys.readouterr().err
    assert "'linaer'" in err and "adascale" in err and "warmup" in err


def test_bad_policy_option_exits_2(capsys):
    assert cli.main(["run", "--policy", "warmup:span=3", "--", "true"]) == 2
    assert "'span'" in capsys.readouterr().err


def test_run_needs_a_command(capsys):
    assert cli.main(["run", "-np", "2"]) == 2
    assert "after `--`" in capsys.readouterr().err


def test_np_must_be_positive():
    with pytest.raises(SystemExit) as e:
        cli.main(["run", "-np", "0", "--", "true"])
    assert e.value.code == 2


def test_missing_horovodrun_names_the_setup(monkeypatch, capsys):
    monkeypatch.setattr(cli, "_horovodrun", lambda: None)
    assert cli.main(["run", "--", "true"]) == 127
    err = capsys.readouterr().err
    assert "make setup" in err and "hvd-scale build-horovod" in err
    # Where torch is there (a DDP environment), the engine that needs no Horovod is named.
    assert "--engine torchrun" in err, err


def test_policies_lists_every_policy_and_option(capsys):
    assert cli.main(["policies"]) == 0
    out = capsys.readouterr().out
    for name in ("none", "linear", "sqrt", "warmup", "adascale", "adascale_adam", "power", "fixed",
                 "legw"):
        assert f"\n{name} " in "\n" + out
    assert "warmup:fraction=" in out and "adascale:smoothing=" in out and "warmup:rule=" in out
    assert "fixed:factor=" in out and "power:alpha=" in out and "legw:steps=" in out


@requires_horovod
@pytest.mark.timeout(120)
def test_check_reports_the_horovod_build():
    proc = subprocess.run([str(HVD_SCALE), "check"], capture_output=True, text=True, timeout=100,
                          env=worker_env())
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "horovod     0.28.1" in proc.stdout
    assert "horovod[PyTorch]: built; MPI True, Gloo True" in proc.stdout
    assert "horovod[TensorFlow]: built; MPI True, Gloo True" in proc.stdout


@requires_horovod
@pytest.mark.timeout(300)
def test_run_end_to_end_writes_metrics_and_plot(tmp_path):
    log_dir = tmp_path / "linear"
    budget, np_ = 40, 2
    cmd = [str(HVD_SCALE), "run", "-np", str(np_), "--gloo", "--policy", "linear",
           "--log-dir", str(log_dir), "--", sys.executable, "examples/torch_mnist1d.py",
           "--budget", str(budget), "--log-every", "0", "--samples", "2000"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=280, cwd=REPO_ROOT,
                          env=worker_env(), start_new_session=True)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    with open(log_dir / "metrics.csv", newline="") as f:
        reader = csv.DictReader(f)
        rows = list(reader)
    assert reader.fieldnames == list(METRICS)
    # linear at S = 2: tau advances by 2 a step, so budget / 2 steps, one row each.
    assert len(rows) == math.ceil(budget / np_)
    assert [float(r["lr_factor"]) for r in rows] == [2.0] * len(rows)
    assert float(rows[-1]["progress"]) == budget
    assert all(1.0 <= float(r["gain"]) <= 2.0 for r in rows)  # measured although linear
    info = json.loads((log_dir / "run.json").read_text())
    assert info["policy"] == "linear" and info["scale"] == 2.0 and info["workers"] == 2
    assert any((log_dir / "tb").iterdir()), "TensorBoard event file missing"

    png = tmp_path / "plot.png"
    plot = subprocess.run([str(HVD_SCALE), "plot", str(log_dir), "-o", str(png)],
                          capture_output=True, text=True, timeout=120)
    assert plot.returncode == 0, plot.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000


def test_plot_of_a_directory_without_metrics_fails_clearly(tmp_path, capsys):
    assert cli.main(["plot", str(tmp_path), "-o", str(tmp_path / "x.png")]) == 2
    assert "no metrics.csv" in capsys.readouterr().err


def test_plot_refuses_a_metric_it_cannot_draw(tmp_path, capsys):
    """#32 items 5 and 8: a --metric that is no column, or has no value in any run, is an error
    (it drew an empty panel and exited 0); the first panel plots the lr factor each step
    applied, which a fixed rule has too."""
    from hvd_scale.adapters.log import MetricsLogger

    log_dir = tmp_path / "run"
    logger = MetricsLogger(log_dir, run_info={"policy": "sqrt", "scale": 4.0}, progress_bar=False,
                           tensorboard=False)
    for step in range(1, 6):
        logger.log({"step": step, "progress": 4.0 * step, "lr_factor": 2.0, "lr": 0.2, "gain": 1.3})
    logger.close()
    out = tmp_path / "p.png"
    assert cli.main(["plot", str(log_dir), "-o", str(out), "--metric", "accuracy"]) == 2
    err = capsys.readouterr().err
    assert "--metric 'accuracy' is not a column" in err and "lr_factor" in err
    assert cli.main(["plot", str(log_dir), "-o", str(out), "--metric", "loss"]) == 2
    assert "'loss' has no value" in capsys.readouterr().err and not out.exists()
    # Without --metric a log with no loss (Keras's) still plots; its panel says why it is empty.
    assert cli.main(["plot", str(log_dir), "-o", str(out)]) == 0 and out.exists()
    out.unlink()
    assert cli.main(["plot", str(log_dir), "-o", str(out), "--metric", "lr_factor"]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_run_hands_policy_log_dir_and_cpu_defaults_to_horovodrun(monkeypatch, tmp_path):
    seen = {}

    def fake_call(cmd, env):
        seen["cmd"], seen["env"] = cmd, env
        return 3

    monkeypatch.setattr(cli, "_horovodrun", lambda: "/x/horovodrun")
    monkeypatch.setattr(cli.engines, "run_stoppable", fake_call)
    monkeypatch.setenv("HOROVOD_CYCLE_TIME", "0.5")  # the user's own setting wins
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    code = cli.main(["run", "-np", "3", "--mpi", "--policy", "sqrt", "--log-dir", str(tmp_path / "l"),
                     "--timeline-filename", "t.json", "--", "python", "train.py", "--x"])
    assert code == 3  # the job's exit code
    assert seen["cmd"] == ["/x/horovodrun", "-np", "3", "-H", "localhost:3", "--mpi",
                           "--timeline-filename", "t.json", sys.executable, "train.py", "--x"]
    env = seen["env"]
    assert env["HVD_SCALE_POLICY"] == "sqrt" and env["HVD_SCALE_LOG_DIR"] == str(tmp_path / "l")
    assert env["OMP_NUM_THREADS"] == "1" and env["HOROVOD_CYCLE_TIME"] == "0.5"


def test_help_reads_as_whole_sentences(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["--help"])
    assert e.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    assert cli.DESCRIPTION in out and cli.DESCRIPTION.endswith(".")
    # Every command's and every option's help is a sentence: capital letter to full stop.
    parser = cli.build_parser()
    subparsers = next(a for a in parser._actions if a.choices and isinstance(a.choices, dict))
    helps = [a.help for a in subparsers._choices_actions]
    for sub in subparsers.choices.values():
        helps += [a.help for a in sub._actions if a.help and a.help != "==SUPPRESS=="
                  and not a.option_strings == ["-h", "--help"]]
    for text in helps:
        assert text[0].isupper() and text.endswith("."), text


# -- a bare python: the interpreter running hvd-scale (#48 item 3) ------------------------------

@pytest.mark.parametrize("command, expected", [
    (["python", "train.py"], [sys.executable, "train.py"]),
    (["python3", "-m", "pkg"], [sys.executable, "-m", "pkg"]),
    (["python3.11", "train.py"], ["python3.11", "train.py"]),  # a version asked for: as given
    (["/usr/bin/python3", "t.py"], ["/usr/bin/python3", "t.py"]),
    (["./python", "t.py"], ["./python", "t.py"]),
    (["bash", "-c", "python t.py"], ["bash", "-c", "python t.py"]),  # the first word only
])
def test_a_bare_python_is_this_interpreter(command, expected):
    assert cli.engines.resolve_python(command) == expected


def test_help_says_a_bare_python_is_this_interpreter(capsys):
    with pytest.raises(SystemExit):
        cli.main(["run", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "A bare python or python3 as COMMAND's first word runs as the interpreter" in out


def test_ray_and_spark_ranks_resolve_python_in_the_worker(tmp_path):
    """command_worker (the Ray and Spark engines' rank) runs a bare python as its own
    interpreter, whatever PATH says."""
    result = cli.engines.command_worker(
        ["python", "-c", "import sys; print(sys.executable)"], {"PATH": "/nonexistent"}, None)
    assert result["returncode"] == 0, result["stderr"]
    assert result["stdout"].strip() == sys.executable


@requires_horovod
@pytest.mark.timeout(150)
def test_run_python_without_the_venv_on_path():
    """The user's case: the venv not activated (its bin/ not on PATH); `-- python` runs the
    interpreter that runs hvd-scale, on every rank, and nothing extra is printed."""
    env = worker_env()
    bin_dir = str(Path(sys.executable).parent)
    env["PATH"] = os.pathsep.join(p for p in env["PATH"].split(os.pathsep) if p != bin_dir)
    env.pop("VIRTUAL_ENV", None)
    proc = run_process(
        [str(HVD_SCALE), "run", "-np", "1", "--gloo", "--", "python", "-c",
         "import sys, torch; print('python', sys.executable)"],
        timeout=130, env=env, what="hvd-scale run without the venv on PATH")
    assert f"python {sys.executable}" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "hvd-scale" not in proc.stdout + proc.stderr  # no note of its own


# -- elastic horovodrun jobs: -np (#48 item 1) ---------------------------------------------------

def _horovodrun_line(monkeypatch, argv):
    """The horovodrun command line `hvd-scale` would start for argv (nothing is started)."""
    seen = []

    def fake_call(cmd, env):
        seen.append(cmd)
        return 0

    monkeypatch.setattr(cli, "_horovodrun", lambda: "/x/horovodrun")
    monkeypatch.setattr(cli.engines, "run_stoppable", fake_call)
    assert cli.main(argv) == 0
    return seen[-1]


def test_elastic_run_starts_with_min_np_workers(monkeypatch):
    """#48 item 1: horovodrun requires -np in elastic mode too (without it, its 43-line usage and
    exit 2); docs/elastic.md's command gets -np = --min-np."""
    cmd = _horovodrun_line(monkeypatch, [
        "run", "--min-np", "2", "--max-np", "4", "--host-discovery-script", "./hosts.sh",
        "--network-interfaces", "lo", "--", "python", "train.py"])
    assert cmd == ["/x/horovodrun", "-np", "2", "--min-np", "2", "--max-np", "4",
                   "--host-discovery-script", "./hosts.sh", "--network-interfaces", "lo",
                   sys.executable, "train.py"]
    # A -np of its own stays; without a discovery script -H offers the most workers' slots.
    cmd = _horovodrun_line(monkeypatch, ["run", "-np", "3", "--min-np", "2", "--max-np", "4",
                                         "--", "./train"])
    assert cmd == ["/x/horovodrun", "-np", "3", "--min-np", "2", "--max-np", "4",
                   "-H", "localhost:3", "--network-interfaces", "lo", "./train"]


def test_an_elastic_job_on_this_host_alone_gets_the_loopback(monkeypatch, tmp_path, capsys):
    """Horovod's elastic driver, with no NIC named, waits for two hosts to compare their
    interfaces: on one host it hung with no output. hvd-scale run adds --network-interfaces lo
    where every host the job starts on is this one (a discovery script's, -H's, a hostfile's),
    leaves a NIC the user named alone, and warns within seconds where one remote host would
    leave the job waiting."""
    monkeypatch.chdir(tmp_path)
    script = tmp_path / "hosts.sh"
    script.write_text("#!/bin/sh\necho localhost:1\necho 127.0.0.1:1\n")
    script.chmod(0o755)
    base = ["run", "--min-np", "1", "--max-np", "2"]
    cmd = _horovodrun_line(monkeypatch, [*base, "--host-discovery-script", "./hosts.sh", "--",
                                         "python", "train.py"])
    assert cmd[-4:] == ["--network-interfaces", "lo", sys.executable, "train.py"], cmd
    cmd = _horovodrun_line(monkeypatch, [*base, "--", "python", "train.py"])  # -H localhost:2
    assert "--network-interfaces" in cmd and cmd[cmd.index("-H") + 1] == "localhost:2", cmd
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("localhost slots=2\n")
    cmd = _horovodrun_line(monkeypatch, [*base, "--hostfile", "hostfile", "--", "./train"])
    assert cmd[-3:] == ["--network-interfaces", "lo", "./train"], cmd
    for given in (["--network-interfaces", "eth0"], ["--network-interface=eth1"]):
        cmd = _horovodrun_line(monkeypatch, [*base, "--host-discovery-script", "./hosts.sh",
                                             *given, "--", "./train"])
        assert cmd.count("lo") == 0 and given[-1] in cmd, cmd
    # Not an elastic job: nothing added.
    cmd = _horovodrun_line(monkeypatch, ["run", "-np", "2", "--", "./train"])
    assert "--network-interfaces" not in cmd
    capsys.readouterr()
    # One remote host: the job would wait for a second; say what to add.
    script.write_text("#!/bin/sh\necho remote-host.invalid:2\n")
    cmd = _horovodrun_line(monkeypatch, [*base, "--host-discovery-script", "./hosts.sh", "--",
                                         "./train"])
    err = capsys.readouterr().err
    assert "--network-interfaces" not in cmd
    assert "waits for two hosts" in err and "--network-interfaces eth0" in err, err


def test_a_missing_requirement_says_the_job_never_started(monkeypatch, capsys):
    """`hvd-scale run` in an environment without psutil (a DDP one: psutil came with Horovod)
    said "the torchrun job failed: ModuleNotFoundError" of a job that never started. psutil
    is now hvd-scale's own requirement; where it is missing all the same, one line says what
    to install, and a failure of the engine's start is not called the job's."""
    monkeypatch.setitem(sys.modules, "psutil", None)
    code = cli.main(["run", "--engine", "torchrun", "--", "python", "-c", "pass"])
    err = capsys.readouterr().err
    assert code == 127 and "job failed" not in err, err
    assert err.strip() == ("hvd-scale run: psutil is not installed: a requirement of hvd-scale: "
                           "pip install psutil (or reinstall hvd-scale)"), err
    monkeypatch.delitem(sys.modules, "psutil")

    class Broken(cli.engines.TorchrunEngine):
        def start(self, job):
            raise OSError("no rendezvous")

    monkeypatch.setitem(cli.engines.ENGINES, "torchrun", Broken)
    assert cli.main(["run", "--engine", "torchrun", "--", "python", "-c", "pass"]) == 1
    err = capsys.readouterr().err
    assert err.strip() == "hvd-scale run: the torchrun job did not start: OSError: no rendezvous"


@pytest.mark.parametrize("argv, line", [
    (["plot", "RUN", "-o", "p.png"],
     "hvd-scale plot: matplotlib is not installed: pip install 'hvd-scale[plot]'"),
    (["advise", "RUN", "--plot", "e.png"],
     "hvd-scale advise --plot: matplotlib is not installed: pip install 'hvd-scale[plot]'"),
])
def test_a_command_without_its_optional_dependency_names_the_extra(monkeypatch, capsys, tmp_path,
                                                                   argv, line):
    """`hvd-scale plot` without matplotlib ended in a traceback: one line naming the extra,
    exit 2, before any log is read."""
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    argv = [str(tmp_path / "run") if a == "RUN" else a for a in argv]
    assert cli.main(argv) == 2
    captured = capsys.readouterr()
    assert captured.err.strip() == line and not captured.out, captured


def test_every_extra_a_hint_names_is_in_pyproject():
    import tomllib

    extras = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    assert set(cli.engines.EXTRA_OF_MODULE.values()) <= set(extras)
    for hint in cli.engines.INSTALL_HINTS.values():
        assert hint.split("[")[1].split("]")[0] in extras, hint
    dependencies = " ".join(tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())[
        "project"]["dependencies"]).lower()
    for module in cli.engines.REQUIRED_MODULES:
        assert module.lower() in dependencies, module


@pytest.mark.parametrize("argv, message", [
    (["-np", "5", "--min-np", "2", "--max-np", "4"], "-np 5 is outside --min-np 2 .. --max-np 4"),
    (["-np", "1", "--min-np", "2"], "-np 1 is outside --min-np 2:"),
])
def test_elastic_np_outside_the_bounds_is_one_line(monkeypatch, capsys, argv, message):
    monkeypatch.setattr(cli, "_horovodrun", lambda: "/x/horovodrun")
    assert cli.main(["run", *argv, "--", "python", "train.py"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err and "(default: --min-np)" in err


def test_help_says_elastic_np_defaults_to_min_np(capsys):
    with pytest.raises(SystemExit):
        cli.main(["run", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "starts with --min-np workers" in out


@requires_horovod
@pytest.mark.timeout(150)
def test_elastic_command_of_the_docs_runs(tmp_path):
    """docs/elastic.md's command shape, for real: --min-np/--max-np and a discovery script, no
    -np; one slot discovered, so one worker, which joins the elastic rendezvous. Without
    --network-interfaces: on one host hvd-scale run names lo (Horovod's elastic driver waited,
    silently, for a second host to find the interfaces the hosts share)."""
    hosts = tmp_path / "hosts.sh"
    hosts.write_text("#!/bin/sh\necho localhost:1\n")
    hosts.chmod(0o755)
    proc = run_process(
        [str(HVD_SCALE), "run", "--min-np", "1", "--max-np", "2", "--host-discovery-script",
         "./hosts.sh", "--", "python", "-c",
         "import horovod.torch as hvd; hvd.init(); print('size', hvd.size(), 'rank', hvd.rank())"],
        timeout=130, cwd=tmp_path, env=worker_env(), what="elastic hvd-scale run")
    assert "size 1 rank 0" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "usage:" not in proc.stdout + proc.stderr


# -- hvd-scale plot: a run's name and its S as it went (#48 item 7) ------------------------------

def _log(run_dir, policy, scales):
    from hvd_scale.adapters.log import MetricsLogger

    logger = MetricsLogger(run_dir, run_info={"policy": policy, "scale": scales[0]},
                           progress_bar=False, tensorboard=False)
    progress = 0.0
    for step, scale in enumerate(scales, 1):
        progress += scale
        logger.log({"step": step, "progress": progress, "lr_factor": 1.5, "gain": 1.5,
                    "lr": 0.1 if step < len(scales) else 0.001, "scale": scale})
    logger.close()


def test_plot_labels_each_run_by_its_directory_and_s_as_it_went(tmp_path, capsys):
    from hvd_scale.launch.plot import plot_runs

    a, b = tmp_path / "ada_fixed", tmp_path / "ada_elastic"
    _log(a, "adascale", [2.0] * 5)
    _log(b, "adascale", [2.0, 2.0, 1.0, 1.0, 2.0])
    fig = plot_runs([str(a), str(b)], str(tmp_path / "p.png"))
    legend = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    assert legend == ["ada_fixed (adascale, S=2)", "ada_elastic (adascale, S=2->1->2)"]
    lr_axis = next(ax for ax in fig.axes if ax.get_title() == "effective lr")
    assert lr_axis.get_yscale() == "log"

    fig = plot_runs([str(a), str(b)], str(tmp_path / "p.png"), labels=["fixed", "resized"])
    legend = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    assert legend == ["fixed (adascale, S=2)", "resized (adascale, S=2->1->2)"]

    out = tmp_path / "q.png"
    assert cli.main(["plot", str(a), str(b), "-o", str(out), "--label", "x", "--label", "y"]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    capsys.readouterr()
    assert cli.main(["plot", str(a), str(b), "-o", str(out), "--label", "x"]) == 2
    err = capsys.readouterr().err
    assert "--label given 1 time(s) for 2 run(s)" in err and err.count("\n") == 1


def test_plot_shortens_a_long_s_history(tmp_path):
    from hvd_scale.launch.plot import MAX_SCALES_IN_LABEL, read_run

    run = tmp_path / "long"
    _log(run, "linear", [4.0, 3.0, 2.0, 3.0, 4.0, 3.0, 2.0, 1.0])
    label, _ = read_run(run)
    assert label == "long (linear, S=4->3->2->3->...->1)"
    assert label.count("->") == MAX_SCALES_IN_LABEL - 1
