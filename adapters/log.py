"""The per-step metrics log that rank 0 writes: CSV, TensorBoard scalars, run.json, a progress bar.

Files in a log directory:
    run.json        policy spec, scale, workers, budget: what ``hvd-scale plot`` labels runs with;
                    rank 0's host: its CPUs and the workers on it (``host_facts``); facts learnt
                    as the run goes (``note``: ``zero_gradients_at_step``)
    metrics.csv     one row per optimizer step (thinned on long runs: ``due``), the columns of
                    ``hvd_scale.metrics.METRICS`` in order, then with two parameter groups or
                    more each group's noise scale (``columns``)
    tb/             TensorBoard scalars under ``hvd_scale/<name>``, written by tensorboardX (imported
                    when the first row is written; it never imports TensorFlow)

The metric names are the engine's (``hvd_scale.metrics``); writing them is the adapters' business.
"""

from __future__ import annotations

import atexit
import csv
import itertools
import json
import math
import os
import pathlib
import sys
import time
import warnings
from typing import Any, Callable, Mapping

from hvd_scale.metrics import (GROUP_NOISE_METRICS, METRICS, check_names, group_metric,
                               split_group_metric)

# Numbers this process's TensorBoard files (with its pid), so a log reopened within the same second
# (a replay under elastic) never reuses, and truncates, an earlier file's name.
_TB_FILES = itertools.count()
# Seconds between flushes of the TensorBoard file, so TensorBoard follows a run as it goes.
TB_FLUSH_SECS = 10


def due(step: float, every: int | None = None) -> bool:
    """Is this step's row written? ``every`` N: steps 1, N, 2N, ...; None (the default): every
    step up to 1,000, every 10th up to 10,000, every 100th after, so a 500,000-step job writes
    ~7,000 rows while short runs (and a long run's start) keep each step. The last step of a
    log is written at ``close`` whatever it is."""
    step = int(step)
    if every is None:
        every = 1 if step <= 1_000 else 10 if step <= 10_000 else 100
    return step == 1 or step % every == 0


def check_every(every: Any, name: str = "log every") -> int | None:
    """``every`` for ``due``: None, or an integer >= 1; ValueError naming ``name`` (the argument,
    flag or variable it came from) otherwise."""
    if every is not None and (isinstance(every, bool) or not isinstance(every, int) or every < 1):
        raise ValueError(f"{name} must be an integer >= 1 (steps between metrics rows), "
                         f"got {every!r}")
    return every


# Where a launcher says how many workers share this host (Horovod's Gloo launcher and its Ray
# executor; OpenMPI's mpirun; torchrun): the first one set.
LOCAL_SIZE_VARIABLES = ("HOROVOD_LOCAL_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE", "LOCAL_WORLD_SIZE")


def host_facts() -> dict[str, int | None]:
    """What run.json records of the host that writes the log (rank 0's): its CPUs, and how
    many workers shared it (None: no launcher said). ``hvd-scale advise`` reads them: workers
    that share a host's cores pass at another pace at another W."""
    shared = None
    for name in LOCAL_SIZE_VARIABLES:
        try:
            shared = int(os.environ[name])
            break
        except (KeyError, ValueError):
            continue
    return {"host_cpus": os.cpu_count(), "workers_on_host": shared}


def columns(names) -> list[str]:
    """The CSV's columns for rows with the metrics ``names``: ``METRICS`` in order, then the
    per-group ones among ``names`` (``hvd_scale.metrics.group_metric``), group by group."""
    groups = {split_group_metric(k) for k in names} - {None}
    ordered = sorted(groups, key=lambda g: (g[1], GROUP_NOISE_METRICS.index(g[0])))
    return list(METRICS) + [group_metric(name, j) for name, j in ordered]


def _float(value: Any) -> float:
    if value is None:
        return math.nan
    if hasattr(value, "item"):  # a 0-d tensor or numpy scalar
        value = value.item()
    return float(value)


