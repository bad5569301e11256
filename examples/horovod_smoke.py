"""A 2-process Horovod smoke job: a few steps of data-parallel linear regression in PyTorch.

    .venv/bin/horovodrun --gloo -np 2 -H localhost:2 .venv/bin/python examples/horovod_smoke.py

Each rank fits y = 3x - 1 on its own shard with hvd.DistributedOptimizer; rank 0 prints a short
summary: the size, the controller, the loss before/after, and whether the replicas agree (the
parameters of every rank, allgathered, must be identical).
"""

import sys

import horovod
import horovod.torch as hvd
import torch


def main(steps: int = 50) -> int:
    hvd.init()
    torch.manual_seed(1234 + hvd.rank())  # different data per rank; same start via broadcast
    torch.set_num_threads(1)
    x = torch.randn(256, 1)
    y = 3.0 * x - 1.0 + 0.05 * torch.randn_like(x)

    model = torch.nn.Linear(1, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1 * hvd.size())  # linear lr scaling
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())

    def global_loss():
        with torch.no_grad():
            return hvd.allreduce(torch.nn.functional.mse_loss(model(x), y), op=hvd.Average).item()

    first = global_loss()
    for _ in range(steps):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    last = global_loss()

    params = torch.cat([p.detach().flatten() for p in model.parameters()])
    gathered = hvd.allgather(params.unsqueeze(0))
    in_sync = bool(torch.equal(gathered.min(0).values, gathered.max(0).values))
    if hvd.rank() == 0:
        controller = "gloo" if hvd.gloo_enabled() else "mpi" if hvd.mpi_enabled() else "?"
        w, b = params.tolist()
        print(f"horovod {horovod.__version__}, torch {torch.__version__}: "
              f"{hvd.size()} processes over {controller}")
        print(f"loss {first:.4f} -> {last:.4f} in {steps} steps; w={w:.3f} b={b:.3f} (true 3, -1)")
        print(f"replicas in sync: {in_sync}")
    hvd.shutdown()
    return 0 if in_sync and last < first else 1


if __name__ == "__main__":
    sys.exit(main())
