"""What differs between Keras backends for the adapter: Horovod's module, the gradient
allreduce, the squared norms (in each backend's fused kernels), the call to the engine on the
host, the step clock's stamps, and elastic's run wrapper.

The optimizer (``optimizer.py``) is written once in ``keras.ops``; ``current()`` picks the class
for ``keras.backend.backend()`` in one ``if``, as Keras picks its own backend optimizer.

    tensorflow  horovod.tensorflow; the engine runs through tf.numpy_function, so the step can be
                traced into a tf.function (model.fit's train function)
    torch       horovod.torch; eager, the engine is a plain call
    jax         refused: Horovod has no JAX binding
"""

from __future__ import annotations

import functools
from typing import Callable, Sequence

import keras
import numpy as np

from hvd_scale.adapters.environment import elastic
from hvd_scale.reduce import SMALLEST_MEAN_SQUARE


class TensorFlowBackend:
    name = "tensorflow"

    def __init__(self):
        import horovod.tensorflow as hvd
        import tensorflow as tf

        self.hvd, self._tf = hvd, tf

    def check_context(self) -> None:
        """Refuse the contexts Horovod's TensorFlow ops cannot run in."""
        if _in_xla_context():
            raise ValueError(
                "hvd_scale's DistributedOptimizer uses Horovod collectives, which XLA cannot "
                "compile (this Horovod build has no XLA ops): compile the model with "
                "jit_compile=False (model.compile(..., jit_compile=False)) or do not use "
                "tf.function(jit_compile=True)")
        if self._tf.distribute.has_strategy():
            raise ValueError("DistributedOptimizer distributes with Horovod; do not use it inside "
                             "a tf.distribute strategy scope")

    def eager(self) -> bool:
        return self._tf.executing_eagerly()

    def world_size(self):
        """hvd.size() as a tensor; under Horovod elastic read when the graph runs, not when it is
        traced (a resize must not leave a train function with the old size, as Horovod does)."""
        tf = self._tf
        return tf.cast(self.hvd.size_op() if elastic() else self.hvd.size(), tf.float64)

    def stamp(self, fn: Callable[[], None], after: Sequence):
        """``fn()`` (a clock's stamp) on the host once ``after`` are computed, as a graph op;
        the token it returns is what ``allreduce_average(after=...)`` waits for."""
        tf = self._tf
        with tf.control_dependencies(list(after)):
            return tf.numpy_function(functools.partial(_stamp, fn), [], tf.float64, stateful=True,
                                     name="hvd_scale_clock")

    def allreduce_average(self, tensors: Sequence, name: str, after=None) -> list:
        """hvd.grouped_allreduce(op=Average), one group per dtype (Horovod's TensorFlow grouped op
        takes one dtype); order kept. Groups in order of first appearance: the same on every rank.
        ``after``: a ``stamp``'s token, run first."""
        tf = self._tf
        with tf.control_dependencies([] if after is None else [after]):
            return self._allreduce_average(tensors, name)

    def _allreduce_average(self, tensors: Sequence, name: str) -> list:
        groups: dict = {}
        for i, t in enumerate(tensors):
            groups.setdefault(t.dtype, []).append(i)
        out: list = [None] * len(tensors)
        for dtype, indices in groups.items():
            suffix = "" if len(groups) == 1 else f".{dtype.name}"
            reduced = self.hvd.grouped_allreduce([tensors[i] for i in indices],
                                                 op=self.hvd.Average, name=name + suffix)
            for i, r in zip(indices, reduced):
                out[i] = r
        return out

    def sum_of_squares(self, tensors: Sequence):
        """sum_i |t_i|^2 as a float64 scalar: one fused l2_loss kernel per tensor (half types in
        float32) and one add_n per dtype, not a square, a sum, a cast and an add per tensor.

        float32 squares overflow from |t| ~ 1.8e19 on, where the tensors are still finite (a
        finite step would be called non-finite), and underflow below |t| ~ 1e-19 (a loss scaled
        far down): then, and only then (one cond on the total), the sum is taken again on
        float64 copies."""
        tf = self._tf

        def total(wide: bool):
            groups: dict = {}
            for t in tensors:
                if wide or t.dtype not in (tf.float32, tf.float64):
                    t = tf.cast(t, tf.float64 if wide else tf.float32)
                groups.setdefault(t.dtype, []).append(tf.nn.l2_loss(t))
            out = tf.constant(0.0, tf.float64)
            for losses in groups.values():
                out += tf.cast(2 * tf.add_n(losses), tf.float64)
            return out

        fast = total(False)
        # Small enough that float32 squares underflowed (mean square below SMALLEST_MEAN_SQUARE)?
        elements = float(sum(t.shape.num_elements() or 0 for t in tensors))
        plain = tf.math.is_finite(fast) & (fast >= elements * SMALLEST_MEAN_SQUARE)
        return tf.cond(plain, lambda: fast, lambda: total(True))

    def host_call(self, fn: Callable, args: Sequence, name: str):
        """fn(*numpy args) -> (float64 vector, float64 vector), as a graph op (numpy_function)."""
        tf = self._tf
        vector, values = tf.numpy_function(fn, list(args), [tf.float64, tf.float64],
                                           stateful=True, name=name)
        return vector, values

    def broadcast_variables(self, variables, root_rank: int) -> None:
        self.hvd.broadcast_variables([v.value if isinstance(v, keras.Variable) else v
                                      for v in variables], root_rank=root_rank)

    def elastic_run(self, func):
        """``hvd.elastic.run`` for TensorFlow, without its silent failure: Horovod's wrapper turns
        an ``UnknownError`` from a Horovod collective into a restore-and-retry, but *returns
        None* on any other ``UnknownError`` (e.g. a Python error raised inside a
        ``tf.numpy_function``), so training stops early as if it had finished. This re-raises."""
        from horovod.common.elastic import run_fn
        from horovod.common.exceptions import HorovodInternalError
        from horovod.tensorflow.elastic import _reset

        tf = self._tf

        @functools.wraps(func)
        def wrapper(state, *args, **kwargs):
            try:
                return func(state, *args, **kwargs)
            except tf.errors.UnknownError as e:
                # Horovod's own test: the op names of its collectives in the message.
                if any(op in e.message for op in ("HorovodAllreduce", "HorovodAllgather",
                                                  "HorovodBroadcast")):
                    raise HorovodInternalError(e) from e
                raise
        return run_fn(wrapper, _reset)


