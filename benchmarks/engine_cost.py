"""Per-step cost of the hvd_scale engine on the host: Policy.transition with gradient statistics.

    .venv/bin/python benchmarks/engine_cost.py [--repeat 2000] [--number 10] [--output PATH]

Times ``state, info = policy.transition(state, sqnorm_sum, mean_sqnorm, n, scale=S)`` (the
estimator update, the gain, the factor and tau, and the new state record: everything the engine
adds to an optimizer step, not counting the reduction of the statistics or the norms themselves)
for AdaScale and for a fixed rule (linear, which with statistics also
updates the estimator for logging), with 1 and with 100 parameter groups. Statistics are numpy
float64 arrays, as the adapters pass them. Each timing is one timeit repetition of ``--number``
consecutive steps, the cases taking turns; the table gives the median (and the 10th/90th percentiles) over ``--repeat``
repetitions, per step, in microseconds. The table is printed and written, with the date, the
machine and the command, to benchmarks/results/engine_cost.md.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import os
import platform
import subprocess
import sys
import timeit
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402

import hvd_scale  # noqa: E402
from hvd_scale import make_policy  # noqa: E402

SCALE = 8.0
N_MICRO = 8
DEFAULT_OUTPUT = REPO / "benchmarks" / "results" / "engine_cost.md"

CASES = [
    # (label, spec, pass statistics)
    ("adascale", "adascale", True),
    ("linear (fixed rule), with statistics", "linear", True),
    ("linear (fixed rule), no statistics", "linear", False),
]
GROUPS = [1, 100]


def statistics(groups: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    m = rng.uniform(1.0, 2.0, groups)
    return m * N_MICRO, 0.3 * m, N_MICRO  # |g_bar|^2 <= mean |g_i|^2


def make_timer(spec: str, with_stats: bool, groups: int) -> timeit.Timer:
    policy = make_policy(spec)
    s, q, n = statistics(groups) if with_stats else (None, None, None)
    state = policy.init()

    def step():  # one transition; the record is carried from step to step, as a caller does
        nonlocal state
        state, _ = policy.transition(state, s, q, n, scale=SCALE)

    for _ in range(200):  # warm-up
        step()
    return timeit.Timer(step)


def time_cases(cases, repeat: int, number: int) -> list[np.ndarray]:
    """Microseconds per step, one array of `repeat` timings per case.

    The cases take turns (round robin over the repetitions), so that a busy spell of the machine
    slows all of them alike instead of one case's whole run.
    """
    timers = [make_timer(*case) for case in cases]
    times = np.empty((len(timers), repeat))
    for r in range(repeat):
        for i, timer in enumerate(timers):
            times[i, r] = timer.timeit(number)
    return list(times / number * 1e6)


def machine() -> dict[str, str]:
    try:
        nproc = subprocess.run(["nproc"], capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        nproc = str(os.cpu_count())
    cpu = "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return {"nproc": nproc, "cpu": cpu, "python": platform.python_version(),
            "numpy": np.__version__, "hvd_scale": hvd_scale.__version__,
            "platform": platform.platform()}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=2000, help="timeit repetitions (default 2000)")
    parser.add_argument("--number", type=int, default=10, help="steps per repetition (default 10)")
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT, help="markdown file to write")
    args = parser.parse_args(argv)

    load_before = os.getloadavg()
    cases, labels = [], []
    for label, spec, with_stats in CASES:
        # Without statistics the group count does not matter: one row.
        for groups in (GROUPS if with_stats else GROUPS[:1]):
            cases.append((spec, with_stats, groups))
            labels.append((label, groups if with_stats else "-"))
    rows = []
    for (label, groups), us in zip(labels, time_cases(cases, args.repeat, args.number)):
        p10, med, p90 = np.percentile(us, [10, 50, 90])
        rows.append((label, groups, med, p10, p90))

    load_after = os.getloadavg()
    info = machine()
    now = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    try:
        shown = Path(args.output).resolve().relative_to(REPO)
    except ValueError:
        shown = args.output
    command = ".venv/bin/python benchmarks/engine_cost.py" + (
        f" --repeat {args.repeat}" if args.repeat != 2000 else "") + (
        f" --number {args.number}" if args.number != 10 else "") + (
        f" --output {shown}" if Path(args.output).resolve() != DEFAULT_OUTPUT else "")
    table = [
        "| policy | parameter groups | median us/step | p10 | p90 |",
        "|---|---|---|---|---|",
        *(f"| {label} | {g} | {med:.1f} | {p10:.1f} | {p90:.1f} |" for label, g, med, p10, p90 in rows),
    ]
    text = "\n".join([
        "# Engine cost per optimizer step (host, numpy)",
        "",
        f"`Policy.transition(state, sqnorm_sum, mean_sqnorm, n, scale=S)` at S = {SCALE:g}, "
        f"n = {N_MICRO}; timeit, "
        f"{args.repeat} repetitions of {args.number} steps each; microseconds per step "
        "(median, 10th and 90th percentile over the repetitions). Excludes computing the norms "
        "and reducing the statistics vector.",
        "",
        *table,
        "",
        f"- date: {now}",
        f"- machine: {info['nproc']} CPUs (`nproc`), {info['cpu']}; {info['platform']}",
        f"- load average (1 min) before / after: {load_before[0]:.2f} / {load_after[0]:.2f} "
        "(other processes compete for the CPUs when it exceeds the CPU count)",
        f"- software: Python {info['python']}, numpy {info['numpy']}, hvd_scale {info['hvd_scale']}",
        f"- rerun: `{command}` (from the repository root)",
        "",
    ])
    print("\n".join(table))
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(text)
    print(f"\nwritten to {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
