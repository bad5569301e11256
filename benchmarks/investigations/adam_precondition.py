"""adascale_adam's preconditioned statistics on a Keras CNN with Adam (issue #50 item 4).

    .venv/bin/python benchmarks/investigations/adam_precondition.py replay            # one process, ~1 min
    .venv/bin/python benchmarks/investigations/adam_precondition.py job               # horovodrun -np 2, ~2 min

``replay``: plain Keras Adam (lr 1e-3, eps 1e-7, the defaults) trains a small CNN on MNIST-1D
(generated locally) in one process with n = S = 2 micro-batches of 32 a step, as two workers
would; before each update the step's statistics (s = sum_j |P g_j|^2, q = |P g_bar|^2) are taken
with several preconditioners P and smoothed as adascale_adam smooths them (theta = 0.999^S, from
step MIN_ADAM_HISTORY on), so their sigma2, mu2 and gain compare on the same gradients:

    prev      g / (sqrt(v_{t-1} / c2) + eps)         the adapters' (v before this step's update)
    prev_raw  g sqrt(c2) / (sqrt(v_{t-1}) + eps)     Keras's own eps placement, v before the update
    current   g sqrt(c2') / (sqrt(v_t) + eps)         v_t = b2 v_{t-1} + (1 - b2) g_bar^2: the v
                                                      Adam divides this step's update by
    floored   the adapters' after the fix (``hvd_scale.adapters.core.precondition``)

and per step the share of the prev statistic's sigma2 carried by coordinates whose v_hat is
below (100 eps)^2, and by its single largest coordinate. ``job``: the same model under
``horovodrun -np 2 --gloo`` with the Keras adapter (adascale_adam, log_dir=), the metrics CSV read
back. Results: benchmarks/results/adam_precondition.md.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import pathlib
import subprocess
import sys
import tempfile

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples"))

BATCH, LR, EPS = 32, 1e-3, 1e-7
MIN_HISTORY = 20  # hvd_scale.policies.AdaScaleAdam.MIN_ADAM_HISTORY


def make_model(keras, length):
    """A new user's CNN: convolutions with ReLU and max-pooling, a hidden Dense layer."""
    return keras.Sequential([
        keras.Input((length, 1)),
        keras.layers.Conv1D(32, 5, padding="same", activation="relu"),
        keras.layers.MaxPooling1D(2),
        keras.layers.Conv1D(64, 3, padding="same", activation="relu"),
        keras.layers.MaxPooling1D(2),
        keras.layers.Flatten(),
        keras.layers.Dense(128, activation="relu"),
        keras.layers.Dense(10),
    ])


class Smoothed:
    """adascale_adam's EMA of the per-step (sigma2_hat, mu2_hat) and the gain at S."""

    def __init__(self, scale):
        from hvd_scale.estimate import GainEstimator
        self.est = GainEstimator(scale)
        self.scale = scale

    def update(self, s, q, n):
        self.est.update(s, q, n)

    def read(self):
        from hvd_scale.estimate import estimated_gain, smoothed, summed_moments
        state = self.est.state if hasattr(self.est, "state") else self.est._state
        if state.sigma2_biased is None:
            return float("nan"), float("nan"), 1.0
        sigma2, mu2 = summed_moments(*smoothed(state))
        return sigma2, mu2, estimated_gain(state, self.scale, self.est.smoothing)


