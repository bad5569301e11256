"""The torchrun engine (launch/engines.py TorchrunEngine, launch/jobs.py torchrun_command): the
torchrun command lines `hvd-scale run --engine torchrun` builds (one node, several nodes through
c10d or the static rendezvous, elastic), the options it refuses, a torchrun command line given as
the command, and a real 2-process DDP job through `hvd-scale run --engine torchrun` whose ranks
report the policy, log directory and rendezvous they got and the DDP steps they took
(tests/workers/ddp_train_worker.py)."""

from __future__ import annotations

import csv
import os
import sys
from pathlib import Path

import pytest

from hvd_scale.launch import cli, engines, jobs
from hvdrun import WORKERS_DIR, run_process, worker_env, worker_results

HVD_SCALE = Path(sys.executable).parent / "hvd-scale"
TORCHRUN = str(Path(sys.executable).parent / "torchrun")
WORKER = WORKERS_DIR / "ddp_train_worker.py"


@pytest.fixture
def launched(monkeypatch):
    """What run_stoppable would have started: {"cmd": [...], "env": {...}} (nothing starts)."""
    seen = {}

    def fake(cmd, env):
        seen.update(cmd=list(cmd), env=dict(env))
        return 0

    monkeypatch.setattr(engines, "run_stoppable", fake)
    monkeypatch.setattr(engines, "find_torchrun", lambda: [TORCHRUN])
    return seen


def test_one_node_is_standalone_on_the_loopback_with_the_workers_environment(launched, tmp_path,
                                                                             monkeypatch):
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    assert cli.main(["run", "--engine", "torchrun", "-np", "2", "--policy", "adascale",
                     "--log-dir", str(tmp_path / "logs"), "--log-every", "5",
                     "--", "python", "train.py", "--budget", "30"]) == 0
    assert launched["cmd"] == [TORCHRUN, "--nproc-per-node", "2", "--standalone", "--local-addr",
                               "127.0.0.1", "train.py", "--budget", "30"]
    env = launched["env"]
    assert env["HVD_SCALE_POLICY"] == "adascale"
    assert env["HVD_SCALE_LOG_DIR"] == str(tmp_path / "logs") and (tmp_path / "logs").is_dir()
    assert env["HVD_SCALE_LOG_EVERY"] == "5" and env["OMP_NUM_THREADS"] == "1"
    assert env["GLOO_SOCKET_IFNAME"] == "lo"  # one node: Gloo on the loopback too


@pytest.mark.parametrize("argv, expected", [
    # several nodes, c10d: the same command on every node
    (["-np", "4", "--nnodes", "2", "--rdzv-endpoint", "node0:29400", "--rdzv-id", "job7"],
     ["--nproc-per-node", "4", "--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint",
      "node0:29400", "--rdzv-id", "job7"]),
    (["--nnodes", "2", "--rdzv-endpoint", "10.0.0.1"],  # torchrun's c10d port by default
     ["--nproc-per-node", "1", "--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint",
      "10.0.0.1:29400"]),
    # several nodes, static: node 0's address and this node's rank
    (["-np", "2", "--nnodes", "2", "--node-rank", "1", "--rdzv-endpoint", "node0:1234"],
     ["--nproc-per-node", "2", "--nnodes", "2", "--node-rank", "1", "--master-addr", "node0",
      "--master-port", "1234"]),
    # elastic: --min-np/--max-np count nodes; restarts by default
    (["-np", "1", "--min-np", "1", "--max-np", "2", "--rdzv-endpoint", "127.0.0.1:29411"],
     ["--nproc-per-node", "1", "--nnodes", "1:2", "--rdzv-backend", "c10d", "--rdzv-endpoint",
      "127.0.0.1:29411", "--max-restarts", str(jobs.ELASTIC_MAX_RESTARTS)]),
    (["--min-np", "2", "--max-np", "4", "--rdzv-endpoint", "[fd00::1]:5", "--max-restarts", "9",
      "--rdzv-conf", "join_timeout=60"],  # torchrun's own options pass through
     ["--nproc-per-node", "1", "--nnodes", "2:4", "--rdzv-backend", "c10d", "--rdzv-endpoint",
      "[fd00::1]:5", "--max-restarts", "9", "--rdzv-conf", "join_timeout=60"]),
    (["--max-restarts", "1", "--tee", "3"],
     ["--nproc-per-node", "1", "--standalone", "--local-addr", "127.0.0.1", "--max-restarts",
      "1", "--tee", "3"]),
])
def test_multi_node_and_elastic_options_map_onto_torchruns(launched, monkeypatch, argv,
                                                           expected):
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    assert cli.main(["run", "--engine", "torchrun", *argv, "--", "python", "t.py", "-x"]) == 0
    assert launched["cmd"] == [TORCHRUN, *expected, "t.py", "-x"]
    # One node: Gloo on the loopback; several: the NIC is the user's choice (left unset).
    assert launched["env"].get("GLOO_SOCKET_IFNAME") == ("lo" if "--standalone" in expected
                                                         else None)


