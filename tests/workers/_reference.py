"""What a step's statistics read, for the one-process references: the micro-gradients of a step
laid out worker by worker (W x k, rank-major), read as the adapters read them by default
(``hvd_scale.estimate.SAMPLES``: from two workers on, each worker's sum G of its k passes once,
|G|^2 / k, W samples; else every pass, n samples)."""

from __future__ import annotations


def read_sums(per_micro, workers: int, samples: str = "auto") -> tuple[float, int]:
    """(sqnorm_sum, samples) for ``per_micro`` (1-D numpy arrays or torch tensors, rank-major)."""
    n = len(per_micro)
    k = n // workers
    if k == 1 or samples == "passes" or (samples == "auto" and workers < 2):
        return sum(float((g * g).sum()) for g in per_micro), n
    return read_worker_sums([per_micro[w * k:(w + 1) * k] for w in range(workers)])


def read_worker_sums(per_worker) -> tuple[float, int]:
    """Each worker's passes (k_w may differ: a short step) read once: (sum_w |G_w|^2 / k_w, W)."""
    sums = [(sum(passes), len(passes)) for passes in per_worker if len(passes)]
    return sum(float((s * s).sum()) / k for s, k in sums), len(sums)


# -- an independent model of a transitions cell (tests/test_transitions.py) ----------------------
#
# What each step of a cell should do, recomputed in numpy from the formulas in the docs
# (hvd_scale/estimate.py, policies.py, moments.py, run.py's layout table) without calling any of
# hvd_scale: the 4-3-1 tanh regression's gradients by hand, the estimator's sigma2/mu2 from the
# raw micro-gradients, the gain, the policy's factor and tau, SGD (torch's or Keras's momentum)
# or Adam with its betas at beta^r, eps / sqrt(r) and the bias correction 1 - beta^tau, and the
# layouts that must be refused. A cell whose adapter gets any of these wrong differs from it.

import math as _math

import numpy as _np

SIGMA2_FLOOR = 1e-6   # sigma2_hat >= 1e-6 m (estimate.py)
DECAY = 0.999         # theta = 0.999 ** S


class Refusal(Exception):
    """A set-up or layout the reference says must be refused, after ``applied`` steps, with a
    message that holds each of ``names`` (the bad value and what to do)."""

    def __init__(self, applied, names, why):
        super().__init__(why)
        self.applied, self.names, self.why = applied, names, why


def to_params(flat, layout):
    """[W1 (3, 4), b1, W2 (1, 3), b2] in torch's layout from a model's flat weights (torch:
    weight then bias per layer; Keras: kernel (in, out) then bias)."""
    flat = _np.asarray(flat, dtype=_np.float64)
    if layout == "torch":
        w1, b1, w2, b2 = _np.split(flat, [12, 15, 18])
        return [w1.reshape(3, 4), b1, w2.reshape(1, 3), b2]
    k1, b1, k2, b2 = _np.split(flat, [12, 15, 18])
    return [k1.reshape(4, 3).T.copy(), b1, k2.reshape(3, 1).T.copy(), b2]


def to_flat(params, layout):
    w1, b1, w2, b2 = params
    if layout == "torch":
        return _np.concatenate([w1.ravel(), b1, w2.ravel(), b2])
    return _np.concatenate([w1.T.ravel(), b1, w2.T.ravel(), b2])


def gradient(params, x, y):
    """d/dparams of mean((tanh(x W1^T + b1) W2^T + b2 - y)^2), by hand."""
    w1, b1, w2, b2 = params
    with _np.errstate(all="ignore"):
        h = _np.tanh(x @ w1.T + b1)
        f = h @ w2.T + b2
        df = 2.0 * (f - y) / f.size
        dz = (df @ w2) * (1.0 - h * h)
        return [dz.T @ x, dz.sum(0), df.T @ h, df.sum(0)]


def _sq(tensors):
    return float(sum(float((t * t).sum()) for t in tensors))


