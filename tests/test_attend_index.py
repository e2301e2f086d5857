"""ATTEND.CREATE / STORE / FINALIZE / QUERY / INFO / DROP: the HNSW attention index against a
numpy brute-force reference.

- Recall@32 (default parameters: M 16, EF_CONSTRUCTION 200, EF 320) against numpy's exact top-32
  by the session's metric, on random and clustered keys, with key-distributed queries (stored keys
  plus noise) and shifted queries (another distribution): printed, and asserted >= 0.95 for the
  key-distributed ones (>= 0.90 shifted).
- ATTEND: output and LSE equal numpy's softmax((q·k)/√key_dim)·V over exactly the returned rows
  (rel err <= 1e-5).
- The graph path (EF given, receipt `exact` 0; at these sizes the defaults scan): recall@32 and
  the best key's presence against numpy's exact top-32, rising with EF, and the receipt's
  `recall_estimate` no over-report — on Gaussian keys of three kinds and on a trained model's
  keys and queries (tests/trained_attention.py).
- Rows staged after a FINALIZE are invisible until the next one; positions are kept per row.
- ATTEND.INFO's metric is text on every protocol (a simple string; str over frames).
"""
from __future__ import annotations

import os
import sys
import threading

import numpy as np
import pytest

from pionlib import HOST, RespError

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "clients",
                                "python"))
import pion  # noqa: E402


def f32(a) -> bytes:
    return np.ascontiguousarray(a, dtype="<f4").tobytes()


def qmap(flat) -> dict:
    if isinstance(flat, dict):
        items = list(flat.items())
    else:
        items = [(flat[i], flat[i + 1]) for i in range(0, len(flat), 2)]
    return {(k.decode() if isinstance(k, bytes) else k): v for k, v in items}


def query(r, sid, k, q, *extra):
    m = qmap(r.execute_command("ATTEND.QUERY", sid, k, f32(q), *extra))
    kk = int(m["k"])
    nq = q.size // q.shape[-1]
    out = {
        "generation": int(m["generation"]), "k": kk,
        "ids": np.frombuffer(m["ids"], "<u4").reshape(nq, kk),
        "positions": np.frombuffer(m["positions"], "<i8").reshape(nq, kk),
        "scores": np.frombuffer(m["scores"], "<f4").reshape(nq, kk),
    }
    for key in ("exact", "ef"):
        out[key] = int(m[key])
    out["recall_estimate"] = float(m["recall_estimate"])
    if "output" in m:
        out["output"] = np.frombuffer(m["output"], "<f4").reshape(nq, -1)
        out["lse"] = np.frombuffer(m["lse"], "<f4")
    return out


def err(srv, *args) -> str:
    with srv.raw() as c:
        got = c.call(*args)
    assert isinstance(got, RespError), "expected an error, got %r" % (got,)
    return str(got)


def scores_ref(q, keys, metric):
    q64, k64 = q.astype(np.float64), keys.astype(np.float64)
    if metric == "l2":
        return -((q64[:, None, :] - k64[None]) ** 2).sum(-1)
    dots = q64 @ k64.T
    if metric == "cos":
        return dots / np.outer(np.linalg.norm(q64, axis=1), np.linalg.norm(k64, axis=1))
    return dots


def finalize(r, sid) -> dict:
    m = qmap(r.execute_command("ATTEND.FINALIZE", sid))
    floats = ("recall_estimate", "build_ms", "calibrate_ms")
    return {k: (float(v) if k in floats else int(v)) for k, v in m.items()}


def make_keys(rng, n, d, clustered):
    keys = rng.standard_normal((n, d)).astype(np.float32)
    if clustered:
        centers = 3 * rng.standard_normal((16, d)).astype(np.float32)
        keys += centers[np.arange(n) % 16]
    return keys


