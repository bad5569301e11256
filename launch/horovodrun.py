"""``hvd-scale-horovodrun``: horovodrun itself, with its build check asked of torch first.

Before it starts a job, horovodrun asks whether Horovod was built with Gloo (or MPI): it imports
Horovod's extensions one at a time in a forked process, TensorFlow's first, and takes the first
that loads (``horovod.common.util.EXTENSIONS``). Importing TensorFlow there cost 8 s of a 10.7 s
two-process Gloo job on 2 cores (2.6 s with torch first), on every launch, whatever the job
trains. One Horovod build has one set of controllers, so every extension answers alike: asking
torch first (TensorFlow, then MXNet, where torch is not there) changes the time, not the answer. Everything else is horovodrun's own
``run_commandline``: same options, same output, same exit codes. ``hvd-scale run`` and the tests
start jobs through it (``jobs.find_horovodrun``); the horovodrun engine's Python-function path
(``engines.run(fn, ...)``, through ``horovod.run``) calls ``check_torch_first`` in its own process.
"""

from __future__ import annotations

# The order horovodrun asks its extensions (Horovod's own: tensorflow, torch, mxnet).
CHECK_ORDER = ("torch", "tensorflow", "mxnet")


def check_torch_first() -> None:
    """Make this process's horovodrun build checks (gloo_built, mpi_built...) load torch first."""
    from horovod.common import util

    util.EXTENSIONS[:] = [e for e in CHECK_ORDER if e in util.EXTENSIONS] + \
        [e for e in util.EXTENSIONS if e not in CHECK_ORDER]


def main() -> None:
    check_torch_first()
    from horovod.runner.launch import run_commandline

    run_commandline()


if __name__ == "__main__":
    main()
