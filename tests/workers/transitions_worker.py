"""Every change of k or S, in every framework (issues #47, #58): the cells of tests/test_transitions.py.

A cell is (loop, change, policy, measured, samples). Each runs a few steps of a small float64
regression, changing k or S the way ``change`` says, and reports its initial weights, per step
(lr factor, tau, S, n = W k, skipped, micro-batches taken), the final weights, optimizer state
and run record, or the refusal it met with what it left (the weights, tau, lr and optimizer
state at that point: the test checks that nothing was applied). The test compares each with an
independent reference (tests/workers/_reference.py). The same script runs under ``horovodrun
-np 2``, in one process, and, for the second half of a resume at another world size, as one
process taking W ranks' micro-batches (``--simulate W``: every micro-batch that the W ranks take
in a step, as its passes). A micro-batch is drawn from (step, its index among the step's W x k
micro-batches), so every run is fed the same ones.

    python transitions_worker.py --framework torch|keras|ddp [--simulate 2] [--save F
        --stop-after 3] [--load F] [--passes-factor 2] [--cells change,...]
        [--workers-cells change,...]
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np

from _report import emit_result

STEPS = 6
LR = 0.05
# The cells' statistics: every pass read (samples="passes"), and, in the cells named by
# --workers-cells, the default at two workers (samples="auto": each rank's sum read once).
SAMPLES = "passes"
# adascale_adam takes its first MIN_ADAM_HISTORY (20) steps at gain 1; in a 6-step cell that
# would leave the gain, sqrt(r), beta^r, eps / sqrt(r), the cap and the preconditioned statistics
# unreached. The cells shorten it (a class constant, set here for this process only;
# tests/workers/_reference.py models the same), and cap the gain at MAX_GAIN: the cells measure
# r ~ 1.05-1.2 at S = 2 (uncapped) and ~1.6-1.7 at S = 4 (capped).
WARM_IN = 2
MAX_GAIN = 1.5
POLICIES = {"none": "none", "warmup": "warmup:baseline_steps=8", "adascale": "adascale",
            "adascale_adam": f"adascale_adam:max_gain={MAX_GAIN}"}
CHANGES = ("steady", "adapt", "set_passes", "checkpoint", "adapt_checkpoint", "short", "join",
           "nonfinite", "resume", "short_below")
# u = S / (W k) of a change where it is not 1: short_below's micro-batches are a quarter of the
# baseline batch (k = 4, scale = W: S = 2 at two workers, 1 at one), so that its leftover step of
# one pass a rank, S = u n = W / 4, is below the baseline batch and must be refused.
UNIT = {"short_below": 0.25}
# Cells that cannot run, and why (reported as such, never left out).
CANNOT = {
    ("keras", "short"): "Keras takes a step every k apply calls: there is no short step (fit "
                        "refuses unequal shards, hvd_scale.adapters.keras.callbacks)",
    ("keras", "short_below"): "Keras takes a step every k apply calls: there is no short step",
    ("keras", "join"): "hvd.join is a torch path (uneven data); Keras's fit refuses unequal "
                       "shards before the first step",
    ("ddp", "join"): "hvd.join is Horovod's; DDP's uneven inputs (torch.distributed's Join "
                     "context) are tests/test_ddp_options.py's",
    ("fsdp", "join"): "hvd.join is Horovod's; FSDP2 has no uneven-inputs context",
    ("fsdp", "resume"): "rank 0's torch.save holds its own shards only: FSDP2 resumes at another "
                        "world size through torch.distributed.checkpoint "
                        "(tests/test_fsdp_checkpoint.py)",
}


def cannot(framework: str, change: str, measured: bool, workers: int,
           samples: str = "passes") -> str | None:
    """Why a cell cannot run (``CANNOT``, and FSDP2's cells that its engine refuses at set-up,
    each tested where it is refused: tests/test_fsdp.py), or None."""
    why = CANNOT.get((framework, change))
    if why is None and framework == "fsdp":
        if not measured:
            why = "measure=False is refused under FSDP2 (the engine always measures)"
        elif change == "short" and workers > 1:
            why = ("ranks taking different numbers of passes in a step: FSDP2 all-gathers the "
                   "parameters in every forward pass, so its own collectives do not pair up "
                   "(plain FSDP2 hangs alike); short_below, where every rank takes one pass, "
                   "runs")
    return why


def k_schedule(change: str, step: int) -> int:
    """k of step ``step`` (1-based) in a cell; the change happens between steps 2 and 3."""
    if change in ("adapt", "adapt_checkpoint"):
        return 2 if step <= 2 else 4
    if change == "set_passes":
        return 2 if step <= 2 or step > 4 else 1
    if change == "short":
        return 2
    if change == "short_below":
        return 4
    return 1


def passes_of(change: str, step: int, rank: int, k: int, workers: int) -> list[int]:
    """The indices, among the step's W x k micro-batches, that rank ``rank`` takes."""
    own = [rank * k + p for p in range(k)]
    if change == "short" and step == 3:
        return own[:k - rank] if workers > 1 else own[:1]  # rank 1 (or the only rank) one short
    if change == "short_below" and step == 3:
        return own[:1]  # a leftover of one pass a rank: S = u W < 1
    if change == "join" and step > 3 and rank == 1:
        return []  # rank 1 has run out of data and joined
    return own


