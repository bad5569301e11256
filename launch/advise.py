"""``hvd-scale advise LOGDIR [LOGDIR ...]``: which workers W, passes k and micro-batch m would
finish soonest.

From runs' log directories (``hvd_scale.adapters.log.MetricsLogger``'s metrics.csv and run.json):
the latest statistics (sigma2, mu2) of the first log that has them give the gain r(S) of any
batch S = W k m (in baseline batches); each W that a log's rows measured (the ``workers`` column:
an elastic run's rows carry several) has ``hvd_scale.goodput``'s step-time model fitted to that
W's own latest steps, from every log given; each configuration of a grid is ranked by goodput
r(S) / T (baseline steps per second). With ``--plot``, a picture of the efficiency r(S) / S
against S at a few points in training.

A W that no log measured is an extrapolation from the nearest W measured (one above 1 for an
allreduce to scale from), marked, with its basis named. Where the workers of that basis shared a
host (run.json's ``workers_on_host``, from ``hvd_scale.adapters.log.host_facts``), its per-pass
time was measured with that sharing and says little of another W's: a warning says so, and that
a short run at the W considered, given beside the others, replaces the guess by a measurement.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import pathlib
from typing import Sequence

import numpy as np

from hvd_scale import goodput
from hvd_scale.launch import batch_schedule
from hvd_scale.launch.plot import noise_text, read_run
from hvd_scale.metrics import TIMING_METRICS, check_names
from hvd_scale.spec import make_policy

# The columns read, named as hvd_scale.metrics names them (checked there: a renamed metric fails
# here at import, never as an empty column).
STEP, PROGRESS, SCALE, SIGMA2, MU2 = "step", "progress", "scale", "sigma2", "mu2"
PASSES, WORKERS, PASS_TIME, OVERHEAD_TIME, ALLREDUCE_TIME, UPDATE_TIME, _, STATISTICS_TIME = \
    TIMING_METRICS
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
        policy = make_policy(info.get("policy"), budget=info.get("budget"))
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
            f"faster), more get less: the W* rows extrapolated from W = {workers}, which carry "
            f"its pass, are a guess. Log a short run at the W you consider and give its log to "
            f"advise beside this one (hvd-scale advise LOGDIR OTHER_LOGDIR): that W's rows then "
            f"come from its own steps")


def _duration(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "never"
    s = round(seconds)
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else \
        f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{seconds:.1f}s"


def _and(items: Sequence) -> str:
    """1, 2 and 4."""
    items = [str(x) for x in items]
    return items[0] if len(items) == 1 else f"{', '.join(items[:-1])} and {items[-1]}"


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


@dataclasses.dataclass(frozen=True)
class Timings:
    """One log's timed steps at one W, the window fitted (what ``goodput.fit_step_time`` takes)."""

    log: str               # the log directory, as given
    info: dict             # its run.json
    workers: int
    first: float           # the window's first and last step
    last: float
    passes: np.ndarray     # k of each step
    micro_batch: np.ndarray  # m, in baseline batches (S = W k m with B0 = 1)
    compute: np.ndarray    # o + k c: the step's passes and own work
    allreduce: np.ndarray
    update: np.ndarray
    per_pass: np.ndarray   # one pass timed alone (k >= 2), else nan
    statistics: np.ndarray  # the once-a-step statistics read within compute (0: none timed)

    @property
    def configuration(self) -> tuple[int, int, float]:
        """(W, k, m) of the window's latest step: the configuration this log measured at W."""
        return self.workers, int(self.passes[-1]), float(self.micro_batch[-1])


