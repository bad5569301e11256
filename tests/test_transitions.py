"""Every change of k or S, in every framework, as a matrix (issue #47).

The bugs this matrix is for lived where two features meet, each passing its own tests. One
harness (tests/workers/transitions_worker.py) runs the cells

    {torch (Horovod), torch (DDP, torchrun), Keras on TensorFlow, Keras on torch}
    x {fit, a custom loop (where both exist)}
    x {steady, adapt changing k, set_passes by hand, a checkpoint saved and resumed through
       broadcast_state (with k fixed, and with k adapted before it: rank 0 loads k = 4, the
       others start at 2), a resume at another world size, a short step, hvd.join, a
       non-finite step on one rank} x {none, warmup, adascale, adascale_adam}
    x {measured, unmeasured (measure=False)}

under ``horovodrun -np 2`` and as the one-process reference fed the same micro-batches
(``--simulate 2``), and one process at W = 1 (``RUNS``: within CI's time, Keras on torch runs
fit only, Keras's custom loop the changes whose code is its own, Keras none for warmup too, and
the one-process cells and the resume at another world size are a subset where Keras's paths are
the same), and asserts for every cell: no crash on a documented path; a
refused path refused on every rank, naming the cause, alike in the reference; every rank's
weights and run record identical; each step's lr factor, tau, S, n = W x k and skip count equal
to the reference's, and the weights too; and, independently of the code under test, tau's advance
against the micro-batches the schedule took (a fixed rule's step: its own S; AdaScale's: a gain in
[1, S]; a skipped step: none). An elastic grow and shrink needs horovodrun's elastic
mode with a host-discovery script: its cells are tests/test_elastic.py's (torch and Keras, tau
and the lr continuous across 2 -> 1 -> 2), not repeated here. Cells that cannot run say why in the
harness (``CANNOT``), never by absence.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import subprocess
import sys

import pytest

from hvdrun import (WORKERS_DIR, free_port, requires_horovod, run_horovod, run_torchrun,
                    worker_results)

WORKER = WORKERS_DIR / "transitions_worker.py"
FRAMEWORKS = {"torch": ("torch", None), "torch/ddp": ("ddp", None),
              "keras/tensorflow": ("keras", "tensorflow"), "keras/torch": ("keras", "torch")}
# What each framework runs, within CI's time (a Keras cell costs ~2 s, its model traced anew):
# the loops; the one-process (np 1) cells beside the reference (itself one process); whether the
# resume at another world size runs (Keras's record travels the same on both backends); the
# policies (Keras's traced step takes every fixed rule's factor from the host alike: none stands
# for warmup there, whose ramp is the engine's, tested with torch and in tests/test_policies.py).
RUNS = {"torch": {"loops": "custom", "alone": None, "resume": True, "custom": None,
                  "policies": "none,warmup,adascale,adascale_adam"},
        # torch under torchrun (DDP): the torch cells, a rank's passes but its last under no_sync.
        "torch/ddp": {"loops": "custom", "alone": None, "resume": True, "custom": None,
                      "policies": "none,warmup,adascale,adascale_adam"},
        # The custom loop's own paths: eager apply calls, adapt_passes by hand, a checkpoint of
        # an adapted k, a non-finite step outside fit; the rest are fit's code.
        "keras/tensorflow": {"loops": "fit,custom", "alone": "steady,set_passes,adapt",
                             "resume": True,
                             "custom": "steady,adapt,adapt_checkpoint,nonfinite",
                             "policies": "none,adascale,adascale_adam"},
        "keras/torch": {"loops": "fit", "alone": "steady,set_passes,adapt", "resume": False,
                        "custom": None, "policies": "none,adascale,adascale_adam"}}
POLICIES = ("none", "warmup", "adascale", "adascale_adam")
CHANGES = ("steady", "adapt", "set_passes", "checkpoint", "adapt_checkpoint", "short", "join",
           "nonfinite", "resume")
TOL = 1e-7


def _env(backend):
    env = {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "TF_CPP_MIN_LOG_LEVEL": "2",
           "CUDA_VISIBLE_DEVICES": ""}
    if backend:
        env["KERAS_BACKEND"] = backend
    return env


def _one_process(framework, backend, *extra, timeout=600):
    """The worker in one process (no horovodrun): its RESULT lines."""
    from hvd_scale.launch.jobs import read_results
    group = {} if framework != "ddp" else {  # torch.distributed: a group of one process
        "RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    out = subprocess.run([sys.executable, str(WORKER), "--framework", framework, *extra],
                         capture_output=True, text=True, timeout=timeout,
                         env={**os.environ, **_env(backend), **group}, cwd=str(WORKERS_DIR))
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    return read_results(out.stdout)


def _by_cell(results):
    cells = {}
    for r in results:
        cells.setdefault(tuple(r["cell"]), {})[r["rank"]] = r
    return cells


@pytest.fixture(scope="module", params=list(FRAMEWORKS))
def matrix(request, tmp_path_factory):
    framework, backend = FRAMEWORKS[request.param]
    runs = RUNS[request.param]
    tmp = tmp_path_factory.mktemp("transitions")
    base = [sys.executable, str(WORKER), "--framework", framework, "--loops", runs["loops"],
            "--policies", runs["policies"],
            *(["--custom-cells", runs["custom"]] if runs["custom"] else [])]
    def job(args, timeout):  # two workers: Horovod's, or torchrun's for DDP
        if framework == "ddp":
            return run_torchrun(args[1:], nproc=2, timeout=timeout, env=_env(backend))
        return run_horovod(args, np=2, timeout=timeout, env=_env(backend))

    both = _by_cell(worker_results(job(base, 900)))
    alone = _by_cell(_one_process(framework, backend, *base[4:],
                                  *(["--cells", runs["alone"]] if runs["alone"] else [])))
    reference = _by_cell(_one_process(framework, backend, *base[4:], "--simulate", "2"))
    resumed = {}
    if runs["resume"]:
        # A resume at another world size: saved by an np 2 job after step 3, resumed by one
        # process taking both ranks' micro-batches (k doubled: the same S).
        first = _by_cell(worker_results(job(
            base + ["--cells", "resume", "--save", str(tmp), "--stop-after", "3"], 600)))
        second = _by_cell(_one_process(framework, backend, *base[4:], "--cells", "resume",
                                       "--simulate", "2", "--load", str(tmp),
                                       "--start-step", "4"))
        resumed = {cell: (ranks, second.get(cell)) for cell, ranks in first.items()}
    return request.param, both, alone, reference, resumed


def _close(a, b):
    return all(math.isclose(x, y, rel_tol=TOL, abs_tol=TOL) or (math.isnan(x) and math.isnan(y))
               for x, y in zip(a, b)) and len(a) == len(b)


def _advance_problem(cell, rows, tau=0.0, skipped=0):
    """tau's advance checked against the micro-batches the schedule says were taken (u = 1
    baseline batch each), independently of the code under test: a skipped step moves nothing;
    a fixed rule's step advances by its own S = n taken (a short step: fewer); AdaScale's by a
    gain in [1, n taken]."""
    for i, (_, after, _, _, skips, taken) in enumerate(rows):
        advance = after - tau
        if skips > skipped:
            ok = advance == 0
        elif cell[3] in ("none", "warmup"):
            ok = math.isclose(advance, taken, rel_tol=1e-12)
        else:
            ok = 1 - 1e-9 <= advance <= taken + 1e-9
        if not ok:
            return f"{cell}: step {i + 1} advanced tau by {advance:g} with {taken} micro-batches"
        tau, skipped = after, skips
    return None


def _same_rows(rows, expected):
    return len(rows) == len(expected) and all(_close(r, e) for r, e in zip(rows, expected))


@requires_horovod
@pytest.mark.timeout(2400)
def test_every_change_of_k_or_s_in_every_framework(matrix):
    name, both, alone, reference, resumed = matrix
    runs, framework = RUNS[name], FRAMEWORKS[name][0]
    assert set(runs["policies"].split(",")) <= set(POLICIES)
    expected = {(framework, loop, change, policy, measured)
                for loop, change, policy, measured in
                itertools.product(runs["loops"].split(","), CHANGES, runs["policies"].split(","),
                                  (True, False))
                if loop != "custom" or not runs["custom"] or change in runs["custom"].split(",")}
    assert set(both) == expected and set(reference) == expected
    assert set(alone) == {cell for cell in expected
                          if runs["alone"] is None or cell[2] in runs["alone"].split(",")}
    assert bool(resumed) == runs["resume"]
    problems, counts = [], {"ok": 0, "refused": 0, "cannot": 0}
    for cell in sorted(expected, key=str):
        ranks, ref = both[cell], reference[cell][0]
        statuses = {r["status"] for r in ranks.values()}
        counts[ranks[0]["status"]] += 1
        if len(statuses) > 1:
            problems.append(f"{cell}: ranks differ: {statuses}")
            continue
        status = statuses.pop()
        if status == "cannot":
            assert ranks[0]["why"] and ranks[1]["why"] == ranks[0]["why"]
            continue
        if status == "refused":
            whys = {r["why"] for r in ranks.values()}
            if len(whys) > 1 or ref["status"] != "refused":
                problems.append(f"{cell}: refused unlike the reference or unlike each other: "
                                f"{whys} / reference {ref.get('why') or ref['status']}")
            elif not any(word in ranks[0]["why"] for word in ("needs", "cannot", "refus", "not")):
                problems.append(f"{cell}: the refusal names no cause: {ranks[0]['why']}")
            continue
        if ref["status"] != "ok":
            problems.append(f"{cell}: ran, the reference {ref['status']}: {ref.get('why')}")
            continue
        zero, one = ranks[0], ranks[1]
        if cell[2] != "join":
            if zero["weights"] != one["weights"] or zero["record"] != one["record"]:
                problems.append(f"{cell}: the ranks' weights or records differ")
            if zero["rows"] != one["rows"]:
                problems.append(f"{cell}: the ranks' steps differ")
        for rows in (zero["rows"], ref["rows"]):
            problem = _advance_problem(cell, rows)
            if problem:
                problems.append(problem)
        if not _same_rows(zero["rows"], ref["rows"]):
            problems.append(f"{cell}: steps (lr factor, tau, S, k, skipped) {zero['rows']} "
                            f"against the reference's {ref['rows']}")
        elif not _close(zero["weights"], ref["weights"]):
            problems.append(f"{cell}: weights differ from the reference's")
    for cell, result in sorted(alone.items(), key=str):
        if result[0]["status"] not in ("ok", "refused", "cannot"):
            problems.append(f"one process {cell}: {result[0]}")
        if result[0]["status"] == "refused" and "Error" not in result[0]["why"]:
            problems.append(f"one process {cell}: {result[0]['why']}")
    for cell, (first, second) in sorted(resumed.items(), key=str):
        ref = reference[cell][0]
        if first[0]["status"] != "ok" or second is None or second[0]["status"] != "ok":
            if ref["status"] == "refused" and first[0]["status"] == "refused":
                continue
            problems.append(f"resume {cell}: {first[0].get('why')} / "
                            f"{second and second[0].get('why')}")
            continue
        rows = first[0]["rows"] + second[0]["rows"]
        problem = _advance_problem(cell, rows)
        if problem:
            problems.append("resume " + problem)
        if not _same_rows(rows, ref["rows"]):
            problems.append(f"resume {cell}: {rows} against the uninterrupted {ref['rows']}")
        elif not _close(second[0]["weights"], ref["weights"]):
            problems.append(f"resume {cell}: weights differ from the uninterrupted run's")
    print(f"{name}: {json.dumps(counts)}")
    assert counts["ok"] > counts["refused"]  # the matrix mostly runs: it can fail
    assert not problems, "\n".join(problems)