def micro(step: int, index: int, poison: bool = False):
    rng = np.random.default_rng(1000 * step + index)
    x = rng.normal(size=(8, 4))
    y = x @ np.array([[1.0], [-2.0], [0.5], [0.3]]) + 0.1 * rng.normal(size=(8, 1))
    if poison:
        x = x * np.inf
    return x, y


def poisoned(change: str, step: int, index: int, workers: int, k: int) -> bool:
    return change == "nonfinite" and step == 3 and index == workers * k - 1


class Ranks:
    """This process as W workers: its rank(s) and the world's size."""

    def __init__(self, hvd, simulate: int | None):
        self.hvd, self.simulate = hvd, simulate
        self.workers = simulate or hvd.size()
        self.ranks = list(range(simulate)) if simulate else [hvd.rank()]

    def indices(self, change, step):
        k = k_schedule(change, step)
        return [i for r in self.ranks for i in passes_of(change, step, r, k, self.workers)], k


def row(ranks, opt, k, change, step):
    """A step's (lr factor, tau, S, n = W x k, skipped, the micro-batches all ranks took): n,
    since the reference takes W x k; the last from the schedule, not from the optimizer (the
    test checks tau's advance against it)."""
    n = k * (1 if ranks.simulate else ranks.workers)
    per_rank = k_schedule(change, step)
    taken = sum(len(passes_of(change, step, r, per_rank, ranks.workers))
                for r in range(ranks.workers))
    return [float(opt.lr_factor), float(opt.progress), float(opt.scale), int(n),
            int(opt.skipped), taken]


# -- torch -------------------------------------------------------------------------------------

