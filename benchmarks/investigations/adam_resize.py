"""Adam's second moment across a change of S (issue #30 item 7), measured in the torch adapter.

    .venv/bin/python benchmarks/investigations/adam_resize.py          # 2 seeds, ~2 min (horovodrun -np 2)

adascale_adam keeps Adam's moments when S changes. v estimates mu^2 + sigma^2 / S per coordinate
(of the step's averaged gradient), so after S shrinks it is too small for the new, noisier
gradients until it has forgotten the old ones (about 1 / (1 - beta2^r) steps), and each step
moves further than a run that was at the new S all along; after S grows, v is too large and the
steps are shorter. This measures it: a noisy least-squares problem (64 features, micro-batches of
8, noise far above the signal near the optimum), adascale_adam with Adam (lr 0.002, betas 0.9 /
0.98), np 2. A run at S = 64 (k = 32) to tau = 3000 then S = 8 (k = 4) to tau = 4000 (``shrink``),
and one at S = 8 throughout (``control``); the same for S growing (8 -> 64 against 64 throughout).
The drift is the weights' movement per unit of tau credited, |w_t - w_{t-1}| / (tau_t -
tau_{t-1}), averaged over a window of tau after the change, as a ratio to the control's over the
same window (1: the change moved nothing by itself). Writes results/adam_resize.md.
"""

from __future__ import annotations

import argparse
import datetime
import os
import pathlib
import statistics
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
D, MICRO, NOISE, LR = 64, 8, 3.0, 0.002
CHANGE, END = 3000.0, 4000.0  # tau at the change, tau at the end
WINDOWS = [(0, 50), (50, 200), (200, 1000)]  # tau after the change


def worker(args) -> None:
    import horovod.torch as hvd
    import torch

    from hvd_scale.adapters.torch import DistributedOptimizer
    from hvd_scale.launch.jobs import print_result

    hvd.init()
    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    w_star = torch.randn(D, dtype=torch.float64) / D ** 0.5
    model = torch.nn.Linear(D, 1, bias=False).double()
    opt = DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=LR, betas=(0.9, 0.98)),
                               named_parameters=model.named_parameters(), policy=args.policy,
                               backward_passes_per_step=args.k0)
    g = torch.Generator().manual_seed(1000 * args.seed + hvd.rank())
    rows, changed = [], args.k0 == args.k1
    while opt.progress < END:
        if not changed and opt.progress >= CHANGE:
            opt.set_passes(args.k1)
            changed = True
        before, tau = model.weight.detach().clone(), opt.progress
        opt.zero_grad()
        for _ in range(opt.backward_passes_per_step):
            x = torch.randn(MICRO, D, generator=g, dtype=torch.float64)
            y = x @ w_star + NOISE * torch.randn(MICRO, generator=g, dtype=torch.float64)
            (((model(x).squeeze(1) - y) ** 2).mean() / 2).backward()
        opt.step()
        rows.append((tau, opt.progress, float((model.weight.detach() - before).norm()),
                     opt.scale, opt.gain))
    if hvd.rank() == 0:
        print_result({"rows": rows})


def run(policy: str, k0: int, k1: int, seed: int) -> list[tuple]:
    from hvd_scale.launch.jobs import horovodrun_command, read_results

    cmd = horovodrun_command([sys.executable, __file__, "--worker", "--policy", policy,
                              "--k0", str(k0), "--k1", str(k1), "--seed", str(seed)], 2,
                             controller="gloo")
    env = {k: v for k, v in os.environ.items() if k != "HVD_SCALE_LOG_DIR"}
    env["OMP_NUM_THREADS"] = "1"
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1200, env=env, cwd=ROOT)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return read_results(proc.stdout)[0]["rows"]


def drift(rows, lo: float, hi: float) -> float:
    """Mean movement per unit of tau over steps starting in [CHANGE + lo, CHANGE + hi)."""
    picked = [move / (after - before) for before, after, move, _, _ in rows
              if CHANGE + lo <= before < CHANGE + hi]
    return statistics.mean(picked)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--worker", action="store_true")
    p.add_argument("--policy", default="adascale_adam")
    p.add_argument("--k0", type=int, default=32)
    p.add_argument("--k1", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--seeds", type=int, default=2)
    p.add_argument("--policies", default="adascale_adam;adascale_adam:max_gain=inf")
    args = p.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    lines = ["# Adam's second moment across a change of S (#30 item 7)", "",
             "Drift per unit of tau credited after the change, as a ratio to a run at the new S all "
             f"along, over windows of tau after the change at tau = {CHANGE:g} (mean over "
             f"{args.seeds} seeds; 1: the change moves nothing by itself). Gains: mean over the "
             "window.", "",
             "| policy | change | " + " | ".join(f"tau +{lo}-{hi}" for lo, hi in WINDOWS)
             + " | gain after (change / control) |",
             "|---|---|" + "---|" * len(WINDOWS) + "---|"]
    for policy in args.policies.split(";"):
        for (k0, k1), label in (((32, 4), "S 64 -> 8"), ((4, 32), "S 8 -> 64")):
            ratios = {w: [] for w in WINDOWS}
            gains = []
            for seed in range(args.seeds):
                changed, control = run(policy, k0, k1, seed), run(policy, k1, k1, seed)
                for lo, hi in WINDOWS:
                    ratios[(lo, hi)].append(drift(changed, lo, hi) / drift(control, lo, hi))
                after = [r[4] for r in changed if CHANGE <= r[0] < CHANGE + 200]
                ref = [r[4] for r in control if CHANGE <= r[0] < CHANGE + 200]
                gains.append((statistics.mean(after), statistics.mean(ref)))
                print(policy, label, seed, {w: round(v[-1], 3) for w, v in ratios.items()},
                      flush=True)
            lines.append(f"| {policy} | {label} | " + " | ".join(
                f"{statistics.mean(v):.2f}" for v in ratios.values())
                + f" | {statistics.mean(a for a, _ in gains):.2f} / "
                  f"{statistics.mean(b for _, b in gains):.2f} |")
    lines += ["", f"- date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC",
              f"- rerun: `.venv/bin/python benchmarks/investigations/adam_resize.py {' '.join(argv or sys.argv[1:])}`".rstrip()]
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "adam_resize.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
