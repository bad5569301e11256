"""``hvd-scale advise LOGDIR``: which workers W, passes k and micro-batch m would finish soonest.

From a run's log directory (``hvd_scale.adapters.log.MetricsLogger``'s metrics.csv and run.json):
the latest statistics (sigma2, mu2) give the gain r(S) of any batch S = W k m (in baseline
batches), the latest steps' timings fit ``hvd_scale.goodput``'s step-time model at the run's W,
and each configuration of a grid is ranked by goodput r(S) / T (baseline steps per second).
With ``--plot``, a picture of the efficiency r(S) / S against S at a few points in training.

Only the run's own W is measured: the rows of other W are extrapolations from it, marked, with
their basis said. Where the run's workers shared a host (run.json's ``workers_on_host``, from
``hvd_scale.adapters.log.host_facts``), its per-pass time was measured with that sharing and
says little of another W's: a warning says so.
"""

from __future__ import annotations

import json
import math
import os
import pathlib
from typing import Sequence

import numpy as np

from hvd_scale import goodput
from hvd_scale.launch.plot import read_run
from hvd_scale.metrics import TIMING_METRICS, check_names
from hvd_scale.spec import make_policy

# The columns read, named as hvd_scale.metrics names them (checked there: a renamed metric fails
# here at import, never as an empty column).
STEP, PROGRESS, SCALE, SIGMA2, MU2 = "step", "progress", "scale", "sigma2", "mu2"
PASSES, WORKERS, PASS_TIME, OVERHEAD_TIME, ALLREDUCE_TIME, UPDATE_TIME, _ = TIMING_METRICS
TIMINGS = (PASSES, PASS_TIME, ALLREDUCE_TIME, UPDATE_TIME)
check_names((STEP, PROGRESS, SCALE, SIGMA2, MU2))

WARMUP_STEPS = 5   # the first steps build caches, compile and fill the loader: not the run's pace
MIN_WINDOW = 10    # steps of timings at least (fewer are noise)
WINDOW_FRACTION = 0.2  # by default the latest 20% of the timed steps: the run as it is now
TOP = 15           # rows of the table (by goodput), plus the measured configuration
ASSUMPTION = ("allreduce wait from the measured one by a ring's traffic 2(W-1)/W (no latency "
              "term; the wait measured is what the passes did not hide); compute per pass as "
              "measured")


def _finite(columns: dict[str, list[float]], names: Sequence[str]) -> list[int]:
    """The rows where every column of ``names`` holds a finite number (a column absent: none)."""
    n = len(columns[STEP])
    cols = [columns.get(k, [math.nan] * n) for k in names]
    return [i for i in range(n) if all(math.isfinite(c[i]) for c in cols)]


def _max_gain(info: dict) -> float:
    """The policy's cap on the gain (adascale_adam's max_gain), else inf."""
    try:
        policy = make_policy(info.get("policy"), scale=float(info.get("scale", 1.0)),
                             budget=info.get("budget"))
    except (TypeError, ValueError):  # a spec this version cannot build: no cap known
        return math.inf
    return float(getattr(policy, "max_gain", math.inf))


def sharing(info: dict, workers: int) -> str | None:
    """The warning for a run whose ``workers`` shared a host (run.json's ``workers_on_host``
    and ``host_cpus``), or whose log does not say whether they did; None for one worker a
    host (or one worker)."""
    on_host, cpus = info.get("workers_on_host"), info.get("host_cpus")
    if workers <= 1 or (isinstance(on_host, int) and on_host <= 1):
        return None
    basis = (f"the per-pass time at W = {workers} was measured with its workers sharing a host"
             if isinstance(on_host, int) else
             f"run.json does not say whether the W = {workers} workers shared a host (a log "
             f"written before it recorded workers_on_host); if they did, the per-pass time was "
             f"measured with that sharing")
    where = (f" ({on_host} workers on {cpus} CPUs)" if isinstance(on_host, int) and cpus else "")
    return (f"warning: {basis}{where}: at another W it is not measured. Fewer workers on a "
            f"host each get more of its cores and memory (a pass at W = 1 can be several times "
            f"faster), more get less: the W* rows, which carry W = {workers}'s pass, are a "
            f"guess. Log a short run at the W you consider and run advise on it")