def timings(log: str, columns: dict[str, list[float]], info: dict,
            window: int | None = None) -> tuple[list[Timings], int]:
    """The log's timed steps grouped by W (in the order each W first ran), each group its latest
    ``window`` steps (default: its latest 20%, at least 10), the warm-up left out: the log's first
    steps and the first after each change of W (Horovod re-forms its ring, loaders refill); and
    the W of the latest timed step. ValueError where no step has timings."""
    timed = _finite(columns, TIMINGS)
    if not timed:
        raise ValueError(f"{log}: no step has timings ({', '.join(TIMINGS)}): both adapters "
                         f"log them from the second step on (Keras's before 2026-12-02 did not)")
    n, steps = len(columns[STEP]), columns[STEP]
    # W of each step (Horovod elastic changes it); a log written before the column: run.json's.
    column = columns.get(WORKERS, [math.nan] * n)
    w_of = [int(w) if math.isfinite(w) else int(info["workers"]) for w in column]
    since, later = [steps[0]] * n, [False] * n  # each row's stretch at its W: first step, not first
    for i in range(1, n):
        changed = w_of[i] != w_of[i - 1]
        since[i] = steps[i] if changed else since[i - 1]
        later[i] = changed or later[i - 1]
    warm = [i for i in timed if (steps[i] >= since[i] + WARMUP_STEPS if later[i]
                                 else steps[i] > WARMUP_STEPS)]
    groups = []
    for W in dict.fromkeys(w_of[i] for i in timed):
        rows = [i for i in warm if w_of[i] == W] or [i for i in timed if w_of[i] == W]
        rows = rows[-(window or max(MIN_WINDOW, math.ceil(WINDOW_FRACTION * len(rows)))):]
        col = lambda name: np.array([columns.get(name, [math.nan] * n)[i]  # noqa: E731
                                     for i in rows])
        k, overhead = col(PASSES), col(OVERHEAD_TIME)
        alone = np.isfinite(overhead)  # a pass timed alone (k >= 2): the step's own work apart
        scale = np.where(np.isfinite(col(SCALE)), col(SCALE), float(info.get("scale", W)))
        groups.append(Timings(log, info, W, steps[rows[0]], steps[rows[-1]], k, scale / (W * k),
                              k * col(PASS_TIME) + np.where(alone, overhead, 0.0),
                              col(ALLREDUCE_TIME), col(UPDATE_TIME),
                              np.where(alone, col(PASS_TIME), np.nan),
                              np.nan_to_num(col(STATISTICS_TIME))))  # a log before it: 0
    return groups, w_of[timed[-1]]


def fit(groups: Sequence[Timings]) -> goodput.StepTimeModel:
    """The step-time model of one W from its steps in every log (pooled)."""
    cat = lambda name: np.concatenate([getattr(g, name) for g in groups])  # noqa: E731
    return goodput.fit_step_time(cat("passes"), cat("micro_batch"), cat("compute"),
                                 cat("allreduce"), cat("update"), workers=groups[0].workers,
                                 per_pass=cat("per_pass"), statistics=cat("statistics"))


def basis(workers: int, measured: Sequence[int]) -> int | None:
    """The measured W that another W is extrapolated from: the nearest (by ratio; a tie, the
    smaller), among those above 1 for a W above 1 (a one-worker run had no allreduce to scale);
    None where there is none."""
    options = [w for w in measured if w > 1] if workers > 1 else list(measured)
    return min(options, key=lambda w: (abs(math.log(workers / w)), w)) if options else None


