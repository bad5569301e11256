"""#31 item 1, a probe (not the adapter): what a per-pass norm costs with accumulation when the
hook runs in Python, as the torch adapter's does, against the same norm in a C++ tensor hook.

With k passes a step every parameter's gradient of every pass is seen by a tensor hook before
autograd adds it into p.grad (adapters/torch/statistics.py: ``StepStatistics._norm_hook``). On the 120-tensor
MLP at k = 4 that is 480 Python calls a step, and B2 measures adascale / plain 1.24-1.31 there
against ``none``'s 1.03. This probe times, in one process (no Horovod: only the hooks differ),
the same steps (zero_grad, k x (forward, backward), SGD step) with:

- ``plain``: no hook;
- ``python``: the adapter's per-pass norm (``cpu_norm``, appended to a list, a pass counter), in
  a Python tensor hook per parameter;
- ``python_noop``: a Python tensor hook per parameter that does nothing (the call alone);
- ``python_out64``: a Python hook writing the float64 norm into its slot of a [k, tensors]
  buffer (one torch call, no ``.item()``, no check: a float64 norm needs none);
- ``cpp``: a C++ tensor hook per parameter (torch.utils.cpp_extension, built at first run: needs
  g++ and ninja) adding |g|^2 in float64 into one accumulator: no Python per gradient, 5 ops;
- ``cpp_out``: a C++ hook writing the norm into its slot of a [k, tensors] buffer (one kernel, no
  allocation), the squares summed once a step.

The variants take turns in rounds (benchmarks/timing.py), ratios to plain paired round by round.
Rerun: ``.venv/bin/python benchmarks/investigations/hook_probe.py`` (~2 minutes, the build ~30 s of it).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import platform
import statistics
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
import timing  # noqa: E402
from torch_overhead import MODELS  # noqa: E402

from hvd_scale.adapters.torch.norms import cpu_norm  # noqa: E402

KINDS = ("plain", "python_noop", "python", "python_out64", "cpp", "cpp_out")
RESULTS = pathlib.Path(__file__).resolve().parent.parent / "results"

CPP = r'''
#include <torch/extension.h>
// |g|^2 of each pass's gradient, in float64, into acc[0] (and a count into acc[1]), before
// autograd adds g into p.grad: the per-pass statistics with no Python call per gradient.
unsigned add_norm_hook(at::Tensor p, at::Tensor acc) {
  return p.register_hook([acc](const at::Tensor& g) {
    auto n = at::linalg_vector_norm(g, 2, c10::nullopt, false, c10::nullopt).to(at::kDouble);
    acc.select(0, 0).add_(n * n);
    acc.select(0, 1).add_(1.0);
  });
}

// One kernel per gradient and no allocation: the norm is written into its slot out[pass, i]
// (float32, as the adapter's CPU norm); the squares are summed once a step.
static std::vector<int64_t> passes_seen;
unsigned add_norm_out_hook(at::Tensor p, at::Tensor out, int64_t i) {
  if ((int64_t)passes_seen.size() <= i) passes_seen.resize(i + 1, 0);
  return p.register_hook([out, i](const at::Tensor& g) {
    auto slot = out.select(0, passes_seen[i]++).select(0, i);
    at::linalg_vector_norm_out(slot, g, 2, c10::nullopt, false, c10::nullopt);
  });
}
void reset_passes() { std::fill(passes_seen.begin(), passes_seen.end(), 0); }
'''


def build_extension():
    """The hooks' C++, built once into torch's extension cache (~/.cache/torch_extensions)."""
    from torch.utils.cpp_extension import load_inline
    return load_inline("hvd_scale_hook_probe", cpp_sources=CPP,
                       functions=["add_norm_hook", "add_norm_out_hook", "reset_passes"])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="mlp", choices=sorted(MODELS))
    p.add_argument("--passes", type=int, default=4)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--rounds", type=int, default=60)
    p.add_argument("--steps", type=int, default=360)
    p.add_argument("--repeats", type=int, default=3, help="jobs (each in this process, in turn)")
    p.add_argument("--out", default="hook_probe")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    ext = build_extension()
    build, shape = MODELS[args.model]
    g = torch.Generator().manual_seed(0)
    x = torch.randn(args.batch, *shape, generator=g)
    y = torch.randint(0, 10, (args.batch,), generator=g)
    loss_fn = torch.nn.CrossEntropyLoss()

    def variant(kind):
        torch.manual_seed(0)
        model = build()
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        params = [q for q in model.parameters() if q.requires_grad]
        state = {"norms": [], "fired": [0] * len(params), "passes": 0}
        acc = torch.zeros(2, dtype=torch.float64)
        out = torch.zeros(args.passes, len(params))
        out64 = torch.zeros(args.passes, len(params), dtype=torch.float64)
        if kind == "python":
            def hook_of(i):
                def hook(grad):
                    state["norms"].append(cpu_norm(grad))
                    state["fired"][i] += 1
                    if state["fired"][i] > state["passes"]:
                        state["passes"] += 1
                return hook
            for i, q in enumerate(params):
                q.register_hook(hook_of(i))
        elif kind == "python_noop":
            for q in params:
                q.register_hook(lambda grad: None)
        elif kind == "python_out64":
            def hook_out(i):
                def hook(grad):
                    torch.linalg.vector_norm(grad, dtype=torch.float64, out=out64[state["fired"][i], i])
                    state["fired"][i] += 1
                return hook
            for i, q in enumerate(params):
                q.register_hook(hook_out(i))
        elif kind == "cpp":
            for q in params:
                ext.add_norm_hook(q, acc)
        elif kind == "cpp_out":
            for i, q in enumerate(params):
                ext.add_norm_out_hook(q, out, i)

        def passes():
            for _ in range(args.passes):
                loss_fn(model(x), y).backward()

        def step():
            opt.zero_grad()
            passes()
            opt.step()
            state["norms"].clear()
            state["fired"] = [0] * len(params)
            state["passes"] = 0
            acc.zero_()
            finish()

        def finish():
            """The step's one sum of the slots' squares (into acc[0], as the accumulating hook)."""
            if kind == "cpp_out":
                acc[0] = out.double().square().sum()
                ext.reset_passes()
            elif kind == "python_out64":
                acc[0] = out64.square().sum()
        return step, passes, acc, state, finish

    # The hooks measure the same thing: one step's sums of squares agree.
    _, passes, _, state, _ = variant("python")
    passes()
    python_sum = sum(n * n for n in state["norms"])
    sums = {}
    for kind in ("cpp", "cpp_out", "python_out64"):
        _, passes, acc, _, finish = variant(kind)
        passes()
        finish()
        sums[kind] = acc[0].item()
        assert abs(sums[kind] - python_sum) <= 1e-5 * python_sum, (kind, sums[kind], python_sum)
    assert len(state["norms"]) == args.passes * len(list(build().parameters()))
    jobs = []
    for _ in range(args.repeats):
        steps = {kind: variant(kind)[0] for kind in KINDS}
        times = timing.interleave(steps, args.rounds, max(1, args.steps // args.rounds), warmup=10)
        jobs.append(timing.summarize(times, "plain"))
    lines = [f"# #31 probe: per-pass norms in a Python hook against a C++ hook ({args.model}, k = {args.passes}, one process)",
             "", __doc__.split("\n\n")[1].replace("\n", " "), "",
             __doc__.split("\n\n")[2].replace("\n  ", " "), "",
             f"{args.steps} steps per variant per job after 10 of warm-up, {args.rounds} rounds, batch {args.batch}, one thread; "
             f"median over {args.repeats} job(s), each job's in brackets.", "",
             "| variant | ms a step | / plain |", "|---|---|---|"]
    for kind in KINDS:
        ms = statistics.median(j[kind]["median_ms"] for j in jobs)
        if kind == "plain":
            lines.append(f"| {kind} | {ms:.2f} | 1 |")
            continue
        ratios = [j[kind]["ratio_to_plain"] for j in jobs]
        med = statistics.median(ratios)
        lines.append(f"| {kind} | {ms:.2f} | {med:.3f} [{', '.join(f'{r:.3f}' for r in ratios)}] |")
    now = datetime.datetime.now(datetime.timezone.utc)
    lines += ["", f"- date: {now:%Y-%m-%d %H:%M} UTC",
              f"- machine: {os.cpu_count()} CPUs, {platform.processor() or platform.machine()}, torch {torch.__version__}",
              f"- the hooks agree: one step's sum of squared per-pass norms over {len(state['norms'])} gradients "
              f"{python_sum:.9g} (python), " + ", ".join(f"{v:.9g} ({k})" for k, v in sums.items()),
              "- rerun: `" + " ".join([".venv/bin/python benchmarks/investigations/hook_probe.py",
                                        *(sys.argv[1:] if argv is None else argv)]) + "`"]
    (RESULTS / f"{args.out}.md").write_text("\n".join(lines) + "\n")
    (RESULTS / f"{args.out}.json").write_text(json.dumps(jobs, indent=1) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
