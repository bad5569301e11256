"""What a step's statistics read, for the one-process references: the micro-gradients of a step
laid out worker by worker (W x k, rank-major), read as the adapters read them by default
(``hvd_scale.estimate.SAMPLES``: from two workers on, each worker's sum G of its k passes once,
|G|^2 / k, W samples; else every pass, n samples)."""

from __future__ import annotations


def read_sums(per_micro, workers: int, samples: str = "auto") -> tuple[float, int]:
    """(sqnorm_sum, samples) for ``per_micro`` (1-D numpy arrays or torch tensors, rank-major)."""
    n = len(per_micro)
    k = n // workers
    if k == 1 or samples == "passes" or (samples == "auto" and workers < 2):
        return sum(float((g * g).sum()) for g in per_micro), n
    return read_worker_sums([per_micro[w * k:(w + 1) * k] for w in range(workers)])


def read_worker_sums(per_worker) -> tuple[float, int]:
    """Each worker's passes (k_w may differ: a short step) read once: (sum_w |G_w|^2 / k_w, W)."""
    sums = [(sum(passes), len(passes)) for passes in per_worker if len(passes)]
    return sum(float((s * s).sum()) / k for s, k in sums), len(sums)
