"""The Python client (clients/python, package `pion`) against live pion-server processes:
every helper of every family, RAW decoding of every codec, the seed 002 SSM serialization,
attention forms against a numpy reference, the LSE merge, the exception classes, and the
same-host shared-memory path (--unixsocket: SHM fetches equal TCP, leases, into=, close).

Tolerances: fp32 storage and RAW decoding are exact (bitwise); attention outputs and LSE are
compared with err = |got - ref| / (1 + |ref|) <= 1e-4 against a float64 numpy reference.
"""
from __future__ import annotations

import os
import struct
import sys
import threading

import numpy as np
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "clients",
                                "python"))

import pion  # noqa: E402
from pion import codecs  # noqa: E402

TOL = 1e-4
FORMATS = ("fp32", "fp16", "bf16", "int8", "turbo4", "turbo3", "turbo2", "fp8", "fp8_e5m2")


@pytest.fixture(scope="module")
def c(shared_pion):
    with pion.Client(port=shared_pion.port, socket_timeout=20) as client:
        yield client


def rnd(rng, *shape, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(np.float32)


def bits(a):
    return np.ascontiguousarray(a, np.float32).view(np.uint32)


def assert_close(got, ref, tol=TOL):
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    err = float(np.max(np.abs(got - ref) / (1 + np.abs(ref)))) if ref.size else 0.0
    assert err <= tol, "max err %.3g > %g" % (err, tol)


def attend_ref(q, k, v, head_map, pos_q, pos_k, window=0, allow=None):
    """float64 reference: q [Hq][M][D], k/v [Hkv][Nk][D] -> (out [Hq][M][D], lse [Hq][M])."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    hq, m, d = q.shape
    pq, pk = np.asarray(pos_q)[:, None], np.asarray(pos_k)[None, :]
    vis = pk <= pq
    if window:
        vis &= pk > pq - window
    out, lse = np.zeros((hq, m, d)), np.full((hq, m), -np.inf)
    for h in range(hq):
        g = head_map[h]
        mask = vis if allow is None else vis & allow[h]
        s = np.where(mask, q[h] @ k[g].T / np.sqrt(d), -np.inf)
        mx = s.max(1)
        ok = np.isfinite(mx)
        e = np.where(mask[ok], np.exp(s[ok] - mx[ok, None]), 0.0)
        out[h, ok] = e @ v[g] / e.sum(1)[:, None]
        lse[h, ok] = mx[ok] + np.log(e.sum(1))
    return out, lse


# ------------------------------------------------------------------------------------------
# Connection, STATE
# ------------------------------------------------------------------------------------------

def test_ping_info_and_connection_error(c):
    assert c.ping() is True
    assert c.info("memory")["maxmemory"] > 0  # auto: 3/4 of the machine's memory
    bad = pion.Client(port=1, socket_connect_timeout=2)
    with pytest.raises(pion.PionConnectionError):
        bad.ping()


def test_state_round_trip_and_lease(c):
    c.state.alloc("st1", 64)
    assert c.state.read("st1", 0, 8) == b"\0" * 8
    a = np.arange(8, dtype=np.float64)
    c.state.write("st1", 0, a)
    c.state.write("st1", 4, b"\x01\x02")
    got = c.state.read("st1", 0, dtype=np.float64, shape=(8,))
    want = a.copy()
    want.view(np.uint8)[4:6] = [1, 2]
    np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8))
    assert c.state.read("st1", 8, dtype=np.int32, length=8).tolist() == a[1:2].view(np.int32).tolist()
    info = c.state.info()
    assert info["slots"] >= 1 and info["bytes"] >= 64
    assert c.state.free("st1") is True and c.state.free("st1") is False
    with c.state.lease("st2", 16) as slot:
        slot.write(0, np.array([7, 8, 9, 10], np.int32))
        assert slot.read(dtype=np.int32, shape=(2, 2)).tolist() == [[7, 8], [9, 10]]
        assert slot.read(12) == struct.pack("<i", 10)
    with pytest.raises(pion.CommandError, match=r"^ERR no such state slot 'st2'$"):
        c.state.read("st2", 0, 1)
    with pytest.raises(pion.CommandError, match="^ERR state slot 'st3' exists with 4 bytes"):
        c.state.alloc("st3", 4)
        c.state.alloc("st3", 8)


# ------------------------------------------------------------------------------------------
# V-store
# ------------------------------------------------------------------------------------------

def test_vstore_fp32_round_trip_ids_info_snapshots(c):
    rng = np.random.default_rng(1)
    rows = rnd(rng, 10, 48)
    c.v.create("vs", 48, "fp32")
    c.v.create("vs", 48, "fp32")  # same shape again: OK
    assert c.v.store_batch("vs", 0, rows) == 10
    got = c.v.fetch("vs", 0, 10)
    assert got.shape == (10, 48) and got.dtype == np.float32
    np.testing.assert_array_equal(bits(got), bits(rows))
    np.testing.assert_array_equal(bits(c.v.fetch_ids("vs", [9, 0, 3])), bits(rows[[9, 0, 3]]))
    extra = rnd(rng, 2, 48)
    assert c.v.store_ids("vs", [100, 7], extra) == 2
    np.testing.assert_array_equal(bits(c.v.fetch_ids("vs", [7, 100])), bits(extra[::-1]))
    info = c.v.info("vs")
    assert (info["dim"], info["format"], info["rows"], info["row_bytes"]) == (48, "fp32", 11, 192)
    assert c.v.info()["sessions"] >= 1
    snap = c.v.snapshot("vs")
    c.v.store_batch("vs", 0, np.zeros((1, 48), np.float32))
    assert not c.v.fetch("vs", 0, 1).any()
    c.v.restore("vs", snap)
    np.testing.assert_array_equal(bits(c.v.fetch("vs", 0, 1)), bits(rows[:1]))
    c.v.commit("vs", snap)
    assert c.v.info("vs")["sealed"] >= 1
    with pytest.raises(pion.CommandError, match="^ERR id 50 was never stored in session 'vs'"):
        c.v.fetch_ids("vs", [50])
    with pytest.raises(pion.CommandError, match="^ERR session 'vs' exists with dim 48"):
        c.v.create("vs", 32, "fp16")
    assert c.v.drop("vs") is True and c.v.drop("vs") is False


@pytest.mark.parametrize("fmt,dim,block", [(f, 256, None) for f in FORMATS] +
                         [("int8", 70, None), ("turbo4", 64, 16), ("turbo3", 96, 32),
                          ("turbo2", 64, 8)])
def test_raw_decode_equals_server_decode(c, fmt, dim, block):
    rng = np.random.default_rng(dim + FORMATS.index(fmt))
    rows = rnd(rng, 9, dim, scale=3.0)
    sid = "raw_%s_%d_%s" % (fmt, dim, block)
    c.v.create(sid, dim, fmt, block)
    c.v.store_batch(sid, 0, rows)
    server = c.v.fetch(sid, 0, 9)
    mine = c.v.fetch_raw(sid, 0, 9)
    assert mine.shape == (9, dim) and mine.dtype == np.float32
    np.testing.assert_array_equal(bits(mine), bits(server))  # specified bit-identical
    raw = c.v.fetch_raw(sid, 0, 9, decode=False)
    assert isinstance(raw, memoryview) and len(raw) == 9 * codecs.row_bytes(fmt, dim, block)
    ids = [8, 2, 2]
    np.testing.assert_array_equal(bits(c.v.fetch_raw_ids(sid, ids)), bits(server[ids]))
    if fmt == "fp32":
        np.testing.assert_array_equal(bits(mine), bits(rows))
    else:  # a lossy codec that returns the input exactly would be storing fp32
        assert not np.array_equal(mine, rows)
        rel = np.mean((mine - rows) ** 2) / np.mean(rows ** 2)
        assert rel < 0.2, rel


def test_codec_worked_example_from_readme():
    x = [0.5, -1.25, 2.0, 0.0, 3.5, -0.75, 1.0, -2.5]
    ex = {"int8": ("0e 27 12 d3 49 00 7f e5 24 a5", "0.496032715 -1.24008179 2.01168823 0 "
                   "3.49978638 -0.744049072 0.99206543 -2.50772095"),
          "turbo4": ("63 45 b5 6c a9 bd", "0.243624598 -1.16339636 2.03523207 0.140962005 "
                     "3.56626368 -0.666334867 1.05092144 -2.45794249"),
          "turbo2": ("21 45 79 fa", "0.678065419 -1.83919871 1.83919871 0.678065419 "
                     "3.19532943 -0.678065419 2.03419638 -1.83919871")}
    for fmt, (hexs, vals) in ex.items():
        got = codecs.decode(fmt, 8, 8, bytes.fromhex(hexs))
        np.testing.assert_array_equal(got[0], np.array(vals.split(), np.float32))
    fp16 = codecs.decode("fp16", 8, None, bytes.fromhex("0038 00bd 0040 0000 0043 00ba 003c 00c1"))
    np.testing.assert_array_equal(fp16[0], np.array(x, np.float32))


# ------------------------------------------------------------------------------------------
# KV.PREFIX
# ------------------------------------------------------------------------------------------

def test_kvprefix_register_store_fetch_lookup(c):
    L, T, H, D = 3, 70, 2, 32
    rng = np.random.default_rng(3)
    c.kv.register("kvp", L, T, H, D, "fp32", model="m1", position="rope1", prefill_ms=12.5)
    c.kv.register("kvp", L, T, H, D, "fp32", model="m1", position="rope1", prefill_ms=20)
    assert c.kv.lookup("kvp", model="m1") is False  # nothing written yet
    ks, vs = [], []
    for layer in range(L):
        k, v = rnd(rng, T, H, D), rnd(rng, T, H, D)
        ks.append(k), vs.append(v)
        if layer == 1:  # the [H, T, D] layout, in two partial writes
            kt, vt = k.transpose(1, 0, 2), v.transpose(1, 0, 2)
            assert c.kv.store_layer("kvp", layer, kt[:, :30], vt[:, :30], layout="hnd") == 30
            c.kv.store_layer("kvp", layer, kt[:, 30:], vt[:, 30:], layout="hnd",
                             token_offset=30, n_tokens=T)
        else:
            assert c.kv.store_layer("kvp", layer, k, v) == T
    for layer in range(L):
        k, v = c.kv.fetch_layer("kvp", layer, model="m1")
        assert k.shape == (T, H, D)
        np.testing.assert_array_equal(bits(k), bits(ks[layer]))
        np.testing.assert_array_equal(bits(v), bits(vs[layer]))
        kr, vr = c.kv.fetch_layer("kvp", layer, raw=True, layout="hnd")
        np.testing.assert_array_equal(bits(kr), bits(ks[layer].transpose(1, 0, 2)))
        np.testing.assert_array_equal(bits(vr), bits(vs[layer].transpose(1, 0, 2)))
    assert c.kv.lookup("kvp") is True
    assert c.kv.lookup("kvp", model="m1", position="rope1") is True
    assert c.kv.lookup("kvp", model="other") is False
    assert c.kv.lookup("kvp", position="rope2") is False
    info = c.kv.info("kvp")
    assert info["model"] == "m1" and info["n_tokens"] == T and info["complete"] is True
    assert info["prefill_ms"] == 20.0 and info["committed_frontier"] == T
    assert info["saved_prefill_ms"] >= 40.0  # two HITs so far
    gen = info["cache_generation"]
    assert c.kv.lookup("kvp", generation=gen) is True
    with pytest.raises(pion.MismatchError, match="^MISMATCH namespace 'kvp' is at generation"):
        c.kv.lookup("kvp", generation=gen + 5)
    with pytest.raises(pion.MismatchError, match="^MISMATCH session 'kvp_pk' holds model 'm1', "
                                                 "not 'm2'"):
        c.kv.fetch_layer("kvp", 0, model="m2")
    blocks = c.kv.blocks("kvp")
    assert [b["block"] for b in blocks] == [0, 1] and all(b["written"] for b in blocks)
    assert c.kv.membership("kvp") == [0, 1]
    assert c.kv.owner("kvp") in (0, 1)
    assert c.kv.info()["prefixes"] >= 1
    c.kv.save("kvp")
    assert all(b["saved"] for b in c.kv.blocks("kvp"))
    c.kv.warm("kvp")
    with pytest.raises(pion.MismatchError, match="^MISMATCH namespace 'kvp' is registered"):
        c.kv.register("kvp", L, T, H, D, "fp16", model="m1")
    assert c.kv.drop("kvp") is True and c.kv.drop("kvp") is False
    with pytest.raises(pion.CommandError, match="^ERR no such prefix namespace 'kvp'"):
        c.kv.info("kvp")


def test_kvprefix_quantized_raw_fetch_matches_server_decode(c):
    L, T, H, D = 2, 20, 2, 64
    rng = np.random.default_rng(4)
    c.kv.register("kvq", L, T, H, D, "turbo3")
    for layer in range(L):
        c.kv.store_layer("kvq", layer, rnd(rng, T, H, D), rnd(rng, T, H, D), n_tokens=T)
    for layer in range(L):
        a, b = c.kv.fetch_layer("kvq", layer), c.kv.fetch_layer("kvq", layer, raw=True)
        np.testing.assert_array_equal(bits(a[0]), bits(b[0]))
        np.testing.assert_array_equal(bits(a[1]), bits(b[1]))
    c.kv.drop("kvq")


# ------------------------------------------------------------------------------------------
# ATTEND.PREFIX
# ------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def slot(c):
    """A slot of H_kv=2 heads, N=96 rows, D=32; queries use H_q=4."""
    rng = np.random.default_rng(5)
    k, v = rnd(rng, 2, 96, 32), rnd(rng, 2, 96, 32)
    c.attend.store("att", 0, k, v)
    return k, v


HM = [0, 0, 1, 1]


def test_attend_slot_lifecycle(c, slot):
    assert c.attend.lookup("att", 0) is True and c.attend.lookup("att", 1) is False
    (info,) = c.attend.info("att")
    assert info["layer"] == 0 and info["heads"] == 2 and info["rows"] == 96
    assert info["head_dim"] == 32 and info["dtype"] == "fp32" and info["source"] == ""
    rng = np.random.default_rng(6)
    k, v = rnd(rng, 1, 8, 32), rnd(rng, 1, 8, 32)
    with c.attend.lease("tmp", 2, k, v) as lease:
        assert c.attend.lookup("tmp", 2)
        res = lease.query(rnd(rng, 1, 32))
        assert res.out.shape == (1, 32) and res.lse is None and res.receipt is None
    assert c.attend.lookup("tmp", 2) is False
    c.attend.store("tmp", 0, k, v)
    c.attend.store("tmp", 1, k, v)
    assert c.attend.drop("tmp", 1) == 1 and c.attend.drop("tmp") == 1
    with pytest.raises(pion.MissError, match="^MISS no attention slot for session 'tmp' layer 0"):
        c.attend.query("tmp", 0, rnd(rng, 1, 32))
    with pytest.raises(pion.CommandError, match="^ERR D 64 does not match the slot's head_dim 32"):
        c.attend.query("att", 0, rnd(rng, 4, 64))


@pytest.mark.parametrize("m,window,qpos", [(1, 0, None), (4, 0, None), (3, 10, None),
                                           (5, 0, 40), (2, 7, 60)])
def test_attend_query_dense_matches_reference(c, slot, m, window, qpos):
    k, v = slot
    rng = np.random.default_rng(10 + m)
    q = rnd(rng, 4, m, 32, scale=2.0)
    p0 = 96 if qpos is None else qpos
    ref, ref_lse = attend_ref(q, k, v, HM, np.arange(p0, p0 + m), np.arange(96), window)
    res = c.attend.query("att", 0, q if m > 1 else q[:, 0], window=window, qpos=qpos,
                         receipt=True)
    if m == 1:
        assert res.out.shape == (4, 32) and res.lse is None
        assert_close(res.out, ref[:, 0])
    else:
        assert res.out.shape == (4, m, 32) and res.lse.shape == (4, m)
        assert_close(res.out, ref)
        assert_close(res.lse, ref_lse)
    rc = res.receipt
    assert rc["exact"] is True and rc["form"] == "dense" and rc["prefix_rows"] == 96
    assert rc["query_rows"] == 4 * m and rc["omitted_mass_estimate"] == 0.0
    assert rc["rows_attended"] == rc["visible_rows"] and isinstance(rc["micros"], float)
    assert isinstance(rc["support"], list) and len(rc["support"]) == 4


def test_attend_query_topk(c, slot):
    k, v = slot
    rng = np.random.default_rng(20)
    q = rnd(rng, 4, 2, 32)
    top_k = 5
    qk = np.einsum("hmd,hnd->hmn", q.astype(np.float64), k[HM].astype(np.float64))
    allow = np.zeros((4, 2, 96), bool)
    for h in range(4):
        for i in range(2):
            allow[h, i, np.argsort(-qk[h, i], kind="stable")[:top_k]] = True
    ref, ref_lse = attend_ref(q, k, v, HM, [96, 97], np.arange(96), allow=allow)
    res = c.attend.query("att", 0, q, top_k=top_k, receipt=True)
    assert_close(res.out, ref)
    assert_close(res.lse, ref_lse)
    assert res.receipt["form"] == "topk" and res.receipt["exact"] is False
    assert res.receipt["rows_attended"] == 4 * 2 * top_k
    assert 0 < res.receipt["omitted_mass_estimate"] < 1


def _suffix(rng, s):
    return rnd(rng, 2, s, 32), rnd(rng, 2, s, 32)


def test_attend_query_fused_and_lse_merge(c, slot):
    k, v = slot
    rng = np.random.default_rng(30)
    s, m = 6, 3
    ks, vs = _suffix(rng, s)
    q = rnd(rng, 4, m, 32)
    kk, vv = np.concatenate([k, ks], 1), np.concatenate([v, vs], 1)
    pos_q = np.arange(96 + s - m, 96 + s)
    ref, _ = attend_ref(q, kk, vv, HM, pos_q, np.arange(96 + s))
    fused = c.attend.query_fused("att", 0, q, ks, vs, receipt=True)
    assert fused.out.shape == (4, m, 32) and fused.lse is None
    assert_close(fused.out, ref)
    assert fused.receipt["form"] == "fused" and fused.receipt["suffix_rows"] == s
    assert fused.receipt["exact"] is True
    # Client-side split: the server's prefix partial (with LSE) merged with a numpy suffix
    # partial equals QUERY_FUSED.
    pre = c.attend.query("att", 0, q, qpos=int(pos_q[0]))
    suf_out, suf_lse = attend_ref(q, ks, vs, HM, pos_q, np.arange(96, 96 + s))
    out, lse = pion.merge_lse(pre.out, pre.lse, suf_out, suf_lse)
    assert_close(out, fused.out)
    _, ref_lse = attend_ref(q, kk, vv, HM, pos_q, np.arange(96 + s))
    assert_close(lse, ref_lse)
    # One query row, explicit head map, window.
    one = c.attend.query_fused("att", 0, q[:, -1], ks, vs, head_map=[1, 1, 0, 0], window=20)
    ref1, _ = attend_ref(q[:, -1:], kk, vv, [1, 1, 0, 0], [96 + s - 1], np.arange(96 + s), 20)
    assert one.out.shape == (4, 32)
    assert_close(one.out, ref1[:, 0])


def test_merge_lse_pure_numpy():
    rng = np.random.default_rng(31)
    q, k, v = rnd(rng, 2, 3, 32), rnd(rng, 2, 40, 32), rnd(rng, 2, 40, 32)
    full, full_lse = attend_ref(q, k, v, [0, 1], [100] * 3, np.arange(40))
    a, la = attend_ref(q, k[:, :15], v[:, :15], [0, 1], [100] * 3, np.arange(15))
    b, lb = attend_ref(q, k[:, 15:], v[:, 15:], [0, 1], [100] * 3, np.arange(15, 40))
    out, lse = pion.merge_lse(a, la, b, lb)
    assert out.dtype == np.float32 and lse.shape == (2, 3)
    assert_close(out, full, 1e-6)
    assert_close(lse, full_lse, 1e-6)
    ninf = np.full((1, 1), -np.inf)
    o, l = pion.merge_lse(np.ones((1, 1, 2)), ninf, np.zeros((1, 1, 2)), ninf)
    assert not o.any() and np.isneginf(l).all()
    o, l = pion.merge_lse(np.ones((1, 1, 2)), ninf, np.full((1, 1, 2), 3.0), np.zeros((1, 1)))
    assert o.tolist() == [[[3.0, 3.0]]] and l.tolist() == [[0.0]]


def test_attend_query_sparse(c, slot):
    k, v = slot
    rng = np.random.default_rng(40)
    q = rnd(rng, 4, 32)
    ragged = [[0, 5, 9], [95], [10, 11, 12, 13, 14, 50], [1, 2]]
    allow = np.zeros((4, 1, 96), bool)
    for h, idx in enumerate(ragged):
        allow[h, 0, idx] = True
    ref, _ = attend_ref(q[:, None], k, v, HM, [96], np.arange(96), allow=allow)
    res = c.attend.query_sparse("att", 0, q, ragged, receipt=True)
    assert res.out.shape == (4, 32)
    assert_close(res.out, ref[:, 0])
    assert res.receipt["form"] == "sparse" and res.receipt["support"] == [3, 1, 6, 2]
    idx = np.zeros((4, 6), np.int32)
    for h, x in enumerate(ragged):
        idx[h, :len(x)] = x
    res2 = c.attend.query_sparse("att", 0, q, idx, counts=[len(x) for x in ragged])
    np.testing.assert_array_equal(bits(res2.out), bits(res.out))


@pytest.mark.parametrize("select", ["mean", "quest"])
def test_attend_query_sparse_auto(c, slot, select):
    k, v = slot
    rng = np.random.default_rng(50)
    q = rnd(rng, 4, 32)
    b = 16  # 6 blocks
    # Every block chosen: equals dense and exact.
    dense = c.attend.query("att", 0, q)
    full = c.attend.query_sparse_auto("att", 0, q, b, 6, h_kv=2, select=select, receipt=True)
    assert_close(full.out, dense.out)
    assert full.receipt["exact"] is True and full.receipt["blocks_total"] == 6
    # K_top 1: the first, last and one best block per head, per the doc's scores.
    res = c.attend.query_sparse_auto("att", 0, q, b, 1, select=select, receipt=True)  # h_kv via INFO
    rc = res.receipt
    assert rc["form"] == "sparse_auto" and rc["exact"] is False
    allow = np.zeros((4, 1, 96), bool)
    for h in range(4):
        kb = k[HM[h]].astype(np.float64).reshape(6, b, 32)
        qh = q[h].astype(np.float64)
        score = (kb.mean(1) @ qh if select == "mean" else
                 np.maximum(qh * kb.min(1), qh * kb.max(1)).sum(1))
        best = 1 + int(np.argmax(score[1:5]))
        assert rc["blocks"][h] == sorted({0, best, 5}), (h, rc["blocks"])
        for i in rc["blocks"][h]:
            allow[h, 0, i * b:(i + 1) * b] = True
    ref, _ = attend_ref(q[:, None], k, v, HM, [96], np.arange(96), allow=allow)
    assert_close(res.out, ref[:, 0])
    assert 0 < rc["omitted_mass_estimate"] < 1
    # shared=True: the heads of each K/V head choose together, by their highest block score.
    res = c.attend.query_sparse_auto("att", 0, q, b, 1, h_kv=2, select=select, shared=True,
                                     receipt=True)
    allow[:] = False
    for g in range(2):
        kb = k[g].astype(np.float64).reshape(6, b, 32)
        heads = [h for h in range(4) if HM[h] == g]
        scores = []
        for h in heads:
            qh = q[h].astype(np.float64)
            scores.append(kb.mean(1) @ qh if select == "mean" else
                          np.maximum(qh * kb.min(1), qh * kb.max(1)).sum(1))
        best = 1 + int(np.argmax(np.max(scores, axis=0)[1:5]))
        for h in heads:
            assert res.receipt["blocks"][h] == sorted({0, best, 5}), (h, res.receipt["blocks"])
            for i in res.receipt["blocks"][h]:
                allow[h, 0, i * b:(i + 1) * b] = True
    ref, _ = attend_ref(q[:, None], k, v, HM, [96], np.arange(96), allow=allow)
    assert_close(res.out, ref[:, 0])


def test_attend_query_sparse_auto_fused(c, slot):
    k, v = slot
    rng = np.random.default_rng(60)
    ks, vs = _suffix(rng, 5)
    q = rnd(rng, 4, 32)
    fused = c.attend.query_fused("att", 0, q, ks, vs)
    res = c.attend.query_sparse_auto_fused("att", 0, q, ks, vs, 16, 6, receipt=True)
    assert res.out.shape == (4, 32) and res.receipt["form"] == "sparse_auto_fused"
    assert_close(res.out, fused.out)
    part = c.attend.query_sparse_auto_fused("att", 0, q, ks, vs, 16, 0, select="quest",
                                            window=0, receipt=True)
    assert part.receipt["exact"] is False and part.receipt["suffix_rows"] == 5


def test_attend_store_from_kvprefix(c):
    T, H, D = 40, 2, 32
    rng = np.random.default_rng(70)
    c.kv.register("afrom", 2, T, H, D, "fp32", model="mm")
    layers = [(rnd(rng, T, H, D), rnd(rng, T, H, D)) for _ in range(2)]
    for i, (k, v) in enumerate(layers):
        c.kv.store_layer("afrom", i, k, v, n_tokens=T)
    with pytest.raises(pion.MismatchError, match="^MISMATCH namespace 'afrom' holds model"):
        c.attend.store_from("bound", 1, "afrom", model="other")
    c.attend.store_from("bound", 1, "afrom", model="mm")
    assert c.attend.info("bound")[0]["source"].startswith("afrom@")
    k, v = (x.transpose(1, 0, 2) for x in layers[1])
    c.attend.store("blob", 1, k, v)
    q = rnd(rng, 4, 3, 32)
    a, b = c.attend.query("bound", 1, q), c.attend.query("blob", 1, q)
    np.testing.assert_array_equal(bits(a.out), bits(b.out))
    np.testing.assert_array_equal(bits(a.lse), bits(b.lse))
    c.kv.drop("afrom")


# ------------------------------------------------------------------------------------------
# SSM.PREFIX (seed 002)
# ------------------------------------------------------------------------------------------

def test_ssm_serialization_byte_layout():
    conv = np.arange(6, dtype=np.float32).reshape(1, 2, 3)
    ssm = np.array([0.5, -2.0], dtype=np.float16)
    bf = np.array([[1.0, -0.5], [3.0, 0.0]], dtype=np.float32)  # bf16-representable
    blob = pion.serialize_arrays([conv, ssm, bf], dtype_codes=[None, None, 2])
    want = struct.pack("<II", 1, 3)
    want += struct.pack("<I3I", 3, 1, 2, 3) + struct.pack("<I", 0) + struct.pack("<6f", *range(6))
    want += struct.pack("<I1I", 1, 2) + struct.pack("<I", 1) + struct.pack("<2f", 0.5, -2.0)
    want += struct.pack("<I2I", 2, 2, 2) + struct.pack("<I", 2) + \
        struct.pack("<4f", 1.0, -0.5, 3.0, 0.0)
    assert blob == want
    back = pion.deserialize_arrays(blob)
    assert [a.dtype for a in back] == [np.float32, np.float16, np.float32]
    for a, b in zip(back, [conv, ssm, bf]):
        np.testing.assert_array_equal(a, b)
        assert a.shape == b.shape
    with pytest.raises(ValueError, match="bf16"):
        pion.serialize_arrays([np.array([1.1], np.float32)], dtype_codes=[2])
    with pytest.raises(ValueError, match="float32, float16 or bfloat16"):
        pion.serialize_arrays([np.zeros(2, np.float64)])
    with pytest.raises(ValueError, match="trailing"):
        pion.deserialize_arrays(blob + b"x")
    with pytest.raises(ValueError, match="truncated"):
        pion.deserialize_arrays(blob[:-1])
    assert pion.deserialize_arrays(struct.pack("<II", 1, 0)) == []


def test_ssm_store_fetch_drop(c):
    rng = np.random.default_rng(80)
    conv = rnd(rng, 1, 64, 4)
    ssm = rnd(rng, 1, 64, 16).astype(np.float16)
    bf = (rnd(rng, 3, 5).view(np.uint32) & 0xFFFF0000).view(np.float32)
    for layer in range(3):
        c.ssm.store("mamba", layer, [conv + layer, ssm, bf], dtype_codes=[0, 1, 2])
    for layer in range(3):
        got = c.ssm.fetch("mamba", layer)
        np.testing.assert_array_equal(bits(got[0]), bits(conv + layer))
        assert got[1].dtype == np.float16
        np.testing.assert_array_equal(got[1].view(np.uint16), ssm.view(np.uint16))
        np.testing.assert_array_equal(bits(got[2]), bits(bf))
    assert c.ssm.fetch("mamba", 9) is None and c.ssm.fetch_blob("mamba", 9) is None
    c.ssm.drop("mamba", 1)
    assert c.ssm.fetch("mamba", 1) is None and c.ssm.fetch("mamba", 2) is not None
    c.ssm.drop("mamba")
    assert c.ssm.fetch("mamba", 0) is None and c.ssm.fetch("mamba", 2) is None
    c.ssm.drop("mamba")  # idempotent
    blob = bytes(range(256)) * 4
    c.ssm.store_blob("opaque", 0, blob)
    assert c.ssm.fetch_blob("opaque", 0) == blob
    with pytest.raises(ValueError, match="version"):
        c.ssm.fetch("opaque", 0)
    c.ssm.drop("opaque")


# ------------------------------------------------------------------------------------------
# torch stays optional
# ------------------------------------------------------------------------------------------

def test_as_torch(shared_pion):
    try:
        import torch
    except ImportError:
        torch = None
    with pion.Client(port=shared_pion.port, as_torch=True) as tc:
        tc.v.create("tt", 4, "fp32")
        tc.v.store_batch("tt", 0, np.ones((2, 4), np.float32))
        if torch is None:
            with pytest.raises(ImportError, match="needs PyTorch"):
                tc.v.fetch("tt", 0, 2)
            assert isinstance(tc.v.fetch("tt", 0, 2, as_torch=False), np.ndarray)
        else:
            t = tc.v.fetch("tt", 0, 2)
            assert isinstance(t, torch.Tensor) and t.shape == (2, 4)
        tc.v.drop("tt")


# ------------------------------------------------------------------------------------------
# Exceptions
# ------------------------------------------------------------------------------------------

def test_error_classes_from_server_text():
    cases = {"ERR x": pion.CommandError, "OOM x": pion.OomError, "BUSY x": pion.BusyError,
             "MISMATCH x": pion.MismatchError, "MISS x": pion.MissError,
             "CORRUPT x": pion.CorruptError, "IOERR x": pion.IoError,
             "NOAUTH x": pion.NoAuthError, "WRONGPASS x": pion.WrongPassError,
             "NOPERM x": pion.NoPermError, "NOPROTO x": pion.PionError}
    from pion import errors
    for text, cls in cases.items():
        e = errors.from_text(text)
        assert type(e) is cls and str(e) == text and e.prefix == text.split()[0]
        assert isinstance(e, pion.PionError)
    # Exceptions raised by a plain redis-py connection (prefixes stripped) map back too.
    import redis.exceptions as rex
    assert str(errors.from_redis(rex.ResponseError("no such session 's'"))) == \
        "ERR no such session 's'"
    assert type(errors.from_redis(rex.AuthenticationError("Authentication required."))) is \
        pion.NoAuthError
    assert type(errors.from_redis(rex.ResponseError("OOM x"))) is pion.OomError
    assert str(errors.from_redis(rex.NoPermissionError("this user"))) == "NOPERM this user"


def test_oom_with_maxmemory(pion_factory):
    srv = pion_factory("--workers", "1", "--maxmemory", "1mb")
    with pion.Client(port=srv.port) as c:
        with pytest.raises(pion.OomError) as ei:
            c.state.alloc("big", 4 << 20)
        assert str(ei.value).startswith("OOM command not allowed when used memory > "
                                        "'maxmemory': state write of")
        assert ei.value.prefix == "OOM" and ei.value.message == str(ei.value)
        c.v.create("s", 1024, "fp32")
        with pytest.raises(pion.OomError):
            c.v.store_batch("s", 0, np.zeros((1024, 1024), np.float32))


def test_auth_errors(pion_factory):
    srv = pion_factory("--workers", "1", "--requirepass", "sekrit")
    with pion.Client(port=srv.port) as c:
        assert c.ping()  # PING is accepted before AUTH
        with pytest.raises(pion.NoAuthError, match=r"^NOAUTH Authentication required\.$"):
            c.state.info()
    with pion.Client(port=srv.port, password="wrong") as c:
        with pytest.raises(pion.WrongPassError, match="^WRONGPASS invalid username-password"):
            c.ping()
    with pion.Client(port=srv.port, password="sekrit") as c:
        assert c.state.info()["slots"] == 0
        c.v.create("a", 4, "fp32")
        c.v.store_batch("a", 0, np.ones((3, 4), np.float32))
        np.testing.assert_array_equal(c.v.fetch("a", 0, 3), np.ones((3, 4)))  # raw connection
    with pion.Client(port=srv.port, password="wrong") as c:
        with pytest.raises(pion.WrongPassError):
            c.fetch_many([("V.INFO",)])


@pytest.mark.parametrize("fmt,top,table", [("fp8", 448, codecs.E4M3),
                                           ("fp8_e5m2", 57344, codecs.E5M2)])
def test_fp8_rows_split_into_bytes_and_scales(pion_factory, fmt, top, table):
    """fp8 / fp8_e5m2 RAW rows: codecs.fp8_parts views the fp8 bytes (what
    torch.float8_e4m3fn / float8_e5m2 view) and the per-row scales; table value times scale
    is exactly the server's decode."""
    srv = pion_factory("--workers", "1")
    rng = np.random.default_rng(8)
    with pion.Client(port=srv.port) as c:
        c.v.create("f8", 96, fmt)
        rows = rng.standard_normal((50, 96)).astype(np.float32) * 3
        c.v.store_batch("f8", 0, rows)
        raw = c.v.fetch_raw("f8", 0, 50, decode=False)
        q, scale = codecs.fp8_parts(raw, 96)
        assert q.shape == (50, 96) and q.dtype == np.uint8 and scale.shape == (50,)
        np.testing.assert_array_equal(scale, np.abs(rows).max(axis=1) / np.float32(top))
        # No NaN (or inf) codes for finite rows; the row's largest value is the largest code.
        biggest = 0x7E if fmt == "fp8" else 0x7B
        assert np.all(np.abs(q & 0x7F) <= biggest)
        assert np.all((q & 0x7F).max(axis=1) == biggest)
        want = c.v.fetch("f8", 0, 50)
        np.testing.assert_array_equal(bits(table[q] * scale[:, None]), bits(want))
        assert codecs.TORCH_FP8[fmt] == ("float8_e4m3fn" if fmt == "fp8" else "float8_e5m2")
        with pytest.raises(ValueError):
            codecs.fp8_parts(bytes(raw)[:-1], 96)


def test_fetch_many_replies_errors_and_reuse(pion_factory):
    """The raw connection of the fetch helpers: large bulks as arrays received in place (into
    the caller's array when given), small ones as bytes, typed errors that leave the
    connection usable, and a too-small into= that closes it (a new one follows)."""
    srv = pion_factory("--workers", "2")
    with pion.Client(port=srv.port) as c:
        c.v.create("fm", 1024, "fp32")
        rows = np.arange(64 * 1024, dtype=np.float32).reshape(64, 1024)
        c.v.store_batch("fm", 0, rows)
        small, big, n = c.fetch_many([("V.FETCH", "fm", "RANGE", 0, 1, "RAW"),
                                      ("V.FETCH", "fm", "RANGE", 0, 64, "RAW"),
                                      ("V.INFO", "fm")])
        assert isinstance(small, bytes) and len(small) == 4096
        assert isinstance(big, np.ndarray) and big.dtype == np.uint8 and big.flags.writeable
        assert big.tobytes() == rows.tobytes() and isinstance(n, list)
        dst = np.zeros(rows.nbytes + 8, np.uint8)
        (got,) = c.fetch_many([("V.FETCH", "fm", "RANGE", 0, 64, "RAW")], [dst])
        assert np.shares_memory(got, dst) and got.tobytes() == rows.tobytes()
        with pytest.raises(pion.CommandError, match="no such session 'nope'"):
            c.fetch_many([("V.FETCH", "nope", "RANGE", 0, 1, "RAW")])
        with pytest.raises(pion.CommandError, match="unknown command"):
            c.fetch_many([("NO.SUCH.COMMAND",), ("PING",)])
        assert c.fetch_many([("PING",)]) == ["PONG"]  # the same connection, still in step
        with pytest.raises(ValueError):
            c.fetch_many([("V.FETCH", "fm", "RANGE", 0, 64, "RAW")], [np.empty(10, np.uint8)])
        assert c.v.fetch_raw("fm", 0, 64, decode=False) == rows.tobytes()


@pytest.mark.parametrize("fmt", FORMATS)
def test_decoded_fetches_own_their_results(pion_factory, fmt):
    """RAW replies that are decoded here land in the connection's reused scratch memory
    (fetch_decode): every decoded result must be its own array, unchanged by the next fetch
    (fp32 decodes to a view, so it must not come from scratch), for fetch_raw, fetch_raw_ids
    and fetch_layer(raw=True), with scratch growing from one size to a larger one."""
    srv = pion_factory()
    rng = np.random.default_rng(7)
    with pion.Client(port=srv.port) as c:
        c.v.create("a", 256, fmt)
        c.v.create("b", 256, fmt)
        c.v.store_batch("a", 0, rnd(rng, 600, 256))
        c.v.store_batch("b", 0, rnd(rng, 600, 256) + 5)
        want_a, want_b = c.v.fetch("a", 0, 600), c.v.fetch("b", 0, 600)
        first = c.v.fetch_raw("a", 0, 300)
        second = c.v.fetch_raw("b", 0, 600)  # more bytes: a bigger scratch
        third = c.v.fetch_raw("a", 0, 600)
        ids = c.v.fetch_raw_ids("b", list(range(0, 600, 2)))
        c.v.fetch_raw("b", 0, 600)
        np.testing.assert_array_equal(bits(first), bits(want_a[:300]))
        np.testing.assert_array_equal(bits(second), bits(want_b))
        np.testing.assert_array_equal(bits(third), bits(want_a))
        np.testing.assert_array_equal(bits(ids), bits(want_b[::2]))
        assert not np.shares_memory(second, third)
        c.kv.register("ns", n_layers=2, n_tokens=400, kv_heads=2, head_dim=64, fmt=fmt)
        for layer in range(2):
            c.kv.store_layer("ns", layer, rnd(rng, 400, 2, 64), rnd(rng, 400, 2, 64))
        want = [c.kv.fetch_layer("ns", j) for j in range(2)]
        got = [c.kv.fetch_layer("ns", j, raw=True) for j in range(2)]
        for (wk, wv), (gk, gv) in zip(want, got):
            np.testing.assert_array_equal(bits(gk), bits(wk))
            np.testing.assert_array_equal(bits(gv), bits(wv))


def test_tcp_fetch_decodes_fp16_here_and_follows_a_changed_format(pion_factory):
    """Over TCP, fetch and fetch_layer of fp16/bf16 sessions take the stored bytes and decode
    them here once the client knows the format: bit-identical to the server's decode (the
    plain V.FETCH, read with redis-py). A session dropped and re-created in another format
    behind the client's back is decoded by the format it has now, never the remembered one."""
    srv = pion_factory()
    rng = np.random.default_rng(11)

    def server_rows(c, sid, n):
        return pion._wire.from_f32(c.execute("V.FETCH", sid, "RANGE", 0, n), (n, -1))

    with pion.Client(port=srv.port) as c, pion.Client(port=srv.port) as other:
        for fmt in ("fp16", "bf16"):
            sid = "tcp_" + fmt
            c.v.create(sid, 128, fmt)
            c.v.store_batch(sid, 0, rnd(rng, 300, 128, scale=4.0))
            want = server_rows(c, sid, 300)
            for _ in range(3):  # the first learns the format, the next decode here
                np.testing.assert_array_equal(bits(c.v.fetch(sid, 0, 300)), bits(want))
            np.testing.assert_array_equal(bits(c.v.fetch(sid, 7, 19)), bits(want[7:19]))
            c.kv.register("ns_" + fmt, n_layers=2, n_tokens=64, kv_heads=2, head_dim=32,
                          fmt=fmt)
            c.kv.store_layer("ns_" + fmt, 1, rnd(rng, 64, 2, 32), rnd(rng, 64, 2, 32))
            k, v = c.kv.fetch_layer("ns_" + fmt, 1)
            wk = pion._wire.from_f32(c.execute("V.FETCH", "ns_%s_pk" % fmt, "RANGE", 64, 128),
                                     (64, 2, 32))
            wv = pion._wire.from_f32(c.execute("V.FETCH", "ns_%s_pv" % fmt, "RANGE", 64, 128),
                                     (64, 2, 32))
            np.testing.assert_array_equal(bits(k), bits(wk))
            np.testing.assert_array_equal(bits(v), bits(wv))
        # Re-created as turbo4 (and then fp32) by another client: c still remembers bf16.
        for fmt in ("turbo4", "fp32", "fp16"):
            other.v.drop("tcp_bf16")
            other.v.create("tcp_bf16", 128, fmt)
            other.v.store_batch("tcp_bf16", 0, rnd(rng, 50, 128))
            want = server_rows(other, "tcp_bf16", 50)
            got = c.v.fetch("tcp_bf16", 0, 50)
            assert got.shape == (50, 128)
            np.testing.assert_array_equal(bits(got), bits(want))
        c.v.drop("tcp_fp16")
        with pytest.raises(pion.PionError, match="tcp_fp16"):
            c.v.fetch("tcp_fp16", 0, 10)  # V.FETCH's own error, not V.INFO's


def test_noperm_for_tenant_user(pion_factory, tmp_path):
    users = tmp_path / "users.txt"
    users.write_text("alice apw teamA\n")
    srv = pion_factory("--workers", "1", "--users", str(users))
    with pion.Client(port=srv.port, username="alice", password="apw") as c:
        with pytest.raises(pion.NoPermError, match="^NOPERM this user has no permissions"):
            c.execute("CONFIG", "GET", "maxmemory")
        c.state.alloc("mine", 8)  # data commands are fine


def test_busy_when_compute_queue_is_full(pion_factory):
    srv = pion_factory("-w", "2", "--compute-threads", "1", "--compute-queue-depth", "1")
    rng = np.random.default_rng(90)
    n, d = 16384, 128
    with pion.Client(port=srv.port, socket_timeout=30) as c:
        c.attend.store("busy", 0, rnd(rng, 1, n, d), rnd(rng, 1, n, d))
        q = rnd(rng, 8, 16, d)
        busy, ok, other = [], [], []
        barrier = threading.Barrier(8)

        def fire():
            barrier.wait(10)
            for _ in range(3):
                try:
                    ok.append(c.attend.query("busy", 0, q))
                except pion.BusyError as e:
                    busy.append(str(e))
                except Exception as e:  # noqa: BLE001
                    other.append(repr(e))

        for _round in range(3):  # timing-dependent: a few rounds make a miss unlikely
            barrier.reset()
            threads = [threading.Thread(target=fire) for _ in range(8)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(30)
            if busy and ok:
                break
    assert not other, other
    assert busy and ok, (len(busy), len(ok))
    assert all(b.startswith("BUSY the compute queue is full (") for b in busy), busy[:3]


# ------------------------------------------------------------------------------------------
# Same-host shared memory (--unixsocket): pion.shm.ShmChannel under Client
# ------------------------------------------------------------------------------------------

@pytest.fixture
def unix_srv(pion_factory, tmp_path):
    path = str(tmp_path / "s.sock")
    if len(path) > 100:
        pytest.skip("tmp path too long for a Unix socket")
    srv = pion_factory("--workers", "2", "--unixsocket", path, "--shm-segment-size", "4mb")
    srv.sock_path = path
    return srv


def _shm_info(tcp):
    return pion._wire.parse_map(tcp.execute("SHM.INFO"))


def _wait_leases(tcp, want, timeout=5.0):
    """SHM.INFO's server-wide lease count once it reaches `want` (or the timeout)."""
    import time
    deadline = time.time() + timeout
    while _shm_info(tcp)["leases"] != want and time.time() < deadline:
        time.sleep(0.02)
    return _shm_info(tcp)["leases"]


@pytest.mark.parametrize("fmt,dim,n", [("fp16", 1024, 700), ("fp32", 256, 130),
                                       ("int8", 96, 100), ("turbo3", 128, 257)])
def test_shm_fetch_raw_equals_tcp(unix_srv, fmt, dim, n):
    rng = np.random.default_rng(dim)
    with pion.Client(port=unix_srv.port) as tcp, \
            pion.Client(unix_socket_path=unix_srv.sock_path) as u:
        sid = "shm_" + fmt
        tcp.v.create(sid, dim, fmt)
        tcp.v.store_batch(sid, 0, rnd(rng, n, dim))
        for a, b in ((0, n), (5, n - 3), (63, 65)):
            want = tcp.v.fetch_raw(sid, a, b, decode=False)
            assert tcp.last_fetch_path == "tcp"
            got = u.v.fetch_raw(sid, a, b, decode=False)
            assert u.last_fetch_path == "shm"
            assert isinstance(got, memoryview) and got == want, (fmt, a, b)
            dec = u.v.fetch_raw(sid, a, b)
            assert u.last_fetch_path == "shm" and dec.dtype == np.float32
            np.testing.assert_array_equal(bits(dec), bits(tcp.v.fetch_raw(sid, a, b)))
            np.testing.assert_array_equal(bits(dec), bits(tcp.v.fetch(sid, a, b)))
        assert _wait_leases(tcp, 0) == 0  # every fetch released its lease


def test_shm_kv_fetch_layer_equals_tcp(unix_srv):
    rng = np.random.default_rng(7)
    L, T, H, D = 2, 96, 4, 32
    with pion.Client(port=unix_srv.port) as tcp, \
            pion.Client(unix_socket_path=unix_srv.sock_path) as u:
        for fmt in ("fp16", "fp32", "int8", "fp8"):
            ns = "shmkv_" + fmt
            tcp.kv.register(ns, L, T, H, D, fmt, model="m")
            for layer in range(L):
                tcp.kv.store_layer(ns, layer, rnd(rng, T, H, D), rnd(rng, T, H, D))
            for layer in range(L):
                for raw in (False, True):
                    for layout in ("nhd", "hnd"):
                        kt, vt = tcp.kv.fetch_layer(ns, layer, raw=raw, layout=layout, model="m")
                        assert tcp.last_fetch_path == "tcp"
                        ks, vs = u.kv.fetch_layer(ns, layer, raw=raw, layout=layout, model="m")
                        assert u.last_fetch_path == "shm"
                        assert ks.shape == kt.shape == ((T, H, D) if layout == "nhd" else (H, T, D))
                        np.testing.assert_array_equal(bits(ks), bits(kt))
                        np.testing.assert_array_equal(bits(vs), bits(vt))
            with pytest.raises(pion.MismatchError):
                u.kv.fetch_layer(ns, 0, model="other")
        assert _wait_leases(tcp, 0) == 0


def test_shm_decode_from_the_mapping_equals_the_server(unix_srv):
    """On a Unix-socket client, v.fetch / fetch_raw / fetch_layer decode fp32, fp16 and bf16
    rows straight from the mapping (pion.codecs.decode_pieces, spread over threads for large
    fetches): bit for bit the server's decode over TCP, specials included (inf, NaN,
    subnormals, signed zeros, the largest finite values), across rows in several pieces."""
    from pion import codecs
    rng = np.random.default_rng(12)
    with pion.Client(port=unix_srv.port) as tcp, \
            pion.Client(unix_socket_path=unix_srv.sock_path) as u:
        dim, n = 1024, 6 * 320  # 7.5 MiB of fp32 rows: several pieces, the parallel decode
        for fmt in ("fp16", "bf16", "fp32"):
            for sid in ("d_" + fmt, "e_" + fmt):
                tcp.v.create(sid, dim, fmt)
            for r in range(6):  # the two sessions' chunks interleave: non-adjacent pieces
                for sid in ("d_" + fmt, "e_" + fmt):
                    rows = rnd(rng, 320, dim) * np.float32(100.0)
                    rows[0, :12] = [np.inf, -np.inf, np.nan, 0.0, -0.0, 6e-8, -3e-5, 65504.0,
                                    -65504.0, 1e-40, 3.0e38, -1.5e-45]
                    u.v.store_batch(sid, r * 320, rows)
            sid = "d_" + fmt
            assert n * dim >= codecs.PARALLEL_ELEMS
            for a, b in ((0, n), (7, n - 5), (319, 321)):
                want = tcp.v.fetch(sid, a, b)
                assert tcp.last_fetch_path == "tcp"
                got = u.v.fetch(sid, a, b)
                assert u.last_fetch_path == "shm" and got.shape == (b - a, dim)
                np.testing.assert_array_equal(bits(got), bits(want), err_msg=fmt)
                np.testing.assert_array_equal(bits(u.v.fetch_raw(sid, a, b)), bits(want))
        # Formats that are not element-wise are decoded by the server on the Unix socket too.
        tcp.v.create("q8", 64, "int8")
        tcp.v.store_batch("q8", 0, rnd(rng, 10, 64))
        np.testing.assert_array_equal(bits(u.v.fetch("q8", 0, 10)), bits(tcp.v.fetch("q8", 0, 10)))
        assert u.last_fetch_path == "tcp"
        with pytest.raises(pion.PionError):
            u.v.fetch("d_fp16", 0, n + 1)  # past the written rows: the server's error
        assert _wait_leases(tcp, 0) == 0


def test_shm_lease_range_is_stable_and_released(unix_srv):
    with pion.Client(port=unix_srv.port) as tcp, \
            pion.Client(unix_socket_path=unix_srv.sock_path) as u:
        tcp.v.create("ow", 512, "fp16")
        tcp.v.store_batch("ow", 0, np.full((128, 512), 1.5, np.float32))
        with u.v.lease_range("ow", 0, 128) as view:
            assert u.last_fetch_path == "shm"
            parts = view if isinstance(view, list) else [view]
            assert all(not p.flags.writeable and p.dtype == np.uint8 for p in parts)
            before = b"".join(p.tobytes() for p in parts)
            assert before == tcp.v.fetch_raw("ow", 0, 128, decode=False)
            assert _shm_info(tcp)["leases"] == 1
            tcp.v.store_batch("ow", 0, np.full((128, 512), -7.0, np.float32))  # concurrent
            assert np.all(u.v.fetch_raw("ow", 0, 128) == -7.0)  # a new fetch: new bytes
            now = b"".join(p.tobytes() for p in parts)
            assert now == before and np.all(np.frombuffer(now, np.float16) == 1.5)
            with pytest.raises(ValueError):
                parts[0][0] = 0  # read-only mapping
        assert _shm_info(tcp)["leases"] == 0
        # A multi-piece range (more than one chunk) yields a list whose concatenation is RAW.
        tcp.v.create("big", 1024, "fp32")
        tcp.v.store_batch("big", 0, rnd(np.random.default_rng(1), 1500, 1024))
        with u.v.lease_range("big", 0, 1500) as view:
            parts = view if isinstance(view, list) else [view]
            assert b"".join(p.tobytes() for p in parts) == \
                tcp.v.fetch_raw("big", 0, 1500, decode=False)
        assert _shm_info(tcp)["leases"] == 0
        with pytest.raises(pion.CommandError, match="Unix socket"):
            with tcp.v.lease_range("ow", 0, 1):
                pass


def test_shm_fetch_into_caller_buffer(unix_srv):
    rng = np.random.default_rng(11)
    rows = rnd(rng, 40, 64)
    with pion.Client(port=unix_srv.port) as tcp, \
            pion.Client(unix_socket_path=unix_srv.sock_path) as u:
        tcp.v.create("into", 64, "int8")
        tcp.v.store_batch("into", 0, rows)
        want = tcp.v.fetch_raw("into", 0, 40, decode=False)
        for client, path in ((u, "shm"), (tcp, "tcp")):
            buf = np.full(len(want) + 16, 0xAB, np.uint8)
            got = client.v.fetch_raw("into", 0, 40, decode=False, into=buf)
            assert client.last_fetch_path == path
            assert got.tobytes() == want and np.shares_memory(got, buf)
            assert np.all(buf[len(want):] == 0xAB)
            dec = client.v.fetch_raw("into", 0, 40, into=np.empty(len(want), np.uint8))
            np.testing.assert_array_equal(bits(dec), bits(tcp.v.fetch("into", 0, 40)))
            with pytest.raises(ValueError):
                client.v.fetch_raw("into", 0, 40, decode=False, into=np.empty(8, np.uint8))
        tcp.v.create("into32", 16, "fp32")
        tcp.v.store_batch("into32", 0, rows[:, :16])
        out = np.empty((40, 16), np.float32)
        u.v.fetch_raw("into32", 0, 40, decode=False, into=out)
        np.testing.assert_array_equal(bits(out), bits(rows[:, :16]))
        # fp16/bf16 with into= and decode: into receives the stored bytes (copied and widened
        # piece by piece), the result is the decode of exactly those bytes.
        big = rnd(rng, 3000, 128)  # 768 KB of fp16: several pieces
        for fmt in ("fp16", "bf16"):
            tcp.v.create("into_" + fmt, 128, fmt)
            tcp.v.store_batch("into_" + fmt, 0, big)
            raw = tcp.v.fetch_raw("into_" + fmt, 0, 3000, decode=False)
            want = tcp.v.fetch("into_" + fmt, 0, 3000)
            buf = np.full(len(raw) + 8, 0xCD, np.uint8)
            dec = u.v.fetch_raw("into_" + fmt, 0, 3000, into=buf)
            assert u.last_fetch_path == "shm"
            assert buf[:len(raw)].tobytes() == bytes(raw) and np.all(buf[len(raw):] == 0xCD)
            np.testing.assert_array_equal(bits(dec), bits(want))
            with pytest.raises(ValueError, match="into= holds 100 bytes"):
                u.v.fetch_raw("into_" + fmt, 0, 3000, into=np.empty(100, np.uint8))
            np.testing.assert_array_equal(bits(u.v.fetch("into_" + fmt, 0, 3000)), bits(want))
        assert _wait_leases(tcp, 0) == 0


def test_shm_large_multi_piece_fetch_shared_between_threads(unix_srv):
    """A fetch of several MiB whose rows lie in several non-adjacent pieces (two sessions
    written in turns) is copied by the calling thread and the copy pool (read_into splits the
    bytes in shares that cut across pieces): byte for byte the TCP reply, fresh or into=."""
    from pion import shm
    rng = np.random.default_rng(11)
    with pion.Client(port=unix_srv.port) as tcp, \
            pion.Client(unix_socket_path=unix_srv.sock_path) as u:
        for sid in ("ta", "tb"):
            tcp.v.create(sid, 1024, "fp32")  # 4 KiB rows
        for r in range(6):  # turns of 320 rows: the chunks of ta and tb interleave
            for sid in ("ta", "tb"):
                u.v.store_batch(sid, r * 320, rnd(rng, 320, 1024))
        n = 6 * 320  # 7.5 MiB
        lease, pieces, _, nbytes = u._shm_channel().fetch_range("ta", 0, n)
        u._shm_channel().release(lease)
        assert nbytes >= shm.PARALLEL_BYTES and len(pieces) > 1, pieces
        want = tcp.v.fetch_raw("ta", 0, n, decode=False)
        assert u.v.fetch_raw("ta", 0, n, decode=False) == want
        assert u.last_fetch_path == "shm"
        buf = np.full(nbytes + 4096, 0xAB, np.uint8)
        got = u.v.fetch_raw("ta", 7, n - 5, decode=False, into=buf)
        assert got.tobytes() == tcp.v.fetch_raw("ta", 7, n - 5, decode=False)
        assert np.all(buf[got.size:] == 0xAB)  # nothing written past the fetched bytes
        assert _wait_leases(tcp, 0) == 0


def test_shm_close_releases_leases_and_opt_out(unix_srv):
    with pion.Client(port=unix_srv.port) as tcp:
        tcp.v.create("cl", 64, "fp16")
        tcp.v.store_batch("cl", 0, np.ones((64, 64), np.float32))
        u = pion.Client(unix_socket_path=unix_srv.sock_path)
        cms = [u.v.lease_range("cl", 0, 64) for _ in range(2)]
        for cm in cms:
            cm.__enter__()
        assert _shm_info(tcp)["leases"] == 2
        u.close()
        assert _wait_leases(tcp, 0) == 0
        for cm in cms:
            cm.__exit__(None, None, None)  # after close: nothing left to release, no error
        # shm=False keeps every byte on the Unix socket.
        with pion.Client(unix_socket_path=unix_srv.sock_path, shm=False) as n:
            got = n.v.fetch_raw("cl", 0, 64, decode=False)
            assert n.last_fetch_path == "tcp"
            assert got == tcp.v.fetch_raw("cl", 0, 64, decode=False)
            assert n._shm is None  # no channel was opened


def test_shm_channel_auth_and_errors(pion_factory, tmp_path):
    from pion.shm import ShmChannel
    path = str(tmp_path / "a.sock")
    if len(path) > 100:
        pytest.skip("tmp path too long for a Unix socket")
    srv = pion_factory("--workers", "1", "--unixsocket", path, "--requirepass", "sekrit")
    with pion.Client(unix_socket_path=path, password="sekrit") as u:
        u.v.create("a", 8, "fp32")
        u.v.store_batch("a", 0, np.arange(16, dtype=np.float32).reshape(2, 8))
        np.testing.assert_array_equal(u.v.fetch_raw("a", 0, 2).ravel(), np.arange(16))
        assert u.last_fetch_path == "shm"
        with pytest.raises(pion.CommandError):
            u.v.fetch_raw("nope", 0, 1, decode=False)
        assert u.v.fetch_raw("a", 0, 2, decode=False)  # channel still usable after an error
    with pytest.raises(pion.WrongPassError):
        ShmChannel(path, password="wrong")
    with pytest.raises(pion.NoAuthError):
        ShmChannel(path)
    ch = ShmChannel(path, password="sekrit")
    try:
        lease, pieces, row_bytes, nbytes = ch.fetch_range("a", 0, 2)
        assert row_bytes == 32 and nbytes == 64
        out = np.empty(nbytes, np.uint8)
        assert ch.read_into(pieces, out) == 64
        assert np.array_equal(out.view(np.float32), np.arange(16, dtype=np.float32))
        assert ch.release(lease) is True and ch.release(lease) is False
    finally:
        ch.close()
    assert srv.alive()


def test_store_batch_writes_through_shared_memory(unix_srv):
    rng = np.random.default_rng(77)
    with pion.Client(unix_socket_path=unix_srv.sock_path) as c, \
            pion.Client(port=unix_srv.port) as tcp:
        c.v.create("shmw", 512, "fp32")
        big = rng.standard_normal((400, 512)).astype(np.float32)  # 800 KiB: the SHM path
        assert c.v.store_batch("shmw", 3, big) == 400
        assert c.last_store_path == "shm"
        small = rng.standard_normal((2, 512)).astype(np.float32)   # 4 KiB: inline
        assert c.v.store_batch("shmw", 500, small) == 2
        assert c.last_store_path == "tcp"
        assert c.v.store_batch("shmw", 1000, big, checksum=True) == 400  # CRC32 checked
        assert np.array_equal(tcp.v.fetch("shmw", 1000, 1400), big)
        assert np.array_equal(tcp.v.fetch("shmw", 3, 403), big)
        assert np.array_equal(tcp.v.fetch("shmw", 500, 502), small)
        # Over TCP the same call sends the bytes inline.
        assert tcp.v.store_batch("shmw", 600, big) == 400 and tcp.last_store_path == "tcp"
        assert _wait_leases(tcp, 0) == 0  # every reservation was spent by its commit


def test_result_pool_reuses_freed_blocks_and_stays_bounded():
    """pion._pool: a large result's block comes back for the next result of its size class
    once its last view is gone (and not before: a live view keeps its bytes), small results
    are plain numpy, and the freed bytes kept never pass POOL_CAP."""
    from pion import _pool
    n = 4 << 20
    a = _pool.empty((n // 4,), np.float32)
    addr = a.__array_interface__["data"][0]
    a[:] = 7.0
    view = a[100:200]
    del a
    b = _pool.empty((n // 4,), np.float32)  # the view still holds a's block
    assert b.__array_interface__["data"][0] != addr
    assert np.all(view == 7.0)
    del view
    c = _pool.empty((n // 4,), np.float32)  # a's block, back
    assert c.__array_interface__["data"][0] == addr
    assert c.flags.writeable and c.flags.c_contiguous and c.shape == (n // 4,)
    assert _pool.empty((16, 16), np.float32).base is None  # small: plain numpy
    before = _pool.kept_bytes()
    many = [_pool.empty((64 << 20,), np.uint8) for _ in range(6)]  # 384 MiB > POOL_CAP
    del many
    assert before <= _pool.kept_bytes() <= _pool.POOL_CAP
    del b, c