class TorchBackend:
    name = "torch"

    def __init__(self):
        import horovod.torch as hvd
        import torch

        from hvd_scale.adapters.torch import norms  # the torch adapter's overflow-free norms

        self.hvd, self._torch, self._norms = hvd, torch, norms

    def check_context(self) -> None:
        pass

    def eager(self) -> bool:
        return True

    def world_size(self):
        return float(self.hvd.size())

    def stamp(self, fn: Callable[[], None], after: Sequence) -> None:
        fn()  # eager: everything before it has run

    def allreduce_average(self, tensors: Sequence, name: str, after=None) -> list:
        # Horovod's torch grouped op takes mixed dtypes; tensors follow the gradients' device.
        return list(self.hvd.grouped_allreduce(list(tensors), op=self.hvd.Average, name=name))

    def sum_of_squares(self, tensors: Sequence):
        """sum_i |t_i|^2 as a float64 scalar: one fused norm kernel per dtype, its norms float64
        (``hvd_scale.adapters.torch.norms``: no finite tensor overflows them, where float32
        squares do from |t| ~ 1.8e19 on), squared and summed in float64."""
        torch = self._torch
        groups: dict = {}
        for t in tensors:
            groups.setdefault(t.dtype, []).append(t)
        total = torch.zeros((), dtype=torch.float64, device=tensors[0].device if tensors else None)
        for ts in groups.values():
            total += self._norms(ts).square().sum()
        return total

    def host_call(self, fn: Callable, args: Sequence, name: str):
        vector, values = fn(*(keras.ops.convert_to_numpy(a) for a in args))
        return (keras.ops.convert_to_tensor(np.asarray(vector), "float64"),
                keras.ops.convert_to_tensor(np.asarray(values), "float64"))

    def broadcast_variables(self, variables, root_rank: int) -> None:
        for i, v in enumerate(variables):
            value = v.value if isinstance(v, keras.Variable) else v
            v.assign(self.hvd.broadcast(value.detach(), root_rank=root_rank,
                                        name=f"hvd_scale.variable.{i}"))

    def elastic_run(self, func):
        """``horovod.torch.elastic.run``: it re-raises errors that are not Horovod's."""
        from horovod.torch.elastic import run

        return run(func)


def _stamp(fn: Callable[[], None]) -> np.ndarray:
    # Module-level (not defined inside the traced step): autograph leaves it alone.
    fn()
    return np.zeros((), np.float64)


def _in_xla_context() -> bool:
    try:  # TensorFlow internals: the XLA context that tf.function(jit_compile=True) enters.
        from tensorflow.python.framework import ops as tf_ops
        from tensorflow.python.ops import control_flow_util
    except ImportError:  # pragma: no cover - moved in a future TF: no check
        return False
    return bool(control_flow_util.GraphOrParentsInXlaContext(tf_ops.get_default_graph()))


_BACKENDS = {"tensorflow": TensorFlowBackend, "torch": TorchBackend}


@functools.cache
def current():
    """The backend class instance for ``keras.backend.backend()``."""
    name = keras.backend.backend()
    if name not in _BACKENDS:
        raise ValueError(f"hvd_scale.adapters.keras runs on the Keras backends {sorted(_BACKENDS)} "
                         f"(Horovod has bindings for those), got KERAS_BACKEND={name!r}"
                         + (": Horovod has no JAX support" if name == "jax" else ""))
    return _BACKENDS[name]()
