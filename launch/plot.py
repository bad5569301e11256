"""``hvd-scale plot``: several runs on one picture (matplotlib, Agg: no display needed).

Panels: the lr factor each step applied (AdaScale's gain r, adascale_adam's sqrt(r), a fixed
rule's own factor: one quantity for every policy), the effective lr (on a log axis, so that each
decay shows as a step of its own size) and tau against the optimizer step; a metric (the loss by
default) against tau; the noise scale B_simple = sigma2 / mu2 against tau with its 95% interval
shaded (``hvd_scale.noise``), for the whole model and, where a run has two parameter groups or
more, per group. Each run is labelled by its directory's name (or a label given for it),
then its policy from run.json and its S as the log's ``scale`` column went over its full steps:
``S=2->1->2`` for an elastic run that lost a worker and got it back (run.json holds only the S it
started at). A short step (``short_step``: an epoch's leftover batch, its row at its own S)
changes no S: the label counts them, ``S=8, 3 short steps``.
"""

from __future__ import annotations

import csv
import json
import math
import pathlib
from typing import Sequence

from hvd_scale.metrics import GROUP_NOISE_METRICS, check_names, group_metric, split_group_metric

NOISE, LOW, HIGH = GROUP_NOISE_METRICS  # the whole model's columns have the same names
check_names(GROUP_NOISE_METRICS)


# An S history longer than this is shortened in the label to as many items: the first values,
# "...", the last.
MAX_SCALES_IN_LABEL = 6


def scale_history(scales: Sequence[float]) -> list[float]:
    """The values S took, in order, each repeat in a row dropped (nan rows skipped)."""
    out: list[float] = []
    for s in scales:
        if not math.isnan(s) and (not out or s != out[-1]):
            out.append(s)
    return out


def run_label(name: str, info: dict, columns: dict[str, list[float]]) -> str:
    """``NAME (POLICY, S=..., N short steps)``: S from the log's scale column over its full
    steps (its changes joined by ->), else run.json's; the short steps counted."""
    short = [s == 1 for s in columns.get("short_step", [])]
    scales = columns.get("scale", [])
    history = scale_history([s for i, s in enumerate(scales) if not (i < len(short) and short[i])])
    if not history and isinstance(info.get("scale"), (int, float)):
        history = [float(info["scale"])]
    if len(history) > MAX_SCALES_IN_LABEL:
        history = history[:MAX_SCALES_IN_LABEL - 2] + [math.nan] + history[-1:]
    parts = [str(info["policy"])] if info.get("policy") else []
    if history:
        parts.append("S=" + "->".join("..." if math.isnan(s) else f"{s:g}" for s in history))
    if any(short):
        parts.append(f"{sum(short)} short step{'s' if sum(short) > 1 else ''}")
    return f"{name} ({', '.join(parts)})" if parts else name


def read_run(run_dir: str | pathlib.Path,
             name: str | None = None) -> tuple[str, dict[str, list[float]]]:
    """The run's label (``run_label``; name: default the directory's) and its metrics columns."""
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
    return run_label(name or run_dir.resolve().name, info, columns), columns


def groups_logged(columns: dict[str, list[float]]) -> int:
    """How many parameter groups the log has per-group noise columns for (0: none)."""
    found = [split_group_metric(k) for k in columns]
    return 1 + max((g[1] for g in found if g is not None), default=-1)


def _interval(low: float, high: float) -> str:
    return f"[{low:.3g}, {high:.3g}] (95%)" if math.isfinite(low) else "(no interval yet)"


def noise_text(columns: dict[str, list[float]], row: int) -> str:
    """The noise scale at ``row`` with its 95% interval, and each group's where logged:
    ``3.2 [2.9, 3.6] (95%); per group: 0: 1.1 [0.9, 1.4] (95%), 1: ...``."""
    value = lambda name: columns.get(name, [math.nan] * (row + 1))[row]  # noqa: E731
    text = f"{value(NOISE):.3g}"
    if LOW in columns:
        text += f" {_interval(value(LOW), value(HIGH))}"
    groups = groups_logged(columns)
    if groups:
        text += "; per group: " + ", ".join(
            f"{j}: {value(group_metric(NOISE, j)):.3g} "
            f"{_interval(value(group_metric(LOW, j)), value(group_metric(HIGH, j)))}"
            for j in range(groups))
    return text


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


