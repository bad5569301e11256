"""Elastic Horovod job (torch adapter): rank 0 rewrites the host file mid-training to resize the job.

    horovodrun -np 3 --min-np 2 --max-np 3 --host-discovery-script discover.sh --network-interfaces lo \\
        python elastic_worker.py --hosts-file hosts --resize-at 6 --resize-to 2 --budget 40

Each rank reports every step it takes (RESULT lines tagged "step") and a final summary.
"""

import horovod.torch as hvd
import torch

from _elastic import after_step, emit, emit_final, parser
from hvd_scale.adapters.torch import DistributedOptimizer


TEACHER = torch.randn(8, 3, generator=torch.Generator().manual_seed(7))


def reference_passes(model, opt, step, rank):
    """k passes of batches of their own; each pass's gradient, flat, computed apart (a functional
    call on detached copies: Horovod's hooks see only the real backward)."""
    params = dict(model.named_parameters())
    micro = []
    for p in range(opt.backward_passes_per_step):
        g = torch.Generator().manual_seed(1000 * step + 10 * rank + p)
        x = torch.randn(16, 8, generator=g, dtype=torch.float64)
        y = (x.float() @ TEACHER).argmax(1)
        copies = {n: t.detach().clone().requires_grad_() for n, t in params.items()}
        loss = torch.nn.functional.cross_entropy(torch.func.functional_call(model, copies, (x,)), y)
        micro.append(torch.cat([t.reshape(-1) for t in torch.autograd.grad(
            loss, list(copies.values()))]).tolist())
        torch.nn.functional.cross_entropy(model(x), y).backward()
    return micro


def main():
    p = parser("elastic job, torch adapter")
    p.add_argument("--policy", default="adascale")
    p.add_argument("--adam", action="store_true", help="Adam with adascale_adam")
    p.add_argument("--passes-at", type=int, default=None,
                   help="with adapt='goodput': every rank sets 2 passes per step at this step")
    p.add_argument("--passes", type=int, default=1, help="k, backward passes per step")
    p.add_argument("--reference", action="store_true",
                   help="float64, a batch of its own per pass, and each step's micro-gradients "
                        "reported (kind 'micro'), for tests/workers/_reference.py's replay")
    args = p.parse_args()
    hvd.init()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
    if args.reference:
        model.double()
    inner = torch.optim.Adam(model.parameters(), lr=0.01) if args.adam else \
        torch.optim.SGD(model.parameters(), lr=0.2)
    adapt = {} if args.passes_at is None else \
        {"adapt": "goodput", "max_passes": 2, "adapt_every": 10_000}  # k changed by hand below
    opt = DistributedOptimizer(inner, named_parameters=model.named_parameters(),
                               policy="adascale_adam" if args.adam else args.policy,
                               backward_passes_per_step=args.passes, budget=args.budget, **adapt)
    state = hvd.elastic.TorchState(model=model, optimizer=opt, resized=False)

    @hvd.elastic.run
    def train(state):
        while not opt.done():
            step = opt.steps
            g = torch.Generator().manual_seed(1000 * step + hvd.rank())
            x = torch.randn(16, 8, generator=g)
            y = (x @ TEACHER).argmax(1)  # a learnable task, so runs can be compared on quality
            opt.zero_grad()
            if args.reference:
                micro = reference_passes(model, opt, step, hvd.rank())
            else:
                for _ in range(opt.backward_passes_per_step):  # 2 after --passes-at
                    torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            if args.reference:  # what the step took and did, for the replay
                emit(hvd, kind="micro", step=opt.steps, size=hvd.size(), micro=micro,
                     factor=opt.lr_factor, progress=opt.progress, scale=opt.scale,
                     passes=opt.backward_passes_per_step, skipped=opt.skipped)
            # The estimator's updates: a step whose statistics were measured adds one.
            emit(hvd, kind="estimates", step=opt.steps, size=hvd.size(),
                 updates=opt.run_state.policy.estimator.updates)
            if args.passes_at is not None and opt.steps == args.passes_at:
                opt.set_passes(2)
            after_step(hvd, args, state, opt)
            state.commit()  # commits the policy with the optimizer, and checks for host changes

    train(state)
    g = torch.Generator().manual_seed(999)  # a fixed held-out batch, the same for every run
    x = torch.randn(512, 8, generator=g)
    y = (x @ TEACHER).argmax(1)
    with torch.no_grad():
        eval_loss = float(torch.nn.functional.cross_entropy(model(x.to(model[0].weight.dtype)), y))
    adam = {}
    if args.adam:  # Adam's moments after the resize: kept (committed, broadcast), not reset
        states = [opt.state[p] for p in model.parameters()]
        adam = {"adam_step": float(states[0]["step"]),
                "moments": float(sum(s["exp_avg_sq"].double().sum() for s in states))}
    emit_final(hvd, opt, eval_loss,
               checksum=float(sum(p.detach().double().sum() for p in model.parameters())), **adam)


if __name__ == "__main__":
    main()
