"""hvd_scale: learning-rate scaling policies for data-parallel training (Horovod, torch.distributed).

The engine (this package) is numpy only: adapters for PyTorch and Keras 3 live in
``hvd_scale.adapters``, the launcher in ``hvd_scale.launch``.

    GainEstimator     AdaScale's gain r from per-step gradient statistics (estimate.py)
    make_policy       none | linear | sqrt | warmup | adascale | adascale_adam (spec.py; the
                      rules: policies.py)
    run               a run as one value: its record and the pure host step (run.py)
    schedules         baseline lr schedules evaluated in scale-invariant iterations
    reduce            the step's statistics as a record (StepRecord: the vector's one pack
                      and unpack) and reducers (local, mpi4py; Horovod's: hvd_scale.adapters)
    metrics           every metric name, once (the log that writes them: hvd_scale.adapters.log)
"""

from . import schedules
from .estimate import GainEstimator
from .policies import Policy, StepInfo, optimizer_family
from .spec import POLICY_ENV, available_policies, describe_policies, make_policy, parse_spec
from .reduce import LocalReducer, pack_local, unpack_summed
from .schedules import lr_at

__all__ = [
    "GainEstimator", "Policy", "StepInfo", "POLICY_ENV", "available_policies", "describe_policies",
    "make_policy", "optimizer_family", "parse_spec", "schedules", "lr_at", "LocalReducer",
    "pack_local", "unpack_summed",
]
__version__ = "0.2.0"
