"""Horovod elastic with the torch adapter: its state handler, registered on import."""

from __future__ import annotations

import horovod.torch as hvd

from .horovod import DistributedOptimizer, broadcast_optimizer_state


def _elastic_handler():
    """A ``hvd.elastic.TorchState`` handler for this optimizer, registered ahead of Horovod's own
    (whose broadcast expects a flat torch state_dict): commit/restore the nested state, and on a
    sync broadcast it from rank 0 (the run's record, k included). S follows the new world size
    at the next step (``hvd_scale.run.host_step``: ``relayout``), also after a reset that skips
    the sync (workers only removed), and so does what the statistics read (each worker's sum
    from two workers on, every pass at one: decided at each step's first gradient,
    ``StepStatistics.per_pass``)."""
    from horovod.torch.elastic import state as elastic_state

    class ScaledOptimizerStateHandler(elastic_state.OptimizerStateHandler):
        def sync(self):
            opt = self.value
            broadcast_optimizer_state(opt, 0)  # a fresh optimizer takes no step (a single worker's)
            opt.sync_run(0)  # the whole record: a joining worker takes tau, k, the estimates

    registry = elastic_state.get_handler_registry()
    if not any(cls is DistributedOptimizer for cls, _ in registry):
        elastic_state.set_handler_registry([(DistributedOptimizer, ScaledOptimizerStateHandler)] + registry)


_elastic_handler()
