"""Per-step metrics on rank 0: a CSV file, TensorBoard event files and a progress bar in tau.

Both adapters hand their policy's ``metrics()`` (plus the effective lr and, when the user passes
it, the loss) to ``MetricsLogger.log`` once per step. The values are host floats the policy already
has, so logging adds no device-to-host transfer; a loss tensor is read only when the row is written.

Files in the log directory:
    run.json        policy spec, scale, workers, budget: what ``hvd-scale plot`` labels runs with
    metrics.csv     one row per optimizer step, columns ``COLUMNS``
    tb/             TensorBoard scalars under ``hvd_scale/<column>``
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
COLUMNS = ["step", "progress", "gain", "lr_factor", "lr", "scale", "sigma2", "mu2", "noise_scale",
           "efficiency", "skipped", "loss", "time"]


def _float(value: Any) -> float:
    if value is None:
        return math.nan
    if hasattr(value, "item"):  # a 0-d tensor or numpy scalar
        value = value.item()
    return float(value)


class MetricsLogger:
    """Writes one row per step; a no-op on every rank but ``rank``'s owner (rank 0)."""

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
        self._csv = csv.DictWriter(self._csv_file, fieldnames=COLUMNS, extrasaction="ignore")
        self._csv.writeheader()
        if tensorboard:
            try:
                from tensorboard.compat.proto.event_pb2 import Event
                from tensorboard.compat.proto.summary_pb2 import Summary
                from tensorboard.summary.writer.event_file_writer import EventFileWriter
            except ImportError:  # TensorBoard is optional: the CSV is always written
                pass
            else:
                self._tb = EventFileWriter(str(self.log_dir / "tb"))
                self._event, self._summary = Event, Summary
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
        if not self.active:
            return
        row = {k: _float(v) for k, v in metrics.items()}
        row["loss"] = _float(self._pending_loss) if "loss" not in metrics else row["loss"]
        row["time"] = time.perf_counter() - self._start
        self._pending_loss = None
        self._csv.writerow(row)
        if self._tb is not None:
            values = [self._summary.Value(tag=f"hvd_scale/{k}", simple_value=row[k])
                      for k in COLUMNS if k not in ("step", "time") and not math.isnan(row.get(k, math.nan))]
            self._tb.add_event(self._event(wall_time=time.time(), step=int(row["step"]),
                                           summary=self._summary(value=values)))  # flushed by its thread
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
