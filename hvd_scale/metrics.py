"""Metric names, once, and the per-step metrics log that rank 0 writes.

Every place a metric appears derives from ``METRICS``: ``Policy.metrics()``, the adapters'
``metrics()``, the CSV columns, the TensorBoard tags (``hvd_scale/<name>``) and the keys Keras's
``ScalingMetrics`` puts into ``logs``. A name that is not here is an error wherever it is written,
never a column silently dropped.

Files in a log directory:
    run.json        policy spec, scale, workers, budget: what ``hvd-scale plot`` labels runs with
    metrics.csv     one row per optimizer step, the columns of ``METRICS`` in order
    tb/             TensorBoard scalars under ``hvd_scale/<name>`` (written without TensorFlow)
"""

from __future__ import annotations

import atexit
import csv
import json
import math
import os
import pathlib
import time
import warnings
from typing import Any, Callable, Mapping

LOG_DIR_ENV = "HVD_SCALE_LOG_DIR"

# name -> meaning; the order is the CSV's. "Latest step" is the optimizer step just applied, so
# ``lr_factor`` and ``lr`` are what that step used, never a forecast of the next one.
METRICS: dict[str, str] = {
    "step": "optimizer steps applied so far",
    "progress": "tau, progress in baseline (S = 1) steps after the latest step",
    "gain": "measured gain r in [1, S], with the latest step's statistics (1 before any)",
    "lr_factor": "factor the latest step applied to the baseline lr (nan before any step)",
    "lr": "lr the latest step applied: baseline lr x lr_factor (first parameter group)",
    "scale": "S, the step's batch in baseline batches",
    "sigma2": "smoothed variance of a baseline-batch gradient (trace)",
    "mu2": "smoothed squared norm of the true gradient",
    "noise_scale": "sigma2 / mu2: the batch, in baseline batches, past which scaling stops paying",
    "efficiency": "gain / S",
    "skipped": "steps skipped for non-finite gradients",
    "sharpness": "top Hessian eigenvalue the lr guard measured last (averaged over workers; "
                 "preconditioned for Adam); nan without a guard",
    "lr_cap": "largest lr the guard allows: margin x the optimizer's stability limit for that "
              "sharpness; inf without a guard or estimate",
    "loss": "the loss passed to log_loss() for the step",
    "time": "seconds since the log was opened",
}

# What the engine's Policy.metrics() returns, and what an adapter's metrics() adds to it.
POLICY_METRICS = ("step", "progress", "gain", "lr_factor", "scale", "sigma2", "mu2", "noise_scale",
                  "efficiency", "skipped")
# The lr guard's (hvd_scale.guard; torch only), in every adapter's metrics() and the log.
GUARD_METRICS = ("sharpness", "lr_cap")
STEP_METRICS = POLICY_METRICS + ("lr",) + GUARD_METRICS
# Keras puts these into every batch and epoch ``logs`` (the loss is Keras's own there).
LOGS_METRICS = tuple(k for k in STEP_METRICS if k not in ("step", "skipped") + GUARD_METRICS)
# Written by the logger itself, not given to it.
_LOGGER_OWN = ("time",)


def check_names(names) -> None:
    """Raise ValueError for any metric name that ``METRICS`` does not define."""
    unknown = [k for k in names if k not in METRICS]
    if unknown:
        raise ValueError(f"unknown metric name(s) {unknown}; hvd_scale.metrics.METRICS defines "
                         f"{list(METRICS)}")


def _float(value: Any) -> float:
    if value is None:
        return math.nan
    if hasattr(value, "item"):  # a 0-d tensor or numpy scalar
        value = value.item()
    return float(value)


