"""B4's task and training script: examples/translation_data.py and examples/torch_translate.py.

The generator is deterministic and keeps the held-out sentences out of training; BLEU scores a
perfect translation 100 and garbage near 0; activation checkpointing changes no gradient; and a real
`horovodrun --gloo -np 2` run with accumulation 2 ends with a RESULT from both ranks holding the
same parameters.
"""

from __future__ import annotations

import sys

import numpy as np
import pytest

from hvdrun import REPO_ROOT, requires_horovod, run_horovod, worker_results

sys.path.insert(0, str(REPO_ROOT / "examples"))
import translation_data as td  # noqa: E402

NP = 2


def test_generator_is_deterministic_and_held_out_is_disjoint():
    a = td.generate(train=3000, test=200)
    b = td.generate(train=3000, test=200)
    for key in ("src", "tgt", "src_test", "tgt_test"):
        np.testing.assert_array_equal(a[key], b[key])
    assert a["train_keys"] == b["train_keys"] and a["test_keys"] == b["test_keys"]
    assert len(set(a["test_keys"])) == 200
    assert not set(a["test_keys"]) & set(a["train_keys"])
    # Disjoint as token sequences too (the source side determines the sentence).
    train_src = {row.tobytes() for row in a["src"]}
    assert not any(row.tobytes() in train_src for row in a["src_test"])
    # Another data seed: another language.
    c = td.generate(train=10, test=10, data_seed=7)
    assert td.Grammar(7).tgt_vocab != td.Grammar(1234).tgt_vocab
    assert c["src"].shape == (10, td.SRC_LEN)


def test_targets_carry_reordering_and_agreement():
    g = td.Grammar()
    sent = g.sample(np.random.default_rng(3))
    src, tgt = g.source(sent), g.target(sent)
    assert src[0] in ("the", "a", "some") and tgt[0] in ("lo", "la", "los", "las", "un", "una", "unos", "unas")
    # SOV: the target ends with the main verb, agreeing with the subject's gender and number.
    subj = dict(sent[0])
    agr = (g.gender[subj["noun"]] == "f") + 2 * subj["plural"]
    assert tgt[-1] == g.tgt_verbs[sent[1]] + ("t", "ta", "n", "na")[agr]
    ids = td._encode(tgt, g.tgt_id, td.TGT_LEN, True)
    assert ids[0] == td.BOS and td.decode(ids[1:], g.tgt_vocab) == " ".join(tgt)


def test_bleu_of_perfect_and_garbage_translations():
    from torch_translate import bleu

    data = td.generate(train=10, test=100)
    g = td.Grammar()
    refs = [td.decode(row[1:], g.tgt_vocab) for row in data["tgt_test"]]
    assert bleu(refs, refs) == pytest.approx(100.0)
    rng = np.random.default_rng(0)
    garbage = [" ".join(rng.choice(g.tgt_vocab[3:], size=len(r.split()))) for r in refs]
    assert bleu(garbage, refs) < 5.0
    shuffled = refs[1:] + refs[:1]  # fluent target sentences, wrong ones: low but not zero
    assert bleu(shuffled, refs) < 30.0


def test_checkpointing_changes_no_gradient():
    import torch

    from torch_translate import Translator

    data = td.generate(train=64, test=10)
    g = td.Grammar()
    src = torch.from_numpy(data["src"][:16])
    tgt = torch.from_numpy(data["tgt"][:16])
    grads = []
    for checkpointing in (False, True):
        torch.manual_seed(0)
        model = Translator(len(g.src_vocab), len(g.tgt_vocab), checkpointing=checkpointing)
        logits = model(src, tgt[:, :-1])
        torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), tgt[:, 1:].reshape(-1),
                                          ignore_index=td.PAD).backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


@pytest.mark.horovod
@requires_horovod
@pytest.mark.timeout(150)
def test_horovod_run_accumulate_2(tmp_path):
    proc = run_horovod(
        [sys.executable, str(REPO_ROOT / "examples" / "torch_translate.py"), "--policy", "adascale_adam",
         "--budget", "16", "--accumulate", "2", "--train-size", "2000", "--test-size", "50",
         "--log-every", "0"],
        np=NP, timeout=120, env={"HVD_SCALE_CACHE": str(tmp_path)})
    results = worker_results(proc, np=NP)
    r0, r1 = results
    assert r0["params_checksum"] == r1["params_checksum"]
    for r in results:
        assert r["scale"] == 4 and r["accumulate"] == 2 and r["workers"] == NP
        assert r["progress"] >= 16 and r["steps"] <= 16
        assert r["mean_gain"] >= 1.0
    assert r0["steps"] == r1["steps"] and r0["progress"] == pytest.approx(r1["progress"])
    assert 0.0 <= r0["bleu"] <= 100.0 and r1["bleu"] is None  # rank 0 decodes