def replay(args) -> list[dict]:
    import keras
    import numpy as np
    import tensorflow as tf

    import mnist1d_data
    from hvd_scale.adapters.core import precondition
    from hvd_scale.estimate import estimate_moments

    keras.utils.set_random_seed(args.seed)
    data = mnist1d_data.load(args.samples)
    x, y = data["x"][:, :, None], data["y"]
    model = make_model(keras, x.shape[1])
    opt = keras.optimizers.Adam(LR, epsilon=EPS)
    opt.build(model.trainable_variables)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    names = [v.path for v in model.trainable_variables]

    @tf.function
    def grads_of(xb, yb):
        with tf.GradientTape() as tape:
            loss = loss_fn(yb, model(xb, training=True))
        return loss, tape.gradient(loss, model.trainable_variables)

    n = scale = args.n
    b2 = opt.beta_2
    variants = ("prev", "prev_raw", "current", "floored")
    ema = {k: Smoothed(scale) for k in variants}
    rng = np.random.default_rng(args.seed)
    rows = []
    order = rng.permutation(len(x))
    pos = 0
    for step in range(1, args.steps + 1):
        micro = []
        losses = []
        for _ in range(n):
            if pos + BATCH > len(order):
                order, pos = rng.permutation(len(x)), 0
            idx = order[pos:pos + BATCH]
            pos += BATCH
            loss, g = grads_of(x[idx], y[idx])
            micro.append([gi.numpy().astype(np.float64) for gi in g])
            losses.append(float(loss))
        mean = [sum(gs) / n for gs in zip(*micro)]
        t = int(opt.iterations.numpy())  # updates so far: v is v_t after t of them
        v_prev = [opt._velocities[opt._get_variable_index(var)].numpy().astype(np.float64)
                  for var in model.trainable_variables]
        row = {"step": step, "loss": float(np.mean(losses))}
        if t > 0:
            c2 = 1 - b2 ** t
            c2_next = 1 - b2 ** (t + 1)
            v_cur = [b2 * v + (1 - b2) * g ** 2 for v, g in zip(v_prev, mean)]
            pre = {
                "prev": lambda g, i: g / (np.sqrt(v_prev[i] / c2) + EPS),
                "prev_raw": lambda g, i: g * np.sqrt(c2) / (np.sqrt(v_prev[i]) + EPS),
                "current": lambda g, i: g * np.sqrt(c2_next) / (np.sqrt(v_cur[i]) + EPS),
                "floored": lambda g, i: precondition(g, v_prev[i], c2, EPS, np.sqrt, beta2=b2,
                                                      mean=np.mean, maximum=np.maximum),
            }
            for name, p in pre.items():
                xs = [[p(g, i) for i, g in enumerate(gs)] for gs in micro]
                xbar = [p(g, i) for i, g in enumerate(mean)]
                s = sum(float(np.sum(a ** 2)) for gs in xs for a in gs)
                q = sum(float(np.sum(a ** 2)) for a in xbar)
                sig, mu = estimate_moments(s, q, n, scale)
                row[f"{name}_sigma2_step"], row[f"{name}_mu2_step"] = float(sig[0]), float(mu[0])
                if t >= MIN_HISTORY:
                    ema[name].update(s, q, n)
                row[f"{name}_sigma2"], row[f"{name}_mu2"], row[f"{name}_gain"] = ema[name].read()
                if name == "prev":
                    # Per-coordinate share of sigma2_hat = S (m - q) / (n - 1), m = s / n.
                    contrib = [scale * (sum(gs[i] ** 2 for gs in xs) / n - xbar[i] ** 2) / (n - 1)
                               for i in range(len(xbar))]
                    tiny = [(v / c2) < (100 * EPS) ** 2 for v in v_prev]
                    total = sum(float(np.sum(c)) for c in contrib)
                    row["tiny_share"] = sum(float(np.sum(c[m])) for c, m in zip(contrib, tiny)) / total
                    row["tiny_coords"] = int(sum(int(np.sum(m)) for m in tiny))
                    row["zero_v_coords"] = int(sum(int(np.sum(v == 0)) for v in v_prev))
                    flat = np.concatenate([c.ravel() for c in contrib])
                    top = int(np.argmax(flat))
                    row["top_share"] = float(flat[top]) / total
                    sizes = np.cumsum([c.size for c in contrib])
                    var = int(np.searchsorted(sizes, top, side="right"))
                    local = top - (sizes[var - 1] if var else 0)
                    row["top_var"] = names[var]
                    row["top_vhat"] = float(v_prev[var].ravel()[local] / c2)
                    row["top_g"] = [float(gs[var].ravel()[local]) for gs in micro]
                    row["d"] = int(flat.size)
        opt.apply([tf.convert_to_tensor(g, tf.float32) for g in mean], model.trainable_variables)
        rows.append(row)
    return rows


def summarize_replay(rows, every) -> str:
    out = []
    head = ("step", "loss", "prev sigma2", "prev mu2", "prev gain", "prev_raw gain",
            "current sigma2", "current mu2", "current gain", "floored sigma2", "floored gain",
            "step sigma2_hat prev", "share v_hat<(100eps)^2", "top coord share", "top coord v_hat, g")
    out.append("| " + " | ".join(head) + " |")
    out.append("|" + "---|" * len(head))
    for r in rows:
        if "prev_sigma2" not in r or not (r["step"] % every == 0 or r["step"] in args_jumps(rows)):
            continue
        out.append("| " + " | ".join([
            str(r["step"]), f"{r['loss']:.3f}", f"{r['prev_sigma2']:.3g}", f"{r['prev_mu2']:.3g}",
            f"{r['prev_gain']:.3f}", f"{r['prev_raw_gain']:.3f}", f"{r['current_sigma2']:.3g}",
            f"{r['current_mu2']:.3g}", f"{r['current_gain']:.3f}", f"{r['floored_sigma2']:.3g}",
            f"{r['floored_gain']:.3f}", f"{r['prev_sigma2_step']:.3g}", f"{r['tiny_share']:.3f}",
            f"{r['top_share']:.3f}",
            f"{r['top_vhat']:.2g}, ({', '.join(f'{g:.2g}' for g in r['top_g'])}) {r['top_var']}"])
            + " |")
    return "\n".join(out)


