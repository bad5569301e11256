"""``hvd-scale``: run a training script under horovodrun with a policy, list the policies, check
the environment and plot runs.

    hvd-scale run -np 2 --policy adascale --log-dir runs/ada -- python train.py --budget 3000
    hvd-scale policies
    hvd-scale check
    hvd-scale plot runs/ada runs/linear -o compare.png

``run`` validates the policy spec before anything starts, then hands it (and the log directory) to
every worker through ``HVD_SCALE_POLICY`` and ``HVD_SCALE_LOG_DIR``, which the adapters read.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from typing import Sequence

from hvd_scale.metrics import LOG_DIR_ENV
from hvd_scale.policies import POLICY_ENV, describe_policies, parse_spec

DESCRIPTION = ("Run a training script under horovodrun with a learning-rate scaling policy, list "
               "the policies, check the environment, and plot runs.")
SETUP_HINT = "run `make setup` (or `bash launch/setup_env.sh`) in the hvd_scale repository"

# Defaults for CPU jobs, each only when the user has not set it (benchmarks/results/overhead.md):
# - one BLAS/OpenMP thread per worker: the workers already use every core between them, and more
#   threads oversubscribe the cores and slow every collective down;
# - a 5 ms Horovod cycle instead of 1 ms: each worker's background thread wakes every cycle, and
#   on a small CPU machine those wake-ups compete with the compute; measured on 2 cores, plain
#   Horovod steps took 0.69x (CNN) and 0.78x (MLP) the time of the default, hvd_scale adascale
#   steps 0.77x and 0.78x.
CPU_ENV_DEFAULTS = {"OMP_NUM_THREADS": "1", "HOROVOD_CYCLE_TIME": "5"}


def _horovodrun() -> str | None:
    here = os.path.join(os.path.dirname(sys.executable), "horovodrun")
    return here if os.path.exists(here) else shutil.which("horovodrun")


def cmd_run(args: argparse.Namespace, command: list[str]) -> int:
    if not command:
        print("hvd-scale run: give the command to run after `--`, e.g. "
              "hvd-scale run -np 2 -- python train.py", file=sys.stderr)
        return 2
    if args.policy is not None:
        try:
            parse_spec(args.policy)
        except ValueError as e:
            print(f"hvd-scale run: bad --policy: {e}", file=sys.stderr)
            return 2
    horovodrun = _horovodrun()
    if horovodrun is None:
        print(f"hvd-scale run: horovodrun not found: {SETUP_HINT}", file=sys.stderr)
        return 127
    np_ = args.np
    cmd = [horovodrun, "-np", str(np_), "-H", args.hosts or f"localhost:{np_}"]
    if args.controller:
        cmd.append(f"--{args.controller}")
    cmd += args.horovodrun_args
    cmd += command
    env = dict(os.environ)
    for key, value in CPU_ENV_DEFAULTS.items():
        env.setdefault(key, value)
    if args.policy is not None:
        env[POLICY_ENV] = args.policy
    if args.log_dir is not None:
        env[LOG_DIR_ENV] = os.path.abspath(args.log_dir)
        os.makedirs(env[LOG_DIR_ENV], exist_ok=True)
    # horovodrun passes the environment through to every worker (Gloo and MPI).
    try:
        return subprocess.call(cmd, env=env)
    except KeyboardInterrupt:
        return 130


def cmd_policies(args: argparse.Namespace) -> int:
    for name, description, options in describe_policies():
        print(f"{name:14s} {description}")
        for opt, help_ in options.items():
            print(f"{'':14s}   {name}:{opt}=...  {help_}")
    return 0


def cmd_check(args: argparse.Namespace) -> int:
    """Versions and Horovod's build; exit 1 when Horovod or a framework is missing."""
    import importlib.metadata as md

    ok = True

    def version(dist: str) -> str:
        try:
            return md.version(dist)
        except md.PackageNotFoundError:
            return "not installed"

    print(f"python      {sys.version.split()[0]}")
    for dist in ("horovod", "torch", "tensorflow-cpu", "tensorflow", "keras", "numpy", "mpi4py"):
        v = version(dist)
        if v != "not installed" or dist in ("horovod", "torch", "keras"):
            print(f"{dist:11s} {v}")
    try:
        import horovod.common.util as util  # noqa: F401
    except ImportError:
        print(f"horovod is not importable: {SETUP_HINT}")
        return 1
    for fw, module in (("PyTorch", "horovod.torch"), ("TensorFlow", "horovod.tensorflow")):
        try:
            hvd = __import__(module, fromlist=["mpi_built"])
            print(f"horovod[{fw}]: built; MPI {hvd.mpi_built()}, Gloo {hvd.gloo_built()}, "
                  f"NCCL {hvd.nccl_built()}")
        except Exception as e:  # an unbuilt or mismatched extension
            ok = False
            print(f"horovod[{fw}]: NOT usable ({type(e).__name__}: {e}): {SETUP_HINT}")
    print(f"slots on this host: {os.cpu_count()}")
    return 0 if ok else 1


