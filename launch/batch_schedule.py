"""The batch schedule a metrics log measured, for a trainer of one's own (``hvd-scale advise
--schedule FORMAT``): Megatron-LM, OLMo-core or Levanter.

The rule (``plan``): at each logged row, the batch the measured noise allows is the largest
``base_batch x 2^j`` not above ``base_batch x B_low``, where B_low is the low end of the noise
scale's 95% interval (``noise_scale_low``, in baseline batches: ``hvd_scale.noise``; a log
written before the interval: the point estimate ``noise_scale``, said in the header). It is
held non-decreasing (a batch warm-up: the critical batch is ~0 at the start and rises, Merrill
et al. 2025) and capped at ``max_batch``. A batch at or below B_simple keeps a step's efficiency
r(S) / S at about one half or more (McCandlish et al. 2018), and the low end grows the batch
only where the measurement says so at 95%. Powers of two of the base batch: OLMo-core changes by
integer factors only, and each stays divisible by what the base batch was divisible by.

Where in training: a row at progress tau (baseline steps) has seen tau x base_batch samples of a
baseline-batch run; that is the threshold written. A run at a larger batch takes more samples
for the same progress (efficiency below 1), so it reaches each threshold at less progress than
the logged run had: the schedule's switches come early by at most that factor.

The formats, each as its project documents it (checked in tests/test_advise.py):

    megatron   --step-batch-size-schedule "0:B0 T1:B1 ..." (megatron/core/
               num_microbatches_calculator.py, StepBatchsizeNumMicroBatchesCalculator): from a
               number of consumed tokens on (the training loop converts with --seq-length), a
               global batch in samples; thresholds strictly increasing from 0; --global-batch-size
               is the schedule's largest, left out.
    olmo-core  BatchSizeSchedulerCallback(batch_sizes=[...], schedule=[Duration...])
               (src/olmo_core/train/callbacks/batch_size_scheduler.py): global batch sizes in
               tokens, each an integer factor of the one before, none repeated; Durations of one
               unit (tokens), the first 0, strictly increasing. Written as the callback's config
               (JSON: {"batch_sizes": [...], "schedule": [{"value": v, "unit": "tokens"}, ...]}).
    levanter   trainer.train_batch_size as a list of ScheduleStep(start, value) (src/levanter/
               schedule.py, BatchSchedule): from optimizer step ``start`` on, ``value`` sequences
               a batch; the first start 0, sorted. Written as YAML.
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Sequence

from hvd_scale.metrics import check_names

FORMATS = ("megatron", "olmo-core", "levanter")
PROGRESS, LOW, POINT = "progress", "noise_scale_low", "noise_scale"
check_names((PROGRESS, LOW, POINT))
NEEDS_TOKENS = ("megatron", "olmo-core")  # their thresholds (and OLMo-core's batch) are tokens


@dataclasses.dataclass(frozen=True)
class Segment:
    """From ``start`` samples consumed on, a global batch of ``batch`` samples."""

    start: int
    batch: int


def plan(columns: dict[str, list[float]], base_batch: int,
         max_batch: int | None = None) -> tuple[list[Segment], str]:
    """(the segments, which column gave B) from a log's columns (``launch.plot.read_run``).
    ValueError naming what is wrong (no noise scale logged, a bad base or maximum)."""
    if isinstance(base_batch, bool) or not isinstance(base_batch, int) or base_batch < 1:
        raise ValueError(f"--base-batch must be a whole number of samples >= 1 (the baseline "
                         f"batch B0 the log's S counts in), got {base_batch!r}")
    if max_batch is not None and (not isinstance(max_batch, int) or max_batch < base_batch):
        raise ValueError(f"--max-batch must be a whole number of samples >= the base batch "
                         f"{base_batch}, got {max_batch!r}")
    use = LOW if any(math.isfinite(v) for v in columns.get(LOW, [])) else POINT
    values = columns.get(use, [])
    if not any(math.isfinite(v) for v in values):
        raise ValueError("the log has no noise scale (noise_scale_low / noise_scale): log a run "
                         "whose policy measures (adascale), or with measure=True")
    level, segments = 0, [Segment(0, base_batch)]
    top = math.inf if max_batch is None else math.floor(math.log2(max_batch / base_batch))
    for tau, b in zip(columns[PROGRESS], values):
        if not math.isfinite(tau) or math.isnan(b):
            continue  # no measurement at this row
        if math.isinf(b) and max_batch is None:
            continue  # mu2 = 0 measured: no limit from the noise, and none given
        allowed = min(top, math.floor(math.log2(b)) if 1 <= b < math.inf else
                      0 if b < 1 else top)
        if allowed > level:
            level, start = allowed, int(round(tau * base_batch))
            if start <= segments[-1].start:  # two rises within one sample: the later one
                segments[-1] = Segment(segments[-1].start, base_batch * 2 ** level)
            else:
                segments.append(Segment(start, base_batch * 2 ** level))
    return segments, use


def megatron(segments: Sequence[Segment], seq_len: int) -> str:
    pairs = " ".join(f"{s.start * seq_len}:{s.batch}" for s in segments)
    return (f"# Megatron-LM: thresholds in consumed tokens (samples x --seq-length {seq_len}), "
            f"global batch in samples; leave --global-batch-size out (the schedule's largest, "
            f"{max(s.batch for s in segments)}) and --rampup-batch-size; each batch must divide "
            f"by --micro-batch-size x the data-parallel size\n"
            f'--step-batch-size-schedule "{pairs}"\n')


def olmo_core(segments: Sequence[Segment], seq_len: int) -> str:
    config = {"batch_sizes": [s.batch * seq_len for s in segments],
              "schedule": [{"value": s.start * seq_len, "unit": "tokens"} for s in segments]}
    return json.dumps(config, indent=2) + "\n"


def levanter(segments: Sequence[Segment]) -> str:
    """Steps from samples: each segment's start is where the previous ones' samples end (a
    threshold inside a step starts the new batch at the next step)."""
    lines = ["# Levanter: trainer.train_batch_size (ScheduleStep: from step `start`, `value` "
             "sequences a batch)", "trainer:", "  train_batch_size:"]
    step, consumed = 0, 0
    for i, s in enumerate(segments):
        if i:
            prev = segments[i - 1]
            step += math.ceil((s.start - consumed) / prev.batch)
            consumed = s.start
        lines += [f"    - start: {step}", f"      value: {s.batch}"]
    return "\n".join(lines) + "\n"


def render(fmt: str, segments: Sequence[Segment], seq_len: int | None = None) -> str:
    """The schedule in ``fmt`` (one of ``FORMATS``); ValueError naming what is missing."""
    if fmt not in FORMATS:
        raise ValueError(f"--schedule {fmt!r}: must be one of {', '.join(FORMATS)}")
    if fmt in NEEDS_TOKENS and (not isinstance(seq_len, int) or seq_len < 1):
        raise ValueError(f"--schedule {fmt} counts tokens: give --seq-len (tokens per sample, "
                         f"a whole number >= 1), got {seq_len!r}")
    if fmt == "megatron":
        return megatron(segments, seq_len)
    if fmt == "olmo-core":
        return olmo_core(segments, seq_len)
    return levanter(segments)


def describe(segments: Sequence[Segment], use: str, base_batch: int) -> str:
    """One line of the report: the schedule in samples, and what B came from."""
    steps = ", ".join(f"{s.batch} from {s.start:,} samples" for s in segments)
    source = ("the low end of the noise scale's 95% interval" if use == LOW else
              "the noise scale's point estimate (this log has no interval: an older hvd_scale "
              "wrote it), so the batch may grow past what the noise allows")
    return (f"batch schedule (base batch {base_batch} samples, powers of two of it up to "
            f"{source}; held non-decreasing): {steps}")
