"""The warm-in switch for the engine's mechanics tests (test_estimate.py, test_policies.py): they
compare the gain with the bare ratio from step 1, so the warm-in (the young EMA's gain held toward
1) is off in their modules and on, at the engine's own z, where a test asks for ``warm_in``."""

import pytest

import hvd_scale.estimate

ENGINE_Z = hvd_scale.estimate.WARM_IN_Z


@pytest.fixture(autouse=True, scope="module")
def without_warm_in():
    hvd_scale.estimate.WARM_IN_Z = 0.0
    yield
    hvd_scale.estimate.WARM_IN_Z = ENGINE_Z


@pytest.fixture
def warm_in(monkeypatch):
    monkeypatch.setattr(hvd_scale.estimate, "WARM_IN_Z", ENGINE_Z)
