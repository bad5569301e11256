"""adapt="goodput" and set_passes, checked alike for every adapter (#31 item 3): the torch and
Keras tests run their own workers' cases (tests/workers/*_adapter_worker.py: ``passes_change``
and ``adapt_goodput``) and hand the results here."""

import math


def close(a, b, rel=1e-9, abs_=1e-12):
    return math.isclose(a, b, rel_tol=rel, abs_tol=abs_)


def check_passes_change(r0, r1, workers):
    """k = 1, 1, 3, 3, 2, 2 set between steps: S = W k each step; gain, tau and weights equal the
    one-process reference replaying the same micro-batches; the step clock times every step
    after the first at its k; the state saved at k = 3 resumes at k = 3, S = 3 W, its tau kept."""
    rows = r0["rows"]
    assert [row["k"] for row in rows] == [1, 1, 3, 3, 2, 2]
    assert [row["gain"] for row in rows] == [row["gain"] for row in r1["rows"]]
    progress = 0.0
    for row in rows:
        assert row["scale"] == workers * row["k"]
        assert close(row["gain"], row["ref_gain"]) and row["diff"] < 1e-9, row
        progress += row["gain"]
        assert close(row["progress"], progress)
        assert row["timing"]["passes"] == row["k"]
    # measured at S = 6 (by how much: the warm-in holds the first steps' gain toward 1)
    assert max(row["gain"] for row in rows if row["k"] == 3) > 1.01
    for row in rows[1:]:
        t = row["timing"]
        assert all(t[key] > 0 for key in ("pass_time", "allreduce_time", "update_time")), t
        assert t["workers"] == workers
        # with k >= 2 a pass is timed alone, and the step's own work kept apart
        assert math.isnan(t["overhead_time"]) == (row["k"] == 1), t
        overhead = 0.0 if row["k"] == 1 else t["overhead_time"]
        assert close(t["step_time"], overhead + row["k"] * t["pass_time"] + t["allreduce_time"]
                     + t["update_time"])
    assert math.isnan(rows[0]["timing"]["pass_time"])  # no previous step's end to time from
    resumed = r0["resumed"]
    assert (resumed["k"], resumed["scale"], resumed["progress"]) == (3, 3.0 * workers,
                                                                     rows[3]["progress"])


def check_adapt_goodput(r0, r1, workers, every=5):
    """adapt='goodput' where the allreduce dwarfs the passes: every rank runs the same k at every
    step and ends equal; k changes only after multiples of ``every`` steps and ends above 1."""
    ks = r0["ks"]
    assert ks == r1["ks"] and r0["checksum"] == r1["checksum"]
    assert all(a == b for i, (a, b) in enumerate(zip(ks, ks[1:]), start=1) if i % every), ks
    assert r0["final_k"] > 1 and r0["scale"] == workers * r0["final_k"], r0
    model = r0["model"]
    assert model["allreduce"] > model["compute"] > 0, model