def torch_cell(ranks, change, spec, measured, args, out, engine="horovod", samples=SAMPLES):
    """torch under Horovod, or under torch.distributed (``engine="ddp"``: the model in
    DistributedDataParallel, a rank's passes but its last under ``no_sync()``). ``out``: the
    cell's report, filled as it goes (rows; "initial" weights; "state", what a refusal left)."""
    import contextlib

    import torch

    if engine == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        from hvd_scale.adapters.torch.ddp import DistributedOptimizer, broadcast_state
    elif engine == "fsdp":
        from torch.distributed.fsdp import fully_shard

        from hvd_scale.adapters.torch.fsdp import DistributedOptimizer

        def broadcast_state(wrapped, opt):  # every rank loads its own shards: nothing to send
            pass
    else:
        import horovod.torch as hvd

        from hvd_scale.adapters.torch import DistributedOptimizer, broadcast_state

    mult = ranks.workers if ranks.simulate else args.passes_factor

    def build():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(),
                                    torch.nn.Linear(3, 1)).double()
        wrapped = DistributedDataParallel(model) if engine == "ddp" else model
        if engine == "fsdp":  # the first layer a unit, the rest the root's
            fully_shard(model[0])
            fully_shard(model)
        inner = (torch.optim.Adam(model.parameters(), lr=LR * 0.1) if spec.startswith("adascale_adam")
                 else torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9))
        out.setdefault("initial", weights(model))
        out["state"] = lambda: torch_state(model, inner, None)
        # torch's set_passes needs no adapt where k starts >= 2
        adapt = change in ("adapt", "adapt_checkpoint")
        where = {"model": wrapped} if engine in ("ddp", "fsdp") else \
            {"named_parameters": model.named_parameters()}
        opt = DistributedOptimizer(inner, **where, policy=spec, samples=samples,
                                   backward_passes_per_step=k_schedule(change, 1) * mult,
                                   scale=UNIT[change] * k_schedule(change, 1) * mult
                                   * (1 if ranks.simulate else ranks.workers)
                                   if change in UNIT else None,
                                   measure=measured,
                                   adapt="goodput" if adapt else None,
                                   max_passes=4 * mult if adapt else None,
                                   adapt_every=10 ** 6 if change == "set_passes" else 2)
        out["state"] = lambda: torch_state(model, opt, opt)
        return model, wrapped, opt

    def whole(t):  # FSDP2's parameters and state are DTensors: the whole tensor
        return t.full_tensor() if hasattr(t, "full_tensor") else t

    def weights(model):
        return torch.cat([whole(p).detach().reshape(-1) for p in model.parameters()]).tolist()

    def torch_state(model, holder, opt):
        """What a refusal left: the weights, tau, the groups' lrs, the optimizer's state."""
        params = list(model.parameters())

        def flat(key):
            values = [holder.state.get(p, {}).get(key) for p in params]
            return None if any(v is None for v in values) else \
                torch.cat([whole(v).reshape(-1) for v in values]).tolist()
        return {"weights": weights(model), "tau": float(opt.progress) if opt else 0.0,
                "steps": int(opt.steps) if opt else 0,
                "lrs": [float(g["lr"]) for g in holder.param_groups],
                "buf": flat("exp_avg") or flat("momentum_buffer"), "v": flat("exp_avg_sq")}

    def quiet(i, indices):  # accumulation: every pass of the rank's step but its last
        if engine == "fsdp":  # per-pass samples: a reduce-scatter every pass
            wrapped.set_requires_gradient_sync(i == indices[-1] or samples == "passes")
        return wrapped.no_sync() if engine == "ddp" and i != indices[-1] else contextlib.nullcontext()

    model, wrapped, opt = build()
    rows = out["rows"]
    if args.load:
        path = checkpoint_path(args.load, "custom", spec, measured, "pt", samples)
        if not os.path.exists(path):  # the first job refused: reported, not a crash
            raise RuntimeError(f"no checkpoint to resume from: {path}")
        state = torch.load(path, weights_only=False) if ranks.hvd.rank() == 0 else None
        if state is not None:
            model.load_state_dict(state["model"])
            opt.load_state_dict(state["opt"])
    broadcast_state(wrapped, opt)
    first = args.start_step
    for step in range(first, STEPS + 1):
        indices, k = ranks.indices(change, step)
        if change == "join" and not indices:
            hvd.join()
            return {"rows": rows, "weights": None, "record": None, "joined_after": step - 1}
        opt.zero_grad()
        for i in indices:
            x, y = micro(step, i, poisoned(change, step, i, ranks.workers, k))
            with quiet(i, indices):
                torch.nn.functional.mse_loss(wrapped(torch.from_numpy(x)),
                                             torch.from_numpy(y)).backward()
        opt.step()
        rows.append(row(ranks, opt, opt.backward_passes_per_step, change, step))
        if change == "set_passes" and step in (2, 4):
            opt.set_passes(k_schedule(change, step + 1) * mult)
        if change in ("checkpoint", "adapt_checkpoint") and step == 3:
            saved = {"model": {k_: v.clone() for k_, v in model.state_dict().items()},
                     "opt": opt.state_dict()}
            # A new job (at the k it starts with): rank 0 loads, then broadcast_state gives
            # every rank the whole record, k included (#47 item 2).
            model, wrapped, opt = build()
            if ranks.hvd.rank() == 0 or engine == "fsdp":  # FSDP2: each rank its own shards
                model.load_state_dict(saved["model"])
                opt.load_state_dict(saved["opt"])
            broadcast_state(wrapped, opt)
        if args.save and step == args.stop_after:
            if ranks.hvd.rank() == 0:
                torch.save({"model": model.state_dict(), "opt": opt.state_dict()},
                           checkpoint_path(args.save, "custom", spec, measured, "pt", samples))
            break
    if change == "join" and ranks.hvd.size() > 1:
        hvd.join()
    return {"rows": rows, "weights": weights(model), "record": opt.scaling.state_dict(),
            "final": torch_state(model, opt, opt)}