def _duration(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "never"
    s = round(seconds)
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else \
        f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{seconds:.1f}s"


def load(log_dir: str | pathlib.Path) -> tuple[dict[str, list[float]], dict]:
    """(columns, run info) of a log directory; FileNotFoundError or ValueError naming what is
    missing."""
    log_dir = pathlib.Path(log_dir)
    if not log_dir.is_dir():
        raise FileNotFoundError(f"{log_dir}: no such directory")
    _, columns = read_run(log_dir)
    info_path = log_dir / "run.json"
    info = json.loads(info_path.read_text()) if info_path.exists() else {}
    if not isinstance(info.get("workers"), int):
        raise ValueError(f"{log_dir} has no run.json with the run's workers (written by the "
                         f"adapters' metrics log)")
    return columns, info


def advise(log_dir: str | pathlib.Path, *, workers: Sequence[int] = (1, 2, 4, 8),
           passes: Sequence[int] = (1, 2, 4, 8, 16), micro_batch_factors: Sequence[float] = (1,),
           budget: float | None = None, window: int | None = None,
           plot: str | None = None) -> str:
    """The report (text). Raises FileNotFoundError or ValueError, naming ``log_dir`` and what
    it lacks."""
    if window is not None and window < 1:
        raise ValueError(f"window must be >= 1 step, got {window}")
    columns, info = load(log_dir)
    stats = _finite(columns, (SIGMA2, MU2))
    if not stats:
        raise ValueError(f"{log_dir}: no step has statistics (sigma2, mu2): log the run with a "
                         f"policy that measures (adascale) or with measure=True")
    timed = _finite(columns, TIMINGS)
    if not timed:
        raise ValueError(f"{log_dir}: no step has timings ({', '.join(TIMINGS)}): both adapters "
                         f"log them from the second step on (Keras's before 2026-12-02 did not)")
    timed = [i for i in timed if columns[STEP][i] > WARMUP_STEPS] or timed
    # W of each step (Horovod elastic changes it); a log written before the column: run.json's.
    n = len(columns[STEP])
    workers_col = columns.get(WORKERS, [math.nan] * n)
    W = int(workers_col[timed[-1]]) if math.isfinite(workers_col[timed[-1]]) else info["workers"]
    timed = [i for i in timed if not math.isfinite(workers_col[i]) or workers_col[i] == W]
    rows = timed[-(window or max(MIN_WINDOW, math.ceil(WINDOW_FRACTION * len(timed)))):]

    col = lambda name: np.array([columns.get(name, [math.nan] * n)[i] for i in rows])  # noqa: E731
    k = col(PASSES)
    # S = W k m with B0 = 1: m in baseline batches (the scale column is each step's S)
    m = np.where(np.isfinite(col(SCALE)), col(SCALE), float(info.get("scale", W))) / (W * k)
    # The step's own work apart from its passes where a pass was timed alone (k >= 2).
    overhead = col(OVERHEAD_TIME)
    alone = np.isfinite(overhead)
    model = goodput.fit_step_time(k, m, k * col(PASS_TIME) + np.where(alone, overhead, 0.0),
                                  col(ALLREDUCE_TIME), col(UPDATE_TIME), workers=W,
                                  per_pass=np.where(alone, col(PASS_TIME), np.nan))
    latest = stats[-1]
    sigma2, mu2 = columns[SIGMA2][latest], columns[MU2][latest]
    cap = _max_gain(info)
    budget = budget if budget is not None else info.get("budget")

    notes = []
    if W == 1 and any(w != 1 for w in workers):  # no allreduce was measured to scale from
        workers = [1]
        notes.append("a one-worker run measured no allreduce: only W = 1 is predicted")
    here = dict(workers=W, passes=int(k[-1]), micro_batch=float(m[-1]))
    measured = goodput.evaluate(model, sigma2, mu2, **here, base_batch=1.0, max_gain=cap)
    grid = goodput.candidates(model, sigma2, mu2, workers=workers, passes=passes,
                              micro_batches=[f * here["micro_batch"] for f in micro_batch_factors],
                              base_batch=1.0, max_gain=cap)
    top = goodput.best(grid)

    def key(c: goodput.Candidate):
        return c.workers, c.passes, round(c.micro_batch, 9)

    def extrapolated(c: goodput.Candidate) -> bool:  # a W the run did not measure
        return c.workers != W

    shown = sorted(grid, key=lambda c: -c.goodput)[:TOP]
    extra = key(measured) not in {key(c) for c in shown}
    if extra:
        shown.append(measured)

    steps = columns[STEP]
    slots = os.cpu_count()
    shared = sharing(info, W)
    lines = [
        f"hvd-scale advise: {log_dir}",
        f"run: policy {info.get('policy', '?')}, W = {W}, k = {here['passes']}, "
        f"m = {here['micro_batch']:g} baseline batches (S = {measured.scale:g}), "
        f"{len(steps)} steps logged",
        f"statistics at step {steps[latest]:g}: sigma2 = {sigma2:.4g}, mu2 = {mu2:.4g}, "
        f"noise scale {sigma2 / mu2 if mu2 > 0 else math.inf:.3g} baseline batches"
        + (f"; gain capped at {cap:g} (the policy's max_gain)" if math.isfinite(cap) else ""),
        f"step time, fitted to steps {steps[rows[0]]:g}-{steps[rows[-1]]:g} ({len(rows)} steps at "
        f"W = {W}): per step {1e3 * model.per_step:.2f} ms, pass {1e3 * model.compute:.2f} ms, "
        f"allreduce wait {1e3 * model.allreduce:.2f} ms, update {1e3 * model.update:.2f} ms, "
        f"fit error {100 * model.error:.1f}%",
        *([] if model.identified else [
            "assumed: the step's own work (zero_grad, evaluation, logging) is charged to the "
            "passes (one k measured and no pass timed alone): larger k is over-predicted"]),
        *([f"extrapolated for W other than {W} (marked W*), not measured: their times come "
           f"from the run at W = {W}: {ASSUMPTION}; the further from W = {W}, the less they "
           f"say"] if set(workers) - {W} else []),
        *([shared] if shared and set(workers) - {W} else []),
        *(["assumed for another m: compute per pass in proportion to m (one m measured)"]
          if set(micro_batch_factors) - {1} and model.per_sample is None else []),
        *notes,
        "",
    ]
    header = (f"{'W':>3} {'k':>3} {'m':>6} {'S':>7} {'gain':>6} {'eff':>5} {'step ms':>9} "
              f"{'batches/s':>10} {'goodput':>9}" + (f" {'time to T':>10}" if budget else ""))
    lines += ["columns: W workers, k passes per step, m micro-batch and S = W k m in baseline "
              "batches; gain and eff(iciency) at S; batches/s of baseline batches computed; "
              "goodput in baseline steps of progress (tau) per second", header]
    for c in shown:
        marks = [name for name, hit in (("measured", key(c) == key(measured)),
                                         ("recommended", c is top)) if hit]
        lines.append(
            f"{str(c.workers) + ('*' if extrapolated(c) else ''):>3} {c.passes:>3} {c.micro_batch:>6.3g} {c.scale:>7.4g} {c.gain:>6.2f} "
            f"{c.efficiency:>5.2f} {1e3 * c.step_time:>9.2f} {c.throughput:>10.2f} "
            f"{c.goodput:>9.2f}" + (f" {_duration(budget / c.goodput):>10}" if budget else "")
            + (f"  <- {', '.join(marks)}" if marks else ""))
    lines += [
        "",
        f"shown: the top {min(TOP, len(grid))} of {len(grid)} configurations by goodput "
        f"(baseline steps of progress per second)" + (", and the measured one" if extra else ""),
        f"recommended: W = {top.workers}, k = {top.passes}, m = {top.micro_batch:g} "
        f"(S = {top.scale:g}): {top.goodput / measured.goodput:.2f}x the measured goodput"
        + (f" (W = {top.workers} extrapolated from W = {W}, not measured"
           + (", whose workers shared a host: see the warning above" if shared else "") + ")"
           if extrapolated(top) else "")
        + (f"; W = {top.workers} is more workers than this machine's {slots} CPU slots: they "
           "need more hosts (hvd-scale run -H)" if slots and top.workers > slots else "")
        + (f"; T = {budget:g} baseline steps in {_duration(budget / top.goodput)} at today's "
           f"statistics" if budget else ""),
    ]
    if plot:
        plot_efficiency(columns, stats, cap, measured.scale, plot)
        lines.append(f"wrote {plot}")
    return "\n".join(lines)


def plot_efficiency(columns: dict[str, list[float]], stats: Sequence[int], max_gain: float,
                    measured_scale: float, output: str, curves: int = 5) -> None:
    """Efficiency r(S) / S against S (1 to 256, log x) at ``curves`` points of training."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    scales = np.geomspace(1, 256, 120)
    picks = sorted({stats[round(j)] for j in np.linspace(0, len(stats) - 1, curves)})
    fig, ax = plt.subplots(figsize=(7, 4.5), constrained_layout=True)
    for i in picks:
        s2, g2 = columns[SIGMA2][i], columns[MU2][i]
        eff = [goodput.gain_at(s2, g2, s, max_gain) / s for s in scales]
        ax.plot(scales, eff, label=f"step {columns[STEP][i]:g} (tau {columns[PROGRESS][i]:.0f})")
    ax.axvline(measured_scale, color="gray", linestyle="--", linewidth=1, label="measured S")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("S (baseline batches)")
    ax.set_ylabel("efficiency r(S) / S")
    ax.set_ylim(0, 1.05)
    ax.set_title("efficiency through training")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.savefig(output, dpi=80)
    plt.close(fig)
