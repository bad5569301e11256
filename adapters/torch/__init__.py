"""PyTorch adapter: ``hvd.DistributedOptimizer`` plus a learning-rate policy, in one line.

    import horovod.torch as hvd
    from hvd_scale.adapters.torch import DistributedOptimizer

    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    opt = DistributedOptimizer(opt, named_parameters=model.named_parameters())  # policy: --policy
    while not opt.done(budget):          # budget in baseline (S = 1) steps
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()

Modules: ``optimizer.py`` (the hooks of ``adapters/protocol.py`` in torch: where torch plugs in;
its statistics in ``statistics.py``, their norms in ``norms.py``, its checkpoints and broadcasts
in ``checkpoint.py``),
``scheduler.py`` (torch lr schedulers in baseline steps), ``hessian.py`` (the lr guard's power
iteration), ``process_set.py`` (the shared half's collectives within a process set),
``elastic.py`` (Horovod elastic's state handler, registered on import).
"""

from . import elastic  # noqa: F401  registers the elastic state handler
from .hessian import hessian_top_eigenvalue
from .checkpoint import broadcast_state
from .norms import norms
from .optimizer import DistributedOptimizer
from .scheduler import ScaleInvariantScheduler

__all__ = ["DistributedOptimizer", "ScaleInvariantScheduler", "broadcast_state", "hessian_top_eigenvalue",
           "norms"]