@pytest.mark.parametrize("command, tail", [
    (["python", "-m", "pkg.train", "--x"], ["-m", "pkg.train", "--x"]),
    (["python", "-u", "t.py"], ["--no-python", sys.executable, "-u", "t.py"]),
    (["bash", "run.sh"], ["--no-python", "bash", "run.sh"]),
    (["/other/python3", "t.py"], ["--no-python", "/other/python3", "t.py"]),  # not torchrun's
    ([sys.executable, "t.py"], ["t.py"]),
])
def test_the_command_after_torchruns_options(command, tail):
    assert jobs.torchrun_script(command) == tail


def test_a_torchrun_command_line_runs_as_given_with_the_policy(launched, monkeypatch):
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    # No --engine: a torchrun command line chooses the torchrun engine; a bare torchrun is this
    # Python's (as a bare python is).
    assert cli.main(["run", "--policy", "sqrt", "--", "torchrun", "--nproc-per-node", "2",
                     "train.py"]) == 0
    assert launched["cmd"] == [TORCHRUN, "--nproc-per-node", "2", "train.py"]
    assert launched["env"]["HVD_SCALE_POLICY"] == "sqrt"
    assert "GLOO_SOCKET_IFNAME" not in launched["env"]  # the line may name other nodes
    assert cli.main(["run", "--engine", "torchrun", "--", "python", "-m", "torch.distributed.run",
                     "--standalone", "t.py"]) == 0
    assert launched["cmd"] == [sys.executable, "-m", "torch.distributed.run", "--standalone",
                               "t.py"]


@pytest.mark.parametrize("argv, message", [
    (["--engine", "torchrun", "--gloo"], "--gloo/--mpi is for --engine horovodrun"),
    (["--engine", "torchrun", "--mpi"], "--gloo/--mpi is for --engine horovodrun"),
    (["--engine", "torchrun", "-H", "a:1,b:1"], "-H/--hosts is for --engine horovodrun"),
    (["--engine", "torchrun", "--ray-address", "auto"], "--ray-address is for --engine ray"),
    (["--nnodes", "2"], "--nnodes is for --engine torchrun, not --engine horovodrun"),
    (["--engine", "ray", "--rdzv-endpoint", "h:1"], "--rdzv-endpoint is for --engine torchrun"),
    (["--max-restarts", "2"], "--max-restarts is for --engine torchrun"),
    (["--engine", "torchrun", "--nnodes", "2"], "--nnodes 2 needs --rdzv-endpoint"),
    (["--engine", "torchrun", "--min-np", "1", "--max-np", "2"],
     "an elastic torchrun job needs --rdzv-endpoint"),
    (["--engine", "torchrun", "--min-np", "1", "--rdzv-endpoint", "h:1"],
     "--min-np needs --max-np on --engine torchrun"),
    (["--engine", "torchrun", "--min-np", "1", "--max-np", "2", "--nnodes", "2",
      "--rdzv-endpoint", "h:1"], "--nnodes does not go with --min-np/--max-np"),
    (["--engine", "torchrun", "--min-np", "1", "--max-np", "2", "--node-rank", "0",
      "--rdzv-endpoint", "h:1"], "--node-rank is torchrun's static rendezvous"),
    (["--engine", "torchrun", "--node-rank", "2", "--nnodes", "2", "--rdzv-endpoint", "h"],
     "--node-rank 2 is not below --nnodes 2"),
    (["--engine", "torchrun", "--node-rank", "0"], "--node-rank (torchrun's static rendezvous) "
                                                   "needs --nnodes and --rdzv-endpoint"),
    (["--engine", "torchrun", "--rdzv-endpoint", "h:port"], "--rdzv-endpoint: "),
    (["--engine", "torchrun", "--nproc-per-node", "2"],
     "--nproc-per-node is set by hvd-scale run on --engine torchrun: give -np instead"),
    (["--engine", "torchrun", "--standalone"], "--standalone is set by hvd-scale run"),
])
def test_options_torchrun_cannot_honour_are_refused(launched, capsys, argv, message):
    assert cli.main(["run", *argv, "--", "python", "t.py"]) == 2
    assert message in capsys.readouterr().err
    assert not launched  # nothing started


