"""The conversion guide's pairs (#32): a Horovod script (examples/horovod_torch_before.py) and its
conversion (examples/horovod_torch_after.py), both run for real with np 2; the Keras and the TF2
GradientTape pairs too. Under `hvd-scale run --policy linear` the converted script trains the
same steps at the same lr as the original (lr x hvd.size()), so their test losses agree; the
default policy runs too."""

import csv
import json
import math
import re
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from hvdrun import REPO_ROOT, requires_horovod, run_horovod, run_process, worker_env

pytestmark = [requires_horovod]
HVD_SCALE = Path(sys.executable).parent / "hvd-scale"
EXAMPLES = REPO_ROOT / "examples"


def test_loss(out: str) -> float:
    losses = re.findall(r"test loss ([0-9.]+)", out)
    assert len(losses) == 1, out[-2000:]
    return float(losses[0])


test_loss.__test__ = False  # a helper, not a test


@pytest.mark.timeout(400)
def test_a_converted_horovod_script_under_linear_trains_as_the_original():
    before = run_horovod([sys.executable, str(EXAMPLES / "horovod_torch_before.py"), "--epochs", "2"],
                         np=2, timeout=180)
    after = run_process([str(HVD_SCALE), "run", "-np", "2", "--gloo", "--policy", "linear", "--",
                         sys.executable, str(EXAMPLES / "horovod_torch_after.py"), "--epochs", "2"],
                        timeout=180, env=worker_env(), what="hvd-scale run")
    assert "hvd_scale: policy linear at S = 2" in after.stderr
    assert test_loss(after.stdout) == pytest.approx(test_loss(before.stdout), rel=1e-5)
    # The flag alone swaps the policy: adascale (the default) on the same script.
    ada = run_process([str(HVD_SCALE), "run", "-np", "2", "--gloo", "--", sys.executable,
                       str(EXAMPLES / "horovod_torch_after.py"), "--epochs", "2"],
                      timeout=180, env=worker_env(), what="hvd-scale run")
    assert "hvd_scale: policy adascale at S = 2" in ada.stderr
    assert test_loss(ada.stdout) < 2.0  # trained (chance is ln 10 = 2.30)


def rank_lines(out: str) -> dict[int, tuple[float, float]]:
    """{rank: (test loss, weights checksum)} from the Keras pair's output."""
    found = re.findall(r"rank (\d) test loss ([0-9.]+) weights (-?[0-9.]+)", out)
    return {int(r): (float(loss), float(w)) for r, loss, w in found}


@pytest.mark.timeout(500)
def test_the_keras_pair():
    """Horovod's Keras example fails on Keras 3 (its layer predates it: what the guide says);
    its conversion trains with every rank equal, under --policy linear and the default."""
    before = run_horovod([sys.executable, str(EXAMPLES / "horovod_keras_before.py"), "--epochs", "1"],
                         np=2, timeout=180, check=False)
    assert before.returncode != 0 and "no attribute 'ref'" in before.stdout + before.stderr
    for policy in ("linear", None):
        flag = ["--policy", policy] if policy else []
        after = run_process([str(HVD_SCALE), "run", "-np", "2", "--gloo", *flag, "--",
                             sys.executable, str(EXAMPLES / "horovod_keras_after.py"), "--epochs", "1"],
                            timeout=180, env=worker_env(), what="hvd-scale run")
        assert f"hvd_scale: policy {policy or 'adascale'} at S = 2" in after.stderr
        ranks = rank_lines(after.stdout)
        assert sorted(ranks) == [0, 1] and ranks[0] == ranks[1], after.stdout  # started apart
        assert ranks[0][0] < 2.0, ranks  # trained (chance is ln 10 = 2.30)


