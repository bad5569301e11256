"""Metric names, once: the engine's, the adapters' and the log's.

Every place a metric appears derives from ``METRICS``: ``Policy.metrics()``, the adapters'
``metrics()``, the CSV columns, the TensorBoard tags (``hvd_scale/<name>``) and the keys Keras's
``ScalingMetrics`` puts into ``logs``. A name that is not here is an error wherever it is written,
never a column silently dropped.

The per-step log that rank 0 writes (metrics.csv, TensorBoard scalars, run.json, a progress bar)
is ``hvd_scale.adapters.log.MetricsLogger``; this module holds names only and imports nothing, so
the engine can use it.
"""

from __future__ import annotations

# The log directory, handed to the workers by `hvd-scale run` and read by the adapters.
LOG_DIR_ENV = "HVD_SCALE_LOG_DIR"
# Write every N-th step's row (``hvd-scale run --log-every``); unset: ``adapters.log.due``'s default.
LOG_EVERY_ENV = "HVD_SCALE_LOG_EVERY"

# name -> meaning; the order is the CSV's. "Latest step" is the optimizer step just applied, so
# ``lr_factor`` and ``lr`` are what that step used, never a forecast of the next one.
METRICS: dict[str, str] = {
    "step": "optimizer steps applied so far",
    "progress": "tau, progress in baseline (S = 1) steps after the latest step",
    "gain": "measured gain r in [1, S], with the latest step's statistics (1 before any)",
    "lr_factor": "factor the latest step applied to the baseline lr (nan before any step)",
    "lr": "lr the latest step applied: baseline lr x lr_factor (first parameter group)",
    "scale": "S, the step's batch in baseline batches (a short step's own: its gain, lr_factor "
             "and efficiency are at that S)",
    "short_step": "1 where the step took fewer micro-batches than announced (an epoch's leftover "
                  "batch, uneven passes across workers), 0 else; the run's S is that of its full "
                  "steps",
    "sigma2": "smoothed variance of a baseline-batch gradient (trace)",
    "mu2": "smoothed squared norm of the true gradient",
    "noise_scale": "sigma2 / mu2: the batch, in baseline batches, past which scaling stops paying",
    "noise_scale_low": "low end of noise_scale's 95% confidence interval (hvd_scale.noise: "
                       "Fieller's interval over the EMA's window); nan until known",
    "noise_scale_high": "high end of noise_scale's 95% interval; inf where mu2 is not told apart "
                        "from 0",
    "efficiency": "gain / S",
    "skipped": "steps skipped for non-finite gradients",
    "sharpness": "top Hessian eigenvalue the lr guard measured last (averaged over workers; "
                 "preconditioned for Adam); nan without a guard",
    "lr_cap": "largest lr the guard allows: margin x the optimizer's stability limit for that "
              "sharpness; inf without a guard or estimate",
    "passes": "k, backward passes per worker the latest step announced (adapt='goodput' changes it)",
    "workers": "W, workers in the job at the latest step (Horovod elastic changes it)",
    "pass_time": "seconds of one pass (forward, backward, its data) in the latest step: timed alone "
                 "with k >= 2 (first gradient to first gradient); with k = 1 the whole time from "
                 "the previous step's end to the wait for the gradients",
    "overhead_time": "seconds of the latest step's own work outside its passes (zero_grad, "
                     "evaluation, logging: from the previous step's end to the wait, less k x "
                     "pass_time); nan where no pass was timed alone (k = 1)",
    "allreduce_time": "seconds the latest step waited for the gradients' allreduce after its passes",
    "update_time": "seconds of the previous step's update (after the wait, to the step's end)",
    "step_time": "overhead_time + passes x pass_time + allreduce_time + update_time "
                 "(hvd_scale.goodput's model; overhead 0 where nan)",
    "statistics_time": "seconds of the latest step's once-a-step statistics read (each worker's "
                       "gradient, read where it is sent), timed apart: a part of pass_time (k = "
                       "1) or overhead_time (k >= 2), a step's cost in the model; 0 where the "
                       "statistics read every pass or nothing",
    "loss": "the loss passed to log_loss() for the step (Keras: ScalingMetrics hands each batch's, "
            "rank 0's)",
    "time": "seconds since the log was opened",
}

# What the engine's Policy.metrics() returns, and what an adapter's metrics() adds to it.
POLICY_METRICS = ("step", "progress", "gain", "lr_factor", "scale", "sigma2", "mu2", "noise_scale",
                  "efficiency", "skipped")
# The lr guard's (hvd_scale.guard; torch only), in every adapter's metrics() and the log.
GUARD_METRICS = ("sharpness", "lr_cap")
# Where a step's time goes (``hvd_scale.goodput``), stamped on the host as the step runs (no
# synchronisation): by the torch adapter always, by Keras's when the metrics are logged.
TIMING_METRICS = ("passes", "workers", "pass_time", "overhead_time", "allreduce_time",
                  "update_time", "step_time", "statistics_time")
# noise_scale's interval (``hvd_scale.noise``), from the run record's noise state.
NOISE_METRICS = ("noise_scale_low", "noise_scale_high")
STEP_METRICS = (POLICY_METRICS + NOISE_METRICS + ("lr", "short_step") + GUARD_METRICS
                + TIMING_METRICS)
# Keras puts these into every batch and epoch ``logs`` (the loss is Keras's own there).
LOGS_METRICS = tuple(k for k in STEP_METRICS
                     if k not in ("step", "skipped", "short_step") + GUARD_METRICS + TIMING_METRICS)


# Per parameter group, with two groups or more: ``group_metric(name, j)`` = "name[j]", columns
# after METRICS' in the CSV (``hvd_scale/name[j]`` in TensorBoard).
GROUP_NOISE_METRICS = ("noise_scale", "noise_scale_low", "noise_scale_high")


def group_metric(name: str, group: int) -> str:
    """The column of metric ``name`` (one of ``GROUP_NOISE_METRICS``) for parameter group j."""
    if name not in GROUP_NOISE_METRICS:
        raise ValueError(f"{name!r} has no per-group column; those are {GROUP_NOISE_METRICS}")
    return f"{name}[{int(group)}]"


def split_group_metric(column: str) -> tuple[str, int] | None:
    """(name, j) of a per-group column ``name[j]``, else None."""
    name, bracket, rest = column.partition("[")
    if not bracket or not rest.endswith("]") or not rest[:-1].isdigit() \
            or name not in GROUP_NOISE_METRICS:
        return None
    return name, int(rest[:-1])


def check_names(names) -> None:
    """Raise ValueError for any metric name that ``METRICS`` does not define (per-group columns,
    ``group_metric``'s, are defined by their name)."""
    unknown = [k for k in names if k not in METRICS and split_group_metric(k) is None]
    if unknown:
        raise ValueError(f"unknown metric name(s) {unknown}; hvd_scale.metrics.METRICS defines "
                         f"{list(METRICS)}")

