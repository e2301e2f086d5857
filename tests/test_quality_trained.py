"""Sparse-auto and its receipts on trained attention (issue 55 §3), through a real server.

A two-layer attention model is trained here on the CPU (tests/trained_attention.py: multi-query
associative recall, 35-60 s) and its K/V of 16 contexts of 2048 tokens — filler with 32
key/value pairs at random depths — are stored as ATTEND.PREFIX slots. Each key is then asked
after its context (512 recalls): the query token runs through the model with every layer's attention over
[context, itself] computed by the server (QUERY_FUSED, or QUERY_SPARSE_AUTO_FUSED with RECEIPT),
and the answer is right when the model's top token is the key's value. Layer 0 has learned
retrieval heads (a needle holds ~0.8-1.0 of their softmax mass); layer 1 attends broadly.

Checked:
- dense through Pion is the model: logits within 1e-3 of numpy's float64 attention, and of the
  model's own forward over the whole sequence; the model recalls >= 90 % at 32x its training
  length;
- sparse-auto at a 1/8 budget (K_top = N/(8B) − 2 blocks of B rows plus the first and last),
  SELECT mean and quest, per head and SHARED, B = 8, 16, 32, on every layer: each receipt says
  what was computed (the first and last block and K_top more per head, one list per K/V group
  with SHARED, rows_attended, exact 0) and the output is numpy's attention over exactly those
  rows; the accuracy must be >= 99 % of dense. Where Pion does not reach that the case is an
  expected failure stating the measured figure (issue 55 §5): block means lose needles at every
  B, Quest's bound keeps them at B = 8 only;
- a selector choosing random blocks at the same budget fails the accuracy check (it loses most
  needles), so the check can fail;
- omitted mass: the receipt's `omitted_mass_estimate` equals what PROTOCOL.md documents (the
  block-mean proxy: rows·exp(q·mean/√D) of the blocks left out over that of all visible
  blocks, averaged over query heads), recomputed here from the stored K; against the true
  omitted mass (the dense softmax mass of the rows left out, numpy) it is printed per layer and
  held to issue 55's ±0.02 — an expected failure: on the retrieval layer it is off by
  -0.50..+0.59 (mean, B8) and -0.03..+0.75 (quest, B8); on the broad layer within
  -0.08..+0.01 (mean) and 0..+0.1 (quest). The receipt's `omitted_mass_bound` (Quest's
  per-block bound over the blocks left out against the exact mass attended) meets the goal's
  other form: it is never below the true omitted mass, per head and SHARED, on every layer.

Runtime on the 2-core dev box while it built C++: 163 s (training 57 s; 84 s of CPU in all).
"""
from __future__ import annotations

import math
import os
import sys
from dataclasses import dataclass, field

import numpy as np
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "clients",
                                "python"))

pytest.importorskip("torch", reason="training the model needs PyTorch (Debian's python3-torch: "
                    "scripts/install-deps.sh installs it)")

import pion  # noqa: E402
import trained_attention as ta  # noqa: E402
from pionlib import HOST, ServerFactory  # noqa: E402

N, PAIRS, CONTEXTS = 2048, 32, 16
BUDGET = 8  # the prefix rows attended: N / BUDGET (plus the query's own)
BLOCKS = (8, 16, 32)
SELECTS = (("mean", False), ("mean", True), ("quest", False), ("quest", True))
GOAL = 0.99  # sparse accuracy >= GOAL x dense accuracy
MASS_GOAL = 0.02  # issue 55: receipts within ±0.02 of the true omitted mass (or a bound >= it)

# Below the goal when measured (recalls of 512 on the 2-core dev box; dense 493): mean B8 380 /
# SHARED 358, B16 294 / 273, B32 240 / 206 (the needle's one row is 1/B of a block mean, under
# the filler's spread); quest B16 468 / 460, B32 408 / 402 (the min/max box of B filler keys
# bounds every block above the needle's score). Quest B8 keeps dense accuracy (495 / 490; over
# three training seeds and two context sets 0.998-1.010 / 0.994-1.008 of dense).
SHORT_OF_GOAL = {("mean", 8), ("mean", 16), ("mean", 32), ("quest", 16), ("quest", 32)}