@pytest.mark.timeout(500)
def test_the_tape_pair(tmp_path):
    """#48 item 4: Horovod's TF2 GradientTape idiom (tensorflow2_mnist.py) fails on Keras 3
    (DistributedGradientTape calls Variable.ref()); its conversion (a plain tape, the gradients
    to hvd_scale's Keras optimizer's apply) trains with every rank equal under --policy linear
    and the default, its metrics log holding each step's loss (log_loss after the step)."""
    before = run_horovod([sys.executable, str(EXAMPLES / "horovod_tape_before.py"), "--epochs", "1"],
                         np=2, timeout=180, check=False)
    out = before.stdout + before.stderr
    assert before.returncode != 0 and "no attribute 'ref'" in out and "tape.gradient" in out
    for policy in ("linear", None):
        flag = ["--policy", policy] if policy else []
        log_dir = tmp_path / (policy or "default")
        after = run_process([str(HVD_SCALE), "run", "-np", "2", "--gloo", *flag, "--log-dir",
                             str(log_dir), "--", sys.executable,
                             str(EXAMPLES / "horovod_tape_after.py"), "--epochs", "1"],
                            timeout=180, env=worker_env(), what="hvd-scale run")
        assert f"hvd_scale: policy {policy or 'adascale'} at S = 2" in after.stderr
        ranks = rank_lines(after.stdout)
        assert sorted(ranks) == [0, 1] and ranks[0] == ranks[1], after.stdout  # started apart
        assert ranks[0][0] < 2.0, ranks  # trained (chance is ln 10 = 2.30)
        with open(log_dir / "metrics.csv", newline="") as f:
            rows = list(csv.DictReader(f))
        # The budget: one epoch of one worker, 100 baseline steps; linear's S = 2 takes 50.
        assert float(rows[-1]["progress"]) >= 100
        assert policy != "linear" or len(rows) == 50
        assert all(math.isfinite(float(r["loss"])) for r in rows)  # log_loss after each step
        assert "log_loss()" not in after.stderr


def epoch_test_losses(out: str) -> list[float]:
    """The loader pair's test loss after each pass over the data (rank 0's lines)."""
    return [float(x) for x in re.findall(r"Test set: Average loss: ([0-9.]+)", out)]


