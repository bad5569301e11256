"""The adapter protocol stands alone: a toy numpy framework implements the hooks of
``adapters/protocol.py`` and runs on ``adapters/core`` (``run_step``, ``Scaling``) without torch,
TensorFlow or Horovod; every real adapter implements the same hooks with the same signatures.

The toy is one process playing one worker with k micro-batches a step, on ``LocalReducer``.
"""

from __future__ import annotations

import csv
import math
import re
import subprocess
import sys
import threading

import numpy as np
import pytest

from hvd_scale import GainEstimator
from hvd_scale.adapters.adapt import ADAPT_EVERY, Adaptation
from hvd_scale.adapters.core import Framework, Readout, Request, Scaling, run_step
from hvd_scale.metrics import METRICS
from hvd_scale.reduce import LocalReducer, pack_local

LR = 0.1


def scaling_of(hvd, *, policy=None, passes=1, scale=None, budget=None, measure=None,
               nonfinite="skip", log_dir=None, log_every=None, adapt=None, max_passes=None,
               adapt_every=ADAPT_EVERY, guard=None, **framework) -> Scaling:
    """A ``Scaling`` built as an adapter builds it, from the adapter's flat arguments: the
    user's ``Request``, the adapter's ``Framework`` (``optimizer_name``, ``framework`` (its
    name), ``groups``, ...), the adaptation and the guard built."""
    framework["name"] = framework.pop("framework")
    return Scaling(hvd, Request(policy=policy, passes=passes, scale=scale, budget=budget,
                                measure=measure, nonfinite=nonfinite, log_dir=log_dir,
                                log_every=log_every),
                   Framework(**framework),
                   adaptation=Adaptation(adapt, max_passes, adapt_every, passes, measure),
                   guard=guard)



def account(scaling, statistics, base_lr):
    """The host side of one step (``Scaling.plan``) with one group's lr: its lr factor."""
    user = [[base_lr, math.nan, math.nan, math.nan, math.nan, scaling.run.policy.steps + 1]]
    return float(scaling.plan(statistics, True, user)[0][0])


class OneProcess:
    """A HorovodBinding for a single process."""

    def __init__(self, size: int = 1):
        self._size = size

    def size(self):
        return self._size

    def rank(self):
        return 0

    def allgather_object(self, obj, name=None):
        return [obj]

    def broadcast_object(self, obj, root_rank=0, name=None):
        return obj


class ToyOptimizer(Readout):
    """Least squares in numpy, implementing protocol.FrameworkOptimizer; its run is read as every
    adapter's (``Readout``: ``policy``, ``steps``, ``progress``, ...)."""

    def __init__(self, w, passes, policy="adascale", **kw):
        self.w = np.asarray(w, dtype=np.float64)
        self.scaling = scaling_of(OneProcess(), policy=policy, passes=passes, scale=None, budget=None,
                                  optimizer_name="SGD", framework="toy", base_lrs=[LR], **kw)
        self._sum, self._count, self._grad = 0.0, 0, np.zeros_like(self.w)

    def backward(self, x, y):  # the framework's own: one micro-batch's gradient
        g = x.T @ (x @ self.w - y) / len(y)
        self._sum += float(g @ g)
        self._count += 1
        self._grad += g

    # the toy's statistics
    def local_statistics(self):
        return pack_local([self._sum], self._count)

    def start_statistics(self):
        return LocalReducer().sum(self.local_statistics())

    def mean_sqnorms(self):
        self._mean = self._grad / max(self._count, 1)  # no pass: zeros, as a framework has
        return np.array([self._mean @ self._mean])

    # the hooks of adapters/protocol.py
    def reduced_statistics(self, step):
        return step, np.concatenate([self.start_statistics(), self.mean_sqnorms()]), True, None

    def user_settings(self):
        return [[LR, math.nan, math.nan, math.nan, math.nan, self.scaling.run.policy.steps + 1]]

    def loss_scale(self):
        return None

    def on_host(self, fn, *args):
        return fn(*args)

    def apply_step(self, plan, step):
        (factor, lr, *_), = plan
        if factor:
            self.w = self.w - lr * self._mean
        self._sum, self._count, self._grad = 0.0, 0, np.zeros_like(self.w)
        return factor

    def step(self):
        return run_step(self, None)