class CellModel:
    """One cell's run. ``policy``: none | warmup (span in baseline steps) | adascale |
    adascale_adam (warm_in steps at gain 1, max_gain); ``convention``: torch or keras (SGD's
    momentum and Adam's eps placement); ``adam_extra``: Adam updates the framework made that no
    policy step accounted (none in the cells: the adapters' broadcast_state leaves Adam's step
    count at the policy's)."""

    def __init__(self, params, *, policy, measured, convention, lr, eps=1e-8, betas=(0.9, 0.999),
                 momentum=0.9, span=8.0, warm_in=20, max_gain=8.0, adam_extra=0, adapt=False,
                 unit=1.0):
        self.params = [p.copy() for p in params]
        self.policy, self.measured, self.convention = policy, measured, convention
        self.lr, self.eps, self.betas, self.momentum = lr, eps, betas, momentum
        self.span, self.warm_in, self.max_gain, self.adam_extra = span, warm_in, max_gain, adam_extra
        self.adam = policy == "adascale_adam"
        self.buf = [_np.zeros_like(p) for p in params]    # momentum, or Adam's m
        self.v = [_np.zeros_like(p) for p in params]      # Adam's v
        self.tau, self.steps, self.skipped, self.factor = 0.0, 0, 0, 1.0
        self.ema = None                                   # [b_sigma2, b_mu2, u]
        self.layout, self.adapt = None, adapt
        self.unit = unit                                  # u = S / (W k), kept by every change

    # -- the layout table (run.py): S = u W k ------------------------------------------------
    def relayout(self, workers, passes, applied):
        if self.layout == (workers, passes):
            return
        if self.layout is None and self.adapt and not self.measured:
            # adapt="goodput" chooses k by the gain at another k: it needs the statistics.
            raise Refusal(applied, ["adapt='goodput'", "measure=False"], "adapt unmeasured")
        scale = self.unit * workers * passes
        if self.policy in ("adascale", "adascale_adam") and scale > 1:
            if not self.measured:
                raise Refusal(applied, [f"S = {scale:g}", "measure=True"],
                              "needs statistics: measure=False")
            if workers * passes == 1:
                raise Refusal(applied, [f"S = {scale:g}", "1 worker x 1 backward pass"],
                              "one micro-gradient")
        self.layout = (workers, passes)

    def state(self):
        return {"params": [p.copy() for p in self.params], "tau": self.tau, "steps": self.steps,
                "buf": [b.copy() for b in self.buf], "v": [v.copy() for v in self.v]}

    # -- one step ------------------------------------------------------------------------------
    def step(self, per_rank, samples):
        """``per_rank``: each rank's micro-batches [(x, y), ...] this step; ``samples``: passes or
        workers. Returns the row (lr factor, tau, S, n = W k, skipped)."""
        return self.take([[gradient(self.params, x, y) for x, y in batches]
                          for batches in per_rank], samples)

    def take(self, grads, samples):
        """A step of the micro-gradients ``grads`` (each rank's, each a list of tensors), at the
        layout set by ``relayout``: the row, as ``step``'s."""
        workers, passes = self.layout
        flat = [g for rank in grads for g in rank]
        n = len(flat)
        if not all(_np.all(_np.isfinite(t)) for g in flat for t in g):
            self.skipped += 1
            return self.row()
        full = workers * passes
        scale = self.unit * (full if n == full else n)  # a short step: its own S = u n
        if scale < 1 - 1e-9:
            raise Refusal(self.steps, ["below the baseline batch", f"S = u n = {scale:g}"],
                          f"a short step of {n} pass(es) at u = {self.unit:g}: S = {scale:g} < 1")
        scale = max(1.0, scale)
        mean = [sum(g[i] for g in flat) / n for i in range(len(flat[0]))]
        reads = samples == "workers" and workers >= 2
        count = sum(1 for rank in grads if rank) if reads else n
        if self.measured and n >= 2 and count >= 2 and scale > 1 and \
                not (self.adam and self.steps < self.warm_in):
            pre = self.preconditioner()
            if reads:
                sums = [[sum(g[i] for g in rank) for i in range(len(flat[0]))]
                        for rank in grads if rank]
                sqnorm = sum(_sq(pre(s)) / len(rank) for s, rank in
                             zip(sums, [r for r in grads if r]))
            else:
                sqnorm = sum(_sq(pre(g)) for g in flat)
            m, q = sqnorm / n, _sq(pre(mean))
            sigma2 = max(scale * (m - q) / (count - 1), SIGMA2_FLOOR * m)
            mu2 = (count * q - m) / (count - 1)
            theta = DECAY ** scale
            b = self.ema or [0.0, 0.0, 0.0]
            self.ema = [theta * b[0] + (1 - theta) * sigma2, theta * b[1] + (1 - theta) * mu2,
                        theta * b[2] + (1 - theta)]
        gain = self.gain(scale)
        if self.policy == "none":
            factor, advance = 1.0, scale
        elif self.policy == "warmup":
            factor, advance = 1.0 + (scale - 1.0) * min(1.0, self.tau / self.span), scale
        elif self.policy == "adascale":
            factor, advance = gain, gain
        else:
            factor, advance = _math.sqrt(gain), gain
        self.tau += advance
        self.steps += 1
        self.factor = factor
        self.update(mean, self.lr * factor, gain)
        return self.row()

    def gain(self, scale):
        if self.adam and self.steps < self.warm_in:
            return 1.0
        if scale == 1.0 or self.ema is None:
            return 1.0
        sigma2, mu2 = max(self.ema[0] / self.ema[2], 0.0), max(self.ema[1] / self.ema[2], 0.0)
        den = sigma2 / scale + mu2
        r = 1.0 if den <= 0 else min(max((sigma2 + mu2) / den, 1.0), scale)
        u, theta = self.ema[2], DECAY ** scale
        if r > 1.0 and u < 1.0:  # the warm-in (estimate.py): r - 1 held by the young EMA's noise
            noise, signal = sigma2 / scale / den, mu2 / den
            v = (2 + min(4 * noise * signal + 2 * noise ** 2, 2)) * 2 * (1 - theta) * (1 - u) / (
                (1 + theta) * u)
            r = 1.0 + (r - 1.0) * min(1.0, 1.5 * _math.exp(-2.0 * _math.sqrt(v)))
        return min(r, self.max_gain) if self.adam else r

    def preconditioner(self):
        """adascale_adam's g / (sqrt(max(v_hat, (1 - b2) / c2 mean(v_hat))) + eps), v before this
        step, c2 = 1 - b2^(tau + extra), per tensor; plain gradients otherwise."""
        if not self.adam:
            return lambda g: g
        b2 = self.betas[1]
        c2 = 1.0 - b2 ** (self.tau + self.adam_extra)
        hats = [v / c2 for v in self.v]
        floors = [_np.maximum(h, (1.0 - b2) / c2 * h.mean()) for h in hats]
        return lambda g: [t / (_np.sqrt(f) + self.eps) for t, f in zip(g, floors)]

    def update(self, mean, lr, gain):
        if not self.adam:
            for p, b, g in zip(self.params, self.buf, mean):
                if self.convention == "torch":   # buf = mu buf + g; w -= lr buf
                    b *= self.momentum
                    b += g
                    p -= lr * b
                else:                            # Keras: m = mu m - lr g; w += m
                    b *= self.momentum
                    b -= lr * g
                    p += b
            return
        b1, b2 = self.betas[0] ** gain, self.betas[1] ** gain
        eps = self.eps / _math.sqrt(gain)
        e = self.tau + self.adam_extra
        c1, c2 = 1.0 - self.betas[0] ** e, 1.0 - self.betas[1] ** e
        for p, m, v, g in zip(self.params, self.buf, self.v, mean):
            m *= b1
            m += (1 - b1) * g
            v *= b2
            v += (1 - b2) * g * g
            if self.convention == "torch":   # eps beside the corrected sqrt(v)
                p -= lr / c1 * m / (_np.sqrt(v / c2) + eps)
            else:                            # Keras: eps beside sqrt(v)
                p -= lr * _math.sqrt(c2) / c1 * m / (_np.sqrt(v) + eps)

    def row(self):
        workers, passes = self.layout
        return [self.factor, self.tau, self.unit * workers * passes, workers * passes,
                self.skipped]


