"""A deterministic, locally generated translation task (numpy only): English-like -> SOV language.

Source (SVO, adjectives before the noun, English-like number agreement on the verb):

    the big red blick sees some dakos that chase a zup

Target (SOV, adjectives after the noun in reverse order, determiners/adjectives inflected for the
noun's gender (fixed per noun, arbitrary) and number, the verb agreeing with its subject in gender
and number, the relative clause moved before the noun it modifies with a clause-final marker):

    lo blicko rosso grando [unas zupi ... ] ...   (see `example()`)

So a model must learn a word-to-word mapping (nouns, verbs, adjectives), reordering (SVO -> SOV,
adjective after noun and reversed, relative clause pre-nominal) and agreement (determiner,
adjective and verb forms depend on a noun elsewhere in the sentence, sometimes several words away).

Sentences come from one grammar seeded by `data_seed`; the held-out sentences are drawn from the
same grammar and are guaranteed not to occur in the training set. Token ids: PAD 0, BOS 1, EOS 2,
then the words. Everything is a pure function of the arguments; `load` caches the arrays.
"""

from __future__ import annotations

import functools
import os
import pathlib
import tempfile

import numpy as np

import mnist1d_data

PAD, BOS, EOS = 0, 1, 2
SPECIALS = ["<pad>", "<s>", "</s>"]

_CONS = list("bdfgklmnprstvz")
_VOWELS = list("aeiou")


def _words(rng: np.random.Generator, n: int, syllables: tuple[int, int], taken: set) -> list[str]:
    out = []
    while len(out) < n:
        k = int(rng.integers(syllables[0], syllables[1] + 1))
        w = "".join(rng.choice(_CONS) + rng.choice(_VOWELS) for _ in range(k))
        if w not in taken:
            taken.add(w)
            out.append(w)
    return out


class Grammar:
    """The lexicon of both languages, and the sentence generator."""

    GENDERS = ("m", "f")

    def __init__(self, data_seed: int = 1234, nouns: int = 48, adjectives: int = 16, verbs: int = 24):
        rng = np.random.default_rng(data_seed)
        taken: set = set()
        self.src_nouns = _words(rng, nouns, (1, 2), taken)
        self.src_adjs = _words(rng, adjectives, (1, 2), taken)
        self.src_verbs = _words(rng, verbs, (1, 2), taken)
        self.tgt_nouns = _words(rng, nouns, (2, 3), taken)
        self.tgt_adjs = _words(rng, adjectives, (2, 2), taken)
        self.tgt_verbs = _words(rng, verbs, (2, 2), taken)
        self.gender = [self.GENDERS[int(g)] for g in rng.integers(0, 2, nouns)]
        # Source words: noun sg/pl (+"s"), verb for a singular/plural subject (+"s" on singular).
        src = list(SPECIALS) + ["the", "a", "some", "that"]
        src += [n for w in self.src_nouns for n in (w, w + "s")]
        src += self.src_adjs
        src += [v for w in self.src_verbs for v in (w + "s", w)]
        # Target: nouns sg/pl, adjectives and verbs in 4 forms (gender x number), 8 determiners.
        tgt = list(SPECIALS) + ["ke"]
        tgt += [d for d in ("lo", "la", "los", "las", "un", "una", "unos", "unas")]
        tgt += [n for w in self.tgt_nouns for n in (w + "r", w + "ri")]
        tgt += [w + suf for w in self.tgt_adjs for suf in ("o", "a", "os", "as")]
        tgt += [w + suf for w in self.tgt_verbs for suf in ("t", "ta", "n", "na")]
        assert len(set(src)) == len(src) and len(set(tgt)) == len(tgt)
        self.src_vocab, self.tgt_vocab = src, tgt
        self.src_id = {w: i for i, w in enumerate(src)}
        self.tgt_id = {w: i for i, w in enumerate(tgt)}

    # ---- one sentence -------------------------------------------------------------------------
    def _np(self, rng) -> dict:
        k = int(rng.choice(3, p=[0.4, 0.4, 0.2]))
        return {"noun": int(rng.integers(len(self.src_nouns))), "plural": bool(rng.random() < 0.4),
                "definite": bool(rng.random() < 0.5),
                "adjs": [int(a) for a in rng.choice(len(self.src_adjs), size=k, replace=False)]}

    def sample(self, rng) -> tuple:
        """A sentence as a hashable structure: (subject, verb, object, relative clause or None)."""
        subj, verb, obj = self._np(rng), int(rng.integers(len(self.src_verbs))), self._np(rng)
        rel = None
        if rng.random() < 0.3:
            rel = (int(rng.integers(len(self.src_verbs))), self._np(rng))
        return _freeze((subj, verb, obj, rel))

    def _src_np(self, np_) -> list[str]:
        det = "the" if np_["definite"] else ("some" if np_["plural"] else "a")
        noun = self.src_nouns[np_["noun"]] + ("s" if np_["plural"] else "")
        return [det] + [self.src_adjs[a] for a in np_["adjs"]] + [noun]

    def _src_verb(self, v, subject) -> str:
        return self.src_verbs[v] + ("" if subject["plural"] else "s")

    def source(self, sent) -> list[str]:
        subj, verb, obj, rel = _thaw(sent)
        words = self._src_np(subj) + [self._src_verb(verb, subj)] + self._src_np(obj)
        if rel is not None:
            words += ["that", self._src_verb(rel[0], obj)] + self._src_np(rel[1])
        return words

    def _agr(self, np_) -> int:  # 0..3: m sg, f sg, m pl, f pl
        return (self.gender[np_["noun"]] == "f") + 2 * np_["plural"]

    def _tgt_np(self, np_) -> list[str]:
        a = self._agr(np_)
        det = ("lo", "la", "los", "las")[a] if np_["definite"] else ("un", "una", "unos", "unas")[a]
        noun = self.tgt_nouns[np_["noun"]] + ("ri" if np_["plural"] else "r")
        adjs = [self.tgt_adjs[j] + ("o", "a", "os", "as")[a] for j in reversed(np_["adjs"])]
        return [det, noun] + adjs

    def _tgt_verb(self, v, subject) -> str:
        return self.tgt_verbs[v] + ("t", "ta", "n", "na")[self._agr(subject)]

    def target(self, sent) -> list[str]:
        subj, verb, obj, rel = _thaw(sent)
        words = self._tgt_np(subj)
        if rel is not None:  # "[object2 verb2 ke] object": the relative clause precedes its noun
            words += self._tgt_np(rel[1]) + [self._tgt_verb(rel[0], obj), "ke"]
        return words + self._tgt_np(obj) + [self._tgt_verb(verb, subj)]


