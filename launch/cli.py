"""``hvd-scale``: run a training script under horovodrun (or on Ray or Spark, or a DDP script under
torchrun) with a policy, list
the policies, check the environment, plot runs and advise on a run's configuration.

    hvd-scale run -np 2 --policy adascale --log-dir runs/ada -- python train.py --budget 3000
    hvd-scale run --engine ray -np 2 --policy adascale -- python train.py --budget 3000
    hvd-scale run --engine torchrun -np 2 --policy adascale -- python ddp_train.py --budget 3000
    hvd-scale run --policy adascale -- torchrun --nproc-per-node 2 ddp_train.py   # as given
    hvd-scale policies
    hvd-scale check
    hvd-scale plot runs/ada runs/linear -o compare.png
    hvd-scale advise runs/ada --workers 1,2,4,8 --passes 1,2,4 --budget 3000

``advise`` (launch/advise.py) ranks configurations (workers, passes, micro-batch) of a logged run
by goodput: its measured gain over its measured step time.

``run`` validates the policy spec before anything starts, then hands it (and the log directory) to
every worker through ``HVD_SCALE_POLICY`` and ``HVD_SCALE_LOG_DIR``, which the adapters read. The
engines (horovodrun, ray, spark, torchrun) and their protocol live in launch/engines.py. A command
that is a torchrun command line itself runs under the torchrun engine, as it is.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Sequence

from hvd_scale.adapters.log import check_every
from hvd_scale.launch import engines, jobs
from hvd_scale.launch.batch_schedule import FORMATS as SCHEDULE_FORMATS
from hvd_scale.spec import describe_policies, parse_spec

DESCRIPTION = ("Run a training script under horovodrun, Ray, Spark or torchrun with a "
               "learning-rate scaling "
               "policy, list the policies, check the environment, plot runs, and advise on a "
               "run's workers, passes and micro-batch.")
# A repository checkout sets up with make; an environment of its own (`pip install .`, README's
# Install) builds or installs Horovod with `hvd-scale build-horovod`.
SETUP_HINT = (f"{engines.SETUP_HINT}; in an environment of your own, "
              "`hvd-scale build-horovod`")

# The environment every worker gets, and how each engine starts them: launch/engines.py.
# CPU_ENV_DEFAULTS (one BLAS thread per worker, a 5 ms Horovod cycle; only the thread where the
# driver has a GPU) is defined and explained there.
CPU_ENV_DEFAULTS = engines.CPU_ENV_DEFAULTS

# Options that only some engines take: option -> (attribute, the engines that take it).
ENGINE_OPTIONS = {
    "-H/--hosts": ("hosts", ("horovodrun",)),
    "--gloo/--mpi": ("controller", ("horovodrun",)),
    "--ray-address": ("ray_address", ("ray",)),
    "--spark-master": ("spark_master", ("spark",)),
    "--min-np": ("min_np", ("horovodrun", "ray", "torchrun")),
    "--max-np": ("max_np", ("horovodrun", "ray", "torchrun")),
    "--nnodes": ("nnodes", ("torchrun",)),
    "--node-rank": ("node_rank", ("torchrun",)),
    "--rdzv-endpoint": ("rdzv_endpoint", ("torchrun",)),
    "--rdzv-id": ("rdzv_id", ("torchrun",)),
    "--max-restarts": ("max_restarts", ("torchrun",)),
}
# Engines that take options of their own (those hvd-scale does not know), before `--`.
OWN_OPTIONS = ("horovodrun", "torchrun")
# What hvd-scale's options set on torchrun's command line: given among torchrun's own options
# they would contradict it.
TORCHRUN_MAPPED = {"--nproc-per-node": "-np", "--nproc_per_node": "-np",
                   "--nnodes": "--nnodes or --min-np/--max-np", "--standalone": None,
                   "--rdzv-backend": "--rdzv-endpoint", "--rdzv_backend": "--rdzv-endpoint",
                   "--rdzv_endpoint": "--rdzv-endpoint", "--rdzv_id": "--rdzv-id",
                   "--node_rank": "--node-rank", "--max_restarts": "--max-restarts",
                   "--master-addr": "--node-rank with --rdzv-endpoint",
                   "--master_addr": "--node-rank with --rdzv-endpoint",
                   "--master-port": "--node-rank with --rdzv-endpoint",
                   "--master_port": "--node-rank with --rdzv-endpoint"}


def _horovodrun() -> str | None:
    return engines.find_horovodrun()


def _usage_error(message: str) -> int:
    print(f"hvd-scale run: {message}", file=sys.stderr)
    return 2


def _torchrun_line_problem(args: argparse.Namespace) -> str | None:
    """Why a command that is a torchrun command line cannot run with these options, or None."""
    if args.engine != "torchrun":
        return (f"the command is a torchrun command line: it runs under --engine torchrun (the "
                f"default for it), not --engine {args.engine}")
    given = [option for option, attr in (("-np", "np"), ("--min-np", "min_np"),
                                         ("--max-np", "max_np"), ("--nnodes", "nnodes"),
                                         ("--node-rank", "node_rank"),
                                         ("--rdzv-endpoint", "rdzv_endpoint"),
                                         ("--rdzv-id", "rdzv_id"),
                                         ("--max-restarts", "max_restarts"))
             if getattr(args, attr) is not None]
    given += args.horovodrun_args
    if given:
        return (f"{' '.join(given)}: the torchrun command line sets the processes, nodes and "
                "rendezvous itself; give them there (only --policy, --log-dir, --log-every and "
                "--samples go with it)")
    return None


def _check_engine_options(args: argparse.Namespace, command: Sequence[str] = ()) -> str | None:
    """Why these options cannot go together, or None."""
    if engines.is_torchrun_command(command):
        return _torchrun_line_problem(args)
    for option, (attr, takers) in ENGINE_OPTIONS.items():
        if getattr(args, attr) is not None and args.engine not in takers:
            return (f"{option} is for --engine {' or '.join(takers)}, not --engine {args.engine}")
    if args.horovodrun_args and args.engine not in OWN_OPTIONS:
        return (f"unrecognized arguments for --engine {args.engine}: "
                f"{' '.join(args.horovodrun_args)} (only horovodrun and torchrun take options "
                "of their own)")
    if args.max_np is not None and args.min_np is None:
        return "--max-np needs --min-np (an elastic job's lower bound)"
    if args.min_np is not None and args.max_np is not None and args.min_np > args.max_np:
        return f"--min-np {args.min_np} is above --max-np {args.max_np}"
    if args.engine == "torchrun":
        return _torchrun_problem(args)
    if args.engine == "ray" and args.min_np is not None and args.np is not None:
        return ("-np does not go with --min-np/--max-np on --engine ray: the elastic job runs as "
                "many workers as the cluster has slots for, from --min-np up to --max-np")
    if args.np is not None and args.min_np is not None and not (
            args.min_np <= args.np <= (args.max_np or args.np)):
        bounds = f"--min-np {args.min_np}" + (f" .. --max-np {args.max_np}" if args.max_np else "")
        return (f"-np {args.np} is outside {bounds}: an elastic job starts with -np workers "
                "(default: --min-np)")
    return None


def _torchrun_problem(args: argparse.Namespace) -> str | None:
    """Why torchrun cannot run with these options, or None."""
    for word in args.horovodrun_args:
        option = word.split("=", 1)[0]
        if option in TORCHRUN_MAPPED:
            instead = TORCHRUN_MAPPED[option]
            return (f"{option} is set by hvd-scale run on --engine torchrun"
                    + (f": give {instead} instead" if instead else " (one node by default)"))
    if args.min_np is not None and args.max_np is None:
        return ("--min-np needs --max-np on --engine torchrun: an elastic job is torchrun's "
                "--nnodes MIN:MAX (nodes, each running -np processes)")
    if args.min_np is not None and args.nnodes is not None:
        return "--nnodes does not go with --min-np/--max-np (the elastic job's nodes)"
    if args.min_np is not None and args.node_rank is not None:
        return ("--node-rank is torchrun's static rendezvous, which cannot be elastic: leave it "
                "out (the c10d rendezvous at --rdzv-endpoint ranks the nodes)")
    if args.min_np is not None and args.rdzv_endpoint is None:
        return ("an elastic torchrun job needs --rdzv-endpoint HOST:PORT, the c10d rendezvous "
                "every node joins (e.g. 127.0.0.1:29400 for nodes on this machine)")
    if args.node_rank is not None and (args.nnodes is None or args.rdzv_endpoint is None):
        return ("--node-rank (torchrun's static rendezvous) needs --nnodes and --rdzv-endpoint "
                "HOST[:PORT], node 0's address")
    if args.node_rank is not None and args.node_rank >= args.nnodes:
        return f"--node-rank {args.node_rank} is not below --nnodes {args.nnodes}"
    if args.nnodes not in (None, 1) and args.rdzv_endpoint is None:
        return (f"--nnodes {args.nnodes} needs --rdzv-endpoint HOST:PORT, the c10d rendezvous "
                "every node joins (one node's address)")
    if args.rdzv_id is not None and args.rdzv_endpoint is None:
        return "--rdzv-id names the c10d rendezvous at --rdzv-endpoint: give that too"
    if args.rdzv_endpoint is not None:
        try:
            jobs.split_endpoint(args.rdzv_endpoint, jobs.C10D_PORT)
        except ValueError as e:
            return f"--rdzv-endpoint: {e}"
    return None


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
    try:
        check_every(args.log_every, "--log-every")
    except ValueError as e:
        print(f"hvd-scale run: {e}", file=sys.stderr)
        return 2
    if args.engine is None:  # a torchrun command line runs under torchrun, all else horovodrun
        args.engine = "torchrun" if engines.is_torchrun_command(command) else "horovodrun"
    problem = _check_engine_options(args, command)
    if problem:
        return _usage_error(problem)
    if args.engine == "horovodrun":
        horovodrun = _horovodrun()
        if horovodrun is None:
            ddp = ("; a DDP script runs without Horovod: hvd-scale run --engine torchrun"
                   if _importable("torch") else "")
            print(f"hvd-scale run: horovodrun not found: {SETUP_HINT}{ddp}", file=sys.stderr)
            return 127
        options = dict(hosts=args.hosts, controller=args.controller,
                       extra_args=args.horovodrun_args, executable=horovodrun)
    elif args.engine == "ray":
        options = dict(address=args.ray_address)
    elif args.engine == "torchrun":
        options = dict(nnodes=args.nnodes, node_rank=args.node_rank,
                       rdzv_endpoint=args.rdzv_endpoint, rdzv_id=args.rdzv_id,
                       max_restarts=args.max_restarts, extra_args=args.horovodrun_args)
    else:
        options = dict(master=args.spark_master)
    np_ = args.np if args.np is not None or args.min_np is not None else 1
    try:
        return engines.run_command(command, np=np_, engine=args.engine, policy=args.policy,
                                   log_dir=args.log_dir, min_np=args.min_np, max_np=args.max_np,
                                   log_every=args.log_every, samples=args.samples, **options)
    except engines.EngineUnavailable as e:
        print(f"hvd-scale run: {e}", file=sys.stderr)
        return 127
    except engines.JobNotStarted as e:  # the engine's start failed: no worker ran
        print(f"hvd-scale run: the {args.engine} job did not start: {e}", file=sys.stderr)
        return 1
    except engines.JobStopped as e:  # the job was stopped; nothing of it is left running
        print(f"hvd-scale run: the job was {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        return 130
    except Exception as e:  # the engine's own failure (a lost worker, a cluster that did not start)
        print(f"hvd-scale run: the {args.engine} job failed: {type(e).__name__}: {e}",
              file=sys.stderr)
        return 1


def cmd_policies(args: argparse.Namespace) -> int:
    for name, description, options in describe_policies():
        print(f"{name:14s} {description}")
        for opt, help_ in options.items():
            print(f"{'':14s}   {name}:{opt}=...  {help_}")
    return 0


def _importable(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


# What Horovod adds where torch.distributed is there already (`hvd-scale check`).
HOROVOD_ADDS = ("the horovodrun engine (hvd-scale run's default; Gloo or MPI, -H hosts, elastic "
                "jobs over a host discovery script), the ray and spark engines, and the Keras "
                "adapter (hvd_scale.adapters.keras)")
# Engines by what they need: torchrun torch.distributed alone; the others Horovod, and ray and
# spark their own packages (module, the pyproject.toml extra's hint).
ENGINE_PACKAGES = {"ray": ("ray", engines.INSTALL_HINTS["ray"]),
                   "spark": ("pyspark", engines.INSTALL_HINTS["spark"])}


def _torch_distributed() -> tuple[bool, str]:
    """Whether the torchrun engine can run here, and what was found."""
    if not _importable("torch"):
        return False, f"torch is not installed: {engines.INSTALL_HINTS['torchrun']}"
    try:
        import torch
        import torch.distributed as dist
    except Exception as e:  # a broken install
        return False, f"torch does not import ({type(e).__name__}: {e})"
    if not dist.is_available():
        return False, f"torch {torch.__version__} was built without torch.distributed"
    torchrun = jobs.find_torchrun()
    if torchrun is None:
        return False, f"torchrun not found: {engines.INSTALL_HINTS['torchrun']}"
    return True, (f"torch.distributed {torch.__version__}: Gloo {dist.is_gloo_available()}, "
                  f"NCCL {dist.is_nccl_available()}, MPI {dist.is_mpi_available()}; torchrun "
                  f"{' '.join(torchrun)}")


def _horovod() -> tuple[bool | None, list[str]]:
    """Whether Horovod is usable (None: not installed), and a line per framework: its
    extension's build, or why it does not load. A framework that is not installed is said
    so, not counted against Horovod."""
    try:
        import horovod.common.util as util  # noqa: F401
    except ImportError:
        return None, []
    ok, frameworks, lines = True, 0, []
    for fw, module, framework in (("PyTorch", "horovod.torch", "torch"),
                                  ("TensorFlow", "horovod.tensorflow", "tensorflow")):
        if not _importable(framework):
            lines.append(f"horovod[{fw}]: not checked ({framework} is not installed)")
            continue
        frameworks += 1
        try:
            hvd = __import__(module, fromlist=["mpi_built"])
            lines.append(f"horovod[{fw}]: built; MPI {hvd.mpi_built()}, Gloo {hvd.gloo_built()}, "
                         f"NCCL {hvd.nccl_built()}")
        except Exception as e:  # an unbuilt or mismatched extension
            ok = False
            lines.append(f"horovod[{fw}]: NOT usable ({type(e).__name__}: {e}): {SETUP_HINT}")
    if not frameworks:
        ok = False
        lines.append("neither torch nor tensorflow is installed: hvd_scale needs one of them")
    return ok, lines


def cmd_check(args: argparse.Namespace) -> int:
    """Versions, then what each engine has here: torch.distributed (the torchrun engine), and
    Horovod's build (horovodrun; ray and spark need it too). Exit 0 when the engine asked for
    (``--engine``), or without one any engine, is usable; else 1. A Horovod that is missing
    where torch.distributed is there is said so with what it would add, not an error."""
    import importlib.metadata as md

    def version(dist: str) -> str:
        try:
            return md.version(dist)
        except md.PackageNotFoundError:
            return "not installed"

    print(f"python      {sys.version.split()[0]}")
    print(f"hvd-scale   {_version()}")
    for dist in ("horovod", "torch", "tensorflow-cpu", "tensorflow", "keras", "numpy", "mpi4py"):
        v = version(dist)
        if v != "not installed" or dist in ("horovod", "torch", "keras"):
            print(f"{dist:11s} {v}")
    asked = args.engine
    ready: dict[str, bool] = {}
    if asked in (None, "torchrun"):
        ready["torchrun"], found = _torch_distributed()
        print(f"torchrun engine: {'ready' if ready['torchrun'] else 'NOT usable'} ({found})")
    if asked != "torchrun":
        horovod, lines = _horovod()
        for line in lines:
            print(line)
        if horovod is None:
            if ready.get("torchrun"):
                print(f"horovod is not installed: DDP scripts run without it (hvd-scale run "
                      f"--engine torchrun). It would add {HOROVOD_ADDS}: hvd-scale "
                      f"build-horovod builds it")
            else:
                print(f"horovod is not importable: {SETUP_HINT}")
        ready["horovodrun"] = bool(horovod)
        print(f"horovodrun engine: {'ready' if horovod else 'NOT usable'}")
        for name, (module, hint) in ENGINE_PACKAGES.items():
            if asked not in (None, name):
                continue
            has = _importable(module)
            ready[name] = bool(horovod) and has
            why = [] if horovod else ["Horovod"]
            why += [] if has else [f"{module} ({hint})"]
            print(f"{name} engine: " + ("ready" if ready[name] else
                                        f"NOT usable (needs {' and '.join(why)})"))
    print(f"slots on this host: {os.cpu_count()}")
    usable = ready.get(asked, False) if asked else any(ready.values())
    if not usable:
        print(f"hvd-scale check: {'the ' + asked + ' engine is not' if asked else 'no engine is'}"
              f" usable here")
    return 0 if usable else 1


def _version() -> str:
    from hvd_scale import __version__

    return __version__


def _optional(command: str, module: str) -> str | None:
    """None when ``module`` imports, else the one line that says what to install."""
    try:
        __import__(module)
    except ImportError as e:
        return f"hvd-scale {command}: {engines.missing_module(e)}"
    return None


def cmd_plot(args: argparse.Namespace) -> int:
    from hvd_scale.launch.plot import plot_runs

    missing = _optional("plot", "matplotlib")
    if missing:
        print(missing, file=sys.stderr)
        return 2
    try:
        plot_runs(args.run_dirs, args.output, metric=args.metric, labels=args.labels)
    except (FileNotFoundError, ValueError) as e:
        print(f"hvd-scale plot: {e}", file=sys.stderr)
        return 2
    print(f"wrote {args.output}")
    return 0


def cmd_advise(args: argparse.Namespace) -> int:
    from hvd_scale.launch.advise import advise

    missing = args.plot and _optional("advise --plot", "matplotlib")
    if missing:
        print(missing, file=sys.stderr)
        return 2
    try:
        print(advise(args.log_dirs, workers=args.workers, passes=args.passes,
                     micro_batch_factors=args.micro_batch_factors, budget=args.budget,
                     window=args.window, plot=args.plot, schedule=args.schedule,
                     base_batch=args.base_batch, seq_len=args.seq_len, max_batch=args.max_batch,
                     schedule_out=args.schedule_out))
    except (FileNotFoundError, ValueError) as e:
        print(f"hvd-scale advise: {e}", file=sys.stderr)
        return 2
    return 0


def _positive_list(kind):
    """An argparse type: a comma list of numbers > 0 (1,2,4)."""
    def parse(text: str):
        try:
            values = [kind(v) for v in text.split(",") if v.strip()]
        except ValueError:
            values = []
        if not values or any(v <= 0 for v in values):
            raise argparse.ArgumentTypeError(f"expected a comma list of numbers > 0, got {text!r}")
        return values
    return parse


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hvd-scale", description=DESCRIPTION,
        epilog="Example: hvd-scale run -np 2 --policy adascale --log-dir runs/ada -- "
               "python train.py. See `hvd-scale COMMAND --help` for each command.")
    parser.add_argument("--version", action="version", version=f"hvd-scale {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="Run COMMAND on every worker with a policy.",
                         description="Run COMMAND on every worker, under horovodrun (the default), "
                                     "on a Ray cluster, on Spark or under torchrun (a DDP "
                                     "script: hvd_scale.adapters.torch.ddp; a torchrun command "
                                     "line as COMMAND runs as it is), with the policy and log "
                                     "directory handed to the adapters. A bare python or python3 "
                                     "as COMMAND's first word runs as the interpreter that runs "
                                     "hvd-scale (its venv, activated or not).",
                         usage="hvd-scale run [-np N] [--engine {horovodrun,ray,spark,torchrun}] "
                               "[-H HOSTS] [--gloo|--mpi] [--policy SPEC] [--log-dir DIR] "
                               "[--log-every N] [--min-np N --max-np N] [--ray-address ADDR] "
                               "[--spark-master URL] [--nnodes N] [--node-rank R] "
                               "[--rdzv-endpoint HOST:PORT] [--rdzv-id ID] [--max-restarts N] "
                               "[horovodrun or torchrun options] -- COMMAND...")
    run.add_argument("-np", "--num-proc", dest="np", type=int, default=None,
                     help="Worker processes (default 1; an elastic horovodrun job, with "
                          "--min-np, starts with --min-np workers unless -np says otherwise; "
                          "under torchrun, the processes per node, its --nproc-per-node).")
    run.add_argument("--engine", choices=sorted(engines.ENGINES), default=None,
                     help="What starts the workers: horovodrun (the default), a Ray cluster "
                          "(horovod.ray), Spark (horovod.spark) or torchrun (torch.distributed, "
                          "for DDP scripts; the default when COMMAND is a torchrun command "
                          "line).")
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
    run.add_argument("--log-every", type=int, default=None, metavar="N",
                     help="Write every N-th step's metrics row (default: every step up to 1,000, "
                          "every 10th up to 10,000, every 100th after; the last step always).")
    run.add_argument("--samples", choices=("workers", "passes"), default=None,
                     help="What the gradient statistics read where the script leaves it to the "
                          "job (samples='auto'): each worker's accumulated gradient once "
                          "(workers; the default from two workers on) or every backward pass "
                          "(passes). Sets HVD_SCALE_SAMPLES.")
    run.add_argument("--min-np", type=int, default=None,
                     help="Elastic: the fewest workers the job runs with (horovodrun, ray; "
                          "torchrun: the fewest nodes, its --nnodes MIN:MAX).")
    run.add_argument("--max-np", type=int, default=None,
                     help="Elastic: the most workers the job grows to (horovodrun, ray; "
                          "torchrun: the most nodes).")
    run.add_argument("--ray-address", default=None,
                     help="The Ray cluster to join, for example ray://head:10001 or auto "
                          "(default: a local cluster started for the job).")
    run.add_argument("--spark-master", default=None,
                     help="The Spark master, for example spark://head:7077 (default local[N]).")
    run.add_argument("--nnodes", type=int, default=None,
                     help="Torchrun: the nodes of a fixed-size job (default 1); run the same "
                          "command on every node.")
    run.add_argument("--node-rank", type=int, default=None,
                     help="Torchrun: this node's rank, for torchrun's static rendezvous (with "
                          "--nnodes, and --rdzv-endpoint naming node 0).")
    run.add_argument("--rdzv-endpoint", default=None, metavar="HOST:PORT",
                     help="Torchrun: the c10d rendezvous every node joins, on one node's "
                          "address (default: one node, on 127.0.0.1).")
    run.add_argument("--rdzv-id", default=None,
                     help="Torchrun: the job's rendezvous id, the same on every node.")
    run.add_argument("--max-restarts", type=int, default=None,
                     help="Torchrun: how often the workers restart after a failure (default 0; "
                          "3 for an elastic job).")

    sub.add_parser("policies", help="List the policies and their options.")
    check = sub.add_parser(
        "check", help="Show what each engine has here: torch.distributed, Horovod's build.",
        description="Show the versions, what each engine has here (torch.distributed for "
                    "torchrun; Horovod's build for horovodrun, ray and spark) and the slots. "
                    "Exit 0 when the engine named, or without --engine any engine, is usable.")
    check.add_argument("--engine", choices=sorted(engines.ENGINES), default=None,
                       help="The engine that must be usable (default: any).")

    from hvd_scale.launch import build_horovod  # standard library only: cheap to import

    build = sub.add_parser(
        "build-horovod", help="Build and install the patched Horovod 0.28.1 for this environment.",
        description=build_horovod.DESCRIPTION, epilog=build_horovod.EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    build_horovod.add_arguments(build)

    plot = sub.add_parser("plot", help="Plot runs' gain, lr, tau and loss.",
                          description="Plot runs' lr factor, effective lr (log axis) and tau "
                                      "against the step, and the loss against tau, one line "
                                      "per run.")
    plot.add_argument("run_dirs", nargs="+", metavar="RUN_DIR",
                      help="Directories written with --log-dir.")
    plot.add_argument("-o", "--output", required=True, metavar="FILE.png",
                      help="The picture to write.")
    plot.add_argument("--metric", default=None,
                      help="The column to plot against tau (default: the loss, where logged).")
    plot.add_argument("--label", action="append", dest="labels", default=None, metavar="TEXT",
                      help="A run's name in the legend, once per RUN_DIR in their order "
                           "(default: each directory's name); the policy and S as it went "
                           "(S=2->1->2 for an elastic run) follow it.")

    advise = sub.add_parser(
        "advise", help="Rank workers, passes and micro-batch for logged runs by goodput.",
        description="From a run's log (--log-dir; torch or Keras), predict each "
                    "configuration's gain, step time and goodput, and recommend the best. Given "
                    "logs of runs at several W (or an elastic run's, whose rows carry several), "
                    "each W measured is predicted from its own steps; any other W is an "
                    "extrapolation from the nearest W measured, marked W* and named.")
    advise.add_argument("log_dirs", nargs="+", metavar="LOGDIR",
                        help="Directories written with --log-dir: the run advised on (its "
                             "statistics, policy and budget: the first that has statistics), "
                             "then runs at other W whose step times to use (a short run at W = 1 "
                             "beside a W = 2 one, for example).")
    advise.add_argument("--workers", type=_positive_list(int), metavar="LIST",
                        default=[1, 2, 4, 8],
                        help="Workers W to consider, a comma list (default 1,2,4,8).")
    advise.add_argument("--passes", type=_positive_list(int), metavar="LIST",
                        default=[1, 2, 4, 8, 16],
                        help="Backward passes per step k, a comma list (default 1,2,4,8,16).")
    advise.add_argument("--micro-batch-factors", type=_positive_list(float), metavar="LIST",
                        default=[1.0],
                        help="Micro-batches as multiples of the run's, a comma list (default 1).")
    advise.add_argument("--budget", type=float, default=None, metavar="T",
                        help="T, baseline steps to train for (default: the run's, if it had one).")
    advise.add_argument("--window", type=int, default=None, metavar="STEPS",
                        help="The latest steps to fit the step time to (default: the latest 20%% "
                             "of the timed steps, at least 10).")
    advise.add_argument("--plot", default=None, metavar="FILE.png",
                        help="Also draw the efficiency r(S)/S against S through training.")
    export = advise.add_argument_group(
        "batch schedule export", "Write the batch schedule the measured noise scale allows, for a "
        "trainer of one's own (docs/choosing-the-batch.md).")
    export.add_argument("--schedule", default=None, choices=SCHEDULE_FORMATS,
                        help="The form: Megatron-LM's --step-batch-size-schedule, OLMo-core's "
                             "BatchSizeSchedulerCallback config (JSON), Levanter's "
                             "train_batch_size segments (YAML).")
    export.add_argument("--base-batch", type=int, default=None, metavar="SAMPLES",
                        help="The baseline batch B0 in samples (the batch S counts in); "
                             "required with --schedule.")
    export.add_argument("--seq-len", type=int, default=None, metavar="TOKENS",
                        help="Tokens per sample: Megatron-LM's thresholds and OLMo-core's "
                             "batches count tokens.")
    export.add_argument("--max-batch", type=int, default=None, metavar="SAMPLES",
                        help="The largest batch the schedule may reach (default: none).")
    export.add_argument("--schedule-out", default=None, metavar="FILE",
                        help="Write the schedule there (default: printed after the report).")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, command = argv[:i], argv[i + 1:]
    parser = build_parser()
    if argv and argv[0] == "run":
        # Unknown options before `--` are horovodrun's own (e.g. --timeline-filename f.json), or
        # torchrun's (--rdzv-conf ..., --tee 3).
        args, extra = parser.parse_known_args(argv)
        args.horovodrun_args = extra
        for option, value in (("-np", args.np), ("--min-np", args.min_np),
                              ("--max-np", args.max_np), ("--nnodes", args.nnodes)):
            if value is not None and value < 1:
                parser.error(f"{option} must be >= 1, got {value}")
        for option, value in (("--node-rank", args.node_rank),
                              ("--max-restarts", args.max_restarts)):
            if value is not None and value < 0:
                parser.error(f"{option} must be >= 0, got {value}")
        return cmd_run(args, command)
    args = parser.parse_args(argv)
    if command:
        parser.error(f"`--` is only for `hvd-scale run`, got {' '.join(command)}")
    if args.command == "build-horovod":
        from hvd_scale.launch import build_horovod

        return build_horovod.run(args)
    return {"policies": cmd_policies, "check": cmd_check, "plot": cmd_plot,
            "advise": cmd_advise}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
