"""bench/quality/train.py's data pieces, which need neither torch nor transformers: the corpus
split by file, passkey / multi-key recall synthesis at chosen and random depths, and batches
deterministic in their seed. The model itself trains on the GPU machine (issue 55 §1)."""
from __future__ import annotations

import importlib.util
import random
import sys
from pathlib import Path

import numpy as np
import pytest

TRAIN = Path(__file__).resolve().parent.parent / "bench" / "quality" / "train.py"


@pytest.fixture(scope="module")
def tr():
    spec = importlib.util.spec_from_file_location("quality_train", TRAIN)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["quality_train"] = mod
    spec.loader.exec_module(mod)
    return mod


def text_bytes(n_lines: int) -> np.ndarray:
    return np.frombuffer("".join("line %d of the haystack text\n" % i
                                 for i in range(n_lines)).encode(), np.uint8).copy()


def test_corpus_is_split_by_file_and_stable(tr, tmp_path):
    root = tmp_path / "site-packages"
    for i in range(400):
        p = root / ("pkg%d" % (i % 7)) / ("mod%03d.py" % i)
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text("# module %d\n" % i + "x = %d\n" % i * 200)
    (root / "pkg0" / "tiny.py").write_text("x = 1\n")  # under 1 KiB: skipped
    (root / "pkg0" / "data.bin").write_bytes(b"x" * 5000)  # not text: skipped
    train, held, info = tr.corpus([root], 1 << 30)
    train2, held2, info2 = tr.corpus([root], 1 << 30)
    assert np.array_equal(train, train2) and np.array_equal(held, held2) and info == info2
    assert info["train_files"] + info["heldout_files"] == 400 == info["files_seen"]
    assert 5 <= info["heldout_files"] <= 40  # 1 in 20 by the path's hash
    text_train, text_held = train.tobytes().decode(), held.tobytes().decode()
    for i in range(400):  # each file on exactly one side
        mark = "# module %d\n" % i
        assert (mark in text_train) != (mark in text_held), i


def test_passkeys_sit_at_their_depths_and_answers_are_weighted(tr):
    text = text_bytes(5000)
    rnd = random.Random(1)
    depths = [0.1, 0.5, 0.9]
    seq, weights, meta = tr.retrieval_sequence(text, 8192, rnd, keys=3, depths=depths, asks=2,
                                               ask=[0, 2])
    assert len(seq) == 8192 and weights.shape == (8192,)
    s = seq.tobytes()
    for (name, digits, depth, ans), want in zip(meta, (0.1, 0.9)):
        line = tr.passkey_line(name, digits)
        # planted at its depth, and asked again at the end (the same line, with its answer)
        assert s.count(line) == 2 and abs(s.index(line) / len(s) - want) < 0.05
        assert s[ans:ans + 7].decode() == digits  # the answer's offset
        assert s[:ans].endswith(tr.passkey_query(name))
        assert weights[ans:ans + 7].tolist() == [1.0] * 7
    assert weights.sum() == 14  # the answers' digits alone
    with pytest.raises(Exception):
        tr.retrieval_sequence(text, 100, rnd, keys=8)  # no room for eight passkeys


def test_batches_are_deterministic(tr):
    text = text_bytes(20000)
    a = tr.batch(text, 8, 1024, 0.5, random.Random(7))
    b = tr.batch(text, 8, 1024, 0.5, random.Random(7))
    assert np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1])
    assert a[0].shape == (8, 1024) and a[1].shape == (8, 1024)
    carrying = sum(b"passkey of" in row.tobytes() for row in a[0])
    assert 0 < carrying < 8 and (a[1].sum(1) > 0).sum() == carrying


def test_recall_drills_ask_every_planted_key(tr):
    """The curriculum's short phase: each retrieval sequence asks all of its 2-8 keys (each
    name planted once and asked once, with the same digits), and the weighted bytes are exactly
    the asked digits."""
    import re
    text = text_bytes(20000)
    xs, ws = tr.batch(text, 32, 1024, 1.0, random.Random(3), ask_all=True)
    for x, w in zip(xs, ws):
        s = x.tobytes()
        found = [(m.group(1), m.group(2), m.start(2))
                 for m in re.finditer(rb"passkey of ([a-z]{6}) is ([0-9]{7})", s)]
        names = {n for n, _, _ in found}
        assert 2 <= len(names) <= 8 and len(found) == 2 * len(names), s[-300:]
        weighted = set(np.flatnonzero(w).tolist())
        want = set()
        for name in names:
            (_, d1, _), (_, d2, at) = [f for f in found if f[0] == name]
            assert d1 == d2
            want |= set(range(at, at + 7))  # the asked occurrence: the later one
        assert weighted == want
