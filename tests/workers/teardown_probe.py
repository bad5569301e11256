"""Runs a DDP script (``teardown_probe.py SCRIPT ARGS...``, under torchrun) and reports whether its
Gloo process group was freed before the interpreter's exit.

A process group still alive when the interpreter exits is freed by the collector during the
exit (DDP's reference cycles keep it until then); its destructor joins the Gloo threads, and a
thread that still has Python to run then (a future's callback, or releasing a Python object
after the last collective, as happens on a loaded machine when it was descheduled) is ended by
CPython with pthread_exit: ``terminate called without an active exception``, SIGABRT.

``TEARDOWN_PENDING=1`` makes that happen every time instead of by chance: the script's
``dist.destroy_process_group()`` first starts an allreduce whose callback is still in Python
(sleeping, the GIL released) when the main thread runs on. A script whose group is freed
before the exit waits for it there; one whose group is freed during the exit aborts.

At exit (after the script's own atexit handlers) it prints ``GLOO_THREADS_AT_EXIT <n>``.
"""

import atexit
import os
import runpy
import sys
import time


def gloo_threads() -> int:
    names = []
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/comm") as f:
                names.append(f.read().strip())
        except OSError:  # a thread that ended meanwhile
            pass
    return sum(name.startswith(("pt_gloo", "gloo_")) for name in names)


def report() -> None:
    print(f"GLOO_THREADS_AT_EXIT {gloo_threads()} rank {os.environ.get('RANK')}", flush=True)


def pending_callback_at_destroy() -> None:
    import torch
    import torch.distributed as dist

    destroy = dist.destroy_process_group

    def slow(fut):
        time.sleep(0.5)  # in a Gloo thread, the GIL released: the main thread runs on
        return fut.value()

    def destroy_with_a_callback_pending(*args, **kwargs):
        dist.all_reduce(torch.ones(1), async_op=True).get_future().then(slow)
        return destroy(*args, **kwargs)

    dist.destroy_process_group = destroy_with_a_callback_pending


if __name__ == "__main__":
    atexit.register(report)  # registered first: runs after the script's own handlers
    if os.environ.get("TEARDOWN_PENDING") == "1":
        pending_callback_at_destroy()
    sys.argv = sys.argv[1:]
    sys.path.insert(0, os.path.dirname(os.path.abspath(sys.argv[0])))
    runpy.run_path(sys.argv[0], run_name="__main__")