@pytest.mark.timeout(300)
def test_the_loader_pair(tmp_path):
    """#48: a fourth Horovod script converted from the site alone, Horovod's pytorch_mnist.py
    whole (a DataLoader over a DistributedSampler, a test after each epoch averaged over the
    workers). At S = 1 (one process each, no launcher) the conversion under the default policy
    trains as the original, test loss for test loss, through an epoch whose last batch is smaller
    (3200 samples in batches of 48: the budget counts ceil(samples / batch) steps an epoch). At
    S = 2 AdaScale reaches the budget in fewer steps than S = 1's 67, each step's loss logged."""
    args = ["--epochs", "1", "--batch-size", "48", "--lr", "0.05", "--momentum", "0.9"]
    script = {name: str(EXAMPLES / f"horovod_loader_{name}.py") for name in ("before", "after")}
    with ThreadPoolExecutor(2) as pool:  # two single processes: the 2 cores at once
        before, after = pool.map(
            lambda name: run_process([sys.executable, script[name], *args], timeout=150,
                                     env=worker_env(), what=name), ("before", "after"))
    assert "hvd_scale: policy adascale at S = 1" in after.stderr
    assert "budget T = 67 baseline steps" in after.stderr
    assert epoch_test_losses(after.stdout) == epoch_test_losses(before.stdout) != []
    log_dir = tmp_path / "adascale"
    ada = run_process([str(HVD_SCALE), "run", "-np", "2", "--gloo", "--log-dir", str(log_dir),
                       "--", sys.executable, script["after"], *args],
                      timeout=180, env=worker_env(), what="hvd-scale run")
    assert "hvd_scale: policy adascale at S = 2" in ada.stderr
    with open(log_dir / "metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert float(rows[-1]["progress"]) >= 67 and 34 <= len(rows) < 67
    assert all(1 <= float(r["gain"]) <= 2 and math.isfinite(float(r["loss"])) for r in rows)
    losses = epoch_test_losses(ada.stdout)
    assert len(losses) == 2 and losses[-1] < 2.0, ada.stdout[-2000:]  # 2 passes; chance: 2.30


def code_lines(path: Path) -> list[str]:
    """A script's lines after its module docstring (what a conversion changes of the code)."""
    text = path.read_text()
    return text[text.index('"""', 3) + 3:].splitlines()


def changed_lines(before: Path, after: Path) -> list[str]:
    import difflib

    diff = difflib.unified_diff(code_lines(before), code_lines(after), lineterm="", n=0)
    return [line for line in diff if line[:1] in "+-" and line[:3] not in ("+++", "---")
            and line[1:].strip()]


@pytest.mark.timeout(200)
def test_the_ddp_pair():
    """#49: PyTorch's own DDP example (the tutorial's ToyModel, DDP(model), SGD, MSELoss) and its
    conversion to hvd_scale's DDP optimizer, both under torchrun --nproc-per-node 2 (Gloo). The
    code's diff is the import, the wrapped optimizer and the line that prints the policy's
    numbers; under HVD_SCALE_POLICY=none the converted script trains as the original, loss for
    loss, and under adascale it measures a gain in [1, 2] and counts tau as the gains' sum."""
    from hvdrun import run_torchrun

    script = {name: EXAMPLES / f"ddp_{name}.py" for name in ("before", "after")}
    changed = changed_lines(script["before"], script["after"])
    assert [line[0] for line in changed] == ["+", "-", "+", "+", "+"], changed
    assert "from hvd_scale.adapters.torch.ddp import DistributedOptimizer" in changed[0]
    assert "DistributedOptimizer(optim.SGD(ddp_model.parameters(), lr=0.001), ddp_model)" \
        in changed[2]

    def final_loss(out: str) -> float:
        losses = re.findall(r"final loss ([0-9.]+)", out)
        assert len(losses) == 1, out[-2000:]  # rank 0's
        return float(losses[0])

    with ThreadPoolExecutor(3) as pool:  # three 2-rank jobs at once: their start-up dominates
        before, plain, ada = pool.map(
            lambda run: run_torchrun([str(script[run[0]])], env=run[1], timeout=150),
            [("before", None), ("after", {"HVD_SCALE_POLICY": "none"}),
             ("after", {"HVD_SCALE_POLICY": "adascale"})])
    assert "hvd_scale" not in before.stdout + before.stderr
    assert "hvd_scale: policy none at S = 2 (2 worker(s) x 1 pass(es))" in plain.stderr
    assert "none at S = 2: 20 steps, tau 40.00, gain 1.000" in plain.stdout
    assert final_loss(plain.stdout) == pytest.approx(final_loss(before.stdout), rel=1e-6)
    assert "hvd_scale: policy adascale at S = 2" in ada.stderr
    found = re.findall(r"adascale at S = 2: 20 steps, tau ([0-9.]+), gain ([0-9.]+)", ada.stdout)
    assert len(found) == 1, ada.stdout[-2000:]
    tau, gain = map(float, found[0])
    assert 20 < tau <= 40 and 1 <= gain <= 2  # measured: neither bound at every step
    assert final_loss(ada.stdout) < 5  # finite, and trained from the same start


@pytest.mark.parametrize("pair", ["ddp", "ddp_tutorial"])
def test_the_ddp_guide_shows_the_pairs_diff(pair):
    """docs/ddp.md quotes the DDP pairs' diffs (the site generates the Horovod pairs' only): each
    is the files' diff as they are now."""
    import difflib

    before, after = (EXAMPLES / f"{pair}_{name}.py" for name in ("before", "after"))
    diff = difflib.unified_diff(before.read_text().splitlines(), after.read_text().splitlines(),
                                f"examples/{before.name}", f"examples/{after.name}", lineterm="")
    page = (REPO_ROOT / "docs" / "ddp.md").read_text()
    assert "```diff\n" + "\n".join(diff) + "\n```" in page, \
        f"docs/ddp.md's diff is not examples/{before.name} against examples/{after.name}: " \
        "paste the new one"


def snapshot_keys(path: Path) -> set[str]:
    import torch

    return set(torch.load(path, weights_only=True))


@pytest.mark.timeout(300)
def test_the_ddp_tutorial_pair(tmp_path):
    """The shape most DDP scripts have, PyTorch's DDP tutorial series (multigpu_torchrun.py: a
    Trainer class, the optimizer built before DDP, epochs, snapshots of the model alone), and its
    conversion: the optimizer wrapped after DDP, a budget in baseline steps for the epochs, k
    micro-batches a step under no_sync(), snapshots with the optimizer's state. Under torchrun
    (2 ranks, k = 3, S = 6) the conversion stops at the budget (the epochs' worth of steps at one
    worker: 64 baseline steps an epoch), marks each epoch's leftover step short (2 of its 3
    passes: S = 4), says once that the tutorial's gradients are zero (its cross-entropy over one
    output is exactly 0), and resumes from its snapshot at its tau, to the next budget."""
    from hvd_scale.launch.plot import read_run
    from hvdrun import run_torchrun

    before, after = (EXAMPLES / f"ddp_tutorial_{name}.py" for name in ("before", "after"))
    changed = changed_lines(before, after)
    added = [line[1:].strip() for line in changed if line[0] == "+"]
    for line in ("from hvd_scale.adapters.torch.ddp import DistributedOptimizer",
                 "self.optimizer = DistributedOptimizer(optimizer, self.model, budget=budget,",
                 "with self.model.no_sync() if i < len(batches) - 1 else contextlib.nullcontext():",
                 '"OPTIMIZER_STATE": self.optimizer.state_dict()}',
                 'self.optimizer.load_state_dict(snapshot["OPTIMIZER_STATE"])',
                 "while not self.optimizer.done():"):
        assert line in added, (line, added)
    assert len(changed) <= 60, changed  # what docs/ddp.md shows, and says it costs

    snap = {name: tmp_path / f"{name}.pt" for name in ("before", "after")}
    log_dir = tmp_path / "log"
    policy = {"HVD_SCALE_POLICY": "adascale"}
    with ThreadPoolExecutor(2) as pool:
        first = pool.map(lambda run: run_torchrun(run[0], env=run[1], timeout=150), [
            ([str(before), "2", "1", "--snapshot_path", str(snap["before"])], None),
            ([str(after), "1", "1", "--passes", "3", "--snapshot_path", str(snap["after"])],
             {**policy, "HVD_SCALE_LOG_DIR": str(log_dir)})])
        plain, ada = list(first)
    assert "hvd_scale" not in plain.stdout + plain.stderr
    assert "[RANK0] Epoch 1 | Batchsize: 32 | Steps: 32" in plain.stdout
    assert snapshot_keys(snap["before"]) == {"MODEL_STATE", "EPOCHS_RUN"}

    assert "policy adascale at S = 6 (2 worker(s) x 3 pass(es))" in ada.stderr
    assert "budget T = 64 baseline steps" in ada.stderr
    assert "adascale at S = 6: 64 steps, tau 64.00, gain 1.000" in ada.stdout
    assert ada.stderr.count("are all zero") == 1, ada.stderr[-3000:]  # rank 0's, once
    assert snapshot_keys(snap["after"]) == {"MODEL_STATE", "EPOCHS_RUN", "OPTIMIZER_STATE"}
    assert json.loads((log_dir / "run.json").read_text())["zero_gradients_at_step"] == 1
    with open(log_dir / "metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    short = [(r["step"], r["scale"], r["passes"]) for r in rows if float(r["short_step"])]
    # 32 batches an epoch on each rank: 10 steps of 3 and a leftover of 2, epoch after epoch
    assert short == [(f"{11.0 * e:.1f}", "4.0", "2.0") for e in range(1, 6)], short
    assert {r["scale"] for r in rows if not float(r["short_step"])} == {"6.0"}
    assert read_run(log_dir)[0] == "log (adascale, S=6, 5 short steps)"

    resumed = run_torchrun([str(after), "2", "1", "--passes", "3", "--snapshot_path",
                            str(snap["after"])], env=policy, timeout=150)
    assert "Resuming training from snapshot at Epoch 6, tau 64" in resumed.stdout
    assert "adascale at S = 6: 128 steps, tau 128.00, gain 1.000" in resumed.stdout


def step_losses(out: str) -> list[float]:
    return [float(x) for x in re.findall(r"^step \d+ loss ([0-9.]+)$", out, re.M)]


@pytest.mark.timeout(400)
def test_the_fsdp_tutorial_pair(tmp_path):
    """PyTorch's FSDP2 example (meta init, fully_shard per block, Adam, clipping, checkpoints
    through torch.distributed.checkpoint's state_dict functions) and its conversion: the wrapped
    optimizer, k micro-batches a step (the first k - 1 without gradient sync), the optimizer's
    state through hvd_scale's DCP functions. Under torchrun (2 ranks) with HVD_SCALE_POLICY=none
    the conversion trains as the original, loss for loss; under sqrt with k = 2 (S = 4) it counts
    tau 4 a step and resumes from its checkpoint at its tau."""
    from hvdrun import run_torchrun

    before, after = (EXAMPLES / f"fsdp_tutorial_{name}.py" for name in ("before", "after"))
    changed = changed_lines(before, after)
    added = [line[1:].strip() for line in changed if line[0] == "+"]
    for line in ("from hvd_scale.adapters.torch.fsdp import DistributedOptimizer",
                 "from hvd_scale.adapters.torch.dcp import get_optimizer_state_dict, "
                 "set_optimizer_state_dict",
                 "optim = DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=args.lr), "
                 "model,",
                 "model.set_requires_gradient_sync(i == args.passes - 1)"):
        assert line in added, (line, added)
    assert len(changed) <= 45, changed  # what docs/fsdp.md shows

    ck = {name: str(tmp_path / name) for name in ("before", "none", "sqrt")}
    runs = [([str(before), "--checkpoint-dir", ck["before"]], None),
            ([str(after), "--checkpoint-dir", ck["none"]], {"HVD_SCALE_POLICY": "none"}),
            ([str(after), "--passes", "2", "--checkpoint-dir", ck["sqrt"]],
             {"HVD_SCALE_POLICY": "sqrt"})]
    with ThreadPoolExecutor(3) as pool:
        plain, none, sqrt = pool.map(lambda run: run_torchrun(run[0], env=run[1], timeout=200),
                                     runs)
    assert "hvd_scale" not in plain.stdout + plain.stderr
    assert len(step_losses(plain.stdout)) == 10
    assert step_losses(none.stdout) == pytest.approx(step_losses(plain.stdout), rel=1e-6)
    assert "none at S = 2: 10 steps, tau 20.00" in none.stdout
    assert "sqrt at S = 4: 10 steps, tau 40.00" in sqrt.stdout
    assert step_losses(sqrt.stdout)[-1] < step_losses(plain.stdout)[-1]  # lr x 2, 4x the data
    import torch

    saved = torch.load(Path(ck["sqrt"]) / "10" / "optim_state_dict.pt", weights_only=True)
    assert json.loads(saved["hvd_scale"])["hvd_scale"]["policy"]["progress"] == 40.0

    resumed = run_torchrun([str(after), "--steps", "5", "--passes", "2", "--checkpoint-dir",
                            ck["sqrt"]], env={"HVD_SCALE_POLICY": "sqrt"}, timeout=200)
    assert "[RANK0] resumed at step 10, tau 40" in resumed.stdout
    assert "sqrt at S = 4: 15 steps, tau 60.00" in resumed.stdout


def test_the_fsdp_guide_shows_the_pairs_diff():
    """docs/fsdp.md quotes the FSDP2 pair's diff as the files are now."""
    import difflib

    before, after = (EXAMPLES / f"fsdp_tutorial_{name}.py" for name in ("before", "after"))
    diff = difflib.unified_diff(before.read_text().splitlines(), after.read_text().splitlines(),
                                f"examples/{before.name}", f"examples/{after.name}", lineterm="")
    page = (REPO_ROOT / "docs" / "fsdp.md").read_text()
    assert "```diff\n" + "\n".join(diff) + "\n```" in page, \
        "docs/fsdp.md's diff is not examples/fsdp_tutorial_before.py against _after.py: paste " \
        "the new one"