@dataclass
class Run:
    """One configuration's pass over every recall."""
    correct: int = 0
    total: int = 0
    logits: list = field(default_factory=list)
    # per sparse call: (layer, true omitted mass, documented proxy, receipt's estimate)
    mass: list = field(default_factory=list)
    checked_calls: int = 0


class Lab:
    def __init__(self, model, client):
        self.model, self.client = model, client
        rng = np.random.default_rng(2055)
        self.contexts = [ta.make_context(rng, N, PAIRS) for _ in range(CONTEXTS)]
        self.kv = [model.context_kv(c.ids) for c in self.contexts]
        for i, kv in enumerate(self.kv):
            for layer, (k, v) in enumerate(kv):
                client.attend.store(self.sid(i), layer, k, v)
        self.runs: dict = {}

    @staticmethod
    def sid(i):
        return "recall%d" % i

    def run(self, name, attend_for):
        """Every recall with attend_for(i) as the model's attention; cached by name."""
        if name not in self.runs:
            r = Run()
            for i, c in enumerate(self.contexts):
                attend = attend_for(i, r)
                for key, value in zip(c.keys, c.values):
                    logits = self.model.answer(int(c.ids[-1]), int(key), attend)
                    r.logits.append(logits)
                    r.correct += int(np.argmax(logits) == value)
                    r.total += 1
            self.runs[name] = r
        return self.runs[name]

    def dense(self):
        return self.run("numpy", lambda i, r: ta.dense_attend(self.kv[i]))

    def server_dense(self):
        def attend_for(i, r):
            return lambda layer, q, ks, vs: self.client.attend.query_fused(
                self.sid(i), layer, q, ks, vs).out
        return self.run("pion dense", attend_for)

    def sparse(self, select, shared, block):
        k_top = N // (BUDGET * block) - 2

        def attend_for(i, r):
            def attend(layer, q, ks, vs):
                res = self.client.attend.query_sparse_auto_fused(
                    self.sid(i), layer, q, ks, vs, block, k_top, select=select, shared=shared,
                    receipt=True)
                check_receipt(self.kv[i], layer, q, ks, vs, block, k_top, shared, res, r)
                return res.out
            return attend
        return self.run("pion %s%s B%d" % (select, " SHARED" if shared else "", block),
                        attend_for)