def advise(log_dirs: str | os.PathLike | Sequence[str | os.PathLike], *,
           workers: Sequence[int] = (1, 2, 4, 8), passes: Sequence[int] = (1, 2, 4, 8, 16),
           micro_batch_factors: Sequence[float] = (1,), budget: float | None = None,
           window: int | None = None, plot: str | None = None, schedule: str | None = None,
           base_batch: int | None = None, seq_len: int | None = None,
           max_batch: int | None = None, schedule_out: str | None = None) -> str:
    """The report (text) on one log directory or several (runs at different W: each W measured
    is predicted from its own steps). The statistics, policy and budget are the first log's that
    has statistics. Raises FileNotFoundError or ValueError, naming the log and what it lacks."""
    if window is not None and window < 1:
        raise ValueError(f"window must be >= 1 step, got {window}")
    if isinstance(log_dirs, (str, os.PathLike)):
        log_dirs = [log_dirs]
    if not log_dirs:
        raise ValueError("no log directory given")
    names = [str(d) for d in log_dirs]
    several = len(names) > 1
    logs = [load(d) for d in log_dirs]
    groups, latest_w = [], []
    for name, (columns, info) in zip(names, logs):
        found, w = timings(name, columns, info, window)
        groups.append(found)
        latest_w.append(w)
    with_stats = [i for i, (columns, _) in enumerate(logs) if _finite(columns, (SIGMA2, MU2))]
    if not with_stats:
        raise ValueError(f"{_and(names)}: no step has statistics (sigma2, mu2): log the run with "
                         f"a policy that measures (adascale) or with measure=True")
    p = with_stats[0]  # the run advised on: its statistics, policy, budget and configuration
    log_dir, (columns, info) = names[p], logs[p]
    stats = _finite(columns, (SIGMA2, MU2))
    latest = stats[-1]
    sigma2, mu2 = columns[SIGMA2][latest], columns[MU2][latest]
    cap = _max_gain(info)
    budget = budget if budget is not None else info.get("budget")

    # Each W measured, from its own steps in every log; the others from the nearest measured W.
    at: dict[int, list[Timings]] = {}
    for found in groups:
        for g in found:
            at.setdefault(g.workers, []).append(g)
    measured_w = sorted(at)
    models = {w: fit(gs) for w, gs in at.items()}
    notes = []
    if max(measured_w) == 1 and any(w != 1 for w in workers):  # no allreduce to scale from
        workers = [1]
        notes.append("a one-worker run measured no allreduce: only W = 1 is predicted"
                     + ("" if not several else " (give a log of a run at W > 1 beside it)"))
    bases = {w: w if w in models else basis(w, measured_w) for w in workers}
    W = latest_w[p]
    here = dict(zip(("workers", "passes", "micro_batch"),
                    next(g for g in groups[p] if g.workers == W).configuration))
    measured = goodput.evaluate(models[W], sigma2, mu2, **here, base_batch=1.0, max_gain=cap)
    grid = [c for w in workers
            for c in goodput.candidates(models[bases[w]], sigma2, mu2, workers=[w], passes=passes,
                                        micro_batches=[f * here["micro_batch"]
                                                       for f in micro_batch_factors],
                                        base_batch=1.0, max_gain=cap)]
    top = goodput.best(grid)

    def key(c: goodput.Candidate):
        return c.workers, c.passes, round(c.micro_batch, 9)

    def extrapolated(c: goodput.Candidate) -> bool:  # a W no log measured
        return c.workers not in models

    # Every configuration a log measured (one a W of each log), marked; the one advised on first.
    where: dict[tuple, list[str]] = {}
    others = []
    for found in groups:
        for g in found:
            c = goodput.evaluate(models[g.workers], sigma2, mu2, workers=g.workers,
                                 passes=g.configuration[1], micro_batch=g.configuration[2],
                                 base_batch=1.0, max_gain=cap)
            if key(c) not in where and key(c) != key(measured):
                others.append(c)
            where.setdefault(key(c), []).append(g.log)
    marks_of = {key(c): "measured" + (f" in {_and(dict.fromkeys(where[key(c)]))}" if several
                                      else "")
                for c in [measured, *others]}

    shown = sorted(grid, key=lambda c: -c.goodput)[:TOP]
    keys = {key(c) for c in shown}
    extra = [c for c in [measured, *others] if key(c) not in keys]
    shown += extra

    steps = columns[STEP]
    slots = os.cpu_count()
    unmeasured = [w for w in dict.fromkeys(workers) if w not in models]
    from_basis = {b: [w for w in unmeasured if bases[w] == b] for b in measured_w}
    from_basis = {b: ws for b, ws in from_basis.items() if ws}
    warnings = {b: sharing(at[b][0].info, b) for b in from_basis}
    lines = [
        f"hvd-scale advise: {' '.join(names)}",
        f"run{f' {log_dir}' if several else ''}: policy {info.get('policy', '?')}, W = {W}, "
        f"k = {here['passes']}, m = {here['micro_batch']:g} baseline batches "
        f"(S = {measured.scale:g}), {len(steps)} steps logged",
        *[f"run {name}: policy {other_info.get('policy', '?')}, W = "
          f"{_and(dict.fromkeys(g.workers for g in found))}, "
          f"{len(other_columns[STEP])} steps logged; its step times only"
          for i, (name, (other_columns, other_info), found) in enumerate(zip(names, logs, groups))
          if i != p],
        f"statistics at step {steps[latest]:g}{f' of {log_dir}' if several else ''}: "
        f"sigma2 = {sigma2:.4g}, mu2 = {mu2:.4g}, "
        f"noise scale (baseline batches) {noise_text(columns, latest)}"
        + (f"; gain capped at {cap:g} (the policy's max_gain)" if math.isfinite(cap) else ""),
    ]
    for w in measured_w:
        model = models[w]
        spans = "; ".join(f"steps {g.first:g}-{g.last:g}" + (f" of {g.log}" if several else "")
                          for g in at[w])
        lines += [
            f"step time, fitted to {spans} ({sum(len(g.passes) for g in at[w])} steps at "
            f"W = {w}): per step {1e3 * model.per_step:.2f} ms, pass {1e3 * model.compute:.2f} "
            f"ms, allreduce wait {1e3 * model.allreduce:.2f} ms, update "
            f"{1e3 * model.update:.2f} ms, fit error {100 * model.error:.1f}%"
            + (f", statistics read {1e3 * model.statistics:.2f} ms a step (once, whatever k)"
               if model.statistics > 0 else "")]
    unidentified = [w for w in measured_w if not models[w].identified]
    if unidentified:
        lines.append(f"assumed{f' at W = {_and(unidentified)}' if len(measured_w) > 1 else ''}: "
                     f"the step's own work (zero_grad, evaluation, logging) is charged to the "
                     f"passes (one k measured and no pass timed alone): larger k is "
                     f"over-predicted")
    if len(measured_w) > 1 and set(workers) & set(models):
        lines.append(f"measured: W = {_and(measured_w)}, each W's rows from its own steps "
                     f"(compute per pass and allreduce wait as measured at that W)")
    if from_basis and len(measured_w) == 1:
        lines.append(f"extrapolated for W other than {W} (marked W*), not measured: their times "
                     f"come from the run at W = {W}: {ASSUMPTION}; the further from W = {W}, the "
                     f"less they say")
    elif from_basis:
        lines.append(f"extrapolated for W other than {_and(measured_w)} (marked W*), not "
                     f"measured: " + "; ".join(f"W = {_and(ws)} from the rows at W = {b}"
                                                for b, ws in from_basis.items())
                     + f": {ASSUMPTION}; the further from the W measured, the less they say")
    lines += [message for message in warnings.values() if message]
    if set(micro_batch_factors) - {1} and any(m.per_sample is None for m in models.values()):
        lines.append("assumed for another m: compute per pass in proportion to m (one m "
                     "measured)")
    lines += [*notes, ""]
    header = (f"{'W':>3} {'k':>3} {'m':>6} {'S':>7} {'gain':>6} {'eff':>5} {'step ms':>9} "
              f"{'batches/s':>10} {'goodput':>9}" + (f" {'time to T':>10}" if budget else ""))
    lines += ["columns: W workers, k passes per step, m micro-batch and S = W k m in baseline "
              "batches; gain and eff(iciency) at S; batches/s of baseline batches computed; "
              "goodput in baseline steps of progress (tau) per second", header]
    for c in shown:
        marks = [name for name, hit in ((marks_of.get(key(c)), key(c) in marks_of),
                                         ("recommended", c is top)) if hit]
        lines.append(
            f"{str(c.workers) + ('*' if extrapolated(c) else ''):>3} {c.passes:>3} {c.micro_batch:>6.3g} {c.scale:>7.4g} {c.gain:>6.2f} "
            f"{c.efficiency:>5.2f} {1e3 * c.step_time:>9.2f} {c.throughput:>10.2f} "
            f"{c.goodput:>9.2f}" + (f" {_duration(budget / c.goodput):>10}" if budget else "")
            + (f"  <- {', '.join(marks)}" if marks else ""))
    lines += [
        "",
        f"shown: the top {min(TOP, len(grid))} of {len(grid)} configurations by goodput "
        f"(baseline steps of progress per second)"
        + ((", and the measured one" if len(extra) == 1 else ", and the measured ones")
           if extra else ""),
        f"recommended: W = {top.workers}, k = {top.passes}, m = {top.micro_batch:g} "
        f"(S = {top.scale:g}): {top.goodput / measured.goodput:.2f}x the measured goodput"
        + ((f" of W = {W}, k = {here['passes']}" + (f" ({log_dir})" if several else ""))
           if others else "")
        + (f" (W = {top.workers} extrapolated from W = {bases[top.workers]}, not measured"
           + (", whose workers shared a host: see the warning above"
              if warnings.get(bases[top.workers]) else "") + ")"
           if extrapolated(top) else "")
        + (f"; W = {top.workers} is more workers than this machine's {slots} CPU slots: they "
           "need more hosts (hvd-scale run -H)" if slots and top.workers > slots else "")
        + (f"; T = {budget:g} baseline steps in {_duration(budget / top.goodput)} at today's "
           f"statistics" if budget else ""),
    ]
    if schedule is not None:  # the batch schedule for a trainer of one's own (batch_schedule.py)
        segments, use = batch_schedule.plan(columns, base_batch, max_batch)
        text = batch_schedule.render(schedule, segments, seq_len)
        lines += ["", batch_schedule.describe(segments, use, base_batch)]
        if schedule_out:
            pathlib.Path(schedule_out).write_text(text)
            lines.append(f"wrote {schedule_out} ({schedule})")
        else:
            lines += [f"{schedule}:", text.rstrip("\n")]
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
