"""#50 item 4: adascale_adam's preconditioned statistic g / (sqrt(v_hat) + eps) used Adam's v
before the step's update; a coordinate whose v held no gradient yet (a ReLU unit dead so far)
gave ~g / eps and one step's sigma2 went from ~2e5 to 4e10 (benchmarks/results/
adam_precondition.md). ``core.precondition`` floors v_hat per tensor at (1 - beta2) / c2 x
mean(v_hat); the bulk is untouched."""

import os
import sys
import textwrap

import numpy as np
import pytest

from hvd_scale.adapters.core import precondition
from hvd_scale.estimate import estimate_moments

B2, EPS = 0.999, 1e-7
FLOOR = dict(beta2=B2, mean=np.mean, maximum=np.maximum)


def _v_and_micro(rng, d=4000, dead=64):
    """v after ~100 steps of gradients ~N(0, 1e-6) per coordinate, but `dead` coordinates that
    never had one; two micro-gradients where the dead ones come alive on the first only."""
    c2 = 1 - B2 ** 100
    v = np.full(d, 1e-6 * c2)
    v[:dead] = 0.0
    micro = rng.normal(0, 1e-3, (2, d))
    micro[1, :dead] = 0.0
    return v, c2, micro


def _sigma2(v, c2, micro, **floor):
    xs = [precondition(g, v, c2, EPS, np.sqrt, **floor) for g in micro]
    xbar = precondition(micro.mean(0), v, c2, EPS, np.sqrt, **floor)
    s, q = sum(float(x @ x) for x in xs), float(xbar @ xbar)
    return float(estimate_moments(s, q, 2, 2.0)[0][0])


def test_bulk_is_untouched_bit_for_bit():
    rng = np.random.default_rng(0)
    v = rng.uniform(0.5, 2.0, 1000) * 1e-6
    g = rng.normal(0, 1e-3, 1000)
    assert np.array_equal(precondition(g, v, 0.1, EPS, np.sqrt, **FLOOR),
                          precondition(g, v, 0.1, EPS, np.sqrt))


def test_a_coordinate_with_empty_v_no_longer_swamps_sigma2():
    v, c2, micro = _v_and_micro(np.random.default_rng(1))
    alive = _sigma2(v[64:], c2, micro[:, 64:])  # the live coordinates alone: ~2 per coordinate
    assert 0.5 * 2 * 3936 < alive < 2 * 2 * 3936
    unfloored = _sigma2(v, c2, micro)
    floored = _sigma2(v, c2, micro, **FLOOR)
    assert unfloored > 1e4 * alive  # the bug: 64 coordinates at ~(1e-3 / 1e-7)^2 each
    # Floored: each dead coordinate counts at most c2 / (1 - beta2) (~95 here) live ones.
    assert alive < floored < alive + 64 * c2 / (1 - B2)
    # The same P for the micro-gradients and the mean: m - q stays >= 0 per coordinate.
    xs = np.stack([precondition(g, v, c2, EPS, np.sqrt, **FLOOR) for g in micro])
    xbar = precondition(micro.mean(0), v, c2, EPS, np.sqrt, **FLOOR)
    assert np.allclose(xs.mean(0), xbar)


@pytest.mark.timeout(120)
def test_keras_adapter_floors_v_hat(tmp_path):
    pytest.importorskip("keras")
    pytest.importorskip("horovod.tensorflow")
    from hvdrun import run_process

    script = tmp_path / "keras_precondition.py"
    script.write_text(textwrap.dedent("""
        import horovod.tensorflow as hvd, keras, numpy as np
        from keras import ops
        from hvd_scale.adapters.keras import DistributedOptimizer
        hvd.init()
        w = keras.Variable(np.zeros((3, 2), "float32"))
        opt = DistributedOptimizer(keras.optimizers.Adam(1e-3, epsilon=1e-7),
                                   policy="adascale_adam", backward_passes_per_step=2)
        g = np.array([[1e-3, 2e-3], [3e-3, -1e-3], [0, 0]], "float32")  # row 2: dead so far
        for _ in range(6):  # 3 optimizer steps
            opt.apply([ops.convert_to_tensor(g)], [w])
        inner = opt.inner_optimizer
        v = inner._velocities[inner._get_variable_index(w)].numpy().astype(np.float64)
        t = int(inner.iterations.numpy())
        alive = g.copy(); alive[2] = 1e-3  # the dead row comes alive
        got = ops.convert_to_numpy(opt._precondition([ops.convert_to_tensor(alive)], [w])[0])
        c2 = 1 - 0.999 ** t
        v_hat = np.maximum(v / c2, 0.001 / c2 * np.mean(v / c2))
        want = alive / (np.sqrt(v_hat) + 1e-7)
        print("T", t, "MAXERR", float(np.max(np.abs(got / want - 1))), "DEAD", float(got[2, 0]))
    """))
    proc = run_process([sys.executable, str(script)], timeout=110,
                       env={**os.environ, "KERAS_BACKEND": "tensorflow", "OMP_NUM_THREADS": "1",
                            "TF_CPP_MIN_LOG_LEVEL": "2"},
                       what="a one-process Keras adascale_adam")
    line = next(line for line in proc.stdout.splitlines() if line.startswith("T "))
    _, t, _, err, _, dead = line.split()
    assert int(t) == 3 and float(err) < 1e-5
    # Unfloored it would be 1e-3 / 1e-7 = 1e4; floored, sqrt(c2 / (1 - b2)) / sqrt(mean ratio).
    assert 1.0 < float(dead) < 200.0
