"""The deployment files in docs/ run commands the CLI accepts, with -np matching the workers."""

import shlex
from pathlib import Path

import pytest

from hvd_scale.launch import cli
from hvd_scale.spec import parse_spec
from hvdrun import REPO_ROOT

yaml = pytest.importorskip("yaml")  # PyYAML: a Horovod dependency, in the venv


def check_run_command(argv):
    """hvd-scale run's own parsing of ``argv`` (after 'hvd-scale'); returns (args, command)."""
    assert argv[0] == "run", argv
    i = argv.index("--")
    args, extra = cli.build_parser().parse_known_args(argv[:i])
    parse_spec(args.policy)  # a valid policy spec
    command = argv[i + 1:]
    assert command[0] == "python" and (REPO_ROOT / command[1]).is_file(), command
    return args, extra, command


def test_mpijob_manifest_command_is_a_valid_hvd_scale_run():
    job = yaml.safe_load((REPO_ROOT / "docs" / "mpijob.yaml").read_text())
    assert job["kind"] == "MPIJob" and job["apiVersion"] == "kubeflow.org/v2beta1"
    spec = job["spec"]
    launcher = spec["mpiReplicaSpecs"]["Launcher"]["template"]["spec"]["containers"][0]
    workers = spec["mpiReplicaSpecs"]["Worker"]["replicas"] * spec["slotsPerWorker"]
    assert launcher["command"][0] == "hvd-scale"
    args, extra, command = check_run_command(launcher["command"][1:])
    assert args.np == workers and args.controller == "mpi"
    assert extra == ["--hostfile", "/etc/mpi/hostfile"]  # horovodrun's, passed through
    assert args.log_dir.startswith(launcher["volumeMounts"][0]["mountPath"])


def test_slurm_script_command_is_a_valid_hvd_scale_run():
    text = (REPO_ROOT / "docs" / "slurm.sbatch").read_text()
    line = " ".join(l.strip().rstrip("\\") for l in text.splitlines()
                    if l.startswith("hvd-scale run") or l.startswith("    -- "))
    argv = shlex.split(line.replace('"$SLURM_NTASKS"', "4").replace('"$HOSTS"', "n1:2,n2:2")
                       .replace('"runs/$SLURM_JOB_ID"', "runs/1"))
    args, extra, _ = check_run_command(argv[1:])
    assert args.np == 4 and args.hosts == "n1:2,n2:2" and args.controller == "mpi" and not extra
