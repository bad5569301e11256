"""Every change of k or S, in every framework, as a matrix (issues #47, #58).

The bugs this matrix is for lived where two features meet, each passing its own tests. One
harness (tests/workers/transitions_worker.py) runs the cells

    {torch (Horovod), torch (DDP, torchrun), torch (FSDP2, torchrun), Keras on TensorFlow,
     Keras on torch}
    x {fit, a custom loop (where both exist)}
    x {steady, adapt changing k, set_passes by hand, a checkpoint saved and resumed through
       broadcast_state (with k fixed, and with k adapted before it: rank 0 loads k = 4, the
       others start at 2), a resume at another world size, a short step, a short step below
       the baseline batch (short_below: k = 4 at u = S / (W k) = 1/4, one pass a rank left
       over, S = u n < 1: refused), hvd.join, a non-finite step on one rank}
    x {none, warmup, adascale, adascale_adam}
    x {measured, unmeasured (measure=False)}, every pass read (samples="passes")
    + {adapt, short, join, checkpoint, resume} x {adascale, adascale_adam} measured at the
      default samples (from two workers on: each worker's sum read once, samples="workers")

under ``horovodrun -np 2`` (torchrun for DDP) and in one process at W = 1 (``RUNS``: within CI's
time, Keras on torch runs fit only, Keras's custom loop the changes whose code is its own, Keras
none for warmup too, and the one-process cells and the resume at another world size a subset
where Keras's paths are the same). adascale_adam's warm-in is cut to 2 steps in the cells
(``transitions_worker.WARM_IN``) and its cap to max_gain=1.5, so that its gain, sqrt(r), beta^r,
eps / sqrt(r), the cap and the preconditioned statistics are all reached within 6 steps.

Every cell is compared with an independent reference (tests/workers/_reference.py,
``CellModel``): numpy recomputing, from the micro-batches each rank took and the formulas in the
docs, without calling hvd_scale, the gradients, the statistics (per pass, or per worker), the
estimator's sigma2 / mu2 and the gain, each step's lr factor and tau (a fixed rule's S, a short
step's own S, AdaScale's r), SGD's momentum (torch's or Keras's form) or Adam's moments at
beta^r and its bias correction by tau, and which layouts must be refused. A cell that runs must
match it step by step (lr factor, tau, S, n = W k, skips) and in its final weights and optimizer
state, every rank alike. A cell the reference refuses must be refused on every rank, after the
same steps, with a message naming the bad S and its cause, and with nothing applied: every
rank's weights, tau, lr and optimizer state those of the reference before the refusal.

Cells that cannot run say why in the harness (``CANNOT``), never by absence. The elastic cells,
a shrink 2 -> 1 and a grow 1 -> 2 (torch under Horovod elastic, adascale, k = 2, the default
samples), run in tests/test_elastic.py (``test_a_job_that_shrinks_to_one_worker_keeps_measuring``:
horovodrun's elastic mode needs its host-discovery script): every rank reports each step's
micro-gradients and the job's row, and ``_reference.replay_elastic`` replays them through
``CellModel`` at each step's world size (per worker at W = 2, per pass at W = 1, S = W k
following W); every step's lr factor, tau, S and n must match it.

What each kind of cell catches, shown by breaking the code on purpose once per kind (on a copy
of the tree, /tmp/sabotage, run with its own hvd_scale on PYTHONPATH; never in the shared tree).
The cells that failed, of one framework's matrix (np 2, one process, resume):

    apply       policies.AdaScaleAdam.rule_factor: sqrt(r) dropped (lr x r)            [torch/ddp]
                16 cells: every measured adascale_adam cell whose gain passed 1 (steady,
                adapt, adapt_checkpoint, set_passes, checkpoint, short, nonfinite, resume;
                per pass and per worker; np 2 and one process)
    adapt       run.relayout: S kept when k changes (u not kept)                       [torch/ddp]
                30 cells: every adapt, adapt_checkpoint and set_passes cell that runs, np 2
                and one process, per pass and per worker
    short       run.host_step: a short step at the full S, not u n                    [torch/ddp]
                13 cells: the short cells of every policy (per pass and per worker, np 2; and
                one process but adascale_adam, whose one-pass step there is S = 1 either way)
    join        torch statistics: a joined rank's zeros averaged in (n not counted)    [torch]
                8 cells: every join cell that runs (none and warmup measured or not; adascale
                and adascale_adam per pass and per worker)
    checkpoint  core.Scaling.broadcast: the other ranks drop the root's estimates      [torch]
                10 cells: every measured checkpoint and adapt_checkpoint cell (the ranks'
                records differ; AdaScale's gains and weights too). Taking the root's record
                on the root only crashes the np 2 job instead (rank 1 keeps k = 2 in
                adapt_checkpoint: Horovod's accumulation asserts), which fails the test too
    resume      run.restored: the estimates dropped when the layout moved              [torch/ddp]
                8 cells: the resume at another world size (adascale, adascale_adam, per pass
                and per worker) and adapt_checkpoint (its saved k = 4 taken at k = 2)
    refused     run.check_layout: the measure=False refusal removed                    [torch/ddp]
                16 cells: every unmeasured adascale and adascale_adam cell that the layout
                table refuses (np 2, one process, resume): refused later, by the policy's
                step, with a message that no longer names S nor measure=True
    short_below run.host_step: the refusal of a short step at u n < 1 removed         [torch]
                14 cells: every short_below cell but the two refused at set-up (adascale and
                adascale_adam unmeasured at np 2, S = 2): ran, the reference refuses
    elastic     run.reads: always "passes" (W = 2 reads every pass, not each worker's sum)
                both elastic cells (tests/test_elastic.py): the shrink 2 -> 1 from step 1
                (45 steps' gain and tau off the reference's), the grow 1 -> 2 from step 8,
                its first at W = 2 (31 steps). Always "workers" instead: both jobs refuse at
                their first step at W = 1 ("statistics hold one sample"), which fails them too
"""