def batches(step, k, rng_seed=0):
    rng = np.random.default_rng([rng_seed, step])
    x = rng.normal(size=(k, 8, 3))
    y = x @ np.array([1.0, -2.0, 0.5]) + rng.normal(size=(k, 8))
    return x, y


def test_toy_framework_matches_the_engine_reference(tmp_path):
    k = 4
    opt = ToyOptimizer(np.zeros(3), passes=k, log_dir=str(tmp_path))
    ref_w, ref = np.zeros(3), GainEstimator(scale=k)
    for step in range(6):
        xs, ys = batches(step, k)
        for x, y in zip(xs, ys):
            opt.backward(x, y)
        factor = opt.step()
        grads = [x.T @ (x @ ref_w - y) / len(y) for x, y in zip(xs, ys)]
        mean = np.mean(grads, axis=0)
        gain = ref.update(sum(g @ g for g in grads), mean @ mean, k)
        ref_w = ref_w - LR * gain * mean
        assert factor == pytest.approx(gain, rel=1e-12) and 1.0 <= factor <= k
        assert opt.scaling.metrics()["lr_factor"] == factor
        assert opt.scaling.last_lr == pytest.approx(LR * factor)
    np.testing.assert_allclose(opt.w, ref_w, rtol=1e-12)
    opt.scaling.logger.close()
    with open(tmp_path / "metrics.csv", newline="") as f:
        reader = csv.DictReader(f)
        rows = list(reader)
    assert reader.fieldnames == list(METRICS) and len(rows) == 6
    assert float(rows[-1]["lr"]) == pytest.approx(opt.scaling.last_lr)


@pytest.mark.parametrize("nonfinite", ["skip", "raise"])
def test_nonfinite_statistics_skip_or_raise(nonfinite):
    opt = ToyOptimizer(np.zeros(3), passes=2, nonfinite=nonfinite)
    x, y = batches(0, 2)
    y[0, 0] = math.inf
    for xi, yi in zip(x, y):
        opt.backward(xi, yi)
    if nonfinite == "raise":
        with pytest.raises(FloatingPointError, match="step 1"):
            opt.step()
    else:
        assert opt.step() == 0.0
        assert opt.scaling.run.policy.skipped == 1 and opt.scaling.run.policy.steps == 0
        assert np.all(opt.w == 0)


def test_a_diverged_run_stops_instead_of_skipping_forever():
    from hvd_scale.adapters.core import DIVERGED_AFTER

    opt = ToyOptimizer(np.zeros(3), passes=2)

    def nonfinite_step():
        x, y = batches(0, 2)
        y[0, 0] = math.inf
        for xi, yi in zip(x, y):
            opt.backward(xi, yi)
        return opt.step()

    for _ in range(DIVERGED_AFTER - 2):
        assert nonfinite_step() == 0.0
    x, y = batches(1, 2)  # one finite step resets the count
    for xi, yi in zip(x, y):
        opt.backward(xi, yi)
    assert opt.step() > 0
    for _ in range(DIVERGED_AFTER - 1):
        assert nonfinite_step() == 0.0
    with pytest.raises(FloatingPointError, match=f"{DIVERGED_AFTER} steps in a row had non-finite "
                                                 "gradients and were skipped.*training has diverged"):
        nonfinite_step()
    assert opt.scaling.run.policy.steps == 1


def test_statistics_must_count_workers_times_passes():
    opt = ToyOptimizer(np.zeros(3), passes=2)
    x, y = batches(0, 3)
    for xi, yi in zip(x, y):  # 3 micro-batches where 2 were announced
        opt.backward(xi, yi)
    with pytest.raises(RuntimeError, match="count 3 micro-gradients, expected 1 workers x 2"):
        opt.step()


