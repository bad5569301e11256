"""Data-parallel softmax regression in plain numpy, scaled by AdaScale from the hvd_scale engine.

    mpirun -np 2 python examples/numpy_mpi.py --passes 2
    horovodrun --mpi -np 2 -H localhost:2 python examples/numpy_mpi.py --passes 2
    python examples/numpy_mpi.py --passes 2 --reference-world 2     # one process, the same run

No framework and no adapter: the model's gradient is written out in numpy, gradients are averaged
with mpi4py, and hvd_scale only sees the statistics (pack_local -> a reducer -> unpack_summed ->
policy.transition). Every micro-batch is a function of (seed, rank, step, pass), so one process playing
all the ranks (--reference-world N, with hvd_scale.reduce.LocalReducer) sees exactly the same data
and measures the same gains as N processes.
"""

from __future__ import annotations

import argparse
import hashlib

import numpy as np

import hvd_scale
from hvd_scale.launch.jobs import print_result
from hvd_scale.reduce import LocalReducer, MPIReducer, pack_local, unpack_summed

FEATURES, CLASSES = 8, 4
TEACHER, TRAIN, EVAL = 0, 1, 2  # random streams: teacher weights, micro-batches, held-out set


def rng(seed: int, stream: int, rank: int = 0, step: int = 0, k: int = 0) -> np.random.Generator:
    """A generator that depends on these numbers only (not on the process or the world size)."""
    return np.random.default_rng([seed, stream, rank, step, k])


def sample(gen: np.random.Generator, teacher: np.ndarray, size: int) -> tuple[np.ndarray, np.ndarray]:
    """Inputs (with a constant 1 for the bias) and labels drawn from the teacher's softmax:
    the labels are noisy, so micro-gradients disagree and the gain stays below S."""
    x = np.hstack([gen.standard_normal((size, FEATURES)), np.ones((size, 1))])
    p = softmax(x @ teacher)
    y = (gen.random((size, 1)) > np.cumsum(p, axis=1)).sum(axis=1)  # inverse-CDF sampling
    return x, np.minimum(y, CLASSES - 1)


def softmax(z: np.ndarray) -> np.ndarray:
    e = np.exp(z - z.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)


def loss(w: np.ndarray, x: np.ndarray, y: np.ndarray) -> float:
    """Mean cross-entropy."""
    p = softmax(x @ w)
    return float(-np.mean(np.log(p[np.arange(len(y)), y])))


