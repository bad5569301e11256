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