@pytest.mark.parametrize("argv, message", [
    (["--engine", "horovodrun"], "the command is a torchrun command line: it runs under "
                                 "--engine torchrun"),
    (["-np", "2"], "-np: the torchrun command line sets the processes"),
    (["--engine", "torchrun", "--max-restarts", "1"], "--max-restarts: the torchrun command"),
])
def test_a_torchrun_command_line_takes_no_launch_options(launched, capsys, argv, message):
    assert cli.main(["run", *argv, "--", "torchrun", "--nproc-per-node", "2", "t.py"]) == 2
    assert message in capsys.readouterr().err
    assert not launched


def test_the_engine_refuses_what_torchrun_cannot_run():
    with pytest.raises(ValueError, match="needs max_np"):
        engines.run_command(["true"], engine="torchrun", min_np=1)
    with pytest.raises(ValueError, match="needs the c10d rendezvous endpoint"):
        engines.run_command(["true"], engine="torchrun", min_np=1, max_np=2)
    with pytest.raises(ValueError, match="needs the rendezvous endpoint"):
        engines.run_command(["true"], engine="torchrun", nnodes=3)


def test_the_engine_implements_the_protocol_and_stops_as_the_others(launched):
    assert isinstance(engines.TorchrunEngine(), engines.Engine)
    # Stop signals: the command goes through run_stoppable (its own session; SIGINT/SIGTERM to
    # the driver stop torchrun and its workers: the horovodrun engine's path).
    assert engines.run_command(["python", "t.py"], np=2, engine="torchrun", policy="linear") == 0
    assert launched["cmd"][:3] == [TORCHRUN, "--nproc-per-node", "2"]


@pytest.mark.timeout(240)
def test_hvd_scale_run_trains_two_ddp_ranks_under_torchrun(tmp_path):
    """The real thing: `hvd-scale run --engine torchrun -np 2 --policy adascale --log-dir D --
    python worker`: both ranks got the policy and log directory from the environment, met on
    127.0.0.1, and took the same DDP steps (weights equal on both; adascale's gain measured from
    2 workers x 2 passes, S = 4); rank 0 wrote the metrics."""
    logs = tmp_path / "logs"
    proc = run_process([HVD_SCALE, "run", "--engine", "torchrun", "-np", "2", "--policy",
                        "adascale", "--log-dir", logs, "--", "python", WORKER, "--steps", "3",
                        "--passes", "2"], timeout=200, env=worker_env(), cwd=tmp_path,
                       what="hvd-scale run --engine torchrun")
    results = worker_results(proc)
    starts = [r for r in results if r["event"] == "start"]
    steps = [r for r in results if r["event"] == "step"]
    assert [s["rank"] for s in starts] == [0, 1], proc.stdout
    for s in starts:
        assert (s["world"], s["policy_env"], s["policy"]) == (2, "adascale", "adascale")
        assert s["log_dir"] == str(logs) and s["master_addr"] == "127.0.0.1"
        assert s["scale"] == 4
    by_rank = {r: [s for s in steps if s["rank"] == r] for r in (0, 1)}
    assert [s["steps"] for s in by_rank[0]] == [1, 2, 3] == [s["steps"] for s in by_rank[1]]
    for a, b in zip(by_rank[0], by_rank[1]):
        for key in ("progress", "gain", "lr_factor", "sigma2", "mu2", "weights"):
            assert a[key] == b[key], (key, a, b)
        assert 1 < a["gain"] < 4 and a["lr_factor"] == a["gain"]
    assert by_rank[0][0]["weights"] != by_rank[0][1]["weights"]  # it trained
    # The worker ends with dist.destroy_process_group(); the log's rows are flushed after it.
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    with open(logs / "metrics.csv") as f:
        assert [float(row["step"]) for row in csv.DictReader(f)] == [1, 2, 3]


def _probe(tag):
    return {"tag": tag, "rank": int(os.environ["RANK"]), "world": int(os.environ["WORLD_SIZE"]),
            "policy": os.environ.get("HVD_SCALE_POLICY")}


@pytest.mark.timeout(200)
def test_the_engine_runs_a_python_function_on_every_rank():
    """engines.run(fn, engine="torchrun"): fn on each process (torch's elastic_launch, spawned),
    with the workers' environment; the results in rank order."""
    results = engines.run(_probe, args=("x",), np=2, engine="torchrun", policy="linear")
    assert results == [{"tag": "x", "rank": r, "world": 2, "policy": "linear"} for r in (0, 1)]