def args_jumps(rows, factor=3.0):
    """Steps where prev's smoothed sigma2 grew more than ``factor`` x in one step."""
    jumps, last = set(), None
    for r in rows:
        s = r.get("prev_sigma2")
        if s is not None and s == s and last is not None and last == last and s > factor * last:
            jumps.add(r["step"])
        last = s if s is not None else last
    return jumps


# -- the job: the Keras adapter under horovodrun -----------------------------------------------
def worker(args) -> None:
    import horovod.tensorflow as hvd
    import keras
    import tensorflow as tf

    import mnist1d_data
    from hvd_scale.adapters.keras import DistributedOptimizer

    if args.unfloored:  # the statistic before the fix: v_hat as it is
        import hvd_scale.adapters.keras.optimizer as keras_optimizer
        from hvd_scale.adapters.core import precondition
        keras_optimizer.precondition = lambda g, v, c, eps, sqrt, **_: precondition(g, v, c, eps, sqrt)
    hvd.init()
    tf.config.threading.set_intra_op_parallelism_threads(1)
    keras.utils.set_random_seed(args.seed)
    data = mnist1d_data.load(args.samples)
    x, y = data["x"][:, :, None], data["y"]
    model = make_model(keras, x.shape[1])
    opt = DistributedOptimizer(keras.optimizers.Adam(LR, epsilon=EPS), policy="adascale_adam",
                               log_dir=args.log_dir)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    batches = mnist1d_data.shard_batches(x, y, BATCH, hvd.rank(), hvd.size(), args.seed)

    @tf.function
    def train_step(xb, yb, first):
        with tf.GradientTape() as tape:
            loss = loss_fn(yb, model(xb, training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply(grads, model.trainable_variables)
        if first:
            hvd.broadcast_variables(model.variables, root_rank=0)
        return loss

    for step in range(args.steps):
        xb, yb = next(batches)
        train_step(tf.constant(xb), tf.constant(yb), step == 0)


def job(args) -> list[dict]:
    log_dir = tempfile.mkdtemp(prefix="adam_precondition_")
    bin_dir = pathlib.Path(sys.executable).parent
    cmd = [str(bin_dir / "horovodrun"), "--gloo", "-np", "2", "-H", "localhost:2", sys.executable,
           __file__, "worker", "--steps", str(args.steps), "--seed", str(args.seed),
           "--samples", str(args.samples), "--log-dir", log_dir] + \
        (["--unfloored"] if args.unfloored else [])
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "HVD_SCALE_LOG_EVERY": "1"}
    subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL)
    with open(pathlib.Path(log_dir) / "metrics.csv") as f:
        return [dict(r) for r in csv.DictReader(f)]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("mode", choices=("replay", "job", "worker"))
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--n", type=int, default=2, help="replay: micro-batches a step (n = S)")
    p.add_argument("--samples", type=int, default=10_000)
    p.add_argument("--every", type=int, default=25, help="table rows: every this many steps and the jumps")
    p.add_argument("--log-dir")
    p.add_argument("--unfloored", action="store_true", help="job: the statistic before the fix")
    p.add_argument("--json", help="write every row here")
    args = p.parse_args(argv)
    if args.mode == "worker":
        return worker(args)
    rows = replay(args) if args.mode == "replay" else job(args)
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(rows))
    if args.mode == "replay":
        print(summarize_replay(rows, args.every))
    else:
        cols = ("step", "sigma2", "mu2", "gain", "lr_factor", "progress")
        print("| " + " | ".join(cols) + " |\n|" + "---|" * len(cols))
        for r in rows:
            if int(float(r["step"])) % args.every == 0:
                print("| " + " | ".join(str(r.get(c, "")) for c in cols) + " |")


if __name__ == "__main__":
    main()