def _freeze(x):
    if isinstance(x, dict):
        return tuple(sorted((k, _freeze(v)) for k, v in x.items()))
    if isinstance(x, (list, tuple)):
        return tuple(_freeze(v) for v in x)
    return x


def _thaw(sent):
    def np_(t):
        d = dict(t)
        d["adjs"] = list(d["adjs"])
        return d
    subj, verb, obj, rel = sent
    return np_(subj), verb, np_(obj), (None if rel is None else (rel[0], np_(rel[1])))


def _encode(words: list[str], ids: dict, length: int, bos: bool) -> np.ndarray:
    toks = ([BOS] if bos else []) + [ids[w] for w in words] + [EOS]
    out = np.full(length, PAD, dtype=np.int64)
    out[:len(toks)] = toks
    return out


SRC_LEN, TGT_LEN = 20, 24  # with EOS (and BOS on the target); the longest sentence fits


CACHE = pathlib.Path(os.environ.get("HVD_SCALE_CACHE", pathlib.Path.home() / ".cache" / "hvd_scale"))
_ARRAYS = ("src", "tgt", "src_test", "tgt_test")


def generate(train: int = 40_000, test: int = 500, data_seed: int = 1234) -> dict:
    """{'src', 'tgt', 'src_test', 'tgt_test'} int64 arrays (sources end with EOS, targets start
    with BOS and end with EOS, PAD after), plus 'train_keys' and 'test_keys' (the sentence
    structures). The held-out sentences are distinct and none occurs in the training set
    (training sentences may repeat, as in any corpus)."""
    g = Grammar(data_seed)
    rng = np.random.default_rng([data_seed, 1])
    held_out: set = set()
    test_keys: list = []
    while len(test_keys) < test:
        s = g.sample(rng)
        if s not in held_out:
            held_out.add(s)
            test_keys.append(s)
    train_keys = []
    while len(train_keys) < train:
        s = g.sample(rng)
        if s not in held_out:
            train_keys.append(s)

    def enc(keys, side):
        if side == "src":
            return np.stack([_encode(g.source(s), g.src_id, SRC_LEN, False) for s in keys])
        return np.stack([_encode(g.target(s), g.tgt_id, TGT_LEN, True) for s in keys])

    return {"src": enc(train_keys, "src"), "tgt": enc(train_keys, "tgt"),
            "src_test": enc(test_keys, "src"), "tgt_test": enc(test_keys, "tgt"),
            "train_keys": train_keys, "test_keys": test_keys}


@functools.lru_cache(maxsize=4)
def load(train: int = 40_000, test: int = 500, data_seed: int = 1234) -> dict:
    """`generate`'s arrays, cached as .npz in ~/.cache/hvd_scale/ (generating takes ~3 s, and every
    worker of every run reads the same file), plus 'grammar' and 'refs' (the held-out target
    sentences as strings)."""
    path = CACHE / f"translation-{train}-{test}-{data_seed}.npz"
    if not path.exists():
        data = generate(train, test, data_seed)
        path.parent.mkdir(parents=True, exist_ok=True)
        # Write then rename, so concurrent workers never read a half-written file.
        with tempfile.NamedTemporaryFile(dir=path.parent, suffix=".npz", delete=False) as f:
            np.savez(f, **{k: data[k] for k in _ARRAYS})
        os.replace(f.name, path)
    with np.load(path) as d:
        out = {k: d[k].astype(np.int64) for k in _ARRAYS}
    g = Grammar(data_seed)
    out["grammar"] = g
    out["refs"] = [decode(row[1:], g.tgt_vocab) for row in out["tgt_test"]]
    return out


def decode(ids, vocab: list[str]) -> str:
    """Target ids -> a whitespace-joined sentence, stopping at EOS, dropping BOS/PAD."""
    words = []
    for i in ids:
        i = int(i)
        if i == EOS:
            break
        if i in (PAD, BOS):
            continue
        words.append(vocab[i])
    return " ".join(words)


def shard_batches(src, tgt, batch_size: int, rank: int, size: int, seed: int):
    """Endless micro-batches for one worker, dealt out as mnist1d_data.shard_batches deals them
    (the same shuffle on every rank, no overlap), each trimmed to its longest sentence."""
    for s, t in mnist1d_data.shard_batches(src, tgt, batch_size, rank, size, seed):
        ls = int((s != PAD).sum(1).max())
        lt = int((t != PAD).sum(1).max())
        yield s[:, :ls], t[:, :lt]
