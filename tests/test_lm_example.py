"""B5's task C: examples/torch_lm.py, a GRU language model on the translation task's sentences.

The loss is the next word's cross-entropy with PAD ignored, the accuracy counts only real words,
and a real `horovodrun --gloo -np 2` run with accumulation 2 and evaluations along the way ends
with a RESULT from both ranks holding the same parameters and the same curve.
"""

from __future__ import annotations

import math
import sys

import numpy as np
import pytest

from hvdrun import REPO_ROOT, requires_horovod, run_horovod, worker_results

sys.path.insert(0, str(REPO_ROOT / "examples"))
import translation_data as td  # noqa: E402

NP = 2


def test_next_word_loss_ignores_padding_and_counts_real_words():
    import torch

    from torch_lm import GRULanguageModel, evaluate, next_word_loss, trimmed

    torch.manual_seed(0)
    model = GRULanguageModel(vocab=8, hidden=16)
    batch = np.array([[td.BOS, 5, 6, td.EOS, td.PAD, td.PAD],
                      [td.BOS, 7, td.EOS, td.PAD, td.PAD, td.PAD]])
    assert trimmed(batch).shape == (2, 4)  # cut after the longest sentence
    loss, right = next_word_loss(model, batch)
    # By hand: the mean over the 5 real next words (3 + 2) of -log softmax at the right word.
    logits = model(torch.from_numpy(batch[:, :-1]))
    logp = torch.log_softmax(logits, -1)
    terms = [-logp[i, t, batch[i, t + 1]] for i in range(2) for t in range(5) if batch[i, t + 1] != td.PAD]
    assert len(terms) == 5
    assert loss.item() == pytest.approx(torch.stack(terms).mean().item(), rel=1e-6)
    hits = sum(int(logits[i, t].argmax() == batch[i, t + 1]) for i in range(2) for t in range(5)
               if batch[i, t + 1] != td.PAD)
    assert right.item() == hits
    test_loss, accuracy = evaluate(model, batch)
    assert test_loss == pytest.approx(loss.item(), rel=1e-6) and accuracy == pytest.approx(hits / 5)
    assert model.training  # evaluate() hands the model back in training mode


@pytest.mark.horovod
@requires_horovod
@pytest.mark.timeout(150)
def test_horovod_run_accumulate_2_with_evaluations(tmp_path):
    proc = run_horovod(
        [sys.executable, str(REPO_ROOT / "examples" / "torch_lm.py"), "--policy", "adascale_adam",
         "--budget", "16", "--accumulate", "2", "--batch-size", "16", "--train-size", "2000",
         "--test-size", "50", "--eval-every", "8", "--log-every", "0"],
        np=NP, timeout=120, env={"HVD_SCALE_CACHE": str(tmp_path)})
    r0, r1 = worker_results(proc, np=NP)
    assert r0["params_checksum"] == r1["params_checksum"]
    for r in (r0, r1):
        assert r["scale"] == 4 and r["accumulate"] == 2 and r["workers"] == NP
        assert r["progress"] >= 16 and r["steps"] <= 16
        # Random words over a vocabulary of hundreds: a loss below log(vocab) and above 0.
        assert 0 < r["test_loss"] < math.log(len(td.Grammar().tgt_vocab))
        assert 0 <= r["test_accuracy"] <= 1
        # (seconds, tau, steps, test loss, accuracy) at tau 8 and 16, the same on both ranks.
        assert [round(point[1] // 8) for point in r["curve"]] == [1, 2]
    assert [p[3:] for p in r0["curve"]] == [p[3:] for p in r1["curve"]]