def check_receipt(kv, layer, q, ks, vs, block, k_top, shared, res, run):
    """The receipt names what was computed and the output is attention over exactly that; the
    true omitted mass and the documented proxy are recorded beside the receipt's estimate."""
    rc = res.receipt
    nb = N // block
    group = ta.H_Q // ta.H_KV
    assert rc["form"] == "sparse_auto_fused" and rc["exact"] is False
    assert rc["blocks_total"] == nb and len(rc["blocks"]) == ta.H_Q
    scores = ta.dense_scores(kv, layer, q, ks)  # [H_Q, N+1], scaled, float64
    probs = ta.softmax(scores)
    k_heads = np.repeat(kv[layer][0].astype(np.float64), group, axis=0)
    v_heads = np.repeat(np.concatenate([kv[layer][1], vs], 1).astype(np.float64), group, axis=0)
    means = k_heads.reshape(ta.H_Q, nb, block, -1).mean(2)
    true, proxy = [], []
    for h, blocks in enumerate(rc["blocks"]):
        assert blocks == sorted(set(blocks)) and len(blocks) == k_top + 2, (h, blocks)
        assert blocks[0] == 0 and blocks[-1] == nb - 1, blocks  # attention sink, recent block
        if shared:
            assert blocks == rc["blocks"][h - h % group], "SHARED: one list per K/V group"
        kept = np.zeros(N + 1, bool)
        kept[-1] = True  # the query's own row (the suffix)
        for b in blocks:
            kept[b * block:(b + 1) * block] = True
        assert rc["support"][h] == (k_top + 2) * block + 1
        p = np.where(kept, np.exp(scores[h] - scores[h][kept].max()), 0.0)
        want = (p / p.sum()) @ v_heads[h]
        assert np.allclose(res.out[h], want, rtol=1e-4, atol=1e-5), (h, res.out[h], want)
        true.append(probs[h][:-1][~kept[:-1]].sum())
        w = block * np.exp(means[h] @ q[h].astype(np.float64) / math.sqrt(ta.HEAD_DIM) -
                           (means[h] @ q[h]).max() / math.sqrt(ta.HEAD_DIM))
        chosen = np.zeros(nb, bool)
        chosen[blocks] = True
        proxy.append(w[~chosen].sum() / w.sum())
    assert rc["rows_attended"] == ta.H_Q * ((k_top + 2) * block + 1)
    assert rc["rows_attended"] <= ta.H_Q * (N // BUDGET + 1)  # the 1/8 budget
    run.mass.append((layer, float(np.mean(true)), float(np.mean(proxy)),
                     rc["omitted_mass_estimate"], rc["omitted_mass_bound"]))
    run.checked_calls += 1


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    model = ta.trained()
    print("\ntrained: %d steps in %.1f s, training recall %.3f" % (
        model.steps, model.seconds, model.train_accuracy))
    factory = ServerFactory(tmp_path_factory.mktemp("quality"))
    try:
        srv = factory("--workers", "2")
        yield Lab(model, pion.Client(HOST, srv.port, socket_timeout=60))
    finally:
        factory.stop_all()


def test_model_learned_recall_and_dense_pion_is_the_model(lab):
    dense, served = lab.dense(), lab.server_dense()
    print("dense recall at N=%d: numpy %d/%d, through Pion %d/%d" % (
        N, dense.correct, dense.total, served.correct, served.total))
    assert dense.correct >= 0.9 * dense.total  # learned on 64 tokens, holds at 2048
    diff = max(np.abs(a - b).max() for a, b in zip(dense.logits, served.logits))
    assert diff < 1e-3, diff
    assert served.correct == dense.correct
    # The split at the query is the model: its own forward over context + key, a few recalls.
    for c in lab.contexts[:1]:
        for key, logits in list(zip(c.keys, dense.logits))[:4]:
            full = lab.model.full_logits(np.concatenate([c.ids, [key]]))
            assert np.abs(full - logits).max() < 1e-3


def cases():
    for block in BLOCKS:
        for select, shared in SELECTS:
            marks = ()
            if (select, block) in SHORT_OF_GOAL:
                marks = pytest.mark.xfail(
                    reason="issue 55 §5: SELECT %s at B=%d loses needles of trained attention "
                    "at a 1/8 budget (measured figure in SHORT_OF_GOAL)" % (select, block),
                    strict=False)
            yield pytest.param(select, shared, block, marks=marks,
                               id="%s%s-B%d" % (select, "-shared" if shared else "", block))


@pytest.mark.parametrize("select,shared,block", cases())
def test_sparse_auto_at_one_eighth_keeps_dense_accuracy(lab, select, shared, block):
    dense = lab.dense()
    run = lab.sparse(select, shared, block)
    assert run.checked_calls == run.total * ta.LAYERS  # every receipt was checked
    print("%s%s B=%d K_top=%d: recall %d/%d (dense %d/%d, %.3f of it)" % (
        select, " SHARED" if shared else "", block, N // (BUDGET * block) - 2, run.correct,
        run.total, dense.correct, dense.total, run.correct / dense.correct))
    assert run.correct >= GOAL * dense.correct


def test_random_blocks_fail_the_accuracy_check(lab):
    """The accuracy check can fail: a selector that picks random blocks (the same budget, the
    first and last block kept) loses most needles."""
    dense = lab.dense()
    rng = np.random.default_rng(1)
    block = 16
    nb, k_top = N // block, N // (BUDGET * block) - 2

    def keep(layer, q, probs):
        mask = np.zeros((ta.H_Q, N), bool)
        for h in range(ta.H_Q):
            chosen = [0, nb - 1] + list(rng.choice(np.arange(1, nb - 1), k_top, replace=False))
            for b in chosen:
                mask[h, b * block:(b + 1) * block] = True
        return mask

    run = lab.run("random B16", lambda i, r: ta.dense_attend(lab.kv[i], keep))
    print("random blocks B=16: recall %d/%d (dense %d)" % (run.correct, run.total,
                                                            dense.correct))
    assert run.correct < 0.5 * dense.correct


@pytest.mark.parametrize("select,block", [("mean", 8), ("quest", 8), ("mean", 32),
                                          ("quest", 32)], ids=lambda x: str(x))
def test_omitted_mass_receipt_is_the_documented_proxy(lab, select, block):
    run = lab.sparse(select, False, block)
    for layer, true, proxy, got, _ in run.mass:
        assert got == pytest.approx(proxy, abs=2e-4), (layer, got, proxy)
    for layer in range(ta.LAYERS):
        m = np.array([x[1:4] for x in run.mass if x[0] == layer])
        d = m[:, 2] - m[:, 0]
        print("%s B=%d layer %d: true omitted mass mean %.3f (max %.3f), receipt mean %.3f; "
              "receipt - true in [%.3f, %.3f], |.| mean %.3f, below true %d/%d" % (
                  select, block, layer, m[:, 0].mean(), m[:, 0].max(), m[:, 2].mean(),
                  d.min(), d.max(), np.abs(d).mean(), (d < 0).sum(), len(d)))


@pytest.mark.parametrize("select,shared,block", [("mean", False, 8), ("quest", False, 8),
                                                 ("mean", True, 16), ("quest", True, 32)],
                         ids=lambda x: str(x))
def test_omitted_mass_bound_is_never_below_the_true_mass(lab, select, shared, block):
    """Issue 55's receipt goal, met as a bound: `omitted_mass_bound` (Quest's per-block bound on
    q·k over the blocks left out, against the exact mass attended) is never below the true
    omitted mass, on every layer of the trained model; its slack is printed per layer."""
    run = lab.sparse(select, shared, block)
    d = np.array([bound - true for _, true, _, _, bound in run.mass])
    for layer in range(ta.LAYERS):
        m = np.array([(x[1], x[4]) for x in run.mass if x[0] == layer])
        print("%s%s B=%d layer %d: true omitted mass mean %.3f (max %.3f), bound mean %.3f "
              "(bound - true: mean %.3f, max %.3f)" % (
                  select, " SHARED" if shared else "", block, layer, m[:, 0].mean(),
                  m[:, 0].max(), m[:, 1].mean(), (m[:, 1] - m[:, 0]).mean(),
                  (m[:, 1] - m[:, 0]).max()))
    assert (d >= -1e-6).all(), d.min()
    assert all(0 <= x[4] <= 1 for x in run.mass)


@pytest.mark.xfail(reason="issue 55 §5: on the retrieval layer the block-mean proxy is off by "
                   "up to ~0.8 either way (chosen blocks' mass is under-counted by their mean, "
                   "left-out needles too); no summary-only estimate is within ±0.02 there — "
                   "the receipt's omitted_mass_bound is the figure that meets the goal",
                   strict=False)
@pytest.mark.parametrize("select", ["mean", "quest"])
def test_omitted_mass_estimate_within_the_issue_goal(lab, select):
    run = lab.sparse(select, False, 8)
    d = np.array([got - true for _, true, _, got, _ in run.mass])
    within = np.abs(d) <= MASS_GOAL
    print("%s B=8: estimate within ±%.2f of the true omitted mass in %d/%d calls, below it in "
          "%d" % (select, MASS_GOAL, within.sum(), len(d), (d < -1e-6).sum()))
    assert within.all()