@pytest.mark.parametrize("metric", ["ip", "l2", "cos"])
@pytest.mark.parametrize("clustered", [False, True])
def test_recall_at_32_against_brute_force(shared_pion, metric, clustered):
    r = shared_pion.client()
    rng = np.random.default_rng(1 + clustered + 3 * ["ip", "l2", "cos"].index(metric))
    n, d, dv = 5000, 64, 16
    sid = "rec-%s-%d" % (metric, clustered)
    keys = make_keys(rng, n, d, clustered)
    values = rng.standard_normal((n, dv)).astype(np.float32)
    assert r.execute_command("ATTEND.CREATE", sid, d, dv, "METRIC", metric) == b"OK"
    for a in range(0, n, 1024):  # several STOREs
        b = min(n, a + 1024)
        assert r.execute_command("ATTEND.STORE", sid, f32(keys[a:b]), f32(values[a:b])) == b
    fin = finalize(r, sid)
    assert fin["generation"] == 1 and fin["rows"] == n and 0 < fin["recall_estimate"] <= 1
    assert fin["build_ms"] > 0 and fin["calibrate_ms"] > 0  # the graph, then the calibration
    near = keys[rng.integers(0, n, 40)] + 0.3 * rng.standard_normal((40, d)).astype(np.float32)
    shifted = 1.5 * keys[rng.integers(0, n, 40)] + 0.5 * rng.standard_normal((40, d)) + 0.3
    recalls = []
    for qs in (near, shifted.astype(np.float32)):
        got = query(r, sid, 32, qs)
        ref = scores_ref(qs, keys, metric)
        exact = np.argsort(-ref, axis=1)[:, :32]
        recalls.append(np.mean([len(set(got["ids"][i]) & set(exact[i])) / 32
                                for i in range(len(qs))]))
        # Scores are the true scores of the returned rows, best first.
        true = np.take_along_axis(ref, got["ids"].astype(np.int64), 1)
        assert np.allclose(got["scores"], true, rtol=1e-4, atol=1e-3)
        assert np.all(np.diff(got["scores"], axis=1) <= 1e-5)
    print("recall@32 %s %s: key-distributed %.3f shifted %.3f" %
          (metric, "clustered" if clustered else "random", *recalls))
    assert recalls[0] >= 0.95 and recalls[1] >= 0.90, recalls
    r.execute_command("ATTEND.DROP", sid)


@pytest.mark.parametrize("keys_kind", ["isotropic", "clustered", "outlier-channels"])
def test_recall_on_hard_keys_with_receipts(shared_pion, keys_kind):
    """20,000 keys of dim 64 with inner-product truth, queried by independent Gaussian queries
    (out of distribution for the keys): recall@32 >= 0.95 at the defaults, each reply's receipt
    says how it was answered (exact scan or a beam, and its calibrated recall), EXACT returns
    numpy's exact top-32, and an explicit narrow EF reports its lower estimate."""
    r = shared_pion.client()
    rng = np.random.default_rng(["isotropic", "clustered", "outlier-channels"].index(keys_kind))
    n, d = 20000, 64
    keys = rng.standard_normal((n, d)).astype(np.float32)
    if keys_kind == "clustered":
        keys += (3 * rng.standard_normal((64, d)).astype(np.float32))[rng.integers(0, 64, n)]
    elif keys_kind == "outlier-channels":  # a few large-magnitude channels, as real K have
        keys[:, :4] *= 12
    sid = "hard-" + keys_kind
    assert r.execute_command("ATTEND.CREATE", sid, d, 4, "METRIC", "ip") == b"OK"
    r.execute_command("ATTEND.STORE", sid, f32(keys), f32(np.zeros((n, 4), np.float32)))
    fin = finalize(r, sid)
    qs = rng.standard_normal((60, d)).astype(np.float32)
    exact = np.argsort(-scores_ref(qs, keys, "ip"), axis=1)[:, :32]
    got = query(r, sid, 32, qs)
    recall = np.mean([len(set(got["ids"][i]) & set(exact[i])) / 32 for i in range(len(qs))])
    info = qmap(r.execute_command("ATTEND.INFO", sid))
    print("recall@32 %s: %.3f (exact %d, ef %d, estimate %.3f)" %
          (keys_kind, recall, got["exact"], got["ef"], got["recall_estimate"]))
    assert recall >= 0.95, recall
    assert got["recall_estimate"] == pytest.approx(fin["recall_estimate"])
    assert int(info["default_exact"]) == got["exact"] and int(info["default_ef"]) == got["ef"]
    assert float(info["build_ms"]) == pytest.approx(fin["build_ms"])
    assert float(info["calibrate_ms"]) == pytest.approx(fin["calibrate_ms"])
    if got["exact"]:
        assert got["ef"] == 0 and got["recall_estimate"] == 1.0
    else:
        assert got["ef"] >= 32 and 0.98 <= got["recall_estimate"] <= 1.0
    ex = query(r, sid, 32, qs[:8], "EXACT")
    assert ex["exact"] == 1 and ex["ef"] == 0 and ex["recall_estimate"] == 1.0
    np.testing.assert_array_equal(ex["ids"], exact[:8])
    narrow = query(r, sid, 32, qs[:4], "EF", 32)
    assert narrow["exact"] == 0 and narrow["ef"] == 32 and 0 < narrow["recall_estimate"] <= 1
    e = err(shared_pion, "ATTEND.QUERY", sid, 32, f32(qs[:1]), "EXACT", "EF", 64)
    assert e == "ERR EXACT scans every key; it takes no EF", e
    r.execute_command("ATTEND.DROP", sid)


