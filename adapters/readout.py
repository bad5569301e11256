"""The read-only values an adapter's optimizer shows, and its metrics row (names:
``hvd_scale.metrics``)."""

from __future__ import annotations

from typing import Any

from hvd_scale.policies import Policy


class Readout:
    """The read-only values an adapter's optimizer shows (it has ``policy`` and ``scaling``)."""

    policy: Policy
    scaling: Any  # core.Scaling

    gain = property(lambda self: self.policy.gain, doc="measured gain r in [1, S]")
    lr_factor = property(lambda self: self.policy.lr_factor,
                         doc="factor the latest step applied to the baseline lr")
    progress = property(lambda self: self.policy.progress, doc="tau, in baseline steps")
    scale = property(lambda self: self.policy.scale, doc="S")
    sigma2 = property(lambda self: self.policy.estimator.sigma2, doc="smoothed sigma2")
    mu2 = property(lambda self: self.policy.estimator.mu2, doc="smoothed mu2")
    noise_scale = property(lambda self: self.policy.estimator.noise_scale, doc="sigma2 / mu2")
    efficiency = property(lambda self: self.policy.efficiency, doc="the applied gain over S")
    last_learning_rate = property(lambda self: self.scaling.run.last_lr,
                                  doc="lr the latest step applied: baseline lr x lr_factor")

    def metrics(self) -> dict[str, float]:
        """``hvd_scale.metrics.STEP_METRICS`` as floats (host values: read them eagerly)."""
        return self.scaling.metrics(self.policy)

    def done(self, budget: float | None = None) -> bool:
        """True once progress tau has reached the budget (baseline steps)."""
        return self.policy.done(budget)

    def rescale(self, scale: float | None = None) -> None:
        """New S; default: follow the world size, keeping S / (workers x k)."""
        self.scaling.rescale(scale)

    def log_loss(self, loss) -> None:
        """Record the loss (a float or a tensor) of the step just taken in that step's row of
        the metrics log: call it once per step, after ``step()`` (Keras: ``ScalingMetrics``
        does it, after each batch). The row waits for it: it is written, and the tensor read,
        at this call (without one, at the next step). A call before the process's first step,
        or a second for one step, is warned of and not logged; after a skipped step
        (non-finite gradients, which has no row) it is dropped. Without a metrics log: nothing.

        ``loss.backward(); opt.step(); opt.log_loss(loss.detach())``"""
        if self.scaling.logger is not None:
            policy = self.policy  # the run's counts: which step the loss is for
            self.scaling.logger.set_loss(loss, step=policy.steps, skipped=policy.skipped)

    def close(self) -> None:
        """Flush and close the metrics files."""
        if self.scaling.logger is not None:
            self.scaling.logger.close()
