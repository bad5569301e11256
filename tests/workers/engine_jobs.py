"""Driver-side jobs for tests/test_engines.py, each run inside a loopback-only network namespace.

    python engine_jobs.py ray-two-nodes     # ray.cluster_utils.Cluster, two nodes of 1 CPU
    python engine_jobs.py ray-elastic       # the engine's local cluster, min_np=1, max_np=2
    python engine_jobs.py spark-fn          # local[2], a Python function
    python engine_jobs.py horovodrun-fn     # horovod.run, 2 local processes (Gloo)

Each prints one ``RESULT {json}`` line per rank (what `probe` returned there). `probe` is defined
here, in __main__, so Ray and Spark pickle it by value: the workers need not import this file.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile

from _report import emit_result
from hvd_scale.launch import engines


def probe(tag: str) -> dict:
    import horovod.torch as hvd
    import torch

    hvd.init()
    total = hvd.allreduce(torch.tensor([float(hvd.rank() + 1)]), op=hvd.Sum).item()
    out = {"tag": tag, "rank": hvd.rank(), "size": hvd.size(), "local_size": hvd.local_size(),
           "cross_size": hvd.cross_size(), "sum": total, "pid": os.getpid(),
           "policy": os.environ.get("HVD_SCALE_POLICY"),
           "log_dir": os.environ.get("HVD_SCALE_LOG_DIR"),
           "omp": os.environ.get("OMP_NUM_THREADS"),
           "elastic": os.environ.get("HOROVOD_ELASTIC")}
    hvd.shutdown()
    return out


def ray_two_nodes() -> list[dict]:
    from ray.cluster_utils import Cluster

    temp = tempfile.mkdtemp(prefix="hvdcl-")  # short: Ray's socket paths live below it
    # Cluster records its address in $RAY_TMPDIR/ray/ (else /tmp/ray/): keep that in here too.
    os.environ["RAY_TMPDIR"] = temp
    os.makedirs(os.path.join(temp, "ray"))
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 1, "temp_dir": temp, "include_dashboard": False,
        "object_store_memory": engines.RAY_OBJECT_STORE_BYTES})
    try:
        cluster.add_node(num_cpus=1, object_store_memory=engines.RAY_OBJECT_STORE_BYTES)
        cluster.wait_for_nodes()
        return engines.run(probe, args=("two-nodes",), np=2, engine="ray",
                           address=cluster.address, policy="sqrt")
    finally:
        cluster.shutdown()
        shutil.rmtree(temp, ignore_errors=True)


def ray_elastic() -> list[dict]:
    return engines.run(probe, args=("elastic",), engine="ray", min_np=1, max_np=2,
                       policy="adascale", log_dir=os.environ["HVD_SCALE_TEST_DIR"])


def horovodrun_fn() -> list[dict]:
    return engines.run(probe, args=("horovodrun",), np=2, engine="horovodrun", policy="sqrt",
                       controller="gloo")


def spark_fn() -> list[dict]:
    return engines.run(probe, args=("spark",), np=2, engine="spark", policy="linear")


JOBS = {"ray-two-nodes": ray_two_nodes, "ray-elastic": ray_elastic, "spark-fn": spark_fn,
        "horovodrun-fn": horovodrun_fn}

if __name__ == "__main__":
    for result in JOBS[sys.argv[1]]():
        emit_result(result)
