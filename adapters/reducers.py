"""Reducers (``hvd_scale.reduce``'s ``sum(vector) -> vector`` across workers) over Horovod, for
code that drives the engine directly with one framework's Horovod: the adapters themselves fuse
the statistics into the gradients' allreduce instead. Here, not in the engine, because they
import a framework."""

from __future__ import annotations

import numpy as np


class HorovodTorchReducer:
    """horovod.torch.allreduce with op=Sum, in float64 (exact for counts)."""

    def __init__(self, name: str = "hvd_scale.stats"):
        import horovod.torch as hvd
        import torch

        self._hvd, self._torch, self.name = hvd, torch, name

    def sum(self, vector: np.ndarray) -> np.ndarray:
        t = self._torch.from_numpy(np.ascontiguousarray(vector, dtype=np.float64))
        return self._hvd.allreduce(t, op=self._hvd.Sum, name=self.name).numpy()


class HorovodTensorFlowReducer:
    """horovod.tensorflow.allreduce with op=Sum, in float64 (eager)."""

    def __init__(self, name: str = "hvd_scale.stats"):
        import horovod.tensorflow as hvd
        import tensorflow as tf

        self._hvd, self._tf, self.name = hvd, tf, name

    def sum(self, vector: np.ndarray) -> np.ndarray:
        t = self._tf.constant(np.asarray(vector, dtype=np.float64))
        return self._hvd.allreduce(t, op=self._hvd.Sum, name=self.name).numpy()
