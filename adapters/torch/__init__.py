"""PyTorch adapter: a torch optimizer plus a learning-rate policy, in one line, under Horovod or
torch.distributed (DDP).

    import horovod.torch as hvd
    from hvd_scale.adapters.torch import DistributedOptimizer           # Horovod

    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    opt = DistributedOptimizer(opt, named_parameters=model.named_parameters())  # policy: --policy
    while not opt.done(budget):          # budget in baseline (S = 1) steps
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()

    from hvd_scale.adapters.torch.ddp import DistributedOptimizer       # torchrun, DDP
    model = torch.nn.parallel.DistributedDataParallel(model)
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model)

Modules: ``optimizer.py`` (the hooks of ``adapters/protocol.py`` in torch, whichever engine:
where torch plugs in, built from parts: the step's statistics in ``statistics.py``, their norms
in ``norms.py``, its checkpoints in ``checkpoint.py``); ``engine.py``, the contract every engine
meets; the engines: ``horovod.py`` (``hvd.DistributedOptimizer``
wrapped; ``process_set.py``: the shared half's collectives in a process set; ``elastic.py``:
Horovod elastic's state handler, registered on import) and ``ddp.py`` (DDP's communication hook;
no Horovod needed); ``scheduler.py`` (torch lr schedulers in baseline steps), ``hessian.py``
(the lr guard's power iteration).

Horovod's names are imported when first used, so that ``hvd_scale.adapters.torch.ddp`` works
where Horovod is not installed.
"""

from .hessian import hessian_top_eigenvalue
from .norms import norms
from .scheduler import ScaleInvariantScheduler

_HOROVOD = {"DistributedOptimizer", "broadcast_state"}

__all__ = ["DistributedOptimizer", "ScaleInvariantScheduler", "broadcast_state", "hessian_top_eigenvalue",
           "norms"]


def __getattr__(name):
    if name in _HOROVOD:
        from . import elastic  # noqa: F401  registers Horovod elastic's state handler
        from . import horovod

        return getattr(horovod, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