def graph_recalls(r, sid, keys, qs, efs, k=32):
    """Per EF: (recall@k against numpy's exact top-k, the share of queries whose exact best key
    is returned, the reply's receipt). Every reply must come from the graph: `exact` 0 and the
    beam asked for."""
    exact = np.argsort(-scores_ref(qs, keys, "ip"), axis=1)[:, :k]
    out = {}
    for ef in efs:
        got = query(r, sid, k, qs, "EF", ef)
        assert got["exact"] == 0 and got["ef"] == max(ef, k), (ef, got["exact"], got["ef"])
        recall = np.mean([len(set(got["ids"][i]) & set(exact[i])) / k for i in range(len(qs))])
        best = np.mean([exact[i, 0] in set(got["ids"][i]) for i in range(len(qs))])
        out[ef] = (recall, best, got["recall_estimate"])
    return out


GRAPH_EFS = (32, 64, 128, 256, 512)
# The calibration's probes and a test's queries are samples (128 each): an estimate may sit this
# far above the recall measured here without over-reporting. (Before the calibration measured
# beam 32, EF 32 reported beam 80's recall: 0.10-0.23 above what it found.)
OVER_REPORT = 0.07


@pytest.mark.parametrize("keys_kind", ["isotropic", "clustered", "outlier-channels"])
def test_graph_path_recall_and_receipt(shared_pion, keys_kind):
    """The graph itself — at these sizes a query without EF scans (calibration finds the scan
    cheaper), so the tests above compare a scan with a scan. With EF given every reply is a
    graph search (`exact` 0, `ef` the beam): recall@32 against numpy's exact top-32 rises with
    the beam, and the receipt's `recall_estimate` (calibrated on Gaussian probes) is no
    over-report of what Gaussian queries measure (OVER_REPORT), at narrow beams too. Measured
    recall@32 at EF 32/64/128/256/512, 20,000 keys of dim 64: isotropic 0.28/0.44/0.61/0.79/0.91
    (isotropic inner-product search is hard for a graph: the defaults scan it), clustered
    0.62/0.71/0.79/0.89/0.97, outlier channels 0.78/0.88/0.95/0.98/0.995."""
    rng = np.random.default_rng(10 + ["isotropic", "clustered", "outlier-channels"].index(keys_kind))
    r = shared_pion.client()
    n, d = 20000, 64
    keys = rng.standard_normal((n, d)).astype(np.float32)
    if keys_kind == "clustered":
        keys += (3 * rng.standard_normal((64, d)).astype(np.float32))[rng.integers(0, 64, n)]
    elif keys_kind == "outlier-channels":
        keys[:, :4] *= 12
    sid = "graph-" + keys_kind
    r.execute_command("ATTEND.CREATE", sid, d, 4, "METRIC", "ip")
    r.execute_command("ATTEND.STORE", sid, f32(keys), f32(np.zeros((n, 4), np.float32)))
    finalize(r, sid)
    qs = rng.standard_normal((128, d)).astype(np.float32)
    got = graph_recalls(r, sid, keys, qs, GRAPH_EFS)
    for ef, (recall, best, estimate) in got.items():
        print("graph %s EF %d: recall@32 %.3f, best key returned %.3f, receipt estimate %.3f" %
              (keys_kind, ef, recall, best, estimate))
        assert 0 < estimate <= recall + OVER_REPORT, (ef, recall, estimate)
    recalls = [got[ef][0] for ef in GRAPH_EFS]
    assert all(b >= a - 0.02 for a, b in zip(recalls, recalls[1:])), recalls
    assert recalls[-1] >= {"isotropic": 0.8, "clustered": 0.93,
                           "outlier-channels": 0.98}[keys_kind], recalls
    r.execute_command("ATTEND.DROP", sid)