def test_rank_0_says_what_runs_at_the_start(capsys, tmp_path):
    """#32 item 6: one line on rank 0 with the policy, S and how its factor comes about."""
    ToyOptimizer(np.zeros(3), passes=2)
    err = capsys.readouterr().err
    assert err == ("hvd_scale: policy adascale at S = 2 (1 worker(s) x 2 pass(es)), the gain "
                   "measured each step from 2 micro-gradients; no budget (no progress bar; the "
                   "loop decides when to stop)\n")
    scaling_of(OneProcess(), policy="linear", passes=2, scale=None, budget=100, optimizer_name="SGD",
               framework="toy", base_lrs=[LR], log_dir=str(tmp_path))
    assert capsys.readouterr().err == (f"hvd_scale: policy linear at S = 2 (1 worker(s) x 2 "
                                       f"pass(es)), a fixed factor; budget T = 100 baseline steps; "
                                       f"metrics in {tmp_path}\n")
    # One micro-gradient at S = 1 (#31 item 1): nothing is measured, and the line says so.
    one = scaling_of(OneProcess(), policy="adascale", passes=1, scale=None, budget=None,
                     optimizer_name="SGD", framework="toy", base_lrs=[LR])
    assert not one.measure
    assert "gain 1 (one micro-gradient a step at S = 1: nothing to measure)" in capsys.readouterr().err
    # measure=True asked for them (#47 item 3: so that k or S can change later): taken.
    assert scaling_of(OneProcess(), policy="adascale", passes=1, scale=None, budget=None,
                      optimizer_name="SGD", framework="toy", base_lrs=[LR], measure=True).measure


def test_step_without_backward_says_what_to_call():
    """#32 item 6: step() with no backward pass names the fix."""
    opt = ToyOptimizer(np.zeros(3), passes=2)
    with pytest.raises(RuntimeError, match=r"no gradients.*expected 1 workers x 2.*call "
                                           r"loss.backward\(\).*before step\(\)"):
        opt.step()


@pytest.mark.parametrize("kw, pattern", [
    (dict(passes=True), r"backward_passes_per_step must be an integer >= 1, got True"),
    (dict(passes=0), r"got 0"),
    (dict(passes=2, nonfinite="ignore"), r"nonfinite must be one of \('skip', 'raise'\), got 'ignore'"),
    # one worker x one pass at S = 2: no variance to measure
    (dict(passes=1, scale=2.0), r"needs at least 2 micro-gradients"),
])
def test_bad_set_up_is_refused(kw, pattern):
    kw = {"scale": None, **kw}
    with pytest.raises(ValueError, match=pattern):
        scaling_of(OneProcess(), policy="adascale", budget=None, optimizer_name="SGD",
                   framework="toy", **kw)


def test_base_lr_must_be_positive():
    with pytest.raises(ValueError, match=r"param_groups\[1\] has lr=0"):
        scaling_of(OneProcess(), policy="linear", passes=1, scale=None, budget=None,
                   optimizer_name="SGD", framework="toy", base_lrs=[0.1, 0])


def test_rescale_without_a_scale_keeps_the_ratio_to_the_world_size():
    hvd = OneProcess(2)
    scaling = scaling_of(hvd, policy="linear", passes=2, scale=2.0, budget=None,  # S = 2 x 2 / 2
                         optimizer_name="SGD", framework="toy")
    assert scaling.run.scale == 2.0
    hvd._size = 4
    scaling.rescale()
    assert scaling.run.scale == 4.0  # still workers x k / 2
    scaling.rescale(3.0)
    assert scaling.run.scale == 3.0


def _conformance(result):
    """The protocol checks, alike for every adapter: the hooks' signatures are the protocol's,
    and run_step calls them in its order, once per step."""
    from hvd_scale.adapters.protocol import HOOKS

    assert result["is_protocol"]
    assert result["signatures"] == result["expected"]
    assert result["calls"] == list(HOOKS) * 2
    assert result["steps"] == 2 and result["progress"] > 0 and result["moved"] > 0


