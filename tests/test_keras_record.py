"""Keras holds the run in its variable only (``hvd_scale_state``, as Keras's LossScaleOptimizer
holds its scale): every Python view of the run is read from the variable when asked, so a path
that assigns the variable (ElasticState.restore, tf.train.Checkpoint, a broadcast) and one that
changes the run eagerly (rescale, set_passes) cannot leave a second copy disagreeing with it.

Before: the host step wrote a Python mirror of the record twice a step; ``metrics()`` read that
mirror, so after ``ElasticState.restore()`` it reported the steps and tau of the abandoned
steps while ``opt.steps`` read the variable; and ``rescale(S)`` changed the mirror only, so a
checkpoint taken then held the old S."""

import json
import os
import sys
import textwrap

import pytest

from hvdrun import requires_horovod, run_process

pytestmark = [requires_horovod]

SCRIPT = textwrap.dedent("""
    import json
    import numpy as np, keras
    from hvd_scale.adapters.keras import DistributedOptimizer, hvd
    from hvd_scale.adapters.keras.elastic import ElasticState
    from hvd_scale.run import RunState

    hvd.init()
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 4)).astype("float32")
    y = (x @ np.ones(4, "float32"))[:, None] + rng.normal(size=(64, 1)).astype("float32")
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    opt = DistributedOptimizer(keras.optimizers.SGD(0.01), "adascale", backward_passes_per_step=2)
    model.compile(optimizer=opt, loss="mse", jit_compile=False)

    def fit(batches):
        model.fit(x, y, batch_size=8, epochs=1, steps_per_epoch=batches, verbose=0)

    def variable_record():
        state = next(v for v in opt.variables if v.path.endswith("hvd_scale_state"))
        return RunState.from_vector(keras.ops.convert_to_numpy(state.value), opt.scaling.setup)

    def views():
        m = opt.metrics()
        return {"steps": opt.steps, "metrics_step": m["step"], "progress": opt.progress,
                "metrics_progress": m["progress"], "lr": opt.last_learning_rate,
                "metrics_lr": m["lr"], "variable_steps": variable_record().policy.steps}

    fit(4)  # 2 steps of k = 2
    state = ElasticState(model, opt)  # commits the variables
    committed = views()
    fit(4)  # 2 more steps, then rolled back as after a failed worker
    state.restore()
    restored = views()
    opt.rescale(4.0)
    rescaled = {"scale": opt.scale, "variable_scale": variable_record().scale}
    fit(2)
    after = {"scale": opt.scale, "variable_scale": variable_record().scale,
             "metrics_scale": opt.metrics()["scale"], **views()}
    print("RESULT " + json.dumps({"committed": committed, "restored": restored,
                                  "rescaled": rescaled, "after": after}))
""")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("backend", ["tensorflow", "torch"])
def test_every_view_of_the_run_is_the_variable(tmp_path, backend):
    script = tmp_path / "record.py"
    script.write_text(SCRIPT)
    proc = run_process([sys.executable, str(script)], timeout=240,
                       env={**os.environ, "KERAS_BACKEND": backend, "OMP_NUM_THREADS": "1",
                            "TF_CPP_MIN_LOG_LEVEL": "2"},
                       what=f"one process, Keras on {backend}")
    line = next(l for l in proc.stdout.splitlines() if l.startswith("RESULT "))
    r = json.loads(line[len("RESULT "):])
    committed, restored = r["committed"], r["restored"]
    assert committed["steps"] == committed["metrics_step"] == committed["variable_steps"] == 2
    # Rolled back to the commit: every view says step 2 and its tau and lr.
    assert restored["steps"] == restored["variable_steps"] == 2, r
    assert restored["metrics_step"] == 2, r
    assert restored["metrics_progress"] == restored["progress"] == committed["progress"], r
    assert restored["metrics_lr"] == restored["lr"] == committed["lr"], r
    # rescale(S) is the variable's: a checkpoint taken now holds the new S.
    assert r["rescaled"] == {"scale": 4.0, "variable_scale": 4.0}, r
    after = r["after"]
    assert after["scale"] == after["variable_scale"] == after["metrics_scale"] == 4.0, r
    assert after["steps"] == after["metrics_step"] == after["variable_steps"] == 3, r
