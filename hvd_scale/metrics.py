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
from typing import Any, Mapping

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
    "loss": "the loss passed to log_loss() for the step",
    "time": "seconds since the log was opened",
}

# What the engine's Policy.metrics() returns, and what an adapter's metrics() adds to it.
POLICY_METRICS = ("step", "progress", "gain", "lr_factor", "scale", "sigma2", "mu2", "noise_scale",
                  "efficiency", "skipped")
STEP_METRICS = POLICY_METRICS + ("lr",)
# Keras puts these into every batch and epoch ``logs`` (the loss is Keras's own there).
LOGS_METRICS = tuple(k for k in STEP_METRICS if k not in ("step", "skipped"))
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
    """One row per step in ``log_dir``; a no-op on every rank but rank 0.

    Both adapters hand it their ``metrics()`` once per step. The values are host floats the policy
    already has, so logging adds no device-to-host transfer; a loss tensor given to ``set_loss``
    is read only when its row is written.
    """

    def __init__(self, log_dir: str | os.PathLike, *, rank: int = 0, run_info: Mapping | None = None,
                 budget: float | None = None, progress_bar: bool = True, tensorboard: bool = True):
        self.active = rank == 0
        self.budget = budget
        self._start = time.perf_counter()
        self._bar = None
        self._tb = None
        self._pending_loss = None
        if not self.active:
            return
        self.log_dir = pathlib.Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        (self.log_dir / "run.json").write_text(json.dumps({**(run_info or {}), "budget": budget},
                                                          indent=2) + "\n")
        # Line-buffered: every row reaches the file at once, so a killed job keeps its rows.
        self._csv_file = open(self.log_dir / "metrics.csv", "w", newline="", buffering=1)
        atexit.register(self.close)
        self._csv = csv.DictWriter(self._csv_file, fieldnames=list(METRICS))
        self._csv.writeheader()
        if tensorboard:
            from .tb_events import EventWriter  # stdlib only: no TensorFlow in a torch job

            self._tb = EventWriter(self.log_dir / "tb")
        if progress_bar and budget:
            try:
                from tqdm import tqdm
            except ImportError:
                tqdm = None
            if tqdm is not None:
                # mininterval: under horovodrun every refresh becomes a prefixed output line.
                self._bar = tqdm(total=float(budget), unit="tau", desc="progress", mininterval=10,
                                 bar_format="{l_bar}{bar}| {n:.0f}/{total:.0f} tau [{elapsed}<{remaining}]")

    def set_loss(self, loss: Any) -> None:
        """Keep the step's loss (a float or a tensor) for the next row; read only when written."""
        self._pending_loss = loss

    def log(self, metrics: Mapping[str, Any]) -> None:
        """Write one row; every key must be a name of ``METRICS`` (the logger adds ``time``)."""
        check_names(metrics)
        if not self.active:
            return
        row = {k: math.nan for k in METRICS}
        row.update({k: _float(v) for k, v in metrics.items()})
        if "loss" not in metrics:
            row["loss"] = _float(self._pending_loss)
        row["time"] = time.perf_counter() - self._start
        self._pending_loss = None
        self._csv.writerow(row)
        if self._tb is not None:
            self._tb.add_scalars(int(row["step"]), {f"hvd_scale/{k}": v for k, v in row.items()
                                                    if k not in ("step", "time")})
        if self._bar is not None:
            self._bar.update(min(row["progress"], self.budget) - self._bar.n)
            self._bar.set_postfix(gain=f"{row['gain']:.2f}", refresh=False)

    def close(self) -> None:
        if not self.active:
            return
        self._csv_file.close()
        if self._tb is not None:
            self._tb.close()
        if self._bar is not None:
            self._bar.close()
        self.active = False
