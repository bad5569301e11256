"""Where the torch adapter's fixed per-step time goes, by Python's profiler (#31).

    .venv/bin/python benchmarks/investigations/host_profile.py                 # this checkout, ~3 minutes
    .venv/bin/python benchmarks/investigations/host_profile.py --code REV      # and a git revision, side by side

For each shape (np 2 at k = 1 and k = 4 under horovodrun with the launcher's settings, and one
process at S = 1 started without horovodrun), rank 0 trains benchmarks/torch_overhead.py's
120-tensor MLP under cProfile: forward, backward (where the norms and hooks run) and step. The
adapter's own time is what runs in its files (``adapters/``, ``hvd_scale/``) plus the torch and
numpy calls made from them (not Horovod's: sending and waiting are plain Horovod's work, nor the
wrapped torch optimizer's update); it is reported per step, split by the adapter's function
that spends it, beside the step's total under the profiler (which inflates Python calls: the
split is what to read, not the absolute figures). ``--code REV`` runs the same at a git revision
(``git archive`` into a temporary directory put first on PYTHONPATH). Writes
results/host_profile.md.
"""

from __future__ import annotations

import argparse
import cProfile
import datetime
import io
import json
import os
import pathlib
import pstats
import shlex
import shutil
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[2]
BIN = pathlib.Path(sys.executable).parent
SHAPES = {"np 2, k = 1": (2, 1), "np 2, k = 4": (2, 4), "one process, S = 1": (1, 1)}
OURS = ("/adapters/", "/hvd_scale/")
# Called from the adapter but plain Horovod's work too: sending and waiting for the gradients, the
# wrapped optimizer's update and zero_grad (through torch's compile wrappers).
PLAIN_WORK = ("/horovod/", "/torch/optim/", "/torch/_dynamo/", "/torch/_compile.py")


def _ours(filename: str) -> bool:
    return any(part in filename for part in OURS) and "/benchmarks/" not in filename


def profile(kind: str, passes: int, steps: int) -> dict:
    """Rank 0's profile of `steps` steps (after 20 unprofiled): per-step microseconds."""
    import horovod.torch as hvd
    import torch

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from torch_overhead import MODELS, make_variant

    hvd.init()
    torch.set_num_threads(1)
    build, shape = MODELS["mlp"]
    torch.manual_seed(0)
    model = build()
    opt = make_variant(kind, model, passes)
    g = torch.Generator().manual_seed(hvd.rank())
    x, y = torch.randn(32, *shape, generator=g), torch.randint(0, 10, (32,), generator=g)

    def step():
        opt.zero_grad()
        for _ in range(passes):
            torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()

    for _ in range(20):
        step()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        step()
    prof.disable()
    stats = pstats.Stats(prof, stream=io.StringIO()).stats
    total = sum(v[2] for v in stats.values())  # (cc, nc, tottime, cumtime, callers)
    # Our functions' own time, and the whole time of each call they make outside our files
    # (torch, numpy), charged to the caller; not ``PLAIN_WORK``.
    by_function: dict[str, float] = {}
    for (filename, _, name), (_, _, tt, _, callers) in stats.items():
        if _ours(filename):
            key = f"{pathlib.Path(filename).name}:{name}"
            by_function[key] = by_function.get(key, 0.0) + tt
        elif not any(part in filename for part in PLAIN_WORK):
            for (cfile, _, cname), (_, _, _, ct) in callers.items():
                if _ours(cfile):
                    key = f"{pathlib.Path(cfile).name}:{cname}"
                    by_function[key] = by_function.get(key, 0.0) + ct
    per_step = {k: 1e6 * v / steps for k, v in by_function.items()}
    return {"total_us": 1e6 * total / steps, "ours_us": sum(per_step.values()), "by_function": per_step}


def job(args) -> int:
    out = profile(args.kind, args.passes, args.steps)
    import horovod.torch as hvd
    if hvd.rank() == 0:
        pathlib.Path(args.result).write_text(json.dumps(out))
    return 0