def replay_elastic(records, policy="adascale", samples="workers"):
    """An elastic job's steps replayed by ``CellModel`` at each step's world size (S = u W k,
    u = 1: the default scale), from the micro-gradients every rank reported (kind "micro":
    step, size, rank, micro = its passes' flat gradients; tests/workers/elastic_worker.py
    --reference). Returns [(the job's row, the model's row)] for the steps of the process that
    ends as rank 0 (``records`` sorted by seq, its own first)."""
    by_step = {}
    for r in records:  # a rank's latest report of a step at a size (a step redone overwrites)
        by_step.setdefault((r["step"], r["size"]), {})[r["rank"]] = r
    model, pairs = None, []
    for zero in (r for r in records if r.get("zero")):
        ranks = by_step[(zero["step"], zero["size"])]
        assert sorted(ranks) == list(range(zero["size"])), (zero["step"], sorted(ranks))
        grads = [[[_np.asarray(m, dtype=_np.float64)] for m in ranks[w]["micro"]]
                 for w in range(zero["size"])]
        if model is None:
            size = grads[0][0][0].size
            model = CellModel([_np.zeros(size)], policy=policy, measured=True,
                              convention="torch", lr=1.0)
        model.relayout(zero["size"], zero["passes"], applied=zero["step"] - 1)
        expected = model.take(grads, samples)
        got = [zero["factor"], zero["progress"], zero["scale"], zero["size"] * zero["passes"],
               zero["skipped"]]
        pairs.append((got, expected))
    return pairs
