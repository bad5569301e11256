"""What an adapter's optimizer shows of its run, and the few calls beside it.

The read-only values and the metrics row (names: ``hvd_scale.metrics``): each a function of the
run's record (``run_state``) and the policy's configuration, read at the latest step's S, as that
step's row in the metrics log: the run's S, or a short step's own (fewer micro-batches than
announced; ``short_step``) until the next step. Three calls act: ``rescale`` changes S (the
record's layout, ``hvd_scale.run.relayout``), ``log_loss`` and ``close`` write the metrics log."""

from __future__ import annotations

from typing import Any

from hvd_scale.policies import Policy
from hvd_scale.run import RunState


class Readout:
    """The values an adapter's optimizer shows of its run, and ``rescale``, ``log_loss``,
    ``close`` (it has ``scaling``)."""

    scaling: Any  # core.Scaling

    @property
    def policy(self) -> Policy:
        """The policy: a frozen configuration (spec, options, budget); the run's values are
        read here (``progress``, ``gain``, ...) or from ``run_state``."""
        return self.scaling.policy

    @property
    def run_state(self) -> RunState:
        """The run's record (``hvd_scale.run.RunState``): steps, tau, the estimates, S, k."""
        return self.scaling.run

    def _at_s(self, read, scale: float | None = None):
        run = self.run_state
        return read(self.scaling.policy, run.policy,
                    self.scaling.step_scale if scale is None else scale)

    steps = property(lambda self: self.run_state.policy.steps, doc="optimizer steps applied")
    skipped = property(lambda self: self.run_state.policy.skipped,
                       doc="steps skipped (non-finite gradients)")
    progress = property(lambda self: self.run_state.policy.progress, doc="tau, in baseline steps")
    scale = property(lambda self: self.run_state.scale,
                     doc="S, the run's: that of a full step (a short step's own: ``metrics()``)")
    short_step = property(lambda self: self.scaling.step_scale != self.run_state.scale,
                          doc="the latest step was short (fewer micro-batches than announced): "
                              "gain and efficiency are at its own S, metrics()['scale']")
    gain = property(lambda self: self._at_s(lambda p, state, s: p.gain(state, s)),
                    doc="the gain r in [1, S] the latest step applied (a short step: at its "
                        "own S); before any, the gain a step at S would apply")
    efficiency = property(lambda self: self._at_s(lambda p, state, s: p.efficiency(state, s)),
                          doc="the latest step's gain over its S")
    sigma2 = property(lambda self: self._at_s(lambda p, state, s: p.estimator(state, s).sigma2),
                      doc="smoothed sigma2")
    mu2 = property(lambda self: self._at_s(lambda p, state, s: p.estimator(state, s).mu2),
                   doc="smoothed mu2")
    noise_scale = property(
        lambda self: self._at_s(lambda p, state, s: p.estimator(state, s).noise_scale),
        doc="sigma2 / mu2")
    lr_factor = property(lambda self: self._at_s(lambda p, state, s: p.metrics(state, s)["lr_factor"]),
                         doc="factor the latest step applied to the baseline lr (nan before any)")
    last_learning_rate = property(lambda self: self.run_state.last_lr,
                                  doc="lr the latest step applied: baseline lr x lr_factor")

    def factor(self) -> float:
        """The factor the next (full) step would apply at S (from the estimates so far)."""
        return self._at_s(lambda p, state, s: p.factor(state, s), self.run_state.scale)

    def metrics(self) -> dict[str, float]:
        """``hvd_scale.metrics.STEP_METRICS`` as floats (host values: read them eagerly): the
        latest step's row of the metrics log (a short step's at its own S, ``short_step`` 1)."""
        return self.scaling.metrics()

    def done(self, budget: float | None = None) -> bool:
        """True once progress tau has reached the budget (baseline steps)."""
        return self.scaling.policy.done(self.run_state.policy, budget)

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
            record = self.run_state.policy  # the run's counts: which step the loss is for
            self.scaling.logger.set_loss(loss, step=record.steps, skipped=record.skipped)

    def close(self) -> None:
        """Flush and close the metrics files."""
        if self.scaling.logger is not None:
            self.scaling.logger.close()