from __future__ import annotations

import itertools
import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest

from hvdrun import (WORKERS_DIR, free_port, requires_horovod, run_horovod, run_torchrun,
                    worker_results)

sys.path.insert(0, str(WORKERS_DIR))
import _reference  # noqa: E402  (tests/workers: the independent reference)
import transitions_worker as harness  # noqa: E402  (the cells' schedule and micro-batches)

WORKER = WORKERS_DIR / "transitions_worker.py"
FRAMEWORKS = {"torch": ("torch", None), "torch/ddp": ("ddp", None), "torch/fsdp": ("fsdp", None),
              "keras/tensorflow": ("keras", "tensorflow"), "keras/torch": ("keras", "torch")}
# What each framework runs, within CI's time (a Keras cell costs ~2 s, its model traced anew):
# the loops; the one-process (np 1) cells; whether the resume at another world size runs (Keras's
# record travels the same on both backends); the policies (Keras's traced step takes every fixed
# rule's factor from the host alike: none stands for warmup there, whose ramp is the engine's,
# tested with torch and in tests/test_policies.py); the changes also run at the default samples.
RUNS = {"torch": {"loops": "custom", "alone": None, "resume": True, "custom": None,
                  "policies": "none,warmup,adascale,adascale_adam",
                  "workers": "adapt,short,join,checkpoint,resume"},
        # torch under torchrun (DDP): the torch cells, a rank's passes but its last under no_sync.
        "torch/ddp": {"loops": "custom", "alone": None, "resume": True, "custom": None,
                      "policies": "none,warmup,adascale,adascale_adam",
                      "workers": "adapt,short,checkpoint,resume"},
        # torch under torchrun with FSDP2 (fully_shard): the policies its engine measures (it
        # refuses adascale_adam and measure=False); one process is a mesh of one. Its resume at
        # another world size goes through DCP (tests/test_fsdp_checkpoint.py).
        "torch/fsdp": {"loops": "custom", "alone": None, "resume": False, "custom": None,
                       "policies": "none,warmup,adascale",
                       "workers": "adapt,checkpoint"},
        # The custom loop's own paths: eager apply calls, adapt_passes by hand, a checkpoint of
        # an adapted k, a non-finite step outside fit; the rest are fit's code.
        "keras/tensorflow": {"loops": "fit,custom", "alone": "steady,set_passes,adapt",
                             "resume": True,
                             "custom": "steady,adapt,adapt_checkpoint,nonfinite",
                             "policies": "none,adascale,adascale_adam",
                             "workers": "adapt,checkpoint,resume"},
        "keras/torch": {"loops": "fit", "alone": "steady,set_passes,adapt", "resume": False,
                        "custom": None, "policies": "none,adascale,adascale_adam",
                        "workers": "adapt,checkpoint"}}