class MetricsLogger:
    """One row per step in ``log_dir``, written by whichever process is rank 0 at that step.

    Both adapters hand it their ``metrics()`` once per step. The values are host floats the policy
    already has, so logging adds no device-to-host transfer. A due row waits for the step's
    loss (``set_loss``, after the step), and a loss tensor is read when its row is written.

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
                 progress_bar: bool = True, tensorboard: bool = True, every: int | None = None):
        self.every = check_every(every)
        # The latest step not due: (its metrics, called only at close; its loss).
        self._unwritten: tuple[Callable[[], Mapping[str, Any]], Any] | None = None
        # The latest due row, waiting for its loss: (its metrics, the time of its step).
        self._held: tuple[dict[str, Any], float] | None = None
        self._latest: int | None = None  # the latest step() of this process
        self._latest_has_loss = False
        self._loss_key: tuple[int, int] | None = None  # (steps, skipped) at the latest set_loss
        self.log_dir = pathlib.Path(log_dir)
        self._rank = rank if callable(rank) else (lambda: rank)
        self._run_info = dict(run_info or {})
        self.budget = budget
        self._progress_bar, self._tensorboard = progress_bar, tensorboard
        self._start = time.perf_counter()
        self._csv_file = self._bar = self._tb = None
        self._header: list[str] | None = None  # the CSV's columns, set when it opens
        self._last_step = -math.inf
        self.closed = False

    @property
    def active(self) -> bool:
        """Writing now (this process is rank 0 and the log is open)."""
        return self._csv_file is not None

    def set_loss(self, loss: Any, step: int | None = None, skipped: int = 0) -> None:
        """The loss (a float or a tensor) of the step just taken, into that step's row, which
        waits for it (``step``); the meaning users read is ``Readout.log_loss``'s docstring.

        ``step`` and ``skipped``: the run's counts when the loss came (None: the latest step),
        to tell a second call for one step (warned, ignored) from a call after a skipped step
        (no row: ignored), and a call before this process's first step (warned, ignored)."""
        key = None if step is None else (int(step), int(skipped))
        if key is not None and key == self._loss_key:
            self._warn(f"log_loss() was called twice for step {key[0]}; the first loss is kept "
                       "(call it once per step, after step())")
            return
        self._loss_key = key
        if self._latest is None:
            if key is None or key[1] == 0:  # skipped steps (AMP's first ones) have no row
                self._warn("log_loss() was called before this process's first step(): the loss "
                           "is that of the step just taken, so call it after step(); this one "
                           "is not logged")
            return
        if key is not None and key[0] != self._latest:
            return  # an elastic reset took the run back: the step it was for is gone
        if self._latest_has_loss:
            if key is None:
                self._warn(f"log_loss() was called twice for step {self._latest}; the first "
                           "loss is kept (call it once per step, after step())")
            return  # else a step was skipped since (non-finite gradients): it has no row
        self._latest_has_loss = True
        if self._held is not None:
            (row, at), self._held = self._held, None
            self.log({**row, "loss": loss}, at=at)
        elif self._unwritten is not None:
            self._unwritten = (self._unwritten[0], loss)

    def _warn(self, message: str) -> None:
        if self._rank() == 0:  # once, where the rows are written
            warnings.warn(f"hvd_scale: {message}", stacklevel=4)

    def step(self, step: float, metrics: Callable[[], Mapping[str, Any]]) -> None:
        """An optimizer step: its row (``metrics()``, called only then) if ``due``, waiting for
        ``set_loss`` (or the next step, or ``close``); else kept to be written at ``close``
        should it be the last."""
        self._flush_held()
        self._latest, self._latest_has_loss = int(step), False
        if due(step, self.every):
            self._unwritten = None
            self._held = (dict(metrics()), time.perf_counter() - self._start)
        else:
            self._unwritten = (metrics, None)

    def _flush_held(self) -> None:
        if self._held is not None:
            (row, at), self._held = self._held, None
            self.log(row, at=at)

    def log(self, metrics: Mapping[str, Any], at: float | None = None) -> None:
        """Write one row; every key must be a name of ``METRICS``. The logger adds ``time``:
        ``at`` (seconds since the logger started, when its step ended), else now."""
        check_names(metrics)
        if self.closed:
            return
        if self._rank() != 0:
            self._close_files()  # another process is rank 0 now (elastic): it writes
            return
        header = columns(metrics) if self._csv_file is None else self._header
        row = {k: math.nan for k in header}
        # a per-group column the open file lacks cannot occur (the groups are fixed for a run)
        row.update({k: _float(v) for k, v in metrics.items() if k in row})
        row["time"] = time.perf_counter() - self._start if at is None else at
        step = row["step"]
        if self._csv_file is None:
            self._open(step, header)
        elif step <= self._last_step:  # a restored elastic job replays steps it had logged
            self._close_files()
            self._open(step, header)
        self._last_step = step
        self._csv.writerow(row)
        if self._tb is not None:
            # NaN and inf (no gain yet, no guard) are left out: TensorBoard draws neither, and
            # tensorboardX warns at each. The CSV has them.
            for k, v in row.items():
                if k not in ("step", "time") and math.isfinite(v):
                    self._tb.add_scalar(f"hvd_scale/{k}", v, int(step))
        if self._bar is not None:
            self._bar.update(min(row["progress"], self.budget) - self._bar.n)
            self._bar.set_postfix(gain=f"{row['gain']:.2f}", refresh=False)

    # -- files -------------------------------------------------------------------------------------
    def _open(self, first_step: float, header: list[str]) -> None:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self._header = header
        path = self.log_dir / "metrics.csv"
        earlier = _read_rows(path)
        if earlier is not None and (first_step <= 1 or earlier[0] != header):
            self._keep_apart()  # a fresh run (or another layout): the earlier run stays whole
            earlier = None
        if earlier is not None:
            header, rows = earlier
            replayed = [r for r in rows if _step(r) >= first_step]
            if replayed:
                _append_rows(self.log_dir / "metrics.replayed.csv", header, replayed)
                _write_rows(path, header, [r for r in rows if _step(r) < first_step])
        else:
            _write_rows(path, header, [])
        if first_step > 1:
            self._run_info["resumed_at_step"] = int(first_step)
        else:
            self._run_info.pop("resumed_at_step", None)
        self._write_info()
        # Line-buffered: every row reaches the file at once, so a killed job keeps its rows.
        self._csv_file = open(path, "a", newline="", buffering=1)
        self._csv = csv.DictWriter(self._csv_file, fieldnames=header)
        atexit.register(self.close)
        if self._tensorboard:
            SummaryWriter = _import_summary_writer()
            self._tb = SummaryWriter(str(self.log_dir / "tb"), flush_secs=TB_FLUSH_SECS,
                                     filename_suffix=f".{os.getpid()}.{next(_TB_FILES)}")
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

    def _write_info(self) -> None:
        info = {**self._run_info, "budget": self.budget}
        for key, value in host_facts().items():  # what the caller gave first
            info.setdefault(key, value)
        (self.log_dir / "run.json").write_text(json.dumps(info, indent=2) + "\n")

    def note(self, key: str, value: Any) -> None:
        """A fact about the run learnt as it goes (e.g. ``zero_gradients_at_step``), into
        run.json: now where the log is open, else when it opens."""
        self._run_info[key] = value
        if self.active:
            self._write_info()

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
        if not self.closed:
            self._flush_held()
        last, self._unwritten = self._unwritten, None
        if last is not None and not self.closed:
            try:  # the run's last step, whatever the interval (its row still describes the state)
                self.log({**last[0](), "loss": last[1]})
            except Exception as e:  # noqa: BLE001 (also at exit: never fail the job over a row)
                warnings.warn(f"hvd_scale: the last step's metrics row was not written: {e}")
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


def _import_summary_writer():
    """``tensorboardX.SummaryWriter``, imported without importing torch where it is not loaded.

    tensorboardX imports torch when it can (for a type hint): a Keras job on TensorFlow would pay
    torch's start-up and memory for nothing. ``sys.modules["torch"] = None`` makes that import
    fail as if torch were not installed, for the length of the import.
    """
    block = "torch" not in sys.modules
    if block:
        sys.modules["torch"] = None
    try:
        from tensorboardX import SummaryWriter
    finally:
        if block and sys.modules.get("torch", False) is None:
            del sys.modules["torch"]
    return SummaryWriter
