"""What the adapters read from the environment, which the launcher (``hvd-scale run``) and
``horovodrun`` set: the shared half (``core.py``) is given these values and reads none itself."""

from __future__ import annotations

import os

from hvd_scale.adapters.log import check_every
from hvd_scale.estimate import SAMPLES_ENV
from hvd_scale.metrics import LOG_DIR_ENV, LOG_EVERY_ENV


def elastic() -> bool:
    """Under ``horovodrun`` elastic (workers join and leave while the job runs)."""
    return os.environ.get("HOROVOD_ELASTIC") == "1"


def log_dir(given: str | None) -> str | None:
    """Where rank 0 writes the per-step metrics: ``given``, else ``$HVD_SCALE_LOG_DIR``, else none."""
    return given or os.environ.get(LOG_DIR_ENV) or None


def log_every() -> int | None:
    """Steps between metrics rows: ``$HVD_SCALE_LOG_EVERY`` (``hvd-scale run --log-every``), else
    None (``adapters.log.due``'s default)."""
    value = os.environ.get(LOG_EVERY_ENV)
    if not value:
        return None
    try:
        every: int | str = int(value)
    except ValueError:
        every = value
    return check_every(every, f"${LOG_EVERY_ENV}={value!r} (set by hvd-scale run --log-every, or "
                              "in the environment)")


def samples() -> str | None:
    """What the statistics read where the code leaves it to the job: ``$HVD_SCALE_SAMPLES``
    ("workers" or "passes"; ``hvd_scale.estimate.resolve_samples`` checks it), else None."""
    return os.environ.get(SAMPLES_ENV) or None
