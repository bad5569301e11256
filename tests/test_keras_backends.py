"""The Keras adapter picks its backend class in one place; a backend Horovod cannot serve is refused."""

import pytest

keras = pytest.importorskip("keras")
pytest.importorskip("horovod.tensorflow")


def test_jax_backend_is_refused_with_the_reason(monkeypatch):
    from hvd_scale.adapters.keras import backends

    monkeypatch.setattr(keras.backend, "backend", lambda: "jax")
    backends.current.cache_clear()
    try:
        with pytest.raises(ValueError, match=r"KERAS_BACKEND='jax': Horovod has no JAX support"):
            backends.current()
    finally:
        backends.current.cache_clear()
    monkeypatch.undo()
    assert backends.current().name == keras.backend.backend()


@pytest.mark.parametrize("name", ["tensorflow", "torch"])
def test_sum_of_squares_of_large_finite_float32_gradients_is_finite(name):
    """Issue #22, 5: float32 squares overflow from |g| ~ 1.8e19 on, so a finite step was called
    non-finite (skipped; after 100 such steps the run stopped as diverged)."""
    import numpy as np

    from hvd_scale.adapters.keras import backends

    if name == "torch":
        pytest.importorskip("horovod.torch")
        import torch
        backend = backends.TorchBackend()
        tensor = lambda a: torch.tensor(a)  # noqa: E731
    else:
        import tensorflow as tf
        backend = backends.TensorFlowBackend()
        tensor = tf.constant
    big = [tensor(np.full((4, 3), 1e20, np.float32)), tensor(np.full(5, 3e19, np.float32))]
    total = float(backend.sum_of_squares(big))
    assert total == pytest.approx(12 * 1e40 + 5 * 9e38, rel=1e-6)
    small = [tensor(np.array([3.0, 4.0], np.float32)), tensor(np.array([1e-20], np.float32))]
    assert float(backend.sum_of_squares(small)) == pytest.approx(25.0, rel=1e-7)
    assert not np.isfinite(float(backend.sum_of_squares([tensor(np.array([np.inf, 1.0], np.float32))])))
    assert np.isnan(float(backend.sum_of_squares([tensor(np.array([np.nan], np.float32))])))