@pytest.mark.time_limit(300)  # trains the model when no earlier test of the session did
def test_graph_path_on_trained_attention(shared_pion):
    """The graph on a trained model's keys and queries (tests/trained_attention.py): the K rows
    of the retrieval layer's K/V head over 8 recall contexts (16,384 rows of dim 32) and the
    queries of its query heads asking each of their 256 keys. Such queries are peaked on one
    key (the needle: the value token after the asked key) and out of the keys' distribution.
    With EF given (`exact` 0): recall@32 and the share of queries whose best key is returned
    rise with the beam, and the receipt's estimate is no over-report (OVER_REPORT). Measured:
    recall@32 0.76/0.87/0.94/0.97, best key 0.80/0.91/0.97/0.99 at EF 32/64/128/256 (receipt
    0.70/0.70/0.85/0.92)."""
    pytest.importorskip("torch", reason="the trained model needs PyTorch (Debian's "
                        "python3-torch: scripts/install-deps.sh installs it)")
    import trained_attention as ta
    model = ta.trained()
    rng = np.random.default_rng(4055)
    contexts = [ta.make_context(rng, 2048, 32) for _ in range(8)]
    kvs = [model.context_kv(c.ids) for c in contexts]
    queries = np.stack([ta.recall_queries(model, c, kv)[:, 0] for c, kv in zip(contexts, kvs)])
    # queries [context, key, H_Q, hd]. The retrieval K/V head: the one whose query heads put the
    # most dense attention on the needles.
    group = ta.H_Q // ta.H_KV
    needle_mass = np.zeros(ta.H_Q)
    for c, kv, qc in zip(contexts, kvs, queries):
        for j in range(len(c.keys)):
            k_self = kv[0][0][:, -1:]  # any own key: its mass is not counted
            p = ta.softmax(ta.dense_scores(kv, 0, qc[j], k_self))
            needle_mass += p[:, c.value_pos[j]]
    kv_head = int(np.argmax(needle_mass.reshape(ta.H_KV, group).sum(1)))
    keys = np.concatenate([kv[0][0][kv_head] for kv in kvs])
    values = np.concatenate([kv[0][1][kv_head] for kv in kvs])
    qs = queries[:, :, kv_head * group:(kv_head + 1) * group].reshape(-1, ta.HEAD_DIM)
    print("retrieval K/V head %d: needle mass per query head %s" % (
        kv_head, np.round(needle_mass / (len(contexts) * 32), 3)))
    r = shared_pion.client()
    r.execute_command("ATTEND.CREATE", "trained", ta.HEAD_DIM, ta.HEAD_DIM, "METRIC", "ip")
    r.execute_command("ATTEND.STORE", "trained", f32(keys), f32(values))
    finalize(r, "trained")
    got = graph_recalls(r, "trained", keys, qs, (32, 64, 128, 256))
    for ef, (recall, best, estimate) in got.items():
        print("trained keys EF %d: recall@32 %.3f, best key returned %.3f, receipt estimate %.3f"
              % (ef, recall, best, estimate))
        assert 0 < estimate <= recall + OVER_REPORT, (ef, recall, estimate)
    recalls = [got[ef][0] for ef in (32, 64, 128, 256)]
    assert all(b >= a - 0.02 for a, b in zip(recalls, recalls[1:])), recalls
    assert got[256][0] >= 0.9 and got[256][1] >= 0.97, got[256]
    r.execute_command("ATTEND.DROP", "trained")


def test_attend_equals_exact_attention_over_returned_rows(shared_pion):
    r = shared_pion.client()
    rng = np.random.default_rng(2)
    n, d, dv = 3000, 32, 24
    keys = rng.standard_normal((n, d)).astype(np.float32)
    values = rng.standard_normal((n, dv)).astype(np.float32)
    r.execute_command("ATTEND.CREATE", "att", d, dv)
    r.execute_command("ATTEND.STORE", "att", f32(keys), f32(values), 500)
    finalize(r, "att")
    q = rng.standard_normal((3, d)).astype(np.float32)
    got = query(r, "att", 40, q, "EF", 100, "ATTEND")
    assert got["k"] == 40
    for i in range(3):
        ids = got["ids"][i].astype(np.int64)
        assert np.array_equal(got["positions"][i], 500 + ids)  # candidate ids are not positions
        s = keys[ids].astype(np.float64) @ q[i].astype(np.float64) / np.sqrt(d)
        mx = s.max()
        p = np.exp(s - mx)
        ref = (p / p.sum()) @ values[ids].astype(np.float64)
        assert np.allclose(got["output"][i], ref, rtol=1e-5, atol=1e-6)
        assert abs(got["lse"][i] - (mx + np.log(p.sum()))) <= 1e-5 * (1 + abs(mx))
    r.execute_command("ATTEND.DROP", "att")