@pytest.mark.timeout(300)
@pytest.mark.parametrize("adapter", ["toy", "torch", "torch/ddp", "torch/fsdp", "keras/tensorflow",
                                     "keras/torch"])
def test_every_adapter_implements_the_protocol(adapter):
    """Issue #23, 1: one step driver (core.run_step) for every adapter, one signature per hook."""
    import importlib.util
    import os
    import pathlib

    from hvd_scale.launch.jobs import read_results

    worker = pathlib.Path(__file__).parent / "workers" / "protocol_conformance.py"
    if adapter == "toy":
        spec = importlib.util.spec_from_file_location("protocol_conformance", worker)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        opt = ToyOptimizer(np.zeros(3), passes=2, policy="linear")

        def micro_step(i):
            x, y = batches(i // 2, 2)
            opt.backward(x[i % 2], y[i % 2])
            if i % 2:
                opt.step()

        _conformance(module.check(opt, micro_step, lambda: opt.w.copy()))
        return
    if adapter == "torch/fsdp":  # two processes: FSDP2's reduce-scatter path
        from hvdrun import run_torchrun
        out = run_torchrun([str(worker), adapter], nproc=2, timeout=240)
        _conformance(read_results(out.stdout)[0])
        return
    framework, _, backend = adapter.partition("/")
    if adapter == "torch/ddp":
        framework, backend = adapter, None
    from hvdrun import free_port
    env = {**os.environ, "KERAS_BACKEND": backend or "torch", "OMP_NUM_THREADS": "1",
           "MASTER_PORT": str(free_port())}
    out = subprocess.run([sys.executable, str(worker), framework], capture_output=True, text=True,
                         timeout=240, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    _conformance(read_results(out.stdout)[0])


def test_the_shared_half_imports_no_framework():
    code = ("import sys, hvd_scale.adapters.core, hvd_scale.adapters.protocol; "
            "print(sorted(m for m in ('torch', 'tensorflow', 'keras', 'horovod') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


# -- Issue #22: what every rank must agree on, bounds, divergence, checkpoints ------------------

class ThreadRanks:
    """A HorovodBinding for n ranks played by n threads of one process: ``allgather_object``
    meets at a barrier (each wait times out, so a rank left alone fails instead of hanging)."""

    def __init__(self, n: int):
        self.n = n
        self._barrier = threading.Barrier(n)
        self._slots: list = [None] * n
        self._local = threading.local()

    def size(self):
        return self.n

    def rank(self):
        return self._local.rank

    def allgather_object(self, obj, name=None):
        self._slots[self.rank()] = obj
        self._barrier.wait(timeout=30)
        gathered = list(self._slots)
        self._barrier.wait(timeout=30)  # nobody overwrites a slot before every rank has read
        return gathered

    def broadcast_object(self, obj, root_rank=0, name=None):
        raise AssertionError("not used at set-up")


def build_on_ranks(per_rank: list[dict], binding=ThreadRanks, **common):
    """Scaling(...) on every rank (a thread each) with that rank's keywords: [Scaling or error]."""
    hvd, out = binding(len(per_rank)), [None] * len(per_rank)

    def run(rank):
        hvd._local.rank = rank
        kw = {"policy": "adascale", "passes": 1, "scale": None, "budget": None,
              "optimizer_name": "SGD", "framework": "toy", **common, **per_rank[rank]}
        try:
            out[rank] = scaling_of(hvd, **kw)
        except Exception as e:  # noqa: BLE001 - reported per rank
            out[rank] = e

    threads = [threading.Thread(target=run, args=(r,)) for r in range(len(per_rank))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads), "a rank hung"
    return out


@pytest.mark.parametrize("key, values, named", [
    ("scale", (2.0, 4.0), "scale {0: 2.0, 1: 4.0}"),
    ("budget", (100, 200), "budget {0: 100.0, 1: 200.0}"),
    ("passes", (1, 2), "backward_passes_per_step {0: 1, 1: 2}"),
    ("base_lrs", ([0.1], [0.2]), "lr {0: {'param_groups[0]': 0.1}, 1: {'param_groups[0]': 0.2}}"),
    ("nonfinite", ("skip", "raise"), "nonfinite {0: 'skip', 1: 'raise'}"),
    ("measure", (None, False), "measure {0: True, 1: False}"),
])
def test_ranks_given_different_settings_fail_alike_naming_each_ranks_value(key, values, named):
    """Issue #22, 1: scale=2 on rank 0 and 4 on rank 1 trained with different lr factors (the
    replicas drifting apart), a budget per rank ended in 'Horovod has been shut down'. Now one
    allgather at set-up compares them: the same ValueError on every rank."""
    results = build_on_ranks([{key: v} for v in values])
    for result in results:
        assert isinstance(result, ValueError), result
        assert "the ranks were given different" in str(result) and named in str(result), result
    assert str(results[0]) == str(results[1])
    # The same values everywhere: built, in one allgather.
    same = build_on_ranks([{key: values[0]}, {key: values[0]}])
    assert all(isinstance(r, Scaling) for r in same), same


def test_differing_settings_cost_one_allgather():
    calls = []

    class Counting(ThreadRanks):
        def allgather_object(self, obj, name=None):
            calls.append(name)
            return super().allgather_object(obj, name)

    results = build_on_ranks([{}, {}], binding=Counting, policy="linear", budget=10,
                             base_lrs=[0.1, 0.2])
    assert all(isinstance(r, Scaling) for r in results), results
    assert calls == ["hvd_scale.spec"] * 2  # one allgather on each of the 2 ranks


@pytest.mark.parametrize("budget", [0, -1, math.nan, math.inf])
def test_budget_out_of_bounds_is_refused(budget):
    """Issue #22, 4: budget=0 or negative trained nothing and exited 0; nan never finished."""
    with pytest.raises(ValueError, match=r"budget must be a finite number > 0 .*got"):
        scaling_of(OneProcess(), policy="linear", passes=1, scale=None, budget=budget,
                   optimizer_name="SGD", framework="toy")


@pytest.mark.parametrize("lr", [math.inf, math.nan, -0.1])
def test_base_lr_must_be_finite_and_positive(lr):
    with pytest.raises(ValueError, match=r"param_groups\[0\] has lr=.*finite number > 0"):
        scaling_of(OneProcess(), policy="linear", passes=1, scale=None, budget=None,
                   optimizer_name="SGD", framework="toy", base_lrs=[lr])


@pytest.mark.parametrize("lr", [-0.1, math.nan, math.inf])
def test_an_lr_turned_bad_after_construction_is_refused_before_anything_counts(lr):
    """Issue #22, 4: an lr set negative or nan after construction was applied."""
    opt = ToyOptimizer(np.zeros(3), passes=2)
    xs, ys = batches(0, 2)
    for x, y in zip(xs, ys):
        opt.backward(x, y)
    stats = np.concatenate([opt.start_statistics(), opt.mean_sqnorms()])
    with pytest.raises(ValueError, match=rf"lr is {re.escape(repr(lr))} at step 1: the learning "
                                         r"rate must be a finite number >= 0"):
        account(opt.scaling, stats, lr)
    record = opt.scaling.run.policy
    assert (record.steps, record.skipped, record.progress) == (0, 0, 0.0)
    assert math.isnan(opt.scaling.last_lr)
    # lr 0 (a warm-up starting there) is a step like any other, also under a guard.
    from hvd_scale.guard import SharpnessGuard
    guarded = scaling_of(OneProcess(), policy="adascale", passes=2, scale=None, budget=None,
                         optimizer_name="SGD", framework="toy", guard=SharpnessGuard())
    guarded.guard.update(10.0, 0)
    assert account(guarded, stats, 0.0) >= 1.0 and guarded.last_lr == 0.0


def test_the_divergence_error_says_nothing_was_applied():
    """Issue #22, 5: 100 skips from the first step ended in '... lr nan): training has
    diverged' although no step was taken."""
    from hvd_scale.adapters.core import DIVERGED_AFTER

    scaling = scaling_of(OneProcess(), policy="adascale", passes=2, scale=None, budget=None,
                         optimizer_name="SGD", framework="toy")
    bad = [math.inf, 2.0, 1.0]
    for _ in range(DIVERGED_AFTER - 1):
        assert account(scaling, bad, LR) == 0.0
    with pytest.raises(FloatingPointError) as e:
        account(scaling, bad, LR)
    message = str(e.value)
    assert "nan" not in message and "no step has been applied since the optimizer was built" in message
    assert f"{DIVERGED_AFTER} steps in a row had non-finite gradients" in message


def test_a_checkpoint_with_statistics_for_other_groups_is_refused_by_a_fresh_optimizer():
    """Issue #22, 6: the policy part is checked against this optimizer's groups even before it
    has statistics of its own (a fresh optimizer, the usual resume)."""
    two = scaling_of(OneProcess(), policy="adascale", passes=2, scale=None, budget=None,
                     optimizer_name="SGD", framework="toy", groups=2)
    two.plan([1.0, 2.0, 2.0, 2.0, 0.5, 0.5], True, [[LR] + [math.nan] * 4 + [1.0]] * 2)
    fresh = scaling_of(OneProcess(), policy="adascale", passes=2, scale=None, budget=None,
                       optimizer_name="SGD", framework="toy", groups=1)
    before = fresh.state_dict()
    with pytest.raises(ValueError, match=r"statistics for 2 parameter group\(s\), this optimizer has 1"):
        fresh.restored(two.state_dict())
    assert fresh.state_dict() == before


@pytest.mark.parametrize("scale, passes, noise", [(1.0, 2, 1e-6), (4.0, 2, 1e-6)])
def test_adapt_never_takes_k_below_the_start(scale, passes, noise):
    """#30 item 1: one worker, k = 2 with scale=1 (the baseline batch is two micro-batches) went to
    k = 1 (S = 0.5) and the next step raised after the update was applied; with scale=4 it went to
    k = 1 (S = 2 from one micro-gradient) and raised 'no variance estimate'. Low noise predicts
    the most goodput at k = 1; the job keeps k = 2 and keeps stepping."""
    scaling = scaling_of(OneProcess(), policy="adascale", passes=passes, scale=scale, budget=None,
                         optimizer_name="SGD", framework="toy", base_lrs=[LR], adapt="goodput",
                         max_passes=4, adapt_every=10)
    # Two micro-gradients that differ by a little: mean |g_i|^2 = 1 + noise, |g_bar|^2 = 1.
    stats = [2.0 * (1.0 + noise), 2.0, 2.0, 1.0]
    # Rank 0's step times at k = 2: 10 ms a pass, no allreduce (one worker), 2 ms of update.
    scaling.clock.history.extend([(1, passes, 0.02, 0.0, 0.002, 0.01)] * 20)
    for step in range(1, 31):
        account(scaling, stats, LR)
        k = scaling.adapted_passes()
        assert k == passes, (step, k)
        scaling.set_passes(k)
    assert scaling.run.scale == scale and scaling.run.policy.steps == 30


def test_a_resize_below_the_baseline_batch_is_refused_naming_the_cause():
    """A job whose baseline batch is two workers' micro-batches (scale=1 at 2 workers) cannot
    shrink to one worker (S = 0.5): refused before anything is applied or counted, saying why."""
    hvd = OneProcess(size=2)
    scaling = scaling_of(hvd, policy="linear", passes=1, scale=1.0, budget=None,
                         optimizer_name="SGD", framework="toy", base_lrs=[LR], elastic=True)
    account(scaling, None, LR)
    hvd._size = 1
    with pytest.raises(ValueError, match=r"from 2 to 1 worker.*S from 1 to 0\.5.*at least 2 workers"):
        account(scaling, None, LR)
    assert scaling.run.policy.steps == 1 and scaling.run.scale == 1.0