# -- Keras ---------------------------------------------------------------------------------------

def keras_cell(ranks, loop, change, spec, measured, args, out, samples=SAMPLES):
    import keras

    from hvd_scale.adapters.keras import (BroadcastInitialState, DistributedOptimizer,
                                          ScalingMetrics, broadcast_state)

    keras.config.set_floatx("float64")
    mult = ranks.workers if ranks.simulate else args.passes_factor
    tf_backend = keras.backend.backend() == "tensorflow"

    def build():
        keras.utils.set_random_seed(0)
        # Named, so that a checkpoint's variables are found by path in a rebuilt model.
        model = keras.Sequential([keras.Input((4,)),
                                  keras.layers.Dense(3, activation="tanh", name="hidden"),
                                  keras.layers.Dense(1, name="out")], name="model")
        inner = (keras.optimizers.Adam(LR * 0.1, name="inner") if spec.startswith("adascale_adam")
                 else keras.optimizers.SGD(LR, momentum=0.9, name="inner"))
        out.setdefault("initial", weights_of(model))
        out["state"] = lambda: keras_state(model, inner, None)
        adapt = change in ("adapt", "adapt_checkpoint", "set_passes")  # Keras: k changes only so
        opt = DistributedOptimizer(inner, policy=spec, name="hvd_scale", samples=samples,
                                   backward_passes_per_step=k_schedule(change, 1) * mult,
                                   measure=measured,
                                   adapt="goodput" if adapt else None,
                                   max_passes=4 * mult if adapt else None,
                                   adapt_every=10 ** 6 if change == "set_passes" else 2)
        model.compile(optimizer=opt, loss="mse", jit_compile=False)
        opt.build(model.trainable_variables)
        out["state"] = lambda: keras_state(model, inner, opt)
        return model, opt

    def keras_state(model, inner, opt):
        """What a refusal left: the weights, tau, the lr, the optimizer's state."""
        def flat(variables):
            return None if not variables else np.concatenate(
                [np.asarray(keras.ops.convert_to_numpy(v.value)).reshape(-1)
                 for v in variables]).tolist()
        built = bool(getattr(inner, "built", False))
        momenta = (getattr(inner, "_momentums", None) or getattr(inner, "momentums", None)) \
            if built else None
        return {"weights": weights_of(model), "tau": float(opt.progress) if opt else 0.0,
                "steps": int(opt.steps) if opt else 0,
                "lrs": [float(keras.ops.convert_to_numpy(inner.learning_rate))],
                "buf": flat(momenta), "v": flat(getattr(inner, "_velocities", None))}

    def state_of(model, opt):
        """A checkpoint: every variable by its path (the accumulation variables of another k
        are the new job's own, as with tf.train.Checkpoint's expect_partial)."""
        return {v.path: np.array(keras.ops.convert_to_numpy(v.value), copy=True)
                for v in model.variables + opt.variables}

    def load(model, opt, values):
        for v in model.variables + opt.variables:
            if v.path in values and "accumulat" not in v.path and "micro_steps" not in v.path \
                    and "local_sqnorm" not in v.path:
                v.assign(values[v.path])

    model, opt = build()
    if args.load:
        if ranks.hvd.rank() == 0:
            path = checkpoint_path(args.load, loop, spec, measured, "npy", samples)
            if not os.path.exists(path):  # the first job refused: reported, not a crash
                raise RuntimeError(f"no checkpoint to resume from: {path}")
            load(model, opt, np.load(path, allow_pickle=True).item())
    broadcast_state(model, opt)
    rows = out["rows"]

    def after_step(step):
        """Between steps (both loops): a change by hand, a checkpoint; True: stop."""
        nonlocal model, opt
        if change == "set_passes" and step in (2, 4):
            opt.set_passes(k_schedule(change, step + 1) * mult)
        if change in ("checkpoint", "adapt_checkpoint") and step == 3:
            saved = state_of(model, opt)
            model, opt = build()
            if ranks.hvd.rank() == 0:
                load(model, opt, saved)
            broadcast_state(model, opt)
        if args.save and step == args.stop_after:
            if ranks.hvd.rank() == 0:
                np.save(checkpoint_path(args.save, loop, spec, measured, "npy", samples),
                        state_of(model, opt),
                        allow_pickle=True)
            return True
        return False

    first = args.start_step
    if loop == "custom":
        for step in range(first, STEPS + 1):
            indices, k = ranks.indices(change, step)
            for i in indices:
                x, y = micro(step, i, poisoned(change, step, i, ranks.workers, k))
                opt.apply(grads_of(model, x, y, tf_backend), model.trainable_variables)
            rows.append(row(ranks, opt, opt.backward_passes_per_step, change, step))
            if opt.scaling.adapt is not None:
                opt.adapt_passes()
            if after_step(step):
                break
        return {"rows": rows, "weights": weights_of(model), "record": record_of(opt),
                "final": keras_state(model, opt.inner_optimizer, opt)}

    # fit: the batches of each step in order; a callback records rows and makes the changes.
    class Steps(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.seen, self.stop = opt.steps + opt.skipped, False

        def on_train_batch_end(self, batch, logs=None):
            o = self.model.optimizer
            done = o.steps + o.skipped
            if done > self.seen:
                self.seen = done
                step = first + len(rows)
                rows.append(row(ranks, o, o.backward_passes_per_step, change, step))
                self.stop = after_step(step)
                if self.stop or model is not self.model:
                    self.model.stop_training = True

    step = first
    while step <= STEPS:
        xs, ys = [], []
        for s in range(step, STEPS + 1):
            indices, k = ranks.indices(change, s)
            for i in indices:
                x, y = micro(s, i, poisoned(change, s, i, ranks.workers, k))
                xs.append(x)
                ys.append(y)
        before = len(rows)
        recorder = Steps()
        model.fit(np.concatenate(xs), np.concatenate(ys), batch_size=8, epochs=1, shuffle=False,
                  verbose=0, callbacks=[recorder, BroadcastInitialState(), ScalingMetrics()])
        step = first + len(rows)
        if recorder.stop or len(rows) == before:
            break
    return {"rows": rows, "weights": weights_of(model), "record": record_of(opt),
            "final": keras_state(model, opt.inner_optimizer, opt)}


def grads_of(model, x, y, tf_backend):
    import keras
    if tf_backend:
        import tensorflow as tf
        with tf.GradientTape() as tape:
            loss = keras.losses.mean_squared_error(y, model(x, training=True))
            loss = keras.ops.mean(loss)
        return tape.gradient(loss, model.trainable_variables)
    for v in model.trainable_variables:
        v.value.grad = None
    loss = keras.ops.mean(keras.losses.mean_squared_error(y, model(x, training=True)))
    loss.backward()
    return [v.value.grad.detach().clone() for v in model.trainable_variables]


def weights_of(model):
    return np.concatenate([np.asarray(w).reshape(-1) for w in model.get_weights()]).tolist()


def record_of(opt):
    return opt.scaling.state_dict()


def checkpoint_path(folder, loop, spec, measured, suffix, samples=SAMPLES):
    name = f"{loop}-{spec.replace(':', '_').replace('=', '_')}-{measured}-{samples}"
    return os.path.join(folder, f"{name}.{suffix}")


# -- the cells -------------------------------------------------------------------------------------

class DistributedRanks:
    """torch.distributed with the few calls of Horovod's module this script makes (init, rank,
    size, allgather_object); its group from the environment (torchrun's, or the one-process
    group tests/test_transitions.py sets)."""

    def init(self):
        import torch.distributed as dist

        dist.init_process_group("gloo")
        self._dist = dist

    def rank(self):
        return self._dist.get_rank()

    def size(self):
        return self._dist.get_world_size()

    def allgather_object(self, obj, name=None):
        out = [None] * self.size()
        self._dist.all_gather_object(out, obj)
        return out


def scripted_adapt(mult):
    """adapt="goodput" with a scripted choice (rank 0's; broadcast as usual): k doubles after
    step 2, so that the cells are deterministic (the real choice follows timings)."""
    from hvd_scale.adapters import adapt

    def choose(self, clock, *, sigma2, mu2, scale, passes, workers, max_gain=float("inf")):
        return passes * 2 if passes == 2 * mult else passes
    adapt.Adaptation.choose = choose


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--framework", choices=("torch", "keras", "ddp", "fsdp"), required=True)
    parser.add_argument("--simulate", type=int, default=None)
    parser.add_argument("--cells", default=",".join(CHANGES))
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument("--loops", default=None)
    parser.add_argument("--custom-cells", default=None,
                        help="the changes the custom loop runs (default: --cells)")
    parser.add_argument("--save", default=None)
    parser.add_argument("--stop-after", type=int, default=None)
    parser.add_argument("--load", default=None)
    parser.add_argument("--start-step", type=int, default=1)
    parser.add_argument("--passes-factor", type=int, default=1)
    parser.add_argument("--workers-cells", default="",
                        help="changes also run at the default samples (per worker from W = 2), "
                             "measured, with the AdaScale policies")
    args = parser.parse_args()
    from hvd_scale.policies import AdaScaleAdam
    AdaScaleAdam.MIN_ADAM_HISTORY = WARM_IN
    if args.framework == "torch":
        import horovod.torch as hvd
        loops = ["custom"]
    elif args.framework in ("ddp", "fsdp"):
        hvd = DistributedRanks()  # torchrun's environment, or one process on its own
        loops = ["custom"]
    else:
        from hvd_scale.adapters.keras import hvd
        loops = (args.loops or "fit,custom").split(",")
    hvd.init()
    ranks = Ranks(hvd, args.simulate)
    scripted_adapt(ranks.workers if args.simulate else args.passes_factor)
    for loop in loops:
        changes = args.cells.split(",")
        if loop == "custom" and args.custom_cells:
            changes = [c for c in changes if c in args.custom_cells.split(",")]
        runs = [(change, name, measured, "passes") for change in changes
                for name in args.policies.split(",") for measured in (True, False)]
        runs += [(change, name, True, "workers") for change in changes
                 if change in args.workers_cells.split(",")
                 for name in args.policies.split(",") if name.startswith("adascale")]
        for change, name, measured, samples in runs:
            cell = [args.framework, loop, change, name, measured, samples]
            why = cannot(args.framework, change, measured, ranks.workers, samples)
            if why is None and change == "join" and ranks.workers == 1:
                why = "hvd.join needs 2 workers"
            if why is None and change == "resume" and not (args.save or args.load
                                                           or args.simulate):
                why = "runs as two jobs (tests/test_transitions.py: save, then resume)"
            if why:
                emit_result(rank=hvd.rank(), cell=cell, status="cannot", why=why)
                continue
            report = {"rows": []}
            chosen = SAMPLES if samples == "passes" else "auto"
            try:
                if args.framework in ("torch", "ddp", "fsdp"):
                    out = torch_cell(ranks, change, POLICIES[name], measured, args, report,
                                     engine={"torch": "horovod"}.get(args.framework,
                                                                     args.framework),
                                     samples=chosen)
                else:
                    out = keras_cell(ranks, loop, change, POLICIES[name], measured, args,
                                     report, samples=chosen)
                status = {"status": "ok", "initial": report.get("initial"), **out}
            except (ValueError, RuntimeError, FloatingPointError) as e:
                # What the refusal left, against which the test checks that nothing
                # was applied: the steps before it, the weights, tau, lr, state.
                try:
                    left = report["state"]() if "state" in report else None
                except Exception as failed:  # noqa: BLE001 (reported, the test fails)
                    left = {"error": repr(failed)}
                status = {"status": "refused", "why": f"{type(e).__name__}: {e}",
                          "where": traceback.format_exc(limit=-3),
                          "rows": report["rows"], "initial": report.get("initial"),
                          "left": left}
            # Every rank meets here: a rank that failed alone would show as a hang.
            if hvd.size() > 1:
                hvd.allgather_object(cell, name="transitions.cell")
            emit_result(rank=hvd.rank(), cell=cell, **status)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