def gradient(w: np.ndarray, x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """d loss / d w for the mean cross-entropy of softmax(x w): x^T (p - onehot(y)) / batch."""
    p = softmax(x @ w)
    p[np.arange(len(y)), y] -= 1.0
    return x.T @ p / len(y)


class MPIWorld:
    """One process per rank: sums over ranks go through mpi4py."""

    def __init__(self):
        from mpi4py import MPI

        self._mpi, self.comm = MPI, MPI.COMM_WORLD
        self.rank, self.size = self.comm.Get_rank(), self.comm.Get_size()
        self.ranks = [self.rank]           # whose micro-batches this process computes
        self.reducer = MPIReducer(self.comm)

    def allreduce_sum(self, local: np.ndarray) -> np.ndarray:
        out = np.empty_like(local)
        self.comm.Allreduce(local, out, op=self._mpi.SUM)
        return out


class ReferenceWorld:
    """One process playing ranks 0..size-1: it already holds every rank's part, so the sum over
    processes is the identity (LocalReducer)."""

    rank = 0

    def __init__(self, size: int):
        self.size, self.ranks, self.reducer = size, list(range(size)), LocalReducer()

    def allreduce_sum(self, local: np.ndarray) -> np.ndarray:
        return local.copy()


def rank_part(w, teacher, args, rank: int, step: int) -> tuple[np.ndarray, np.ndarray]:
    """What one rank computes in a step: the sum of its k micro-gradients, and its statistics
    vector [sum_i |g_i|^2, k]."""
    grads = [gradient(w, *sample(rng(args.seed, TRAIN, rank, step, k), teacher, args.batch_size))
             for k in range(args.passes)]
    return sum(grads), pack_local([sum(float(np.sum(g * g)) for g in grads)], len(grads))


def main(argv=None) -> dict:
    args = parse_args(argv)
    world = ReferenceWorld(args.reference_world) if args.reference_world else MPIWorld()
    # S = micro-gradients per step (each micro-batch is one baseline batch); optimizer="SGD"
    # rejects a policy without theory for plain SGD (adascale_adam). The policy is a frozen
    # configuration; the run's record (steps, tau, the estimates) is ``state``, S an argument.
    scale = float(world.size * args.passes)
    policy = hvd_scale.make_policy(args.policy, budget=args.budget, optimizer="SGD")
    state = policy.init()
    teacher = 2.0 * rng(args.seed, TEACHER).standard_normal((FEATURES + 1, CLASSES))
    held_out = sample(rng(args.seed, EVAL), teacher, 4096)
    w = np.zeros((FEATURES + 1, CLASSES))  # the same start everywhere: nothing to broadcast
    loss_before = loss(w, *held_out)

    gains = []
    while not policy.done(state):
        # Rank by rank, then summed in rank order: the reference adds exactly what MPI adds.
        parts = [rank_part(w, teacher, args, r, state.steps) for r in world.ranks]
        summed = world.reducer.sum(sum(stats for _, stats in parts))  # one tiny allreduce
        sqnorm_sum, n, _ = unpack_summed(summed, 1)
        g_bar = world.allreduce_sum(sum(g for g, _ in parts)) / n    # the gradient allreduce
        # |g_bar|^2 needs no communication: every rank holds the same averaged gradient.
        state, info = policy.transition(state, sqnorm_sum, [float(np.sum(g_bar * g_bar))], n,
                                        scale=scale)
        # A baseline schedule is evaluated at progress tau (here a constant lr).
        w -= hvd_scale.lr_at(args.lr, info.progress_before) * info.lr_factor * g_bar
        gains.append(info.gain)

    loss_after = loss(w, *held_out)
    if world.rank == 0:
        print(f"{policy.spec} at S={scale:g} ({world.size} ranks x {args.passes} passes): "
              f"{state.steps} steps for {state.progress:.1f} baseline steps, mean gain "
              f"{np.mean(gains):.2f}; held-out loss {loss_before:.4f} -> {loss_after:.4f}")
    result = {"rank": world.rank, "size": world.size, "reference": bool(args.reference_world),
              "policy": policy.spec, "scale": scale, "steps": state.steps, "gains": gains,
              "progress": state.progress, "weights": w.ravel().tolist(),
              "checksum": hashlib.sha256(w.tobytes()).hexdigest()[:16],
              "loss_before": loss_before, "loss_after": loss_after}
    if args.report:
        print_result(result)
    return result


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--policy", default=None, help="policy spec (default: $HVD_SCALE_POLICY or adascale)")
    p.add_argument("--budget", type=float, default=200, help="baseline (S = 1) steps to train for")
    p.add_argument("--passes", type=int, default=2, help="micro-batches (k) per rank per step")
    p.add_argument("--batch-size", type=int, default=8, help="samples per micro-batch (= baseline batch)")
    p.add_argument("--lr", type=float, default=0.2, help="baseline learning rate")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--reference-world", type=int, default=0, metavar="N",
                   help="no MPI: one process plays ranks 0..N-1 with the same data")
    p.add_argument("--report", action="store_true", help="print one line RESULT {json} per rank")
    args = p.parse_args(argv)
    if args.passes < 1 or args.batch_size < 1 or args.reference_world < 0:
        p.error("--passes and --batch-size must be >= 1, --reference-world >= 0")
    return args


if __name__ == "__main__":
    main()