def cmd_plot(args: argparse.Namespace) -> int:
    from hvd_scale.launch.plot import plot_runs

    try:
        plot_runs(args.run_dirs, args.output, metric=args.metric)
    except (FileNotFoundError, ValueError) as e:
        print(f"hvd-scale plot: {e}", file=sys.stderr)
        return 2
    print(f"wrote {args.output}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hvd-scale", description=DESCRIPTION,
        epilog="Example: hvd-scale run -np 2 --policy adascale --log-dir runs/ada -- "
               "python train.py. See `hvd-scale COMMAND --help` for each command.")
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="Run COMMAND under horovodrun with a policy.",
                         description="Run COMMAND on every worker under horovodrun, with the "
                                     "policy and log directory handed to the adapters.",
                         usage="hvd-scale run [-np N] [-H HOSTS] [--gloo|--mpi] [--policy SPEC] "
                               "[--log-dir DIR] [horovodrun options] -- COMMAND...")
    run.add_argument("-np", "--num-proc", dest="np", type=int, default=1,
                     help="Worker processes (default 1).")
    run.add_argument("-H", "--hosts", default=None,
                     help="Hosts as horovodrun takes them (default localhost:N).")
    group = run.add_mutually_exclusive_group()
    group.add_argument("--gloo", dest="controller", action="store_const", const="gloo",
                       help="Use Gloo as the controller.")
    group.add_argument("--mpi", dest="controller", action="store_const", const="mpi",
                       help="Use MPI as the controller.")
    run.add_argument("--policy", default=None,
                     help="The policy spec, for example adascale or warmup:fraction=0.055.")
    run.add_argument("--log-dir", default=None,
                     help="Where rank 0 writes per-step metrics (CSV and TensorBoard).")

    sub.add_parser("policies", help="List the policies and their options.")
    sub.add_parser("check", help="Show Horovod's build, the frameworks and the slots.")

    plot = sub.add_parser("plot", help="Plot runs' gain, lr, tau and loss.")
    plot.add_argument("run_dirs", nargs="+", metavar="RUN_DIR",
                      help="Directories written with --log-dir.")
    plot.add_argument("-o", "--output", required=True, metavar="FILE.png",
                      help="The picture to write.")
    plot.add_argument("--metric", default="loss", help="The column to plot against tau (default loss).")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, command = argv[:i], argv[i + 1:]
    parser = build_parser()
    if argv and argv[0] == "run":
        # Unknown options before `--` are horovodrun's own (e.g. --timeline-filename f.json).
        args, extra = parser.parse_known_args(argv)
        args.horovodrun_args = extra
        if args.np < 1:
            parser.error(f"-np must be >= 1, got {args.np}")
        return cmd_run(args, command)
    args = parser.parse_args(argv)
    if command:
        parser.error(f"`--` is only for `hvd-scale run`, got {' '.join(command)}")
    return {"policies": cmd_policies, "check": cmd_check, "plot": cmd_plot}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
