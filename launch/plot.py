"""``hvd-scale plot``: several runs on one picture (matplotlib, Agg: no display needed).

Panels: the lr factor each step applied (AdaScale's gain r, adascale_adam's sqrt(r), a fixed
rule's own factor: one quantity for every policy), the effective lr and tau against the
optimizer step; a metric (the loss by default) against tau. Each run is labelled by its policy
and scale from its run.json.
"""

from __future__ import annotations

import csv
import json
import math
import pathlib
from typing import Sequence


def read_run(run_dir: str | pathlib.Path) -> tuple[str, dict[str, list[float]]]:
    run_dir = pathlib.Path(run_dir)
    path = run_dir / "metrics.csv"
    if not path.exists():
        raise FileNotFoundError(f"{run_dir} has no metrics.csv (was the job run with --log-dir {run_dir}?)")
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    if not rows:
        raise ValueError(f"{path} has no rows")
    columns = {k: [float(r[k]) if r[k] not in ("", None) else math.nan for r in rows] for k in rows[0]}
    info_path = run_dir / "run.json"
    info = json.loads(info_path.read_text()) if info_path.exists() else {}
    label = f"{info.get('policy', run_dir.name)}, S={info.get('scale', '?'):g}" \
        if isinstance(info.get("scale"), (int, float)) else str(info.get("policy", run_dir.name))
    return label, columns


def has_values(columns: dict[str, list[float]], name: str) -> bool:
    """The log has the column and a value in it (not nan throughout)."""
    return name in columns and not all(math.isnan(v) for v in columns[name])


def check_metric(metric: str, run_dirs: Sequence[str], runs: list) -> None:
    """The metric panel's column: in every run's log, with a value in at least one (else an
    empty panel would look like a plot)."""
    missing = [str(d) for d, (_, cols) in zip(run_dirs, runs) if metric not in cols]
    if missing:
        raise ValueError(f"--metric {metric!r} is not a column of {', '.join(missing)}; the "
                         f"columns are {', '.join(runs[0][1])}")
    if not any(has_values(cols, metric) for _, cols in runs):
        raise ValueError(f"--metric {metric!r} has no value in any run's metrics.csv")


def plot_runs(run_dirs: Sequence[str], output: str, metric: str | None = None) -> None:
    """``metric`` None: the loss, where a run logged it (torch: ``opt.log_loss``; Keras:
    ``ScalingMetrics``), else the panel says so; a metric asked for by name must be there."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [read_run(d) for d in run_dirs]
    asked, metric = metric is not None, metric or "loss"
    if asked:
        check_metric(metric, run_dirs, runs)
    fig, axes = plt.subplots(2, 2, figsize=(10, 7), constrained_layout=True)
    panels = [(axes[0, 0], "step", "lr_factor", "lr factor applied (AdaScale: r; adascale_adam: "
               "sqrt(r))"), (axes[0, 1], "step", "lr", "effective lr"),
              (axes[1, 0], "step", "progress", "tau (baseline steps)"),
              (axes[1, 1], "progress", metric, f"{metric} vs tau")]
    for ax, x, y, title in panels:
        for label, cols in runs:
            if x in cols and has_values(cols, y):
                ax.plot(cols[x], cols[y], label=label)
        ax.set_title(title)
        ax.set_xlabel("tau" if x == "progress" else "optimizer step")
        ax.grid(alpha=0.3)
    if not any(has_values(cols, metric) for _, cols in runs):
        axes[1, 1].text(0.5, 0.5, "no loss logged\n(torch: opt.log_loss(loss);\nKeras: the "
                        "ScalingMetrics callback)", ha="center", va="center",
                        transform=axes[1, 1].transAxes)
    axes[0, 0].legend(fontsize=8)
    fig.savefig(output, dpi=80)
    plt.close(fig)
