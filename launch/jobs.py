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