def run_shape(workers: int, passes: int, kind: str, steps: int, code: str | None) -> dict:
    from hvd_scale.launch.jobs import CPU_ENV_DEFAULTS, horovodrun_command

    result = pathlib.Path(tempfile.mkdtemp(prefix="host_profile_")) / "result.json"
    worker = [str(BIN / "python"), str(ROOT / "benchmarks" / "investigations" / "host_profile.py"), "--job", "--kind", kind,
              "--passes", str(passes), "--steps", str(steps), "--result", str(result)]
    cmd = worker if workers == 1 else [str(a) for a in horovodrun_command(worker, 2)]
    env = {**os.environ, **CPU_ENV_DEFAULTS}
    if code:
        env["PYTHONPATH"] = code + os.pathsep + env.get("PYTHONPATH", "")
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900, cwd=ROOT)
        if proc.returncode or not result.exists():
            raise RuntimeError(f"{cmd} failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
        return json.loads(result.read_text())
    finally:
        shutil.rmtree(result.parent, ignore_errors=True)


def snapshot(rev: str, into: str) -> str:
    """The package at ``rev`` as it installs, for PYTHONPATH: ``git archive`` into ``into``, laid
    out by B4's ``snapshot`` (a directory of its own, removed with ``into`` by the caller)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import transformer_bleu as b4

    tree = pathlib.Path(into) / "tree"
    tree.mkdir()
    archive = subprocess.run(["git", "archive", rev], cwd=ROOT, capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(tree)], input=archive, check=True)
    code, _ = b4.snapshot(tree)
    shutil.move(str(code), str(pathlib.Path(into) / "code"))
    return str(pathlib.Path(into) / "code")


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--code", help="a git revision to profile beside this checkout")
    p.add_argument("--kinds", default="none,adascale")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--top", type=int, default=8)
    p.add_argument("--job", action="store_true")
    p.add_argument("--kind", default="adascale")
    p.add_argument("--passes", type=int, default=1)
    p.add_argument("--result", help="where a job writes rank 0's profile (JSON)")
    args = p.parse_args(argv)
    if args.job:
        return job(args)
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                          text=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "adapters", "hvd_scale"], cwd=ROOT,
                           capture_output=True, text=True).stdout.strip()
    codes = {f"{head}{' + changes' if dirty else ''}": None}
    with tempfile.TemporaryDirectory(prefix="hvd_scale_code_") as tmp:
        if args.code:
            rev = subprocess.run(["git", "rev-parse", "--short", args.code], cwd=ROOT,
                                 capture_output=True, text=True, check=True).stdout.strip()
            codes = {rev: snapshot(rev, tmp), **codes}
        results = {}
        for shape, (workers, passes) in SHAPES.items():
            for kind in args.kinds.split(","):
                for label, code in codes.items():
                    r = run_shape(workers, passes, kind, args.steps, code)
                    results[(shape, kind, label)] = r
                    print(f"{shape}, {kind}, {label}: ours {r['ours_us']:.0f} us of {r['total_us']:.0f}",
                          flush=True)
    lines = ["# Where the torch adapter's per-step time goes (cProfile, rank 0; #31)", "",
             "benchmarks/torch_overhead.py's 120-tensor MLP, batch 32, the launcher's CPU settings; "
             f"{args.steps} profiled steps after 20. *ours*: time in the adapter's and engine's files "
             "plus the torch / numpy calls they make, per step; *total*: the whole step (forward, "
             "backward, step) under the profiler, which inflates Python calls: read the split and the "
             "ratio between codes, not the absolute figures.", ""]
    for shape in SHAPES:
        for kind in args.kinds.split(","):
            lines += [f"## {shape}, policy {kind}", "",
                      "| code | ours us / step | total us / step | ours / total |", "|---|---|---|---|"]
            for label in codes:
                r = results[(shape, kind, label)]
                lines.append(f"| {label} | {r['ours_us']:.0f} | {r['total_us']:.0f} | "
                             f"{r['ours_us'] / r['total_us']:.3f} |")
            lines += ["", "| function (file:name) | " + " | ".join(f"{label} us" for label in codes) + " |",
                      "|---|" + "---|" * len(codes)]
            names: dict[str, float] = {}
            for label in codes:
                for name, us in results[(shape, kind, label)]["by_function"].items():
                    names[name] = max(names.get(name, 0.0), us)
            for name in sorted(names, key=names.get, reverse=True)[:args.top]:
                cells = [f"{results[(shape, kind, label)]['by_function'].get(name, 0.0):.0f}" for label in codes]
                lines.append(f"| `{name}` | " + " | ".join(cells) + " |")
            lines.append("")
    lines += [f"- date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC",
              f"- rerun: `.venv/bin/python benchmarks/investigations/host_profile.py {shlex.join(argv)}`".rstrip()]
    out = ROOT / "benchmarks" / "results" / "host_profile.md"
    out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