def test_staged_rows_invisible_until_the_next_finalize(shared_pion):
    r = shared_pion.client()
    rng = np.random.default_rng(3)
    d = 16
    a = rng.standard_normal((200, d)).astype(np.float32)
    b = 10 + rng.standard_normal((50, d)).astype(np.float32)  # far from a, close to the query
    r.execute_command("ATTEND.CREATE", "vis", d, 4, "METRIC", "l2")
    e = err(shared_pion, "ATTEND.QUERY", "vis", 5, f32(a[:1]))
    assert e == "ERR session 'vis' has no index yet (0 rows staged); ATTEND.FINALIZE it", e
    r.execute_command("ATTEND.STORE", "vis", f32(a), f32(np.zeros((200, 4))))
    assert finalize(r, "vis")["generation"] == 1
    assert r.execute_command("ATTEND.STORE", "vis", f32(b), f32(np.ones((50, 4))), 10_000) == 250
    q = np.full((1, d), 10, np.float32)
    got = query(r, "vis", 10, q)
    assert got["generation"] == 1 and np.all(got["ids"] < 200)
    info = qmap(r.execute_command("ATTEND.INFO", "vis"))
    assert int(info["rows"]) == 250 and int(info["indexed_rows"]) == 200
    assert int(info["queries"]) == 1 and float(info["query_us"]) > 0  # worker time per query
    assert finalize(r, "vis")["generation"] == 2
    got = query(r, "vis", 10, q, "ATTEND")
    assert got["generation"] == 2 and np.all(got["ids"] >= 200)
    assert np.all(got["positions"] >= 10_000)
    assert np.allclose(got["output"], 1.0)
    r.execute_command("ATTEND.DROP", "vis")


def test_queries_during_a_finalize_use_the_published_index(shared_pion):
    r = shared_pion.client()
    rng = np.random.default_rng(4)
    d = 32
    keys = rng.standard_normal((4000, d)).astype(np.float32)
    r.execute_command("ATTEND.CREATE", "live", d, 2)
    r.execute_command("ATTEND.STORE", "live", f32(keys[:1000]), f32(np.zeros((1000, 2))))
    finalize(r, "live")
    r.execute_command("ATTEND.STORE", "live", f32(keys[1000:]), f32(np.zeros((3000, 2))))
    done = []
    t = threading.Thread(target=lambda: done.append(finalize(shared_pion.client(), "live")))
    t.start()
    gens = set()
    while t.is_alive():
        got = query(r, "live", 5, keys[:1])
        gens.add(got["generation"])
        assert np.all(got["ids"] < (1000 if got["generation"] == 1 else 4000))
    t.join()
    assert done[0]["generation"] == 2 and gens <= {1, 2}
    r.execute_command("ATTEND.DROP", "live")


