"""One way to start a Horovod job and read back what it reported: for the launcher, the
benchmarks, the examples and the tests.

    from hvd_scale.launch.jobs import CPU_ENV_DEFAULTS, horovodrun_command, read_results

    cmd = horovodrun_command([sys.executable, "train.py"], 2, controller="gloo")
    # [".venv/bin/hvd-scale-horovodrun", "-np", "2", "-H", "localhost:2", "--gloo",
    #  ".venv/bin/python", "train.py"]
    proc = subprocess.run(cmd, env={**os.environ, **CPU_ENV_DEFAULTS}, capture_output=True,
                          text=True)
    rank0 = next(r for r in read_results(proc.stdout) if r["rank"] == 0)

    from hvd_scale.launch.jobs import print_result      # in each worker:
    print_result({"rank": hvd.rank(), "loss": 0.25})    # RESULT {"rank": 0, "loss": 0.25}

A worker reports with one line ``RESULT {json}`` (``print_result``; another tag for another kind
of line); ``read_results`` finds those objects in a job's output, each rank's lines put back
together from horovodrun's per-rank prefixes first. The module imports the standard library only
(workers import it for print_result).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
from typing import Any, Iterable, Mapping, Sequence

# Defaults for CPU jobs, each only when the user has not set it (benchmarks/results/overhead.md):
# - one BLAS/OpenMP thread per worker: the workers already use every core between them, and more
#   threads oversubscribe the cores and slow every collective down;
# - a 5 ms Horovod cycle instead of 1 ms: each worker's background thread wakes every cycle, and
#   on a small CPU machine those wake-ups compete with the compute; measured on 2 cores (3 jobs
#   each), plain Horovod steps took 0.87-0.94x the time of the default on four models.
# horovodrun's controller is left to it: MPI where Horovod has it, measured as fast as Gloo or
# faster (0.92x on a 120-tensor MLP).
#   Measured on CPUs only: where the driver sees a GPU, the cycle is left to Horovod (GPU steps
#   are short, and a longer cycle would delay every allreduce); one thread per worker stays, as
#   torchrun sets it too.
# TF_CPP_MIN_LOG_LEVEL=2: TensorFlow's INFO and WARNING notices (oneDNN, cpu features, absl) off;
# plain horovodrun's build check imports TensorFlow, so a torch job printed them too (errors stay).
CPU_ENV_DEFAULTS = {"OMP_NUM_THREADS": "1", "HOROVOD_CYCLE_TIME": "5", "TF_CPP_MIN_LOG_LEVEL": "2"}
GPU_ENV_DEFAULTS = {"OMP_NUM_THREADS": "1", "TF_CPP_MIN_LOG_LEVEL": "2"}

RESULT_TAG = "RESULT"
# horovodrun options that name the hosts themselves, so no default -H goes with them (elastic
# discovery, or a hostfile such as the MPI Operator's /etc/mpi/hostfile).
HOST_OPTIONS = frozenset({"--host-discovery-script", "--hostfile", "-hostfile"})
# pyproject.toml's console script for hvd_scale/launch/horovodrun.py (horovodrun, faster to start).
LAUNCHER_SCRIPT = "hvd-scale-horovodrun"


# ----------------------------------------------------------------------------------------------
# Starting a job

def find_horovodrun() -> str | None:
    """horovodrun beside this Python (a venv's bin/), else on PATH; where it is beside this
    Python, ``hvd-scale-horovodrun`` (the same, with a build check seconds faster:
    hvd_scale/launch/horovodrun.py) when installed there too."""
    bin_dir = os.path.dirname(sys.executable)
    here = os.path.join(bin_dir, "horovodrun")
    if not os.path.exists(here):
        return shutil.which("horovodrun")
    faster = os.path.join(bin_dir, LAUNCHER_SCRIPT)
    return faster if os.path.exists(faster) else here


def start_np(np: int | None, min_np: int | None) -> int | None:
    """The workers a horovodrun job starts with: np, else min_np (horovodrun and horovod.run need
    a number in elastic mode too; a job starts with its fewest)."""
    return min_np if np is None else np


def horovodrun_command(command: Sequence[Any], np: int | None = None, *,
                       hosts: str | bool | None = None, controller: str | None = None,
                       extra_args: Iterable[str] = (), min_np: int | None = None,
                       max_np: int | None = None, executable: str | os.PathLike | None = None
                       ) -> list[str]:
    """The horovodrun command line that runs ``command`` on np workers:
    ``horovodrun -np N [--min-np M] [--max-np X] -H HOSTS [--CONTROLLER] EXTRA_ARGS... COMMAND...``.

    np: default min_np (``start_np``). hosts: the -H value; default ``localhost:N`` (N: np, else
    max_np, else min_np), none when extra_args name the hosts (HOST_OPTIONS) or hosts is False.
    controller: "gloo", "mpi" or None (horovodrun's choice). executable: default
    ``find_horovodrun()`` (plain "horovodrun" when there is none). Every element comes back as a
    str."""
    if controller not in (None, "gloo", "mpi"):
        raise ValueError(f"controller must be 'gloo', 'mpi' or None, got {controller!r}")
    extra_args = [str(a) for a in extra_args]
    cmd = [str(executable or find_horovodrun() or "horovodrun")]
    slots = np or max_np or min_np
    for option, value in (("-np", start_np(np, min_np)), ("--min-np", min_np),
                          ("--max-np", max_np)):
        if value is not None:
            cmd += [option, str(value)]
    if hosts is not False and not HOST_OPTIONS & set(extra_args):
        cmd += ["-H", hosts or f"localhost:{slots}"]
    if controller:
        cmd.append(f"--{controller}")
    return cmd + extra_args + [str(a) for a in command]


# ----------------------------------------------------------------------------------------------
# torchrun (torch.distributed's launcher)

TORCHRUN_SCRIPT = "torchrun"
TORCHRUN_MODULE = "torch.distributed.run"
# torchrun's default ports: the c10d rendezvous's and the static one's (MASTER_PORT).
C10D_PORT, STATIC_PORT = 29400, 29500
# A restart of an elastic job's workers after a failure (a node lost) counts against torchrun's
# --max-restarts (default 0 there: the first lost node would end the job); a node joining does not.
ELASTIC_MAX_RESTARTS = 3
# A one-node job: its rendezvous (and MASTER_ADDR) on the loopback, not on the hostname's address.
LOCAL_ADDR = "127.0.0.1"
_PYTHON_NAME = re.compile(r"python[0-9.]*$")


def find_torchrun() -> list[str] | None:
    """torchrun beside this Python (a venv's bin/), else ``this Python -m torch.distributed.run``
    where torch imports here, else torchrun on PATH: a list (one word, or three)."""
    here = os.path.join(os.path.dirname(sys.executable), TORCHRUN_SCRIPT)
    if os.path.exists(here):
        return [here]
    import importlib.util

    if importlib.util.find_spec("torch") is not None:
        return [sys.executable, "-m", TORCHRUN_MODULE]
    found = shutil.which(TORCHRUN_SCRIPT)
    return [found] if found else None


def is_torchrun_command(command: Sequence[Any]) -> bool:
    """The command is a torchrun command line of its own (``torchrun ...`` or
    ``python -m torch.distributed.run ...``)."""
    words = [str(c) for c in command]
    if not words:
        return False
    if os.path.basename(words[0]) == TORCHRUN_SCRIPT:
        return True
    return (bool(_PYTHON_NAME.match(os.path.basename(words[0])))
            and words[1:3] == ["-m", TORCHRUN_MODULE])


def _this_python(word: str) -> bool:
    """``word`` runs this interpreter, the one torchrun runs scripts with: a bare python or
    python3 (``resolve_python``'s rule) or sys.executable itself."""
    return word in ("python", "python3") or word == sys.executable


def torchrun_script(command: Sequence[Any]) -> list[str]:
    """What follows torchrun's options for ``command``: ``SCRIPT ARGS`` for this Python running
    a script, ``-m MODULE ARGS`` for a module, else ``--no-python COMMAND...`` (another
    interpreter, interpreter options such as -u, or no Python at all: run as given)."""
    words = [str(c) for c in command]
    if not words:
        raise ValueError("give the command to run")
    if _this_python(words[0]) and len(words) > 1:
        if not words[1].startswith("-"):
            return words[1:]
        if words[1] == "-m" and len(words) > 2:
            return ["-m", *words[2:]]
    if words[0] in ("python", "python3"):  # run as given, but by this Python (resolve_python)
        words[0] = sys.executable
    return ["--no-python", *words]


def split_endpoint(endpoint: str, default_port: int) -> tuple[str, int]:
    """``HOST[:PORT]`` (``[v6]:PORT`` too) as (host, port); ValueError for a bad port."""
    if endpoint.startswith("["):  # [v6]:PORT
        host, _, rest = endpoint[1:].partition("]")
        port = rest[1:] if rest.startswith(":") else rest
    elif endpoint.count(":") == 1:
        host, port = endpoint.split(":")
    else:  # no port (a bare IPv6 address included)
        host, port = endpoint, ""
    if not host:
        raise ValueError(f"rendezvous endpoint {endpoint!r} names no host")
    if not port:
        return host, default_port
    if not port.isdigit() or not 0 <= int(port) < 65536:
        raise ValueError(f"rendezvous endpoint {endpoint!r}: bad port {port!r}")
    return host, int(port)


def torchrun_command(command: Sequence[Any], nproc_per_node: int | None = None, *,
                     nnodes: int | None = None, min_nodes: int | None = None,
                     max_nodes: int | None = None, node_rank: int | None = None,
                     rdzv_endpoint: str | None = None, rdzv_id: str | None = None,
                     max_restarts: int | None = None, extra_args: Iterable[str] = (),
                     executable: Sequence[str] | str | None = None) -> list[str]:
    """The torchrun command line that runs ``command`` with nproc_per_node processes (default 1)
    on this node of a job of one or more nodes:

    * one node (no endpoint, nnodes 1): ``--standalone --local-addr 127.0.0.1`` (a c10d
      rendezvous on a free port of the loopback; MASTER_ADDR 127.0.0.1);
    * nnodes N with ``rdzv_endpoint`` HOST[:PORT]: ``--nnodes N --rdzv-backend c10d
      --rdzv-endpoint HOST:PORT`` (every node the same; torchrun hands out the node ranks);
    * ... and ``node_rank`` R: torchrun's static rendezvous, ``--nnodes N --node-rank R
      --master-addr HOST --master-port PORT`` (the endpoint is node 0's address);
    * elastic, min_nodes..max_nodes: ``--nnodes MIN:MAX --rdzv-backend c10d --rdzv-endpoint
      HOST:PORT --max-restarts R`` (R default ELASTIC_MAX_RESTARTS).

    rdzv_id: ``--rdzv-id`` (the same on every node). extra_args: any other torchrun options,
    before the command. The command: ``torchrun_script``. executable: default
    ``find_torchrun()``. ValueError names a combination torchrun cannot run."""
    for name, value in (("nproc_per_node", nproc_per_node), ("nnodes", nnodes),
                        ("min_nodes", min_nodes), ("max_nodes", max_nodes)):
        if value is not None and (not isinstance(value, int) or value < 1):
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    for name, value in (("node_rank", node_rank), ("max_restarts", max_restarts)):
        if value is not None and (not isinstance(value, int) or value < 0):
            raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
    elastic = min_nodes is not None or max_nodes is not None
    if executable is None:
        executable = find_torchrun() or [TORCHRUN_SCRIPT]
    cmd = [executable] if isinstance(executable, (str, os.PathLike)) else list(executable)
    cmd = [str(c) for c in cmd] + ["--nproc-per-node", str(nproc_per_node or 1)]
    if elastic:
        if min_nodes is None or max_nodes is None:
            raise ValueError("an elastic torchrun job needs both bounds (--nnodes MIN:MAX)")
        if min_nodes > max_nodes:
            raise ValueError(f"min_nodes {min_nodes} is above max_nodes {max_nodes}")
        if nnodes is not None:
            raise ValueError("nnodes is a fixed-size job's; an elastic one has min/max nodes")
        if node_rank is not None:
            raise ValueError("node_rank is torchrun's static rendezvous, which cannot be "
                             "elastic: leave it out (the c10d rendezvous ranks the nodes)")
        if rdzv_endpoint is None:
            raise ValueError("an elastic torchrun job needs the c10d rendezvous endpoint "
                             "HOST:PORT that every node joins (rdzv_endpoint)")
        host, port = split_endpoint(rdzv_endpoint, C10D_PORT)
        cmd += ["--nnodes", f"{min_nodes}:{max_nodes}", "--rdzv-backend", "c10d",
                "--rdzv-endpoint", f"{_bracket(host)}:{port}",
                "--max-restarts", str(ELASTIC_MAX_RESTARTS if max_restarts is None
                                      else max_restarts)]
        max_restarts = None
    elif node_rank is not None:
        if rdzv_endpoint is None or nnodes is None:
            raise ValueError("a node rank (torchrun's static rendezvous) needs nnodes and node "
                             "0's address as the endpoint HOST[:PORT]")
        if node_rank >= nnodes:
            raise ValueError(f"node_rank {node_rank} is not below nnodes {nnodes}")
        host, port = split_endpoint(rdzv_endpoint, STATIC_PORT)
        cmd += ["--nnodes", str(nnodes), "--node-rank", str(node_rank), "--master-addr", host,
                "--master-port", str(port)]
    elif rdzv_endpoint is not None:
        host, port = split_endpoint(rdzv_endpoint, C10D_PORT)
        cmd += ["--nnodes", str(nnodes or 1), "--rdzv-backend", "c10d",
                "--rdzv-endpoint", f"{_bracket(host)}:{port}"]
    else:
        if nnodes not in (None, 1):
            raise ValueError(f"a job of {nnodes} nodes needs the rendezvous endpoint HOST:PORT "
                             "every node joins (rdzv_endpoint; node 0's address)")
        cmd += ["--standalone", "--local-addr", LOCAL_ADDR]
    if rdzv_id is not None:
        if node_rank is not None and not elastic:
            raise ValueError("rdzv_id names a c10d rendezvous; the static one (node_rank) has none")
        cmd += ["--rdzv-id", str(rdzv_id)]
    if max_restarts is not None:
        cmd += ["--max-restarts", str(max_restarts)]
    return cmd + [str(a) for a in extra_args] + torchrun_script(command)


def _bracket(host: str) -> str:
    return f"[{host}]" if ":" in host else host


# ----------------------------------------------------------------------------------------------
# Reporting: the worker's side

def result_line(row: Mapping[str, Any], tag: str = RESULT_TAG) -> str:
    """``<tag> {json}`` and a newline: the one format of a result line (the keys in row's order)."""
    return f"{tag} {json.dumps(dict(row))}\n"


def print_result(row: Mapping[str, Any], tag: str = RESULT_TAG, file=None) -> None:
    """Write ``result_line(row, tag)`` to file (default sys.stdout) with ONE write(2), after
    flushing what the stream holds.

    print() writes a text and its newline separately, and under PYTHONUNBUFFERED=1 mpirun can
    then splice another rank's output between them; a single write of less than PIPE_BUF (4096)
    bytes to a pipe is atomic. A stream without a file descriptor (pytest's capture) gets a
    plain write."""
    out = sys.stdout if file is None else file
    data = result_line(row, tag)
    out.flush()
    try:
        fd = out.fileno()
    except (AttributeError, OSError, ValueError):  # io.UnsupportedOperation is both
        out.write(data)
        out.flush()
        return
    view = memoryview(data.encode())
    while view:
        view = view[os.write(fd, view):]


# ----------------------------------------------------------------------------------------------
# Reading the results: the driver's side

# horovodrun's per-rank prefixes: "[0]<stdout>:" (Gloo) or "[1,0]<stdout>:" (OpenMPI --tag-output).
_PREFIX = re.compile(r"\[(?:\d+,)?(\d+)\]<(stdout|stderr)>:")


def demux_output(text: str) -> dict[tuple[int | None, str], str]:
    """Split horovodrun's combined output into one text per (rank, stream).

    OpenMPI tags the chunks it reads, not whole lines: a long line can arrive as
    "[1,0]<stdout>:RESULT {...[1,1]<stdout>:other...[1,0]<stdout>:...}". Joining each rank's pieces
    in order restores its lines. Untagged text before the first tag (horovodrun's or mpirun's own,
    or all of a plain process's output) goes to (None, ""); untagged text after a tag cannot be
    told apart and stays with that tag.
    """
    streams: dict[tuple[int | None, str], list[str]] = {}
    key: tuple[int | None, str] = (None, "")
    pos = 0
    for m in _PREFIX.finditer(text):
        if m.start() > pos:
            streams.setdefault(key, []).append(text[pos:m.start()])
        key = (int(m.group(1)), m.group(2))
        pos = m.end()
    if pos < len(text):
        streams.setdefault(key, []).append(text[pos:])
    return {k: "".join(v) for k, v in streams.items()}


def read_results(text: str, tag: str = RESULT_TAG) -> list[dict]:
    """The ``<tag> {json}`` objects in a job's output (horovodrun's, mpirun's or one process's),
    rank by rank (in the order the ranks first wrote) and in order within a rank; the ranks'
    stderr is left out.

    The tag counts as a whole word followed by a space and "{"; the object is decoded on its own,
    so a line may go on after it or hold the next one. ValueError names a line whose object does
    not decode."""
    start = re.compile(rf"(?<!\w){re.escape(tag)} (?=\{{)")
    decoder = json.JSONDecoder()
    found = []
    for (_, stream), body in demux_output(text).items():
        if stream == "stderr":
            continue
        for line in body.splitlines():
            m = start.search(line)
            while m:
                try:
                    obj, end = decoder.raw_decode(line, m.end())
                except json.JSONDecodeError as e:
                    raise ValueError(f"unparsable {tag} line {line!r}: {e}") from None
                found.append(obj)
                m = start.search(line, end)
    return found