def run_names(run_dirs: Sequence[str], labels: Sequence[str] | None = None) -> list[str]:
    """One name per run: the labels given (exactly one per run), else each directory's name, or
    its path as given where two runs share a name."""
    if labels is not None:
        if len(labels) != len(run_dirs):
            raise ValueError(f"--label given {len(labels)} time(s) for {len(run_dirs)} run(s): "
                             "give one --label per RUN_DIR, in the same order")
        return list(labels)
    names = [pathlib.Path(d).resolve().name for d in run_dirs]
    return [n if names.count(n) == 1 else str(d) for n, d in zip(names, run_dirs)]


def plot_runs(run_dirs: Sequence[str], output: str, metric: str | None = None,
              labels: Sequence[str] | None = None):
    """Draw the runs into ``output``; the (closed) matplotlib Figure. ``metric`` None: the loss,
    where a run logged it (torch: ``opt.log_loss``; Keras: ``ScalingMetrics``), else the panel
    says so; a metric asked for by name must be there. labels: one per run (``run_names``)."""
    names = run_names(run_dirs, labels)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [read_run(d, name) for d, name in zip(run_dirs, names)]
    asked, metric = metric is not None, metric or "loss"
    if asked:
        check_metric(metric, run_dirs, runs)
    fig, axes = plt.subplots(3, 2, figsize=(10, 10), constrained_layout=True)
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
    if any(has_values(cols, "lr") for _, cols in runs):
        axes[0, 1].set_yscale("log")  # decays by x0.1 are as tall as the first one
    if not any(has_values(cols, metric) for _, cols in runs):
        axes[1, 1].text(0.5, 0.5, "no loss logged\n(torch: opt.log_loss(loss);\nKeras: the "
                        "ScalingMetrics callback)", ha="center", va="center",
                        transform=axes[1, 1].transAxes)
    axes[0, 0].legend(fontsize=8)
    plot_noise(axes[2, 0], axes[2, 1], runs)
    fig.savefig(output, dpi=80)
    plt.close(fig)
    return fig


def _band(ax, columns, x, point, low, high, label, **style):
    """The noise scale against tau, its 95% interval shaded (an open high end drawn to the top)."""
    line, = ax.plot(columns[x], columns[point], label=label, **style)
    if has_values(columns, low):
        top = [h if math.isfinite(h) else math.nan for h in columns[high]]
        ax.fill_between(columns[x], columns[low], top, color=line.get_color(), alpha=0.2,
                        linewidth=0)


def plot_noise(whole, groups, runs) -> None:
    """The noise scale B_simple with its 95% interval: the whole model (``whole``) and each
    parameter group (``groups``) against tau, on log y axes."""
    for label, cols in runs:
        if "progress" in cols and has_values(cols, NOISE):
            _band(whole, cols, "progress", NOISE, LOW, HIGH, label)
        for j in range(groups_logged(cols)):
            _band(groups, cols, "progress", group_metric(NOISE, j), group_metric(LOW, j),
                  group_metric(HIGH, j), f"{label}, group {j}", linestyle="--")
    for ax, title in ((whole, "noise scale sigma2 / mu2 (baseline batches), 95% interval"),
                      (groups, "noise scale per parameter group")):
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("tau")
        ax.grid(alpha=0.3)
        if ax.has_data():
            ax.set_yscale("log")
            ax.legend(fontsize=7)
    if not whole.has_data():
        whole.text(0.5, 0.5, "no noise scale logged\n(a policy that measures, or measure=True)",
                   ha="center", va="center", transform=whole.transAxes)
    if not groups.has_data():
        groups.text(0.5, 0.5, "one parameter group\n(or a log without per-group columns)",
                    ha="center", va="center", transform=groups.transAxes)
