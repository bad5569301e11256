"""Horovod collectives in TensorFlow, eagerly and inside tf.function: every rank reports values.

Same inputs as collectives_torch.py (see there); tests/test_environment.py checks them.
"""

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import horovod
import horovod.tensorflow as hvd
import tensorflow as tf

from _report import emit_result


def inputs(r):
    a = tf.constant([r + 1.0, 10.0 * (r + 1), -float(r)], dtype=tf.float32)
    # float32 like `a`: Horovod's TF HorovodGroupedAllreduce op takes one dtype for the whole group
    # ("input #1 was expected to be a float tensor but is a double tensor"); torch's allows a mix.
    b = tf.fill([2, 2], tf.constant(float(r), dtype=tf.float32))
    i = tf.constant([r + 1, 7], dtype=tf.int64)
    c = tf.constant([100.0 * r + 1, 100.0 * r + 2])
    g = tf.constant([[float(r), r + 0.5]])
    return a, b, i, c, g


def collectives(r, n, prefix):
    """The ops; run eagerly, or traced by tf.function. Names differ per mode (Horovod keys on them)."""
    a, b, i, c, g = inputs(r)
    return {
        "allreduce_avg": hvd.allreduce(a, op=hvd.Average, name=prefix + "avg"),
        "allreduce_sum": hvd.allreduce(a, op=hvd.Sum, name=prefix + "sum"),
        "allreduce_sum_int": hvd.allreduce(i, op=hvd.Sum, name=prefix + "sum_int"),
        "grouped_avg": hvd.grouped_allreduce([a, b], op=hvd.Average, name=prefix + "gavg"),
        "grouped_sum": hvd.grouped_allreduce([a, b], op=hvd.Sum, name=prefix + "gsum"),
        "broadcast_last": hvd.broadcast(c, root_rank=n - 1, name=prefix + "bcast_last"),
        "broadcast0": hvd.broadcast(c, root_rank=0, name=prefix + "bcast0"),
        "allgather": hvd.allgather(g, name=prefix + "gather"),
    }


def to_py(d):
    out = {}
    for k, v in d.items():
        out[k] = [t.numpy().tolist() for t in v] if isinstance(v, (list, tuple)) else v.numpy().tolist()
    return out


def main():
    hvd.init()
    r, n = hvd.rank(), hvd.size()
    out = {
        "rank": r,
        "size": n,
        "local_rank": hvd.local_rank(),
        "gloo_enabled": bool(hvd.gloo_enabled()),
        "mpi_enabled": bool(hvd.mpi_enabled()),
        "horovod": horovod.__version__,
        "tensorflow": tf.__version__,
    }
    out["eager"] = to_py(collectives(r, n, "eager_"))

    @tf.function
    def graph_collectives():
        return collectives(r, n, "fn_")

    out["function"] = to_py(graph_collectives())
    out["function_again"] = to_py(graph_collectives())  # the traced graph, run a second time

    # broadcast_variables on plain tf.Variables (Keras 3 weights go through their .value).
    v = tf.Variable([100.0 * r + 1, 100.0 * r + 2])
    hvd.broadcast_variables([v], root_rank=0)
    out["broadcast_variables0"] = v.numpy().tolist()
    hvd.shutdown()
    emit_result(out)


if __name__ == "__main__":
    sys.exit(main())