POLICIES = ("none", "warmup", "adascale", "adascale_adam")
CHANGES = harness.CHANGES
# Relative tolerances against the reference: torch computes in float64 throughout; Keras holds
# its optimizer's lr, momentum and betas as float32 (0.05 and 0.9 rounded: ~1e-7 a step, 4e-7
# after 6; on TensorFlow 1 - beta2 = 1 - float32(0.999) is 1.3e-5 off, which Adam's v carries:
# V_TOLS), far below what a wrong S, gain or beta moves (>= 1e-3 in the sabotages below).
TOL = 1e-7
TOLS = {"keras": 1e-5}
V_TOLS = {"keras": 1e-4}


def _env(backend):
    env = {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "TF_CPP_MIN_LOG_LEVEL": "2",
           "CUDA_VISIBLE_DEVICES": ""}
    if backend:
        env["KERAS_BACKEND"] = backend
    return env


def _one_process(framework, backend, *extra, timeout=600):
    """The worker in one process (no horovodrun): its RESULT lines."""
    from hvd_scale.launch.jobs import read_results
    group = {} if framework not in ("ddp", "fsdp") else {  # torch.distributed: a group of one process
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
    def job(args, timeout):  # two workers: Horovod's, or torchrun's for DDP and FSDP2
        if framework in ("ddp", "fsdp"):
            return run_torchrun(args[1:], nproc=2, timeout=timeout, env=_env(backend))
        return run_horovod(args, np=2, timeout=timeout, env=_env(backend))

    both = _by_cell(worker_results(job(base + ["--workers-cells", runs["workers"]], 900)))
    alone = _by_cell(_one_process(framework, backend, *base[4:],
                                  *(["--cells", runs["alone"]] if runs["alone"] else [])))
    resumed = {}
    if runs["resume"]:
        # A resume at another world size: saved by an np 2 job after step 3, resumed by one
        # process taking both ranks' micro-batches (k doubled: the same S).
        first = _by_cell(worker_results(job(
            base + ["--cells", "resume", "--workers-cells", "resume", "--save", str(tmp),
                    "--stop-after", "3"], 600)))
        second = _by_cell(_one_process(framework, backend, *base[4:], "--cells", "resume",
                                       "--workers-cells", "resume", "--simulate", "2",
                                       "--load", str(tmp), "--start-step", "4"))
        resumed = {cell: (ranks, second.get(cell)) for cell, ranks in first.items()}
    return request.param, both, alone, resumed


# -- the reference ------------------------------------------------------------------------------

def reference(cell, initial, workers, resumed=False):
    """What the cell must do, by ``_reference.CellModel``: ("ok", rows, model) or ("refused",
    rows, model, refusal). ``workers``: W of the job; ``resumed``: steps from 4 on in one process
    taking both ranks' micro-batches (W = 1, k doubled)."""
    framework, _, change, policy, measured, samples = cell
    layout = "keras" if framework == "keras" else "torch"
    adam = policy == "adascale_adam"
    model = _reference.CellModel(
        _reference.to_params(initial, layout), policy=policy, measured=measured,
        convention=layout, lr=harness.LR * (0.1 if adam else 1.0),
        eps=1e-7 if layout == "keras" else 1e-8, span=8.0, warm_in=harness.WARM_IN,
        max_gain=harness.MAX_GAIN, unit=harness.UNIT.get(change, 1.0),
        adapt=change in ("adapt", "adapt_checkpoint") or (framework == "keras" and
                                                           change == "set_passes"))
    rows = []
    try:
        for step in range(1, harness.STEPS + 1):
            k = harness.k_schedule(change, step)
            ranks = [harness.passes_of(change, step, r, k, workers) for r in range(workers)]
            poison = {i for i in range(workers * k) if harness.poisoned(change, step, i, workers, k)}
            if resumed and step > 3:  # one process: both ranks' passes as its own, W = 1
                ranks, layout_w, layout_k = [[i for r in ranks for i in r]], 1, k * workers
            else:
                layout_w, layout_k = workers, k
            model.relayout(layout_w, layout_k, applied=step - 1)
            batches = [[harness.micro(step, i, i in poison) for i in r] for r in ranks]
            rows.append(model.step(batches, samples if layout_w >= 2 else "passes"))
    except _reference.Refusal as refusal:
        return "refused", rows, model, refusal
    return "ok", rows, model, None


def _close(a, b, tol=TOL):
    a = [] if a is None else list(np.asarray(a, dtype=np.float64).ravel())
    b = [] if b is None else list(np.asarray(b, dtype=np.float64).ravel())
    return len(a) == len(b) and all(
        math.isclose(x, y, rel_tol=tol, abs_tol=1e-9) or (math.isnan(x) and math.isnan(y))
        for x, y in zip(a, b))


def _state_problem(got, model, layout, lr, tol=TOL, v_tol=TOL):
    """Where ``got`` (a worker's weights, tau, lr and optimizer state) is not ``model``'s."""
    if not got or "error" in got:
        return f"no state reported: {got}"
    flat = lambda tensors: _reference.to_flat(tensors, layout)  # noqa: E731
    zeros = np.zeros_like(flat(model.params))
    if not _close(got["weights"], flat(model.params), tol):
        return "weights differ from the reference's"
    if not math.isclose(got["tau"], model.tau, rel_tol=tol, abs_tol=1e-12):
        return f"tau {got['tau']} against the reference's {model.tau}"
    if any(not math.isclose(x, lr, rel_tol=max(tol, 1e-12)) for x in got["lrs"]):
        return f"the lr left is {got['lrs']}, the user's is {lr}"
    for key, expected in (("buf", model.buf), ("v", model.v if model.adam else None)):
        if expected is None:
            continue
        value = got[key] if got[key] is not None else zeros  # not built yet: zeros
        if not _close(value, flat(expected), tol if key == "buf" else v_tol):
            return f"the optimizer's {'momentum' if key == 'buf' else 'v'} differs from the reference's"
    return None


def _rows_problem(rows, expected, tol=TOL):
    """Each step's (lr factor, tau, S, n, skipped) against the reference's; S and n as the
    layout of that step or, where adapt changed k inside the step (torch's step, fit), of the
    next: the factor and tau show which S the step took."""
    got = [r[:5] for r in rows]
    after = expected[1:] + expected[-1:]
    if len(got) != len(expected) or not all(
            _close(r, e, tol) or _close(r, e[:2] + a[2:4] + e[4:], tol)
            for r, e, a in zip(got, expected, after)):
        return f"steps (lr factor, tau, S, n, skipped) {got} against the reference's {expected}"
    return None


def check_cell(cell, ranks, workers, resumed_second=None):
    """The problems of one cell (``ranks``: rank -> its result; ``resumed_second``: the
    one-process second half of a resume)."""
    statuses = {r["status"] for r in ranks.values()}
    if len(statuses) > 1:
        return [f"ranks differ: {statuses}"]
    status = statuses.pop()
    zero = ranks[0]
    if status == "cannot":
        framework, change = cell[0], cell[2]
        allowed = harness.cannot(framework, change, cell[4], workers, cell[5]) is not None \
            or (change == "join" and workers == 1) or change == "resume"
        same = len({r["why"] for r in ranks.values()}) == 1
        return [] if allowed and same and zero["why"] else [f"cannot: {zero.get('why')}"]
    layout = "keras" if cell[0] == "keras" else "torch"
    tol, v_tol = TOLS.get(cell[0], TOL), V_TOLS.get(cell[0], TOL)
    outcome, expected, model, refusal = reference(cell, zero["initial"], workers,
                                                  resumed=resumed_second is not None)
    rows = [row[:5] for row in zero["rows"]]
    if resumed_second is not None and status == "ok":
        second = resumed_second[0]
        if second["status"] != outcome or second["status"] == "cannot":
            return [f"resumed: {second['status']} ({second.get('why')}), the reference {outcome}"]
        zero = second
        rows = rows + [row[:5] for row in second["rows"]]
    lr = harness.LR * (0.1 if cell[3] == "adascale_adam" else 1.0)
    problems = []
    if outcome == "refused":
        if zero["status"] != "refused":
            return [f"ran ({zero['status']}), the reference refuses after {refusal.applied} "
                    f"step(s): {refusal.why}"]
        for rank, result in sorted(ranks.items()) if resumed_second is None else [(0, zero)]:
            why = result["why"]
            # The message names the bad value and what to do.
            missing = [name for name in refusal.names if name not in why]
            if missing:
                problems.append(f"rank {rank}: the refusal ({refusal.why}) does not name "
                                f"{missing}: {why}")
            problem = _rows_problem(rows if rank == 0 else
                                    [row[:5] for row in result["rows"]], expected, tol)
            if problem:
                problems.append(f"rank {rank}: before the refusal: {problem}")
            problem = _state_problem(result["left"], model, layout, lr, tol, v_tol)
            if problem:
                problems.append(f"rank {rank}: the refusal applied something: {problem}")
        return problems
    if zero["status"] != "ok":
        return [f"{zero['status']}: {zero.get('why')} (the reference runs)"]
    if cell[2] != "join" and resumed_second is None:
        one = ranks[1] if len(ranks) > 1 else ranks[0]
        if zero["weights"] != one["weights"] or zero["record"] != one["record"] \
                or zero["rows"] != one["rows"]:
            problems.append("the ranks' weights, records or steps differ")
    problem = _rows_problem(rows, expected, tol)
    if problem:
        problems.append(problem)
    problem = _state_problem(zero["final"], model, layout, lr, tol, v_tol)
    if problem:
        problems.append(problem)
    return problems


@requires_horovod
@pytest.mark.timeout(2400)
def test_every_change_of_k_or_s_in_every_framework(matrix):
    name, both, alone, resumed = matrix
    runs, framework = RUNS[name], FRAMEWORKS[name][0]
    assert set(runs["policies"].split(",")) <= set(POLICIES)

    def cells(changes, workers_changes):
        return {(framework, loop, change, policy, measured, "passes")
                for loop, change, policy, measured in
                itertools.product(runs["loops"].split(","), changes,
                                  runs["policies"].split(","), (True, False))
                if loop != "custom" or not runs["custom"] or change in runs["custom"].split(",")
                } | {(framework, loop, change, policy, True, "workers")
                     for loop, change, policy in
                     itertools.product(runs["loops"].split(","), workers_changes,
                                       runs["policies"].split(","))
                     if policy.startswith("adascale") and
                     (loop != "custom" or not runs["custom"] or change in runs["custom"].split(","))}

    expected = cells(CHANGES, runs["workers"].split(","))
    assert set(both) == expected
    assert set(alone) == cells(CHANGES if runs["alone"] is None else runs["alone"].split(","), ())
    assert bool(resumed) == runs["resume"]
    problems, counts = [], {"ok": 0, "refused": 0, "cannot": 0}
    for cell in sorted(expected, key=str):
        counts[both[cell][0]["status"]] += 1
        problems += [f"{cell}: {p}" for p in check_cell(cell, both[cell], workers=2)]
    for cell, result in sorted(alone.items(), key=str):
        problems += [f"one process {cell}: {p}" for p in check_cell(cell, result, workers=1)]
    for cell, (first, second) in sorted(resumed.items(), key=str):
        if first[0]["status"] == "cannot":
            continue
        if second is None:
            problems.append(f"resume {cell}: no resumed result")
            continue
        problems += [f"resume {cell}: {p}" for p in check_cell(cell, first, workers=2,
                                                                 resumed_second=second)]
    print(f"{name}: {json.dumps(counts)}")
    assert counts["ok"] > counts["refused"]  # the matrix mostly runs
    assert not problems, f"{len(problems)} problem(s):\n" + "\n".join(problems)