def test_info_drop_and_errors(shared_pion):
    r = shared_pion.client()
    srv = shared_pion
    assert r.execute_command("ATTEND.CREATE", "e", 8, 4, "M", 8, "EF_CONSTRUCTION", 64) == b"OK"
    info = qmap(r.execute_command("ATTEND.INFO", "e"))
    assert info["metric"] == b"ip" and int(info["m"]) == 8 and int(info["ef_construction"]) == 64
    assert int(info["generation"]) == 0 and int(info["rows"]) == 0
    cases = [
        (("ATTEND.CREATE", "e", 8, 4), "ERR attention session 'e' already exists; ATTEND.DROP it first"),
        (("ATTEND.CREATE", "x", 0, 4), "ERR key_dim must be an integer in [1, 4096], got '0'"),
        (("ATTEND.CREATE", "x", 8, 4, "METRIC", "dot"), "ERR METRIC must be ip, l2 or cos, got 'dot'"),
        (("ATTEND.CREATE", "x", 8, 4, "M"), "ERR option 'M' needs a value"),
        (("ATTEND.CREATE", "x", 8, 4, "FOO", 1), "ERR unknown option 'FOO'; expected M, EF_CONSTRUCTION or METRIC"),
        (("ATTEND.STORE", "nope", b"x" * 32, b"x" * 16), "MISS no attention session 'nope'; ATTEND.CREATE it"),
        (("ATTEND.STORE", "e", b"x" * 31, b"x" * 16), "ERR keys_blob must be a non-zero multiple of key_dim*4 = 32 bytes, got 31"),
        (("ATTEND.STORE", "e", b"x" * 64, b"x" * 16), "ERR values_blob must be N*value_dim*4 (N=2 value_dim=4) = 32 bytes, got 16"),
        (("ATTEND.STORE", "e", b"x" * 32, b"x" * 16, -1), "ERR start_pos must be in [0, 2^62], got -1"),
        (("ATTEND.FINALIZE", "e"), "ERR session 'e' has no rows; ATTEND.STORE some first"),
        (("ATTEND.QUERY", "e", 0, b"x" * 32), "ERR k must be an integer in [1, 65536], got '0'"),
        (("ATTEND.QUERY", "e", 5, b"x" * 32, "BOGUS"), "ERR unexpected argument 'BOGUS'; expected EF <ef>, EXACT or ATTEND"),
        (("ATTEND.INFO", "nope"), "MISS no attention session 'nope'; ATTEND.CREATE it"),
    ]
    for args, want in cases:
        assert err(srv, *args) == want, (args, err(srv, *args))
    r.execute_command("ATTEND.STORE", "e", f32(np.ones((3, 8))), f32(np.ones((3, 4))))
    finalize(r, "e")
    e = err(srv, "ATTEND.QUERY", "e", 5, b"x" * 31)
    assert e == "ERR q_blob must be a non-zero multiple of key_dim*4 = 32 bytes, got 31", e
    assert query(r, "e", 10, np.ones((1, 8), np.float32))["k"] == 3  # k beyond the rows
    totals = qmap(r.execute_command("ATTEND.INFO"))
    assert int(totals["sessions"]) >= 1 and int(totals["rows"]) >= 3
    assert r.execute_command("ATTEND.DROP", "e") == 1
    assert r.execute_command("ATTEND.DROP", "e") == 0
    assert r.ping()


@pytest.mark.parametrize("metric", ["ip", "l2", "cos"])
def test_info_metric_is_text_on_every_protocol(shared_pion, metric):
    """ATTEND.INFO's metric is a string like the map's other text: a simple string on RESP2 and
    RESP3 (a raw reader gets str, where a bulk would be bytes) and in the binary protocol's typed
    reply ('+': str, like the keys beside it), not bytes."""
    sid = "metric-" + metric
    assert shared_pion.client().execute_command("ATTEND.CREATE", sid, 4, 2, "METRIC",
                                                metric) == b"OK"
    with shared_pion.raw() as c:
        flat = c.call("ATTEND.INFO", sid)
        assert dict(zip(flat[::2], flat[1::2]))[b"metric"] == metric, flat
        c.call("HELLO", "3")
        assert c.call("ATTEND.INFO", sid)[b"metric"] == metric
    with pion.BinaryClient(HOST, shared_pion.binary_port, timeout=10) as b:
        info = b.attend_info(sid)
        assert info["metric"] == metric and isinstance(info["metric"], str), info
    assert qmap(shared_pion.client().execute_command("ATTEND.INFO", sid))["metric"] == \
        metric.encode()  # redis-py: simple strings as bytes, as before
    shared_pion.client().execute_command("ATTEND.DROP", sid)


def test_index_memory_is_charged_and_bounded(pion_factory):
    srv = pion_factory("-w", "1", "--maxmemory", "4mb")
    r = srv.client()
    d = 64
    r.execute_command("ATTEND.CREATE", "big", d, d)
    rows = np.zeros((4096, d), np.float32)
    assert r.execute_command("ATTEND.STORE", "big", f32(rows), f32(rows)) == 4096  # one chunk: 2 MiB
    e = err(srv, "ATTEND.STORE", "big", f32(rows), f32(rows))
    assert e.startswith("OOM "), e
    assert qmap(r.execute_command("ATTEND.INFO", "big"))["rows"] == 4096
    assert int(srv.info("memory")["used_memory_index"]) > 2 << 20
    r.execute_command("ATTEND.DROP", "big")
    assert int(srv.info("memory")["used_memory_index"]) == 0
