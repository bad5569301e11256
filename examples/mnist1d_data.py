"""MNIST-1D, generated locally by the `mnist1d` package (no download), cached as .npz.

Generating 10,000 samples takes ~8 s, so the arrays are kept in ~/.cache/hvd_scale/ keyed by the
generator's arguments; every worker of a job (and every run of a benchmark) reads the same file.
"""

from __future__ import annotations

import os
import pathlib
import tempfile

import numpy as np

CACHE = pathlib.Path(os.environ.get("HVD_SCALE_CACHE", pathlib.Path.home() / ".cache" / "hvd_scale"))


def load(num_samples: int = 10_000, seed: int = 42) -> dict[str, np.ndarray]:
    """{'x', 'y', 'x_test', 'y_test'}: float32 signals of length 40 and int64 labels (80/20 split)."""
    path = CACHE / f"mnist1d-{num_samples}-{seed}.npz"
    if not path.exists():
        from mnist1d.data import get_dataset_args, make_dataset

        args = get_dataset_args()
        args.num_samples, args.seed = num_samples, seed
        data = make_dataset(args)
        path.parent.mkdir(parents=True, exist_ok=True)
        # Write then rename, so concurrent workers never read a half-written file.
        with tempfile.NamedTemporaryFile(dir=path.parent, suffix=".npz", delete=False) as f:
            np.savez(f, **{k: data[k] for k in ("x", "y", "x_test", "y_test")})
        os.replace(f.name, path)
    with np.load(path) as d:
        return {"x": d["x"].astype(np.float32), "y": d["y"].astype(np.int64),
                "x_test": d["x_test"].astype(np.float32), "y_test": d["y_test"].astype(np.int64)}


def shard_batches(x, y, batch_size: int, rank: int, size: int, seed: int):
    """Endless micro-batches for one worker: each epoch is shuffled the same way on every rank
    (seeded by epoch), then dealt out so that the workers' batches never overlap."""
    epoch = 0
    while True:
        order = np.random.default_rng([seed, epoch]).permutation(len(x))
        per_step = batch_size * size
        for start in range(0, len(order) - per_step + 1, per_step):
            idx = order[start + rank * batch_size:start + (rank + 1) * batch_size]
            yield x[idx], y[idx]
        epoch += 1