class MetricsLogger:
    """One row per step in ``log_dir``, written by whichever process is rank 0 at that step.

    Both adapters hand it their ``metrics()`` once per step. The values are host floats the policy
    already has, so logging adds no device-to-host transfer; a loss tensor given to ``set_loss``
    is read only when its row is written.

    The files open at the first row this process writes, so a log survives restarts:

    * a resumed run (its first step > 1, e.g. from a checkpoint) appends to ``metrics.csv``; rows
      from that step on, which the resumed run replays, move to ``metrics.replayed.csv`` (so
      are rows a restored elastic job replays): never silently duplicated, nothing deleted;
    * a fresh run (step 1) into a used directory keeps the earlier run apart: its files become
      ``metrics.N.csv`` and ``run.N.json`` (with a warning);
    * ``rank`` may be a function (``hvd.rank``): under Horovod elastic the rank 0 of the moment
      writes, and a process that stops being rank 0 closes its files.
    """

    def __init__(self, log_dir: str | os.PathLike, *, rank: int | Callable[[], int] = 0,
                 run_info: Mapping | None = None, budget: float | None = None,
                 progress_bar: bool = True, tensorboard: bool = True):
        self.log_dir = pathlib.Path(log_dir)
        self._rank = rank if callable(rank) else (lambda: rank)
        self._run_info = dict(run_info or {})
        self.budget = budget
        self._progress_bar, self._tensorboard = progress_bar, tensorboard
        self._start = time.perf_counter()
        self._csv_file = self._bar = self._tb = None
        self._pending_loss = None
        self._last_step = -math.inf
        self.closed = False

    @property
    def active(self) -> bool:
        """Writing now (this process is rank 0 and the log is open)."""
        return self._csv_file is not None

    def set_loss(self, loss: Any) -> None:
        """Keep the step's loss (a float or a tensor) for the next row; read only when written."""
        self._pending_loss = loss

    def log(self, metrics: Mapping[str, Any]) -> None:
        """Write one row; every key must be a name of ``METRICS`` (the logger adds ``time``)."""
        check_names(metrics)
        if self.closed:
            return
        if self._rank() != 0:
            self._close_files()  # another process is rank 0 now (elastic): it writes
            self._pending_loss = None
            return
        row = {k: math.nan for k in METRICS}
        row.update({k: _float(v) for k, v in metrics.items()})
        if "loss" not in metrics:
            row["loss"] = _float(self._pending_loss)
        row["time"] = time.perf_counter() - self._start
        self._pending_loss = None
        step = row["step"]
        if self._csv_file is None:
            self._open(step)
        elif step <= self._last_step:  # a restored elastic job replays steps it had logged
            self._close_files()
            self._open(step)
        self._last_step = step
        self._csv.writerow(row)
        if self._tb is not None:
            self._tb.add_scalars(int(step), {f"hvd_scale/{k}": v for k, v in row.items()
                                             if k not in ("step", "time")})
        if self._bar is not None:
            self._bar.update(min(row["progress"], self.budget) - self._bar.n)
            self._bar.set_postfix(gain=f"{row['gain']:.2f}", refresh=False)

    # -- files -------------------------------------------------------------------------------------
    def _open(self, first_step: float) -> None:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        path = self.log_dir / "metrics.csv"
        earlier = _read_rows(path)
        if earlier is not None and (first_step <= 1 or earlier[0] != list(METRICS)):
            self._keep_apart()  # a fresh run (or another layout): the earlier run stays whole
            earlier = None
        if earlier is not None:
            header, rows = earlier
            replayed = [r for r in rows if _step(r) >= first_step]
            if replayed:
                _append_rows(self.log_dir / "metrics.replayed.csv", header, replayed)
                _write_rows(path, header, [r for r in rows if _step(r) < first_step])
        else:
            _write_rows(path, list(METRICS), [])
        info = {**self._run_info, "budget": self.budget}
        if first_step > 1:
            info["resumed_at_step"] = int(first_step)
        (self.log_dir / "run.json").write_text(json.dumps(info, indent=2) + "\n")
        # Line-buffered: every row reaches the file at once, so a killed job keeps its rows.
        self._csv_file = open(path, "a", newline="", buffering=1)
        self._csv = csv.DictWriter(self._csv_file, fieldnames=list(METRICS))
        atexit.register(self.close)
        if self._tensorboard:
            from .tb_events import EventWriter  # stdlib only: no TensorFlow in a torch job

            self._tb = EventWriter(self.log_dir / "tb")
        if self._progress_bar and self.budget:
            try:
                from tqdm import tqdm
            except ImportError:
                tqdm = None
            if tqdm is not None:
                # mininterval: under horovodrun every refresh becomes a prefixed output line.
                self._bar = tqdm(total=float(self.budget), unit="tau", desc="progress",
                                 mininterval=10, bar_format="{l_bar}{bar}| {n:.0f}/{total:.0f} tau "
                                                            "[{elapsed}<{remaining}]")

    def _keep_apart(self) -> None:
        n = 1
        while (self.log_dir / f"metrics.{n}.csv").exists():
            n += 1
        warnings.warn(f"hvd_scale: {self.log_dir} holds an earlier run's metrics; a new run starts "
                      f"there, and the earlier files are kept as metrics.{n}.csv and run.{n}.json",
                      stacklevel=4)
        os.replace(self.log_dir / "metrics.csv", self.log_dir / f"metrics.{n}.csv")
        if (self.log_dir / "run.json").exists():
            os.replace(self.log_dir / "run.json", self.log_dir / f"run.{n}.json")

    def _close_files(self) -> None:
        for handle in (self._csv_file, self._tb, self._bar):
            if handle is not None:
                handle.close()
        self._csv_file = self._tb = self._bar = None

    def close(self) -> None:
        self._close_files()
        self.closed = True


def _step(row: Mapping[str, str]) -> float:
    try:
        return float(row["step"])
    except (KeyError, TypeError, ValueError):
        return math.inf  # unreadable: treat as past any resume point (kept aside, not lost)


def _read_rows(path: pathlib.Path):
    """(header, rows) of a CSV with at least a header, else None."""
    if not path.exists():
        return None
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        rows = list(reader)
        header = reader.fieldnames
    return None if not header else (list(header), rows)


def _write_rows(path: pathlib.Path, header, rows) -> None:
    tmp = path.with_suffix(".tmp")
    with open(tmp, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=header)
        writer.writeheader()
        writer.writerows(rows)
    os.replace(tmp, path)  # atomically: a crash here leaves the old file, never half of it


def _append_rows(path: pathlib.Path, header, rows) -> None:
    new = not path.exists()
    with open(path, "a", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=header)
        if new:
            writer.writeheader()
        writer.writerows(rows)
