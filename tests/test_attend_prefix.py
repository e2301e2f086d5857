"""ATTEND.PREFIX.* (Stage 2): attention over a resident prefix slot, checked against an
independent float64 numpy reference of the math in docs/PROTOCOL.md (softmax over (q·k)/√D with
the causal / sliding-window mask by positions), plus STORE ... FROM a KV.PREFIX namespace,
malformed input, slot lifecycle and LRU eviction, tenants, concurrency and the INFO section.

Tolerances (elementwise, err = |got - ref| / (1 + |ref|)):
- fp32 slots: output err <= 1e-4; LSE err <= 1e-4 (−inf exactly where a row sees no key).
- fp16 slots (--attention-fp16): err <= 1e-4 against the reference computed on K/V rounded to
  float16 (np.float16 and back), and err <= 2e-2 against the fp32 reference; the output must
  also be measurably closer to the fp16 reference than to the fp32 one (a slot that silently
  keeps fp32 is a bug).
- fp8 slots (STORE ... DTYPE fp8, or FROM an fp8 namespace): every form is run on fp8 slots too
  and checked with the fp32 tolerances against the reference computed on the dequantized rows
  (e4m3 value × row scale, by an encoder independent of the server's); against the fp32
  reference on the unquantized Gaussian rows, the output's relative MSE
  Σ(o − o32)² / Σ o32² is at most FP8_REL_MSE_BOUND (4e-3, docs/PROTOCOL.md) and at least
  FP8_REL_MSE_FLOOR (3e-4: a slot that kept more than fp8 is a bug).
- STORE ... FROM vs a blob STORE of the same (decoded) values: bitwise-equal replies (fp8: the
  blob is the namespace's RAW bytes, one scale per row).
- Sparse-auto block choice: the server's chosen blocks per head equal the reference's exactly
  (random data; sparse_auto_ref asserts there is no near-tie at the K_top cut).
- Receipt omitted_mass_estimate: 0 for exact results; for top_k within [min, max] of the exact
  per-row omitted masses; for sparse-auto in (0, 1) and within [min, max] of the per-head
  block-mean estimates (the doc does not say how heads are combined or whether a block's
  `rows` counts masked rows, so both readings bound it), with 1e-4 slack.
"""
from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from pionlib import ATTENTION_BACKEND, RespError, ServerFactory, parse_metrics

TOL = 1e-4
# Host-memory slot budgets (--attention-memory, --maxmemory) apply to cpu slots; the cuda
# backend's --gpu-memory LRU is tested in test_attend_gpu.py.
HOST_SLOTS = pytest.mark.skipif(ATTENTION_BACKEND == "cuda",
                                reason="host-memory slot budget (cuda: see test_attend_gpu.py)")
TOL_FP16_VS_FP32 = 2e-2
DS = (32, 64, 96, 128, 160, 192, 256, 512)


# ------------------------------------------------------------------------------------------
# Wire helpers
# ------------------------------------------------------------------------------------------

def f32(a) -> bytes:
    return np.ascontiguousarray(a, dtype="<f4").tobytes()


def i32(a) -> bytes:
    return np.ascontiguousarray(a, dtype="<i4").tobytes()


def _plain(x):
    if isinstance(x, bytes):
        return x.decode()
    if isinstance(x, list):
        return [_plain(y) for y in x]
    return x


def receipt_map(flat) -> dict:
    """A RESP2 receipt (flat key, value, ...) as a dict; doubles (bulk strings) as floats."""
    if isinstance(flat, dict):
        items = list(flat.items())
    else:
        items = [(flat[i], flat[i + 1]) for i in range(0, len(flat), 2)]
    out = {_plain(k): _plain(v) for k, v in items}
    for k in ("omitted_mass_estimate", "omitted_mass_bound", "omitted_mass_exact", "micros"):
        if k in out:
            out[k] = float(out[k])
    return out


def split_reply(reply):
    """(output bytes, receipt dict or None)."""
    if isinstance(reply, list):
        assert len(reply) == 2, reply
        return reply[0], receipt_map(reply[1])
    return reply, None


def parse_out(blob: bytes, hq: int, m: int, d: int, lse: bool):
    a = np.frombuffer(blob, "<f4")
    n = hq * m * d + (hq * m if lse else 0)
    assert a.size == n, "reply has %d floats, expected %d" % (a.size, n)
    out = a[: hq * m * d].reshape(hq, m, d)
    return (out, a[hq * m * d:].reshape(hq, m)) if lse else (out, None)


def err(srv, *args) -> str:
    """The error text of one command (fails if it did not error)."""
    with srv.raw() as c:
        got = c.call(*args)
    assert isinstance(got, RespError), "expected an error, got %r" % (got,)
    return str(got)


def store(r, sid, layer, k, v):
    h, n, d = k.shape
    assert r.execute_command("ATTEND.PREFIX.STORE", sid, layer, h, n, d, f32(k), f32(v)) == b"OK"


# ------------------------------------------------------------------------------------------
# fp8 (e4m3fn, one f32 scale per row): an encoder written from src/store/codec/README.md alone
# ------------------------------------------------------------------------------------------

SLOT_DTYPES = ("fp32", "fp8")
# Seed offsets of the sparse-auto cases on fp8 slots: fp8's coarser keys put some of the fp32
# seeds' block scores within sparse_auto_ref's near-tie margin at the K_top cut.
FP8_SEED = {"fp32": 0, "fp8": 2000}
FP8_REL_MSE_BOUND = 4e-3
FP8_REL_MSE_FLOOR = 3e-4
# The 127 non-negative finite e4m3 magnitudes, code c = e.m: m/8·2^-6 (e = 0), else (1+m/8)·2^(e-7).
E4M3_MAGS = np.array([np.ldexp(c & 7, -9) if c >> 3 == 0 else np.ldexp(8 + (c & 7), (c >> 3) - 10)
                      for c in range(127)], np.float64)


def fp8_rows(x):
    """x [..., D] float32 → (bytes of the rows [f32 scale][D e4m3] in x's order, the values
    they decode to as float32 of x's shape). scale = amax/448; each value times 448/amax to
    the nearest e4m3 magnitude, ties to the even code."""
    x = np.ascontiguousarray(x, np.float32)
    d = x.shape[-1]
    rows = x.reshape(-1, d)
    amax = np.abs(rows).max(axis=1, keepdims=True)
    scale = (amax / np.float32(448)).astype(np.float32)
    inv = np.where(amax > 0, np.float32(448) / np.where(amax > 0, amax, 1), 0).astype(np.float32)
    mag = np.abs(rows * inv).astype(np.float64)
    hi = np.clip(np.searchsorted(E4M3_MAGS, mag), 1, 126)
    lo = hi - 1
    dl, dh = mag - E4M3_MAGS[lo], E4M3_MAGS[hi] - mag
    code = np.where((dh < dl) | ((dh == dl) & (hi % 2 == 0)), hi, lo)
    code = np.where(mag >= 448, 126, code).astype(np.uint8)
    code |= np.signbit(rows).astype(np.uint8) << 7
    deq = (np.where(code & 0x80, -1, 1) * E4M3_MAGS[code & 0x7F]).astype(np.float32) * scale
    out = np.empty((rows.shape[0], 4 + d), np.uint8)
    out[:, :4] = scale.astype("<f4").view(np.uint8).reshape(-1, 4)
    out[:, 4:] = code
    return out.tobytes(), deq.reshape(x.shape)


def store_as(r, sid, layer, k, v, dtype):
    """Stores k/v [H][N][D] as an fp32 or fp8 slot; returns the K/V values the slot holds."""
    if dtype == "fp32":
        store(r, sid, layer, k, v)
        return k, v
    h, n, d = k.shape
    kb, kd = fp8_rows(k)
    vb, vd = fp8_rows(v)
    assert r.execute_command("ATTEND.PREFIX.STORE", sid, layer, h, n, d, kb, vb, "DTYPE",
                             dtype) == b"OK"
    return kd, vd


def rel_mse(got, ref):
    got = np.asarray(got, np.float64)
    ref = np.asarray(ref, np.float64)
    return float(((got - ref) ** 2).sum() / (ref ** 2).sum())


def flat_map(flat) -> dict:
    return {_plain(flat[i]): _plain(flat[i + 1]) for i in range(0, len(flat), 2)}


def info_slots(r, sid):
    """ATTEND.PREFIX.INFO as a list of dicts."""
    return [flat_map(m) for m in r.execute_command("ATTEND.PREFIX.INFO", sid)]


# ------------------------------------------------------------------------------------------
# The numpy reference (float64)
# ------------------------------------------------------------------------------------------

def contiguous_map(hq, hkv):
    return np.arange(hq) // (hq // hkv)


def visible(pos_q, pos_k, window):
    pq = np.asarray(pos_q, np.int64)[:, None]
    pk = np.asarray(pos_k, np.int64)[None, :]
    m = pk <= pq
    if window:
        m &= pk > pq - window
    return m  # [M][Nk]


def attend_ref(q, k, v, head_map, pos_q, pos_k, window, allow=None):
    """q [Hq][M][D], k/v [Hkv][Nk][D]; allow: optional bool [Hq][M][Nk], the keys the form
    attends before the position mask. Returns (out [Hq][M][D], lse [Hq][M], attended mask);
    a row that sees no key gets 0 and −inf."""
    q = np.asarray(q, np.float64)
    k = np.asarray(k, np.float64)
    v = np.asarray(v, np.float64)
    hq, m, d = q.shape
    vis = visible(pos_q, pos_k, window)
    out = np.zeros((hq, m, d))
    lse = np.full((hq, m), -np.inf)
    att = np.zeros((hq, m, k.shape[1]), bool)
    for h in range(hq):
        g = head_map[h]
        s = q[h] @ k[g].T / np.sqrt(d)
        mask = vis if allow is None else (vis & allow[h])
        att[h] = mask
        s = np.where(mask, s, -np.inf)
        mx = s.max(axis=1)
        rows = np.isfinite(mx)
        if not rows.any():
            continue
        e = np.where(mask[rows], np.exp(s[rows] - mx[rows, None]), 0.0)
        l = e.sum(1)
        out[h, rows] = (e @ v[g]) / l[:, None]
        lse[h, rows] = mx[rows] + np.log(l)
    return out, lse, att


def topk_allow(q, k, head_map, pos_q, window, top_k):
    """Each query row's top_k visible keys by exact score; also the exact omitted mass per row."""
    q = np.asarray(q, np.float64)
    k = np.asarray(k, np.float64)
    hq, m, d = q.shape
    n = k.shape[1]
    vis = visible(pos_q, np.arange(n), window)
    allow = np.zeros((hq, m, n), bool)
    omitted = []
    for h in range(hq):
        s = q[h] @ k[head_map[h]].T / np.sqrt(d)
        for i in range(m):
            idx = np.flatnonzero(vis[i])
            if idx.size == 0:
                continue
            order = idx[np.argsort(-s[i, idx], kind="stable")]
            chosen = order[:top_k]
            allow[h, i, chosen] = True
            p = np.exp(s[i, idx] - s[i, idx].max())
            p /= p.sum()
            omitted.append(1.0 - p[np.isin(idx, chosen)].sum())
    return allow, omitted


def sparse_auto_ref(q, k, head_map, b, k_top, p, window, select, shared=False, recent=0):
    """M=1 block choice over the prefix k [Hkv][N][D] for queries q [Hq][D] at position p.
    shared (SHARED): each block's score is the highest of the query heads mapped to the same
    K/V head, so they choose together. Returns (chosen blocks per head, number of visible
    blocks, allow [Hq][1][N], per-head omitted mass estimates under both readings of 'rows'
    (block rows, visible rows))."""
    q = np.asarray(q, np.float64)
    k = np.asarray(k, np.float64)
    hq, d = q.shape
    n = k.shape[1]
    nb = -(-n // b)
    mean = np.stack([k[:, i * b:(i + 1) * b].mean(1) for i in range(nb)], 1)
    mn = np.stack([k[:, i * b:(i + 1) * b].min(1) for i in range(nb)], 1)
    mx = np.stack([k[:, i * b:(i + 1) * b].max(1) for i in range(nb)], 1)
    allow = np.zeros((hq, 1, n), bool)
    hi = min(p, n - 1)
    lo = max(0, p - window + 1) if window else 0
    if hi < lo:
        return [[] for _ in range(hq)], 0, allow, []
    fb, lb = lo // b, hi // b
    chosen_all, omitted = [], []

    def head_score(h):
        g = head_map[h]
        if select == "quest":
            return np.maximum(q[h] * mn[g], q[h] * mx[g]).sum(1)
        return mean[g] @ q[h]

    for h in range(hq):
        g = head_map[h]
        score = head_score(h)
        if shared:
            score = np.max([head_score(h2) for h2 in range(hq) if head_map[h2] == g], axis=0)
        forced = set(range(max(fb + 1, lb - recent), lb))  # RECENT: before the last block
        cands = [i for i in range(fb + 1, lb) if i not in forced]
        cands.sort(key=lambda i: -score[i])
        keep = k_top - len(forced)
        chosen = sorted({fb, lb} | forced | set(cands[:keep]))
        if len(cands) > keep > 0:  # the seeds must not produce a near-tie at the cut
            gap = score[cands[keep - 1]] - score[cands[keep]]
            assert gap > 1e-4 * (1 + abs(score[cands[keep]])), "near-tie: pick another seed"
        chosen_all.append(chosen)
        for i in chosen:
            allow[h, 0, i * b:(i + 1) * b] = True
        blocks = range(fb, lb + 1)
        for rows_kind in ("block", "visible"):
            w = {}
            for i in blocks:
                r0, r1 = i * b, min((i + 1) * b, n)
                rows = r1 - r0 if rows_kind == "block" else min(r1 - 1, hi) - max(r0, lo) + 1
                w[i] = rows * np.exp(q[h] @ mean[g][i] / np.sqrt(d))
            tot = sum(w.values())
            omitted.append(sum(x for i, x in w.items() if i not in chosen) / tot)
    return chosen_all, lb - fb + 1, allow, omitted


def rel_err(got, ref):
    got = np.asarray(got, np.float64)
    ref = np.asarray(ref, np.float64)
    return float(np.max(np.abs(got - ref) / (1.0 + np.abs(ref)))) if ref.size else 0.0


def assert_close(got, ref, tol=TOL, what="output"):
    e = rel_err(got, ref)
    assert e <= tol, "%s: max err %.3g > %.1g" % (what, e, tol)


def assert_lse(got, ref, tol=TOL):
    got = np.asarray(got, np.float64)
    inf = np.isneginf(ref)
    assert np.array_equal(np.isneginf(got), inf), (got, ref)
    assert_close(got[~inf], ref[~inf], tol, "lse")


def rnd(rng, *shape, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(np.float32)


# ------------------------------------------------------------------------------------------
# Fixtures
# ------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def fp16_pion(tmp_path_factory):
    f = ServerFactory(tmp_path_factory.mktemp("fp16"))
    try:
        yield f("--workers", "2", "--attention-fp16")
    finally:
        f.stop_all()


# ------------------------------------------------------------------------------------------
# 1. Every form against the reference
# ------------------------------------------------------------------------------------------

# (H_q, H_kv, N, D, M, window, qpos or None for N, top_ks)
DENSE_CASES = [
    (4, 4, 37, 32, 1, 0, None, (1, 5, 100)),        # GQA 1, M=1
    (8, 4, 50, 64, 3, 0, None, (2, 50)),             # GQA 2, M>1
    (8, 2, 70, 96, 5, 7, None, (3,)),                # GQA 4, small window
    (8, 1, 33, 128, 2, 1, None, (1,)),               # GQA 8, window 1
    (2, 1, 40, 160, 4, 100, None, (6,)),             # window > N
    (4, 2, 64, 192, 6, 0, 20, (4,)),                 # queries inside the prefix: causal
    (2, 2, 24, 256, 1, 10, 24 + 9 - 1, (3,)),        # decode step at N+S-1 with a window
    (2, 1, 12, 512, 3, 0, None, (2,)),
    (2, 2, 10, 32, 2, 3, 50, (1,)),                  # window past the prefix: sees no key
    (4, 2, 300, 64, 2, 0, None, (17,)),              # larger N (split-K candidates)
]


@pytest.mark.parametrize("dtype", SLOT_DTYPES)
@pytest.mark.parametrize("case", DENSE_CASES, ids=[str(i) for i in range(len(DENSE_CASES))])
def test_query_dense_and_topk_match_reference(shared_pion, case, dtype):
    hq, hkv, n, d, m, w, qpos, top_ks = case
    r = shared_pion.client()
    rng = np.random.default_rng(100 + DENSE_CASES.index(case))
    k, v, q = rnd(rng, hkv, n, d), rnd(rng, hkv, n, d), rnd(rng, hq, m, d, scale=2.0)
    sid = "dense%d%s" % (DENSE_CASES.index(case), dtype)
    k, v = store_as(r, sid, 0, k, v, dtype)
    hm = contiguous_map(hq, hkv)
    p0 = n if qpos is None else qpos
    pos_q = np.arange(p0, p0 + m)
    tail = [w] if w else []
    if qpos is not None:
        tail += ["QPOS", qpos]
    ref, ref_lse, att = attend_ref(q, k, v, hm, pos_q, np.arange(n), w)
    nvis = att.sum(axis=2)  # [Hq][M]

    out, rc = split_reply(r.execute_command("ATTEND.PREFIX.QUERY", sid, 0, hq, d, 0, f32(q),
                                            *tail, "RECEIPT"))
    got, lse = parse_out(out, hq, m, d, m > 1)
    assert_close(got, ref)
    if m > 1:
        assert_lse(lse, ref_lse)
    # Without RECEIPT the bytes are the same.
    assert r.execute_command("ATTEND.PREFIX.QUERY", sid, 0, hq, d, 0, f32(q), *tail) == out
    assert rc["exact"] == 1 and rc["form"] == "dense" and rc["backend"] == ATTENTION_BACKEND
    assert rc["dtype"] == dtype and rc["prefix_rows"] == n and rc["suffix_rows"] == 0
    assert rc["query_rows"] == hq * m
    assert rc["rows_attended"] == rc["visible_rows"] == int(nvis.sum())
    assert rc["support"] == [int(x) for x in nvis.sum(axis=1)]
    assert rc["omitted_mass_estimate"] == 0.0
    assert rc["splits"] >= 1 and rc["micros"] >= 0

    for top_k in top_ks:
        allow, omitted = topk_allow(q, k, hm, pos_q, w, top_k)
        ref_k, ref_klse, att_k = attend_ref(q, k, v, hm, pos_q, np.arange(n), w, allow)
        out, rc = split_reply(r.execute_command("ATTEND.PREFIX.QUERY", sid, 0, hq, d, top_k,
                                                f32(q), *tail, "RECEIPT"))
        got, lse = parse_out(out, hq, m, d, m > 1)
        assert_close(got, ref_k, what="top_k=%d" % top_k)
        if m > 1:
            assert_lse(lse, ref_klse)
        attended = int(att_k.sum())
        assert rc["form"] == "topk"
        assert rc["rows_attended"] == attended, (top_k, rc)
        assert rc["visible_rows"] == int(nvis.sum())
        assert rc["support"] == [int(x) for x in att_k.sum(axis=(1, 2))]
        assert rc["exact"] == (1 if attended == int(nvis.sum()) else 0), (top_k, rc)
        if omitted:
            lo, hi = min(omitted), max(omitted)
            assert lo - 1e-5 <= rc["omitted_mass_estimate"] <= hi + 1e-5, (omitted, rc)
        if attended < int(nvis.sum()):
            assert rc["omitted_mass_estimate"] > 0


def test_query_row_that_sees_no_key_is_zero_and_minus_inf(shared_pion):
    r = shared_pion.client()
    rng = np.random.default_rng(7)
    k, v, q = rnd(rng, 2, 16, 64), rnd(rng, 2, 16, 64), rnd(rng, 2, 3, 64)
    store(r, "blind", 0, k, v)
    # Window 3 at QPOS 16: rows at 16, 17, 18 see prefix keys {14, 15}, {15}, none.
    out = r.execute_command("ATTEND.PREFIX.QUERY", "blind", 0, 2, 64, 0, f32(q), 3, "QPOS", 16)
    got, lse = parse_out(out, 2, 3, 64, True)
    ref, ref_lse, _ = attend_ref(q, k, v, [0, 1], [16, 17, 18], np.arange(16), 3)
    assert_close(got, ref)
    assert_lse(lse, ref_lse)
    assert np.all(got[:, 2] == 0) and np.all(np.isneginf(lse[:, 2]))
    assert np.all(np.isfinite(lse[:, :2]))


# (H_q, H_kv, N, D, S_suf, M, window, head_map or None for contiguous)
FUSED_CASES = [
    (4, 4, 30, 32, 5, 1, 0, [3, 0, 2, 1]),
    (4, 2, 30, 64, 5, 1, 4, None),
    (8, 4, 45, 64, 8, 3, 0, [0, 3, 1, 1, 2, 0, 3, 2]),
    (8, 2, 60, 128, 6, 6, 9, None),
    (8, 1, 20, 96, 4, 2, 30, [0] * 8),
    (4, 2, 25, 160, 3, 3, 2, [1, 0, 1, 0]),
    (2, 2, 18, 192, 7, 4, 0, [1, 0]),
    (4, 4, 12, 256, 2, 1, 5, [2, 2, 0, 3]),
    (2, 1, 9, 512, 3, 2, 0, None),
]


@pytest.mark.parametrize("dtype", SLOT_DTYPES)
@pytest.mark.parametrize("case", FUSED_CASES, ids=[str(i) for i in range(len(FUSED_CASES))])
def test_query_fused_matches_reference_and_client_merge(shared_pion, case, dtype):
    hq, hkv, n, d, s, m, w, hm = case
    idx = FUSED_CASES.index(case)
    r = shared_pion.client()
    rng = np.random.default_rng(200 + idx)
    k, v = rnd(rng, hkv, n, d), rnd(rng, hkv, n, d)
    ks, vs, q = rnd(rng, hkv, s, d), rnd(rng, hkv, s, d), rnd(rng, hq, m, d, scale=2.0)
    hm = np.asarray(contiguous_map(hq, hkv) if hm is None else hm)
    contiguous = np.array_equal(hm, contiguous_map(hq, hkv))
    sid = "fused%d%s" % (idx, dtype)
    k, v = store_as(r, sid, 0, k, v, dtype)
    pos_q = np.arange(n + s - m, n + s)
    tail = [w] if w else []
    ref, _, att = attend_ref(q, np.concatenate([k, ks], 1), np.concatenate([v, vs], 1), hm,
                             pos_q, np.arange(n + s), w)
    out, rc = split_reply(r.execute_command(
        "ATTEND.PREFIX.QUERY_FUSED", sid, 0, hq, d, s, hkv, f32(q), f32(ks), f32(vs), i32(hm),
        *tail, "RECEIPT"))
    got, _ = parse_out(out, hq, m, d, False)
    assert_close(got, ref)
    assert rc["exact"] == 1 and rc["form"] == "fused" and rc["omitted_mass_estimate"] == 0
    assert rc["prefix_rows"] == n and rc["suffix_rows"] == s and rc["query_rows"] == hq * m
    assert rc["rows_attended"] == rc["visible_rows"] == int(att.sum())
    assert rc["support"] == [int(x) for x in att.sum(axis=(1, 2))]

    if contiguous:
        # Algebra: fused == prefix QUERY (M rows at QPOS N+S-M, with LSE) ⊕ client-side suffix.
        # M=1 has no LSE trailer, so ask for two rows (the query twice) and keep the last.
        qq = q if m > 1 else np.concatenate([q, q], 1)
        mm = qq.shape[1]
        tail_q = tail + ["QPOS", n + s - mm]
        pre = r.execute_command("ATTEND.PREFIX.QUERY", sid, 0, hq, d, 0, f32(qq), *tail_q)
        o_a, lse_a = parse_out(pre, hq, mm, d, True)
        o_a, lse_a = o_a[:, mm - m:], lse_a[:, mm - m:].astype(np.float64)
        o_b, lse_b, _ = attend_ref(q, ks, vs, hm, pos_q, np.arange(n, n + s), w)
        mx = np.maximum(lse_a, lse_b)
        wa = np.where(np.isneginf(lse_a), 0, np.exp(lse_a - mx))[..., None]
        wb = np.where(np.isneginf(lse_b), 0, np.exp(lse_b - mx))[..., None]
        merged = (wa * o_a + wb * o_b) / (wa + wb)
        assert_close(got, merged)


# (H, H_kv, N, D, K_sparse_max, window, qpos or None)
SPARSE_CASES = [
    (4, 4, 40, 32, 12, 0, None),
    (8, 4, 33, 64, 33, 0, None),
    (8, 2, 64, 96, 20, 10, None),
    (8, 1, 50, 128, 16, 0, 30),
    (2, 2, 20, 256, 8, 0, None),
    (2, 1, 16, 512, 5, 4, 18),
]


@pytest.mark.parametrize("dtype", SLOT_DTYPES)
@pytest.mark.parametrize("case", SPARSE_CASES, ids=[str(i) for i in range(len(SPARSE_CASES))])
def test_query_sparse_matches_reference(shared_pion, case, dtype):
    hq, hkv, n, d, kmax, w, qpos = case
    idx_case = SPARSE_CASES.index(case)
    r = shared_pion.client()
    rng = np.random.default_rng(300 + idx_case)
    k, v, q = rnd(rng, hkv, n, d), rnd(rng, hkv, n, d), rnd(rng, hq, 1, d, scale=2.0)
    sid = "sparse%d%s" % (idx_case, dtype)
    k, v = store_as(r, sid, 0, k, v, dtype)
    hm = contiguous_map(hq, hkv)
    indices = np.stack([rng.permutation(n)[:kmax] for _ in range(hq)]).astype(np.int32)
    counts = rng.integers(0, kmax + 1, hq).astype(np.int32)
    counts[0], counts[-1] = kmax, 0  # a full head and an empty one
    allow = np.zeros((hq, 1, n), bool)
    for h in range(hq):
        allow[h, 0, indices[h, :counts[h]]] = True
    indices[-1, :] = rng.permutation(n)[:kmax]  # past counts: never read
    p = n if qpos is None else qpos
    tail = ([w] if w else []) + (["QPOS", qpos] if qpos is not None else [])
    ref, lse_kept, att = attend_ref(q, k, v, hm, [p], np.arange(n), w, allow)
    _, lse_all, vis = attend_ref(q, k, v, hm, [p], np.arange(n), w)
    out, rc = split_reply(r.execute_command(
        "ATTEND.PREFIX.QUERY_SPARSE", sid, 0, hq, d, kmax, f32(q), i32(indices), i32(counts),
        *tail, "AUDIT"))
    # AUDIT: the exact share of the mass the lists left out (the empty head: all of it).
    with np.errstate(invalid="ignore"):
        share = np.where(np.isfinite(lse_all[:, 0]), 1 - np.exp(lse_kept[:, 0] - lse_all[:, 0]), 0)
    assert rc["omitted_mass_exact"] == pytest.approx(share.mean(), abs=2e-5), (share, rc)
    assert rc["omitted_mass_bound"] == 1  # caller rows: nothing scored the rest
    got, _ = parse_out(out, hq, 1, d, False)
    assert_close(got, ref)
    assert np.all(got[-1] == 0)  # counts 0: no key
    assert rc["form"] == "sparse"
    assert rc["support"] == [int(x) for x in att.sum(axis=(1, 2))]
    assert rc["rows_attended"] == int(att.sum()) and rc["visible_rows"] == int(vis.sum())
    assert rc["exact"] == 0  # the empty head misses its visible keys

    # Every index, every head: the dense result, exact.
    full = np.stack([rng.permutation(n) for _ in range(hq)]).astype(np.int32)
    dense = r.execute_command("ATTEND.PREFIX.QUERY", sid, 0, hq, d, 0, f32(q), *tail)
    out, rc = split_reply(r.execute_command(
        "ATTEND.PREFIX.QUERY_SPARSE", sid, 0, hq, d, n, f32(q), i32(full),
        i32(np.full(hq, n)), *tail, "RECEIPT"))
    assert_close(parse_out(out, hq, 1, d, False)[0], parse_out(dense, hq, 1, d, False)[0])
    assert rc["exact"] == 1 and rc["rows_attended"] == rc["visible_rows"] == int(vis.sum())


# (H_q, H_kv, N, D, B, K_top, window, qpos or None, head_map or None)
AUTO_CASES = [
    (4, 4, 100, 32, 8, 3, 0, None, [2, 0, 3, 1]),                  # partial last block
    (8, 4, 128, 64, 16, 2, 0, None, [0, 3, 1, 1, 2, 0, 3, 2]),
    (8, 2, 150, 96, 10, 2, 65, None, None),                         # window, partial first
    (8, 1, 90, 128, 7, 0, 0, None, None),                           # K_top 0: first + last
    (4, 2, 120, 160, 12, 3, 0, 70, [1, 1, 0, 0]),                   # QPOS inside the prefix
    (2, 2, 64, 192, 5, 2, 30, 64 + 9, [1, 0]),                      # decode at N+S-1, window
    (2, 1, 40, 256, 4, 2, 0, None, None),
    (2, 2, 24, 512, 3, 1, 0, None, [1, 1]),
]


def sparse_auto_setup(r, case, seed, sid, dtype="fp32"):
    """Random K/V stored as `sid` (a `dtype` slot) and an M=1 query for an AUTO_CASES entry:
    (rng, k, v as the slot holds them, q, head map, query position, the command's window/QPOS
    arguments)."""
    hq, hkv, n, d, _, _, w, qpos, hm = case
    rng = np.random.default_rng(seed)
    k, v, q = rnd(rng, hkv, n, d), rnd(rng, hkv, n, d), rnd(rng, hq, 1, d, scale=2.0)
    hm = np.asarray(contiguous_map(hq, hkv) if hm is None else hm)
    k, v = store_as(r, sid, 0, k, v, dtype)
    p = n if qpos is None else qpos
    tail = ([w] if w else []) + (["QPOS", qpos] if qpos is not None else [])
    return rng, k, v, q, hm, p, tail


@pytest.mark.parametrize("dtype", SLOT_DTYPES)
@pytest.mark.parametrize("select", ["mean", "quest"])
@pytest.mark.parametrize("case", AUTO_CASES, ids=[str(i) for i in range(len(AUTO_CASES))])
def test_query_sparse_auto_matches_reference(shared_pion, case, select, dtype):
    hq, hkv, n, d, b, k_top, w, qpos, _ = case
    idx = AUTO_CASES.index(case)
    r = shared_pion.client()
    sid = "auto%d%s%s" % (idx, select, dtype)
    _, k, v, q, hm, p, tail = sparse_auto_setup(r, case, 400 + idx + FP8_SEED[dtype], sid,
                                                dtype)
    if select == "quest":
        tail += ["SELECT", "quest"]
    chosen, nvis_blocks, allow, omitted = sparse_auto_ref(q[:, 0], k, hm, b, k_top, p, w, select)
    ref, lse_kept, att = attend_ref(q, k, v, hm, [p], np.arange(n), w, allow)
    _, lse_all, vis = attend_ref(q, k, v, hm, [p], np.arange(n), w)
    out, rc = split_reply(r.execute_command(
        "ATTEND.PREFIX.QUERY_SPARSE_AUTO", sid, 0, hq, d, b, k_top, hkv, f32(q), i32(hm),
        *tail, "RECEIPT"))
    # The bound is never below the true share left out (float64, over the slot's own rows).
    true_share = np.mean(1 - np.exp(lse_kept[:, 0] - lse_all[:, 0]))
    assert true_share - 1e-6 <= rc["omitted_mass_bound"] <= 1, (true_share, rc)
    assert "omitted_mass_exact" not in rc  # only with AUDIT
    # AUDIT: the same answer, and the exact share from every visible key's score.
    audited, ra = split_reply(r.execute_command(
        "ATTEND.PREFIX.QUERY_SPARSE_AUTO", sid, 0, hq, d, b, k_top, hkv, f32(q), i32(hm),
        *tail, "AUDIT"))
    assert audited == out
    assert ra["omitted_mass_exact"] == pytest.approx(true_share, abs=2e-5), (true_share, ra)
    assert ra["omitted_mass_exact"] <= ra["omitted_mass_bound"] + 1e-6
    got, _ = parse_out(out, hq, 1, d, False)
    assert [sorted(x) for x in rc["blocks"]] == chosen, (rc["blocks"], chosen)
    assert_close(got, ref)
    assert rc["form"] == "sparse_auto" and rc["suffix_rows"] == 0
    assert rc["blocks_total"] == nvis_blocks
    assert rc["blocks_chosen"] == sum(len(c) for c in chosen)
    assert rc["support"] == [int(x) for x in att.sum(axis=(1, 2))]
    assert rc["rows_attended"] == int(att.sum()) and rc["visible_rows"] == int(vis.sum())
    approx = int(att.sum()) < int(vis.sum())
    assert approx, "case should leave blocks out"
    assert rc["exact"] == 0
    assert 0 < rc["omitted_mass_estimate"] < 1
    assert min(omitted) - 1e-4 <= rc["omitted_mass_estimate"] <= max(omitted) + 1e-4, \
        (omitted, rc["omitted_mass_estimate"])
    # Without RECEIPT: the same bytes; the default selector is mean.
    if select == "mean":
        assert r.execute_command("ATTEND.PREFIX.QUERY_SPARSE_AUTO", sid, 0, hq, d, b, k_top,
                                 hkv, f32(q), i32(hm), *tail, "SELECT", "mean") == out

    # K_top >= number of blocks: every visible block, the dense result, exact.
    nb = -(-n // b)
    out, rc = split_reply(r.execute_command(
        "ATTEND.PREFIX.QUERY_SPARSE_AUTO", sid, 0, hq, d, b, nb, hkv, f32(q), i32(hm),
        *tail, "RECEIPT"))
    ref_d, _, _ = attend_ref(q, k, v, hm, [p], np.arange(n), w)
    assert_close(parse_out(out, hq, 1, d, False)[0], ref_d)
    assert rc["exact"] == 1 and rc["omitted_mass_estimate"] == 0
    assert rc["rows_attended"] == rc["visible_rows"] == int(vis.sum())


@pytest.mark.parametrize("dtype", SLOT_DTYPES)
@pytest.mark.parametrize("select", ["mean", "quest"])
@pytest.mark.parametrize("case", [1, 2, 3, 4])
def test_query_sparse_auto_shared_matches_reference(shared_pion, case, select, dtype):
    """SHARED: the query heads of one K/V head choose one set of blocks, each block ranked by
    the highest of their scores; each head then attends exactly those rows."""
    hq, hkv, n, d, b, k_top, w, qpos, _ = AUTO_CASES[case]
    r = shared_pion.client()
    sid = "autoshared%d%s%s" % (case, select, dtype)
    rng, k, v, q, hm, p, tail = sparse_auto_setup(r, AUTO_CASES[case],
                                                  900 + case + FP8_SEED[dtype], sid, dtype)
    tail += ["SELECT", select, "SHARED"]
    chosen, nvis_blocks, allow, omitted = sparse_auto_ref(q[:, 0], k, hm, b, k_top, p, w, select,
                                                          shared=True)
    for h in range(hq):  # one choice per group
        assert chosen[h] == chosen[list(hm).index(hm[h])]
    ref, _, att = attend_ref(q, k, v, hm, [p], np.arange(n), w, allow)
    out, rc = split_reply(r.execute_command(
        "ATTEND.PREFIX.QUERY_SPARSE_AUTO", sid, 0, hq, d, b, k_top, hkv, f32(q), i32(hm),
        *tail, "RECEIPT"))
    assert [sorted(x) for x in rc["blocks"]] == chosen, (rc["blocks"], chosen)
    assert_close(parse_out(out, hq, 1, d, False)[0], ref)
    assert rc["blocks_total"] == nvis_blocks
    assert rc["support"] == [int(x) for x in att.sum(axis=(1, 2))]
    assert rc["rows_attended"] == int(att.sum()) and rc["exact"] == 0
    assert min(omitted) - 1e-4 <= rc["omitted_mass_estimate"] <= max(omitted) + 1e-4
    # With one query head per K/V head, SHARED changes nothing.
    if hq == hkv:
        plain = r.execute_command("ATTEND.PREFIX.QUERY_SPARSE_AUTO", sid, 0, hq, d, b, k_top,
                                  hkv, f32(q), i32(hm), *tail[:-1])
        assert plain == out
    # The fused form takes SHARED too: the prefix part chooses alike.
    s_suf = 3
    ks, vs = rnd(rng, hkv, s_suf, d), rnd(rng, hkv, s_suf, d)
    out, rc = split_reply(r.execute_command(
        "ATTEND.PREFIX.QUERY_SPARSE_AUTO_FUSED", sid, 0, hq, d, b, k_top, hkv, s_suf, f32(q),
        f32(ks), f32(vs), i32(hm), "SELECT", select, "SHARED", "RECEIPT"))
    chosen_f, _, _, _ = sparse_auto_ref(q[:, 0], k, hm, b, k_top, n + s_suf - 1, 0, select,
                                        shared=True)
    assert [sorted(x) for x in rc["blocks"]] == chosen_f


# (H_q, H_kv, N, D, B, K_top, S_suf, window, head_map or None)
AUTO_FUSED_CASES = [
    (4, 2, 100, 64, 8, 3, 6, 0, [1, 0, 0, 1]),
    (8, 8, 80, 32, 10, 2, 4, 50, None),
    (8, 1, 70, 128, 9, 1, 5, 0, None),
    (2, 2, 40, 512, 6, 2, 3, 0, [1, 0]),
    (4, 4, 60, 96, 7, 2, 5, 3, [0, 0, 3, 2]),  # window inside the suffix: no prefix key
]


@pytest.mark.parametrize("dtype", SLOT_DTYPES)
@pytest.mark.parametrize("select", ["mean", "quest"])
@pytest.mark.parametrize("case", AUTO_FUSED_CASES,
                         ids=[str(i) for i in range(len(AUTO_FUSED_CASES))])
def test_query_sparse_auto_fused_matches_reference(shared_pion, case, select, dtype):
    hq, hkv, n, d, b, k_top, s, w, hm = case
    idx = AUTO_FUSED_CASES.index(case)
    r = shared_pion.client()
    rng = np.random.default_rng(500 + idx + FP8_SEED[dtype])
    k, v = rnd(rng, hkv, n, d), rnd(rng, hkv, n, d)
    ks, vs, q = rnd(rng, hkv, s, d), rnd(rng, hkv, s, d), rnd(rng, hq, 1, d, scale=2.0)
    hm = np.asarray(contiguous_map(hq, hkv) if hm is None else hm)
    sid = "autof%d%s%s" % (idx, select, dtype)
    k, v = store_as(r, sid, 0, k, v, dtype)
    p = n + s - 1
    tail = ([w] if w else []) + (["SELECT", "quest"] if select == "quest" else [])
    chosen, nvis_blocks, allow, _ = sparse_auto_ref(q[:, 0], k, hm, b, k_top, p, w, select)
    allow_all = np.concatenate([allow, np.ones((hq, 1, s), bool)], 2)
    kk, vv = np.concatenate([k, ks], 1), np.concatenate([v, vs], 1)
    ref, lse_kept, att = attend_ref(q, kk, vv, hm, [p], np.arange(n + s), w, allow_all)
    _, lse_all, vis = attend_ref(q, kk, vv, hm, [p], np.arange(n + s), w)
    out, rc = split_reply(r.execute_command(
        "ATTEND.PREFIX.QUERY_SPARSE_AUTO_FUSED", sid, 0, hq, d, b, k_top, hkv, s, f32(q),
        f32(ks), f32(vs), i32(hm), *tail, "AUDIT"))
    # The share of all the mass the row sees (prefix and suffix): exact with AUDIT, and the
    # bound never below it.
    share = np.mean(1 - np.exp(lse_kept[:, 0] - lse_all[:, 0]))
    assert rc["omitted_mass_exact"] == pytest.approx(share, abs=2e-5), (share, rc)
    assert share - 1e-6 <= rc["omitted_mass_bound"] <= 1, (share, rc)
    got, _ = parse_out(out, hq, 1, d, False)
    assert [sorted(x) for x in rc["blocks"]] == chosen, (rc["blocks"], chosen)
    assert_close(got, ref)
    assert rc["form"] == "sparse_auto_fused"
    assert rc["prefix_rows"] == n and rc["suffix_rows"] == s and rc["query_rows"] == hq
    assert rc["blocks_total"] == nvis_blocks
    assert rc["rows_attended"] == int(att.sum()) and rc["visible_rows"] == int(vis.sum())
    assert rc["support"] == [int(x) for x in att.sum(axis=(1, 2))]
    assert rc["exact"] == (1 if int(att.sum()) == int(vis.sum()) else 0)
    if rc["exact"]:
        assert rc["omitted_mass_estimate"] == 0
    else:
        assert 0 < rc["omitted_mass_estimate"] < 1
    # Fused sparse-auto with every block == QUERY_FUSED (dense).
    nb = -(-n // b)
    a = r.execute_command("ATTEND.PREFIX.QUERY_SPARSE_AUTO_FUSED", sid, 0, hq, d, b, nb, hkv, s,
                          f32(q), f32(ks), f32(vs), i32(hm), *tail)
    fused = r.execute_command("ATTEND.PREFIX.QUERY_FUSED", sid, 0, hq, d, s, hkv, f32(q),
                              f32(ks), f32(vs), i32(hm), *([w] if w else []))
    assert_close(parse_out(a, hq, 1, d, False)[0], parse_out(fused, hq, 1, d, False)[0])



@pytest.mark.parametrize("select,shared", [("mean", False), ("quest", True)])
@pytest.mark.parametrize("fused", [False, True], ids=["plain", "fused"])
def test_sparse_auto_recent_blocks_are_always_chosen(shared_pion, select, shared, fused):
    """RECENT r: the r visible blocks before the last are chosen whatever their scores (and
    count in K_top); the rest of K_top by score, as numpy chooses them; RECENT > K_top is
    refused."""
    r = shared_pion.client()
    rng = np.random.default_rng(808 + fused * 2 + shared)
    hq, hkv, n, d, b, k_top, recent, s = 8, 2, 320, 32, 16, 6, 3, 4
    k, v = rnd(rng, hkv, n, d), rnd(rng, hkv, n, d)
    # The recent blocks' keys point away from the queries: by score they would never be chosen.
    q = rnd(rng, hq, 1, d, scale=2.0)
    hm = np.asarray(contiguous_map(hq, hkv))
    for g in range(hkv):
        k[g, n - (recent + 1) * b:n - b] = -3 * q[hm == g, 0].mean(0)
    sid = "recent%d%d%s" % (fused, shared, select)
    store(r, sid, 0, k, v)
    tail = ["SELECT", select] + (["SHARED"] if shared else []) + ["RECENT", recent, "AUDIT"]
    if fused:
        ks, vs = rnd(rng, hkv, s, d), rnd(rng, hkv, s, d)
        args = ("ATTEND.PREFIX.QUERY_SPARSE_AUTO_FUSED", sid, 0, hq, d, b, k_top, hkv, s, f32(q),
                f32(ks), f32(vs), i32(hm))
    else:
        args = ("ATTEND.PREFIX.QUERY_SPARSE_AUTO", sid, 0, hq, d, b, k_top, hkv, f32(q), i32(hm))
    out, rc = split_reply(r.execute_command(*args, *tail))
    p = n + s - 1 if fused else n
    chosen, _, allow, _ = sparse_auto_ref(q[:, 0], k, hm, b, k_top, p, 0, select, shared, recent)
    nb = n // b
    for h in range(hq):
        assert set(range(nb - 1 - recent, nb - 1)) <= set(rc["blocks"][h]), rc["blocks"][h]
    assert [sorted(x) for x in rc["blocks"]] == chosen, (rc["blocks"], chosen)
    # Without RECENT those blocks are not chosen: the option is what put them there.
    _, rc0 = split_reply(r.execute_command(*args, "SELECT", select,
                                           *(["SHARED"] if shared else []), "RECEIPT"))
    assert not set(range(nb - 1 - recent, nb - 1)) & set(rc0["blocks"][0]), rc0["blocks"][0]
    if fused:
        allow = np.concatenate([allow, np.ones((hq, 1, s), bool)], 2)
        kk, vv = np.concatenate([k, ks], 1), np.concatenate([v, vs], 1)
    else:
        kk, vv = k, v
    ref, _, _ = attend_ref(q, kk, vv, hm, [p], np.arange(kk.shape[1]), 0, allow)
    assert_close(parse_out(out, hq, 1, d, False)[0], ref)
    assert 0 < rc["omitted_mass_exact"] <= rc["omitted_mass_bound"] + 1e-6
    with pytest.raises(Exception, match="RECENT 7 exceeds K_top 6"):
        r.execute_command(*args, "RECENT", 7)
    with pytest.raises(Exception, match="RECENT needs a whole number of blocks"):
        r.execute_command(*args, "RECENT", "x")

# ------------------------------------------------------------------------------------------
# fp8 slots: what fp8 storage costs against fp32, persistence, the approximate fallback
# ------------------------------------------------------------------------------------------

# (H_q, H_kv, N, D, M, window, qpos or None)
FP8_ERROR_CASES = [
    (8, 8, 600, 64, 1, 0, None),
    (32, 8, 1000, 128, 1, 0, None),     # GQA 4
    (8, 1, 900, 128, 1, 200, None),     # GQA 8, window
    (4, 2, 500, 256, 17, 0, 250),       # M > 1, causal inside the prefix
    (16, 4, 700, 96, 8, 64, None),      # M > 1, window
    (4, 4, 300, 512, 2, 0, None),
    (4, 2, 800, 32, 33, 100, 400),
]


def test_fp8_slots_error_against_fp32_is_bounded(shared_pion):
    """fp8 slots against the float64 reference on the unquantized Gaussian rows, for the forms
    whose key set does not depend on the scores — dense (M = 1 and M > 1, causal, windows, GQA),
    fused with an fp32 suffix, sparse lists: relative MSE within [FP8_REL_MSE_FLOOR,
    FP8_REL_MSE_BOUND]; and each within TOL of the reference on the dequantized rows. (top_k
    and sparse-auto choose keys by the fp8 scores: the parametrized tests above check them on
    fp8 slots against the reference over the dequantized rows.)"""
    r = shared_pion.client()
    rng = np.random.default_rng(31)
    errs = []
    for i, (hq, hkv, n, d, m, w, qpos) in enumerate(FP8_ERROR_CASES):
        k, v, q = rnd(rng, hkv, n, d), rnd(rng, hkv, n, d), rnd(rng, hq, m, d)
        sid = "fp8err%d" % i
        k8, v8 = store_as(r, sid, 0, k, v, "fp8")
        [info] = info_slots(r, sid)
        assert (info["dtype"], info["bytes"]) == ("fp8", 2 * hkv * n * (d + 4))
        hm = contiguous_map(hq, hkv)
        p0 = n if qpos is None else qpos
        pos_q = np.arange(p0, p0 + m)
        tail = ([w] if w else []) + (["QPOS", qpos] if qpos is not None else [])

        def check(form, got, args32, args8, rows_per_kv=(hq // hkv) * m):
            # 64+ query rows a K/V head (d <= 128) on the cuda backend: the batched tensor-core
            # kernel, Q and P rounded to 16 bits (flash-attention precision, docs/PROTOCOL.md).
            flash = ATTENTION_BACKEND == "cuda" and rows_per_kv >= 64 and d <= 128
            assert_close(got, attend_ref(*args8)[0], 4e-3 if flash else TOL, form)
            errs.append((form, i, rel_mse(got, attend_ref(*args32)[0])))

        out = r.execute_command("ATTEND.PREFIX.QUERY", sid, 0, hq, d, 0, f32(q), *tail)
        check("dense", parse_out(out, hq, m, d, m > 1)[0],
              (q, k, v, hm, pos_q, np.arange(n), w), (q, k8, v8, hm, pos_q, np.arange(n), w))

        s_suf = 4
        mf = min(m, s_suf)
        qf = q[:, :mf]
        ks, vs = rnd(rng, hkv, s_suf, d), rnd(rng, hkv, s_suf, d)
        out = r.execute_command("ATTEND.PREFIX.QUERY_FUSED", sid, 0, hq, d, s_suf, hkv, f32(qf),
                                f32(ks), f32(vs), i32(hm), *([w] if w else []))
        pos_f, pos_k = np.arange(n + s_suf - mf, n + s_suf), np.arange(n + s_suf)
        check("fused", parse_out(out, hq, mf, d, False)[0],
              (qf, np.concatenate([k, ks], 1), np.concatenate([v, vs], 1), hm, pos_f, pos_k, w),
              (qf, np.concatenate([k8, ks], 1), np.concatenate([v8, vs], 1), hm, pos_f, pos_k, w),
              (hq // hkv) * mf)

        if m == 1:
            kmax = n // 2
            idx = np.stack([rng.permutation(n)[:kmax] for _ in range(hq)]).astype(np.int32)
            allow = np.zeros((hq, 1, n), bool)
            for h in range(hq):
                allow[h, 0, idx[h]] = True
            out = r.execute_command("ATTEND.PREFIX.QUERY_SPARSE", sid, 0, hq, d, kmax, f32(q),
                                    i32(idx), i32(np.full(hq, kmax)), *tail)
            check("sparse", parse_out(out, hq, 1, d, False)[0],
                  (q, k, v, hm, pos_q, np.arange(n), w, allow),
                  (q, k8, v8, hm, pos_q, np.arange(n), w, allow))
    for form, i, e in errs:
        assert e <= FP8_REL_MSE_BOUND, (form, FP8_ERROR_CASES[i], e)
        assert e >= FP8_REL_MSE_FLOOR, ("too exact for fp8", form, FP8_ERROR_CASES[i], e)


def test_fp8_slot_is_saved_and_restored_bit_identically(pion_factory):
    srv = pion_factory("-w", "2")
    r = srv.client()
    rng = np.random.default_rng(32)
    k, v, q = rnd(rng, 2, 300, 64), rnd(rng, 2, 300, 64), rnd(rng, 4, 3, 64)
    store_as(r, "f8s", 0, k, v, "fp8")
    answer = r.execute_command("ATTEND.PREFIX.QUERY", "f8s", 0, 4, 64, 0, f32(q))
    auto = r.execute_command("ATTEND.PREFIX.QUERY_SPARSE_AUTO", "f8s", 0, 4, 64, 16, 3, 2,
                             f32(q[:, :1]), i32(contiguous_map(4, 2)), "SELECT", "quest")
    assert r.execute_command("ATTEND.PREFIX.SAVE", "f8s") == b"OK"
    srv.stop()
    srv.start()
    r = srv.client()
    [info] = info_slots(r, "f8s")
    assert (info["dtype"], info["bytes"], info["tier"]) == ("fp8", 2 * 2 * 300 * 68, "disk")
    assert r.execute_command("ATTEND.PREFIX.QUERY", "f8s", 0, 4, 64, 0, f32(q)) == answer
    assert r.execute_command("ATTEND.PREFIX.QUERY_SPARSE_AUTO", "f8s", 0, 4, 64, 16, 3, 2,
                             f32(q[:, :1]), i32(contiguous_map(4, 2)), "SELECT", "quest") == auto


@HOST_SLOTS
def test_fp8_exact_query_refused_and_allow_approx_answers_sparse(pion_factory):
    """ALLOW APPROX on an fp8 slot: a dense decode step that cannot meet its deadline answers
    sparse-auto over the fp8 rows, bit-identical to the explicit QUERY_SPARSE_AUTO."""
    srv = pion_factory("-w", "1", "--attention-backend", "cpu")
    r = srv.client()
    rng = np.random.default_rng(33)
    h, n, d = 8, 16384, 128  # 34 MiB of fp8 K/V: a dense decode step takes milliseconds here
    k, v = rnd(rng, h, n, d), rnd(rng, h, n, d)
    store_as(r, "big8", 0, k, v, "fp8")
    q = rnd(rng, h, 1, d)
    for _ in range(3):  # the measured rate the admission uses
        exact, rc = split_reply(r.execute_command("ATTEND.PREFIX.QUERY", "big8", 0, h, d, 0,
                                                  f32(q), "RECEIPT"))
    if rc["micros"] < 2000:  # deadlines are whole milliseconds: none is below this step
        pytest.skip("a dense step of %.0f us here leaves no deadline below it" % rc["micros"])
    # Half the dense step's time: never enough for it, room for sparse.
    deadline = max(1, int(rc["micros"] / 2000))
    # The slot's block summaries (B = 64) made once beforehand: the fallback's first use would
    # build them inside its budget (what this test checks is the fp8 answer, not that cost).
    r.execute_command("ATTEND.PREFIX.QUERY_SPARSE_AUTO", "big8", 0, h, d, 64, 1, h, f32(q),
                      i32(np.arange(h)))
    with srv.raw() as c:
        reply = c.call("ATTEND.PREFIX.QUERY", "big8", 0, h, d, 0, f32(q), "DEADLINE", deadline)
    assert isinstance(reply, RespError) and str(reply).startswith("TIMEOUT "), reply
    out, rc = split_reply(r.execute_command("ATTEND.PREFIX.QUERY", "big8", 0, h, d, 0, f32(q),
                                            "AUDIT", "DEADLINE", deadline, "ALLOW", "APPROX"))
    assert rc["exact"] == 0 and rc["form"] == "sparse_auto" and rc["dtype"] == "fp8", rc
    # AUDIT: what the fallback left out, exactly; the bound never below it.
    assert 0 < rc["omitted_mass_exact"] <= rc["omitted_mass_bound"] + 1e-6, rc
    assert "approx" in rc["fallback"] and rc["blocks_chosen"] > 0, rc
    k_top = int(rc["fallback"].split(" over ")[2].split(" blocks")[0])
    same = r.execute_command("ATTEND.PREFIX.QUERY_SPARSE_AUTO", "big8", 0, h, d, 64, k_top, h,
                             f32(q), i32(np.arange(h)), "SHARED")
    assert same == out
    assert np.abs(np.frombuffer(out, np.float32) - np.frombuffer(exact, np.float32)).max() < 1.0


def test_sparse_auto_summaries_rebuilt_when_slot_replaced(shared_pion):
    """Block summaries are cached per (slot, B): a re-STORE must not reuse the old ones."""
    r = shared_pion.client()
    rng = np.random.default_rng(55)
    hq, hkv, n, d, b, k_top = 4, 2, 96, 64, 8, 2
    q = rnd(rng, hq, 1, d, scale=2.0)
    hm = contiguous_map(hq, hkv)
    for rep in range(2):
        k, v = rnd(rng, hkv, n, d), rnd(rng, hkv, n, d)
        store(r, "autore", 0, k, v)
        chosen, _, allow, _ = sparse_auto_ref(q[:, 0], k, hm, b, k_top, n, 0, "mean")
        ref, _, _ = attend_ref(q, k, v, hm, [n], np.arange(n), 0, allow)
        out, rc = split_reply(r.execute_command(
            "ATTEND.PREFIX.QUERY_SPARSE_AUTO", "autore", 0, hq, d, b, k_top, hkv, f32(q),
            i32(hm), "RECEIPT"))
        assert [sorted(x) for x in rc["blocks"]] == chosen, rep
        assert_close(parse_out(out, hq, 1, d, False)[0], ref)


def test_fp16_large_slot_converts_off_the_event_loop(fp16_pion):
    """A slot of >= 2^20 elements is converted to fp16 on the compute pool (the reply follows
    the publish); it must equal the fp16 rounding exactly, and a query right after sees it."""
    r = fp16_pion.client()
    rng = np.random.default_rng(161)
    hkv, n, d = 4, 2048, 128  # 2^20 elements per tensor
    k, v = rnd(rng, hkv, n, d), rnd(rng, hkv, n, d)
    q = rnd(rng, 8, 1, d)
    store(r, "big16", 3, k, v)
    [slot] = info_slots(r, "big16")
    assert slot["dtype"] == "fp16" and slot["bytes"] == 2 * hkv * n * d * 2
    got = parse_out(r.execute_command("ATTEND.PREFIX.QUERY", "big16", 3, 8, d, 0, f32(q)),
                    8, 1, d, False)[0]
    k16 = k.astype(np.float16).astype(np.float32)
    v16 = v.astype(np.float16).astype(np.float32)
    ref16, _, _ = attend_ref(q, k16, v16, contiguous_map(8, hkv), np.array([n]), np.arange(n), 0)
    assert_close(got, ref16, TOL, "large fp16 slot")
    assert r.execute_command("ATTEND.PREFIX.DROP", "big16") == 1


def test_fp16_slots(fp16_pion):
    r = fp16_pion.client()
    rng = np.random.default_rng(16)
    hq, hkv, n, d, m = 8, 2, 96, 64, 3
    k, v, q = rnd(rng, hkv, n, d), rnd(rng, hkv, n, d), rnd(rng, hq, m, d, scale=2.0)
    k16 = k.astype(np.float16).astype(np.float32)
    v16 = v.astype(np.float16).astype(np.float32)
    store(r, "h", 0, k, v)
    [slot] = info_slots(r, "h")
    assert slot["dtype"] == "fp16" and slot["bytes"] == 2 * hkv * n * d * 2
    assert attn_info(fp16_pion)["attention_dtype"] == "fp16"
    hm = contiguous_map(hq, hkv)
    pos = np.arange(n, n + m)

    def check(got, ref16, ref32, what):
        assert_close(got, ref16, TOL, what + " vs fp16 reference")
        assert_close(got, ref32, TOL_FP16_VS_FP32, what + " vs fp32 reference")
        assert rel_err(ref16, ref32) > 1e-4, "data too tame to tell fp16 from fp32"
        assert rel_err(got, ref16) * 4 < rel_err(got, ref32), what + ": looks like fp32"

    out, rc = split_reply(r.execute_command("ATTEND.PREFIX.QUERY", "h", 0, hq, d, 0, f32(q),
                                            "RECEIPT"))
    got, lse = parse_out(out, hq, m, d, True)
    ref16, lse16, _ = attend_ref(q, k16, v16, hm, pos, np.arange(n), 0)
    ref32, _, _ = attend_ref(q, k, v, hm, pos, np.arange(n), 0)
    check(got, ref16, ref32, "dense")
    assert_lse(lse, lse16)
    assert rc["dtype"] == "fp16" and rc["exact"] == 1

    # Fused, non-contiguous head map, window: the suffix travels as fp32.
    s = 5
    ks, vs = rnd(rng, hkv, s, d), rnd(rng, hkv, s, d)
    hm2 = np.array([1, 0, 1, 1, 0, 0, 1, 0])
    out = r.execute_command("ATTEND.PREFIX.QUERY_FUSED", "h", 0, hq, d, s, hkv, f32(q),
                            f32(ks), f32(vs), i32(hm2), 40)
    pos_f = np.arange(n + s - m, n + s)
    ref16, _, _ = attend_ref(q, np.concatenate([k16, ks], 1), np.concatenate([v16, vs], 1),
                             hm2, pos_f, np.arange(n + s), 40)
    ref32, _, _ = attend_ref(q, np.concatenate([k, ks], 1), np.concatenate([v, vs], 1),
                             hm2, pos_f, np.arange(n + s), 40)
    check(parse_out(out, hq, m, d, False)[0], ref16, ref32, "fused")

    # Sparse-auto (quest) on the fp16 summaries.
    q1 = q[:, :1]
    chosen, _, allow, _ = sparse_auto_ref(q1[:, 0], k16, hm2, 8, 3, n, 0, "quest")
    out, rc = split_reply(r.execute_command(
        "ATTEND.PREFIX.QUERY_SPARSE_AUTO", "h", 0, hq, d, 8, 3, hkv, f32(q1), i32(hm2),
        "SELECT", "quest", "RECEIPT"))
    assert [sorted(x) for x in rc["blocks"]] == chosen
    ref16, _, _ = attend_ref(q1, k16, v16, hm2, [n], np.arange(n), 0, allow)
    ref32, _, _ = attend_ref(q1, k, v, hm2, [n], np.arange(n), 0, allow)
    check(parse_out(out, hq, 1, d, False)[0], ref16, ref32, "sparse_auto")

    # Sparse, top_k.
    idx = np.stack([rng.permutation(n)[:20] for _ in range(hq)]).astype(np.int32)
    out = r.execute_command("ATTEND.PREFIX.QUERY_SPARSE", "h", 0, hq, d, 20, f32(q1), i32(idx),
                            i32(np.full(hq, 20)))
    allow = np.zeros((hq, 1, n), bool)
    for h in range(hq):
        allow[h, 0, idx[h]] = True
    ref16, _, _ = attend_ref(q1, k16, v16, hm, [n], np.arange(n), 0, allow)
    ref32, _, _ = attend_ref(q1, k, v, hm, [n], np.arange(n), 0, allow)
    check(parse_out(out, hq, 1, d, False)[0], ref16, ref32, "sparse")
    allow, _ = topk_allow(q, k16, hm, pos, 0, 7)
    out = r.execute_command("ATTEND.PREFIX.QUERY", "h", 0, hq, d, 7, f32(q))
    ref16, _, _ = attend_ref(q, k16, v16, hm, pos, np.arange(n), 0, allow)
    assert_close(parse_out(out, hq, m, d, True)[0], ref16, TOL, "top_k vs fp16 reference")

    # Every D on an fp16 slot too.
    for i, dd in enumerate(DS):
        nn = 24 if dd >= 256 else 48
        k, v, qq = rnd(rng, 1, nn, dd), rnd(rng, 1, nn, dd), rnd(rng, 2, 2, dd, scale=2.0)
        store(r, "hd", i, k, v)
        out = r.execute_command("ATTEND.PREFIX.QUERY", "hd", i, 2, dd, 0, f32(qq), 5)
        ref16, _, _ = attend_ref(qq, k.astype(np.float16), v.astype(np.float16), [0, 0],
                                 [nn, nn + 1], np.arange(nn), 5)
        assert_close(parse_out(out, 2, 2, dd, True)[0], ref16, TOL, "fp16 D=%d" % dd)

    # STORE ... FROM an fp32 namespace into an fp16 slot: same as the blob store.
    r.execute_command("KV.PREFIX.REGISTER", "h_ns", 1, 30, 2, 64, "fp32")
    kt, vt = rnd(rng, 30, 128), rnd(rng, 30, 128)
    r.execute_command("V.STOREBATCH", "h_ns_pk", 0, f32(kt))
    r.execute_command("V.STOREBATCH", "h_ns_pv", 0, f32(vt))
    assert r.execute_command("ATTEND.PREFIX.STORE", "hf", 0, "FROM", "h_ns") == b"OK"
    store(r, "hb", 0, kt.reshape(30, 2, 64).transpose(1, 0, 2),
          vt.reshape(30, 2, 64).transpose(1, 0, 2))
    qq = rnd(rng, 4, 2, 64)
    a = r.execute_command("ATTEND.PREFIX.QUERY", "hf", 0, 4, 64, 0, f32(qq))
    b = r.execute_command("ATTEND.PREFIX.QUERY", "hb", 0, 4, 64, 0, f32(qq))
    assert a == b


def test_split_k_over_large_slots(pion_factory):
    """Dense passes over large slots are split by key range across compute threads and merged
    exactly: masked and partially masked pieces (windows, QPOS inside the prefix, rows of one
    call that see different ranges) must merge to the reference."""
    srv = pion_factory("-w", "2", "--compute-threads", "4")
    r = srv.client()
    rng = np.random.default_rng(90)
    hq, hkv, n, d = 4, 2, 4096, 64
    k, v = rnd(rng, hkv, n, d), rnd(rng, hkv, n, d)
    store(r, "big", 0, k, v)
    hm = contiguous_map(hq, hkv)
    splits = []
    for m, w, qpos in ((4, 0, None), (3, 1500, None), (2, 0, 1000), (5, 2000, 3000),
                       (2, 4000, n + 3000)):
        q = rnd(rng, hq, m, d, scale=2.0)
        p0 = n if qpos is None else qpos
        tail = ([w] if w else []) + (["QPOS", qpos] if qpos is not None else [])
        out, rc = split_reply(r.execute_command("ATTEND.PREFIX.QUERY", "big", 0, hq, d, 0,
                                                f32(q), *tail, "RECEIPT"))
        ref, ref_lse, att = attend_ref(q, k, v, hm, np.arange(p0, p0 + m), np.arange(n), w)
        got, lse = parse_out(out, hq, m, d, True)
        assert_close(got, ref, what="m=%d w=%d qpos=%s" % (m, w, qpos))
        assert_lse(lse, ref_lse)
        assert rc["rows_attended"] == rc["visible_rows"] == int(att.sum())
        splits.append(rc["splits"])
        # Stage times: every piece started and ended inside the computation, the merge too.
        stages = [float(rc[f]) for f in ("queue_us", "piece_start_max_us", "piece_max_us",
                                         "merge_us", "micros")]
        assert min(stages) >= 0, rc
        if rc["splits"] > 1 and rc["backend"] == "cpu":  # the CPU executor's pieces
            micros = float(rc["micros"])
            assert 0 < float(rc["piece_max_us"]) <= micros, rc
            assert float(rc["piece_start_max_us"]) < micros, rc
            assert float(rc["merge_us"]) <= micros, rc
        allow, _ = topk_allow(q, k, hm, np.arange(p0, p0 + m), w, 40)
        out = r.execute_command("ATTEND.PREFIX.QUERY", "big", 0, hq, d, 40, f32(q), *tail)
        ref, ref_lse, _ = attend_ref(q, k, v, hm, np.arange(p0, p0 + m), np.arange(n), w, allow)
        got, lse = parse_out(out, hq, m, d, True)
        assert_close(got, ref, what="top_k m=%d w=%d qpos=%s" % (m, w, qpos))
        assert_lse(lse, ref_lse)
    assert splits[0] > 1, "a 4096-row dense pass on 4 compute threads was not split: %r" % splits
    # Fused and sparse-auto over the same large slot.
    s_suf = 8
    ks, vs, q = rnd(rng, hkv, s_suf, d), rnd(rng, hkv, s_suf, d), rnd(rng, hq, 3, d, scale=2.0)
    out = r.execute_command("ATTEND.PREFIX.QUERY_FUSED", "big", 0, hq, d, s_suf, hkv, f32(q),
                            f32(ks), f32(vs), i32(hm), 2500)
    ref, _, _ = attend_ref(q, np.concatenate([k, ks], 1), np.concatenate([v, vs], 1), hm,
                           np.arange(n + s_suf - 3, n + s_suf), np.arange(n + s_suf), 2500)
    assert_close(parse_out(out, hq, 3, d, False)[0], ref, what="fused")
    q1 = q[:, :1]
    chosen, _, allow, _ = sparse_auto_ref(q1[:, 0], k, hm, 64, 8, n, 0, "quest")
    out, rc = split_reply(r.execute_command("ATTEND.PREFIX.QUERY_SPARSE_AUTO", "big", 0, hq, d,
                                            64, 8, hkv, f32(q1), i32(hm), "SELECT", "quest",
                                            "RECEIPT"))
    assert [sorted(x) for x in rc["blocks"]] == chosen
    ref, _, _ = attend_ref(q1, k, v, hm, [n], np.arange(n), 0, allow)
    assert_close(parse_out(out, hq, 1, d, False)[0], ref, what="sparse_auto")


def test_receipt_in_resp3(shared_pion):
    r = shared_pion.client()
    rng = np.random.default_rng(91)
    k, v, q = rnd(rng, 2, 30, 32), rnd(rng, 2, 30, 32), rnd(rng, 2, 1, 32)
    store(r, "r3", 0, k, v)
    with shared_pion.raw() as c:
        assert isinstance(c.call("HELLO", "3"), dict)
        out, rc = c.call("ATTEND.PREFIX.QUERY", "r3", 0, 2, 32, 0, f32(q), "RECEIPT")
        assert rc[b"exact"] is True and rc[b"form"] == b"dense"
        assert rc[b"omitted_mass_estimate"] == 0.0 and isinstance(rc[b"micros"], float)
        assert rc[b"support"] == [30, 30]
        _, rc = c.call("ATTEND.PREFIX.QUERY", "r3", 0, 2, 32, 3, f32(q), "RECEIPT")
        assert rc[b"exact"] is False and 0 < rc[b"omitted_mass_estimate"] < 1
        assert rc[b"rows_attended"] == 6
        ref, _, _ = attend_ref(q, k, v, [0, 1], [30], np.arange(30), 0)
        assert_close(parse_out(out, 2, 1, 32, False)[0], ref)
        assert isinstance(c.call("ATTEND.PREFIX.INFO", "r3")[0], dict)


# ------------------------------------------------------------------------------------------
# 3. STORE ... FROM a KV.PREFIX namespace
# ------------------------------------------------------------------------------------------

def register_fill(r, ns, layers, tokens, heads, dim, fmt, rng, *extra, skip=None):
    """Registers and fills a namespace; skip=(part, layer, token) leaves one row unwritten.
    Returns the written fp32 rows {(layer, part): [T][heads*dim]}."""
    assert r.execute_command("KV.PREFIX.REGISTER", ns, layers, tokens, heads, dim, fmt,
                             *extra) == b"OK"
    rows = {}
    for l in range(layers):
        for part in ("pk", "pv"):
            x = rnd(rng, tokens, heads * dim)
            rows[(l, part)] = x
            if skip is not None and skip[:2] == (part, l):
                t = skip[2]
                if t > 0:
                    r.execute_command("V.STOREBATCH", f"{ns}_{part}", l * tokens, f32(x[:t]))
                if t + 1 < tokens:
                    r.execute_command("V.STOREBATCH", f"{ns}_{part}", l * tokens + t + 1,
                                      f32(x[t + 1:]))
            else:
                r.execute_command("V.STOREBATCH", f"{ns}_{part}", l * tokens, f32(x))
    return rows


def decoded_layer(r, ns, part, l, tokens, heads, dim):
    """Layer l of the namespace as the server decodes it, transposed to [H][N][D]."""
    x = np.frombuffer(r.execute_command("V.FETCH", f"{ns}_{part}", "RANGE", l * tokens,
                                        (l + 1) * tokens), "<f4").reshape(tokens, heads, dim)
    return np.ascontiguousarray(x.transpose(1, 0, 2))


def fp8_blob_of_layer(r, ns, part, l, tokens, heads, dim):
    """Layer l of an fp8 namespace as a DTYPE fp8 STORE blob: its RAW rows ([f32 scale][H*D
    e4m3] per token) rearranged to [H][N] rows of [scale][D e4m3] (each head's row takes its
    token's scale) — the bytes an fp8 slot bound FROM the namespace holds."""
    raw = np.frombuffer(r.execute_command("V.FETCH", f"{ns}_{part}", "RANGE", l * tokens,
                                          (l + 1) * tokens, "RAW"), np.uint8)
    raw = raw.reshape(tokens, 4 + heads * dim)
    out = np.empty((heads, tokens, 4 + dim), np.uint8)
    out[:, :, :4] = raw[None, :, :4]
    out[:, :, 4:] = raw[:, 4:].reshape(tokens, heads, dim).transpose(1, 0, 2)
    return out.tobytes()


def kv_prefix_info(r, ns):
    flat = r.execute_command("KV.PREFIX.INFO", ns)
    return {flat[i].decode(): flat[i + 1] for i in range(0, len(flat), 2)}


def same_replies(r, sid_a, sid_b, layer, hq, hkv, n, d, rng, exact=True):
    """Runs the same dense (M>1), top_k and sparse-auto queries on two slots: bytes equal
    (exact), or equal to 1e-5 where the slots' storage types differ in the GPU kernels' tiling
    (a bf16 slot against the fp32 blob store of the same values)."""
    q = rnd(rng, hq, 3, d, scale=2.0)
    q1 = q[:, :1]
    hm = contiguous_map(hq, hkv)
    cmds = [("ATTEND.PREFIX.QUERY", layer, hq, d, 0, f32(q)),
            ("ATTEND.PREFIX.QUERY", layer, hq, d, 4, f32(q1), 9, "QPOS", n - 3),
            ("ATTEND.PREFIX.QUERY_SPARSE_AUTO", layer, hq, d, 8, 1, hkv, f32(q1), i32(hm))]
    outs = []
    for c in cmds:
        a = r.execute_command(c[0], sid_a, *c[1:])
        b = r.execute_command(c[0], sid_b, *c[1:])
        if exact:
            assert a == b, "%s differs between %s and %s" % (c[0], sid_a, sid_b)
        else:
            np.testing.assert_allclose(np.frombuffer(a, "<f4"), np.frombuffer(b, "<f4"),
                                       rtol=1e-5, atol=1e-5, err_msg=c[0])
        outs.append(a)
    return q, outs


@pytest.mark.parametrize("fmt", ["fp32", "fp16", "bf16", "int8", "fp8", "fp8_e5m2"])
def test_store_from_namespace_equals_blob_store(shared_pion, fmt):
    r = shared_pion.client()
    rng = np.random.default_rng(
        {"fp32": 1, "fp16": 2, "bf16": 3, "int8": 4, "fp8": 5, "fp8_e5m2": 6}[fmt])
    L, T, H, D = 3, 40, 2, 64
    ns = "nsfrom_" + fmt
    rows = register_fill(r, ns, L, T, H, D, fmt, rng, "MODEL", "m1", "POSITION", "rope:1")
    for l in range(L):
        # With and without the identity options.
        extra = ["MODEL", "m1"] if l == 0 else (["MODEL", "m1", "POSITION", "rope:1"]
                                                 if l == 1 else [])
        assert r.execute_command("ATTEND.PREFIX.STORE", "from_" + fmt, l, "FROM", ns,
                                 *extra) == b"OK"
        k = decoded_layer(r, ns, "pk", l, T, H, D)
        v = decoded_layer(r, ns, "pv", l, T, H, D)
        written_k = rows[(l, "pk")].reshape(T, H, D).transpose(1, 0, 2)
        if fmt == "fp32":
            assert np.array_equal(k, written_k)
        elif fmt == "fp16":
            assert np.array_equal(k, written_k.astype(np.float16).astype(np.float32))
        if fmt == "fp8":  # the namespace's own bytes, as an fp8 blob STORE
            blobs = [fp8_blob_of_layer(r, ns, part, l, T, H, D) for part in ("pk", "pv")]
            assert r.execute_command("ATTEND.PREFIX.STORE", "blob_" + fmt, l, H, T, D, *blobs,
                                     "DTYPE", "fp8") == b"OK"
        else:
            store(r, "blob_" + fmt, l, k, v)
        q, outs = same_replies(r, "from_" + fmt, "blob_" + fmt, l, 4, H, T, D, rng,
                               exact=fmt != "bf16" or ATTENTION_BACKEND != "cuda")
        # And the slot is the namespace's layer (not another layer, not untransposed).
        ref, ref_lse, _ = attend_ref(q, k, v, contiguous_map(4, H), np.arange(T, T + 3),
                                     np.arange(T), 0)
        got, lse = parse_out(outs[0], 4, 3, D, True)
        assert_close(got, ref)
        assert_lse(lse, ref_lse)
    pub = kv_prefix_info(r, ns)["publication_generation"]
    assert pub >= 1
    slots = info_slots(r, "from_" + fmt)
    assert [s["layer"] for s in sorted(slots, key=lambda s: s["layer"])] == list(range(L))
    for s in slots:
        assert s["source"] == "%s@%d" % (ns, pub)
        assert (s["heads"], s["rows"], s["head_dim"]) == (H, T, D)
        # A bf16 namespace keeps its bf16 (exact, half the bytes), an fp8 one its e4m3 bytes
        # and a scale per row (D + 4 bytes a row); others (fp8_e5m2 too) decode to fp32.
        want = {"bf16": ("bf16", 2 * H * T * D * 2),
                "fp8": ("fp8", 2 * H * T * (D + 4))}.get(fmt, ("fp32", 2 * H * T * D * 4))
        assert (s["dtype"], s["bytes"]) == want
    assert all(s["source"] == "" for s in info_slots(r, "blob_" + fmt))


def test_store_from_is_a_snapshot(shared_pion):
    """The slot is a converted copy: publishing the namespace anew afterwards (DROP, REGISTER, new
    rows: a published namespace itself never changes) does not change it; a new STORE ... FROM
    picks up the new rows (and the new publication)."""
    r = shared_pion.client()
    rng = np.random.default_rng(12)
    T, H, D = 24, 2, 32
    register_fill(r, "snap", 1, T, H, D, "fp32", rng)
    assert r.execute_command("ATTEND.PREFIX.STORE", "snaps", 0, "FROM", "snap") == b"OK"
    k1 = decoded_layer(r, "snap", "pk", 0, T, H, D)
    v1 = decoded_layer(r, "snap", "pv", 0, T, H, D)
    [s1] = info_slots(r, "snaps")
    assert r.execute_command("KV.PREFIX.DROP", "snap") == 1
    register_fill(r, "snap", 1, T, H, D, "fp32", rng)
    k2 = decoded_layer(r, "snap", "pk", 0, T, H, D)
    v2 = decoded_layer(r, "snap", "pv", 0, T, H, D)
    q = rnd(rng, 2, 1, D)
    for kk, vv in ((k1, v1), (k2, v2)):
        out = r.execute_command("ATTEND.PREFIX.QUERY", "snaps", 0, 2, D, 0, f32(q))
        ref, _, _ = attend_ref(q, kk, vv, [0, 1], [T], np.arange(T), 0)
        assert_close(parse_out(out, 2, 1, D, False)[0], ref)
        assert r.execute_command("ATTEND.PREFIX.STORE", "snaps", 0, "FROM", "snap") == b"OK"
    [s2] = info_slots(r, "snaps")
    assert s2["generation"] > s1["generation"]
    pub = kv_prefix_info(r, "snap")["publication_generation"]
    assert s2["source"] == "snap@%d" % pub


def test_store_from_warms_a_saved_namespace_and_refuses_a_corrupt_one(pion_factory):
    """After a restart a saved namespace is known but not resident: STORE ... FROM warms it from
    disk. A disk copy that fails its checksum is never bound (-CORRUPT, slot MISS)."""
    srv = pion_factory("-w", "2")
    r = srv.client()
    rng = np.random.default_rng(13)
    T, H, D = 40, 2, 32
    register_fill(r, "dsk", 2, T, H, D, "fp16", rng, "MODEL", "m")
    register_fill(r, "bad", 1, T, H, D, "fp16", rng)
    want = [(decoded_layer(r, "dsk", "pk", l, T, H, D), decoded_layer(r, "dsk", "pv", l, T, H, D))
            for l in range(2)]
    assert r.execute_command("KV.PREFIX.SAVE", "dsk") == b"OK"
    assert r.execute_command("KV.PREFIX.SAVE", "bad") == b"OK"
    before = set((srv.data_dir / "prefixes").glob("*.pobj"))
    assert len(before) == 2
    srv.stop()
    srv.start()
    r = srv.client()
    assert kv_prefix_info(r, "dsk")["resident"] == 0
    assert r.execute_command("ATTEND.PREFIX.STORE", "ds", 1, "FROM", "dsk", "MODEL", "m") == b"OK"
    q = rnd(rng, 2, 2, D)
    out = r.execute_command("ATTEND.PREFIX.QUERY", "ds", 1, 2, D, 0, f32(q))
    ref, _, _ = attend_ref(q, *want[1], [0, 1], [T, T + 1], np.arange(T), 0)
    assert_close(parse_out(out, 2, 2, D, True)[0], ref)
    assert kv_prefix_info(r, "dsk")["resident"] == 1
    srv.stop()
    # The file name carries the namespace name hex-encoded (as of this writing).
    (bad_file,) = [f for f in before if b"\0bad".hex() in f.name]
    blob = bytearray(bad_file.read_bytes())
    blob[len(blob) // 2] ^= 0xFF
    bad_file.write_bytes(bytes(blob))
    srv.start()
    e = err(srv, "ATTEND.PREFIX.STORE", "bs", 0, "FROM", "bad")
    assert e.startswith("CORRUPT ") and "checksum" in e, e
    r = srv.client()
    assert r.execute_command("ATTEND.PREFIX.LOOKUP", "bs", 0) == b"MISS"
    assert r.ping()


def test_store_from_errors(shared_pion):
    r = shared_pion.client()
    rng = np.random.default_rng(9)
    register_fill(r, "fe", 2, 20, 2, 32, "fp32", rng, "MODEL", "m1", "POSITION", "rope:1")
    register_fill(r, "fe_half", 2, 20, 2, 32, "fp32", rng, skip=("pv", 0, 7))
    register_fill(r, "fe_80", 1, 20, 2, 80, "fp32", rng)
    assert err(shared_pion, "ATTEND.PREFIX.STORE", "fs", 0, "FROM", "nope") == \
        "ERR no such prefix namespace 'nope'"
    e = err(shared_pion, "ATTEND.PREFIX.STORE", "fs", 0, "FROM", "fe_half")
    assert e.startswith("ERR namespace 'fe_half' is not complete (") and \
        e.endswith("a half-written prefix is never bound"), e
    # The namespace as a whole is incomplete, so even its complete layer is never bound.
    e = err(shared_pion, "ATTEND.PREFIX.STORE", "fs", 1, "FROM", "fe_half")
    assert e.startswith("ERR namespace 'fe_half' is not complete ("), e
    assert err(shared_pion, "ATTEND.PREFIX.STORE", "fs", 2, "FROM", "fe") == \
        "ERR layer 2 is out of range: namespace 'fe' has 2 layers"
    e = err(shared_pion, "ATTEND.PREFIX.STORE", "fs", 0, "FROM", "fe", "MODEL", "m2")
    assert e.startswith("MISMATCH namespace 'fe' holds model 'm1'") and "not model 'm2'" in e, e
    e = err(shared_pion, "ATTEND.PREFIX.STORE", "fs", 0, "FROM", "fe", "MODEL", "m1",
            "POSITION", "rope:2")
    assert e.startswith("MISMATCH namespace 'fe' holds model 'm1'") and "rope:2" in e, e
    assert err(shared_pion, "ATTEND.PREFIX.STORE", "fs", 0, "FROM", "fe", "COLOR", "red") == \
        "ERR unknown option 'COLOR'; expected MODEL or POSITION"
    e = err(shared_pion, "ATTEND.PREFIX.STORE", "fs", 0, "FROM", "fe_80")
    assert e.startswith("ERR namespace 'fe_80' has head_dim 80; attention needs one of"), e
    e = err(shared_pion, "ATTEND.PREFIX.STORE", "fs", "x", "FROM", "fe")
    assert e == "ERR layer must be a non-negative integer, got 'x'"
    for l in range(3):
        assert r.execute_command("ATTEND.PREFIX.LOOKUP", "fs", l) == b"MISS"
    assert r.execute_command("ATTEND.PREFIX.INFO", "fs") == []
    # The good ones still work afterwards.
    assert r.execute_command("ATTEND.PREFIX.STORE", "fs", 1, "FROM", "fe", "MODEL", "m1") == b"OK"
    assert r.execute_command("ATTEND.PREFIX.LOOKUP", "fs", 1) == b"HIT"


def test_store_from_across_shards(pion_factory):
    srv = pion_factory("-w", "4")
    r = srv.client()
    rng = np.random.default_rng(44)
    L, T, H, D = 2, 24, 2, 32
    pairs, cross = [], 0
    for i in range(8):
        ns, sid = "wns%d" % i, "wsid%d" % (i * 7 + 3)
        # KV.PREFIX.OWNER routes by its key like every keyed command: it names a key's shard.
        o_ns = r.execute_command("KV.PREFIX.OWNER", ns)
        o_sid = r.execute_command("KV.PREFIX.OWNER", sid)
        cross += o_ns != o_sid
        pairs.append((ns, sid))
    assert cross >= 2, "names must spread over shards"
    for ns, sid in pairs:
        register_fill(r, ns, L, T, H, D, "fp32", rng)
        for l in range(L):
            assert r.execute_command("ATTEND.PREFIX.STORE", sid, l, "FROM", ns) == b"OK"
            k = decoded_layer(r, ns, "pk", l, T, H, D)
            v = decoded_layer(r, ns, "pv", l, T, H, D)
            q = rnd(rng, 4, 2, D)
            out = r.execute_command("ATTEND.PREFIX.QUERY", sid, l, 4, D, 0, f32(q))
            ref, _, _ = attend_ref(q, k, v, [0, 0, 1, 1], [T, T + 1], np.arange(T), 0)
            assert_close(parse_out(out, 4, 2, D, True)[0], ref)
        pub = kv_prefix_info(r, ns)["publication_generation"]
        assert {s["source"] for s in info_slots(r, sid)} == {"%s@%d" % (ns, pub)}


# ------------------------------------------------------------------------------------------
# 4. Malformed input
# ------------------------------------------------------------------------------------------

E_H, E_N, E_D = 2, 16, 32  # the slot 'e' layer 0


@pytest.fixture(scope="module")
def err_slot(shared_pion):
    r = shared_pion.client()
    rng = np.random.default_rng(77)
    k, v = rnd(rng, E_H, E_N, E_D), rnd(rng, E_H, E_N, E_D)
    store(r, "e", 0, k, v)
    return k, v


Z = bytes
Q2 = Z(2 * E_D * 4)      # H=2, M=1
Q4 = Z(4 * E_D * 4)      # H=4, M=1
Q4M2 = Z(4 * 2 * E_D * 4)
KS4 = Z(2 * 4 * E_D * 4)  # H_kv=2, S_suf=4
KS3 = Z(2 * 3 * E_D * 4)
HM = i32([0, 1, 0, 1])
IDX = i32(np.arange(16).reshape(2, 8))
CNT = i32([8, 8])
STORE_K = Z(E_H * E_N * E_D * 4)
STORE_F8 = Z(E_H * E_N * (E_D + 4))  # fp8 rows: scale 0, values 0
F8_NAN = bytearray(STORE_F8)
F8_NAN[5 * (E_D + 4):5 * (E_D + 4) + 4] = np.float32(np.nan).tobytes()  # head 0 row 5
F8_NEG = bytearray(STORE_F8)
F8_NEG[(E_N + 2) * (E_D + 4):(E_N + 2) * (E_D + 4) + 4] = np.float32(-1.5).tobytes()  # h1 r2
F8_INF = bytearray(STORE_F8)
F8_INF[0:4] = np.float32(np.inf).tobytes()

BAD = [
    # STORE ... DTYPE
    (("ATTEND.PREFIX.STORE", "s", 0, 2, 16, 32, STORE_F8[:-1], STORE_F8, "DTYPE", "fp8"),
     "=ERR K_blob must be H*N*(D+4) (H=2 N=16 D=32), rows of [f32 scale][D e4m3] = 1152 bytes, "
     "got 1151"),
    (("ATTEND.PREFIX.STORE", "s", 0, 2, 16, 32, STORE_F8, STORE_K, "DTYPE", "fp8"),
     "=ERR V_blob must be H*N*(D+4) (H=2 N=16 D=32), rows of [f32 scale][D e4m3] = 1152 bytes, "
     "got 4096"),
    (("ATTEND.PREFIX.STORE", "s", 0, 2, 16, 32, STORE_K, STORE_K, "DTYPE", "fp8"),
     "=ERR K_blob must be H*N*(D+4) (H=2 N=16 D=32), rows of [f32 scale][D e4m3] = 1152 bytes, "
     "got 4096"),
    (("ATTEND.PREFIX.STORE", "s", 0, 2, 16, 32, STORE_K, STORE_K, "DTYPE", "fp16"),
     "=ERR K_blob must be H*N*D*2 (H=2 N=16 D=32) = 2048 bytes, got 4096"),
    (("ATTEND.PREFIX.STORE", "s", 0, 2, 16, 32, STORE_K, STORE_K, "DTYPE", "fp4"),
     "=ERR DTYPE must be one of fp32, fp16, bf16, fp8, got 'fp4'"),
    (("ATTEND.PREFIX.STORE", "s", 0, 2, 16, 32, STORE_K, STORE_K, "TYPE", "fp8"),
     "=ERR unknown option 'TYPE'; expected DTYPE"),
    (("ATTEND.PREFIX.STORE", "s", 0, 2, 16, 32, STORE_K, STORE_K, "DTYPE"),
     "^ERR wrong number of arguments for 'attend.prefix.store'"),
    (("ATTEND.PREFIX.STORE", "s", 0, 2, 16, 32, bytes(F8_NAN), STORE_F8, "DTYPE", "fp8"),
     "=ERR K_blob row 5 (head 0 row 5) has scale nan; fp8 row scales must be finite and >= 0"),
    (("ATTEND.PREFIX.STORE", "s", 0, 2, 16, 32, STORE_F8, bytes(F8_NEG), "DTYPE", "fp8"),
     "=ERR V_blob row 18 (head 1 row 2) has scale -1.500000; fp8 row scales must be finite and "
     ">= 0"),
    (("ATTEND.PREFIX.STORE", "s", 0, 2, 16, 32, bytes(F8_INF), STORE_F8, "DTYPE", "fp8"),
     "=ERR K_blob row 0 (head 0 row 0) has scale inf; fp8 row scales must be finite and >= 0"),
    # STORE
    (("ATTEND.PREFIX.STORE", "s", 0, "x", 16, 32, STORE_K, STORE_K),
     "=ERR H must be an integer in [1, 1024], got 'x'"),
    (("ATTEND.PREFIX.STORE", "s", 0, 0, 16, 32, STORE_K, STORE_K),
     "=ERR H must be an integer in [1, 1024], got '0'"),
    (("ATTEND.PREFIX.STORE", "s", 0, 1025, 16, 32, STORE_K, STORE_K),
     "=ERR H must be an integer in [1, 1024], got '1025'"),
    (("ATTEND.PREFIX.STORE", "s", 0, 2, "x", 32, STORE_K, STORE_K),
     "^ERR N must be an integer in [|got 'x'"),
    (("ATTEND.PREFIX.STORE", "s", 0, 2, 2 ** 26 + 1, 32, STORE_K, STORE_K),
     "^ERR N must be an integer in [|got '67108865'"),
    (("ATTEND.PREFIX.STORE", "s", 0, 2, 16, 100, STORE_K, STORE_K),
     "=ERR D must be one of 32, 64, 96, 128, 160, 192, 256, 512, got '100'"),
    (("ATTEND.PREFIX.STORE", "s", 0, 2, 16, "x", STORE_K, STORE_K),
     "=ERR D must be one of 32, 64, 96, 128, 160, 192, 256, 512, got 'x'"),
    (("ATTEND.PREFIX.STORE", "s", 0, 2, 16, 32, STORE_K[:-4], STORE_K),
     "=ERR K_blob must be H*N*D*4 (H=2 N=16 D=32) = 4096 bytes, got 4092"),
    (("ATTEND.PREFIX.STORE", "s", 0, 2, 16, 32, STORE_K, STORE_K + Z(4)),
     "=ERR V_blob must be H*N*D*4 (H=2 N=16 D=32) = 4096 bytes, got 4100"),
    (("ATTEND.PREFIX.STORE", "s", "x", 2, 16, 32, STORE_K, STORE_K),
     "=ERR layer must be a non-negative integer, got 'x'"),
    (("ATTEND.PREFIX.STORE", "s", -1, 2, 16, 32, STORE_K, STORE_K),
     "=ERR layer must be a non-negative integer, got '-1'"),
    (("ATTEND.PREFIX.STORE", "s", 0, 2, 16, 32, STORE_K),
     "^ERR wrong number of arguments for 'attend.prefix.store'"),
    (("ATTEND.PREFIX.STORE", "s", 0, "FROM"),
     "^ERR wrong number of arguments for 'attend.prefix.store'"),
    (("ATTEND.PREFIX.STORE", "s", 0, "FROM", "fe", "MODEL"), "=ERR option 'MODEL' needs a value"),
    # LOOKUP
    (("ATTEND.PREFIX.LOOKUP", "e", "x"), "^ERR layer "),
    # QUERY
    (("ATTEND.PREFIX.QUERY", "e", 0, 2, 64, 0, Z(512)),
     "=ERR D 64 does not match the slot's head_dim 32"),
    (("ATTEND.PREFIX.QUERY", "e", 0, 3, 32, 0, Z(384)),
     "=ERR H 3 is not a multiple of the slot's 2 K/V heads (contiguous GQA grouping)"),
    (("ATTEND.PREFIX.QUERY", "e", 0, 2, 32, 0, Z(255)),
     "=ERR Q_blob must be H*M*D*4 bytes (H=2 D=32), a non-zero multiple of 256, got 255"),
    (("ATTEND.PREFIX.QUERY", "e", 0, 2, 32, 0, Z(0)),
     "=ERR Q_blob must be H*M*D*4 bytes (H=2 D=32), a non-zero multiple of 256, got 0"),
    (("ATTEND.PREFIX.QUERY", "e", 0, 2, 32, "x", Q2),
     "=ERR top_k must be a non-negative integer, got 'x'"),
    (("ATTEND.PREFIX.QUERY", "e", 0, 2, 32, -1, Q2),
     "=ERR top_k must be a non-negative integer, got '-1'"),
    (("ATTEND.PREFIX.QUERY", "e", 0, 2, 32, 0, Q2, -1),
     "=ERR fa_window must be >= 0 (0 = no window), got -1"),
    (("ATTEND.PREFIX.QUERY", "e", 0, 2, 32, 0, Q2, "QPOS", "x"),
     "=ERR QPOS must be an integer in [0, 2^62], got 'x'"),
    (("ATTEND.PREFIX.QUERY", "e", 0, 2, 32, 0, Q2, 4, "QPOS", "-3"),
     "=ERR QPOS must be an integer in [0, 2^62], got '-3'"),
    (("ATTEND.PREFIX.QUERY", "e", 0, 2, 32, 0, Q2, 4, "BOGUS"),
     "=ERR unexpected argument 'BOGUS'; expected [<fa_window>] then any of QPOS, RECEIPT, "
     "AUDIT, DEADLINE <ms>, ALLOW APPROX"),
    (("ATTEND.PREFIX.QUERY", "e", 0, 2, 32, 0, Q2, "RECEIPT", 4),
     "^ERR unexpected argument '4'"),
    (("ATTEND.PREFIX.QUERY", "e", 0, 2, 32, 0, Q2, "SELECT", "mean"),
     "^ERR unexpected argument 'SELECT'"),
    (("ATTEND.PREFIX.QUERY", "e", 0, 2, 32, 0, Q2, "SHARED"),
     "^ERR unexpected argument 'SHARED'"),
    (("ATTEND.PREFIX.QUERY", "nosuch", 3, 2, 32, 0, Q2),
     "=MISS no attention slot for session 'nosuch' layer 3 (never stored, or dropped);"
     " ATTEND.PREFIX.STORE it"),
    (("ATTEND.PREFIX.QUERY", "e", 7, 2, 32, 0, Q2),
     "=MISS no attention slot for session 'e' layer 7 (never stored, or dropped);"
     " ATTEND.PREFIX.STORE it"),
    (("ATTEND.PREFIX.QUERY", "e", "x", 2, 32, 0, Q2),
     "=ERR layer must be a non-negative integer, got 'x'"),
    # QUERY_FUSED (H_q=4, S_suf=4, H_kv=2, M=1 or 2)
    (("ATTEND.PREFIX.QUERY_FUSED", "e", 0, 4, 32, 4, 4, Q4, Z(4 * 4 * 32 * 4),
      Z(4 * 4 * 32 * 4), HM), "=ERR H_kv 4 does not match the slot's 2 K/V heads"),
    (("ATTEND.PREFIX.QUERY_FUSED", "e", 0, 4, 32, 4, 2, Q4, KS4[:-4], KS4, HM),
     "=ERR K_suf must be H_kv*S_suf*D*4 (H_kv=2 S_suf=4 D=32) = 1024 bytes, got 1020"),
    (("ATTEND.PREFIX.QUERY_FUSED", "e", 0, 4, 32, 4, 2, Q4, KS4, KS4 + Z(4), HM),
     "=ERR V_suf must be H_kv*S_suf*D*4 (H_kv=2 S_suf=4 D=32) = 1024 bytes, got 1028"),
    (("ATTEND.PREFIX.QUERY_FUSED", "e", 0, 4, 32, 4, 2, Q4, KS4, KS4, HM[:12]),
     "=ERR head_map must be H_q*4 (H_q=4) = 16 bytes, got 12"),
    (("ATTEND.PREFIX.QUERY_FUSED", "e", 0, 4, 32, 4, 2, Q4, KS4, KS4, i32([0, 1, 0, 2])),
     "=ERR head_map[3] = 2 is not a K/V head in [0, 2)"),
    (("ATTEND.PREFIX.QUERY_FUSED", "e", 0, 4, 32, 4, 2, Q4, KS4, KS4, i32([0, -1, 0, 1])),
     "=ERR head_map[1] = -1 is not a K/V head in [0, 2)"),
    (("ATTEND.PREFIX.QUERY_FUSED", "e", 0, 4, 32, 1, 2, Q4M2, Z(2 * 32 * 4), Z(2 * 32 * 4),
      HM), "=ERR M 2 (from Q_blob) exceeds S_suf 1: the queries are the last M suffix positions"),
    (("ATTEND.PREFIX.QUERY_FUSED", "e", 0, 4, 64, 4, 2, Z(4 * 64 * 4), Z(2 * 4 * 64 * 4),
      Z(2 * 4 * 64 * 4), HM), "=ERR D 64 does not match the slot's head_dim 32"),
    (("ATTEND.PREFIX.QUERY_FUSED", "e", 0, 4, 32, 4, 2, Z(1000), KS4, KS4, HM),
     "^ERR Q_blob must be |got 1000"),
    (("ATTEND.PREFIX.QUERY_FUSED", "e", 0, 4, 32, 4, 2, Q4, KS4, KS4, HM, -1),
     "=ERR fa_window must be >= 0 (0 = no window), got -1"),
    (("ATTEND.PREFIX.QUERY_FUSED", "e", 0, 4, 32, 4, 2, Q4, KS4, KS4, HM, 0, "QPOS", 3),
     "^ERR unexpected argument 'QPOS'"),
    (("ATTEND.PREFIX.QUERY_FUSED", "e", 9, 4, 32, 4, 2, Q4, KS4, KS4, HM),
     "^MISS no attention slot for session 'e' layer 9 "),
    # QUERY_SPARSE (H=2, K_sparse_max=8)
    (("ATTEND.PREFIX.QUERY_SPARSE", "e", 0, 2, 32, 8, Z(512), IDX, CNT),
     "=ERR Q_blob must be H*D*4 (H=2 D=32) = 256 bytes, got 512"),
    (("ATTEND.PREFIX.QUERY_SPARSE", "e", 0, 2, 32, 8, Q2, IDX[:-4], CNT),
     "^ERR indices must be H*K_sparse_max*4 (|= 64 bytes, got 60"),
    (("ATTEND.PREFIX.QUERY_SPARSE", "e", 0, 2, 32, 8, Q2, IDX, CNT[:4]),
     "^ERR counts must be H*4 (|= 8 bytes, got 4"),
    (("ATTEND.PREFIX.QUERY_SPARSE", "e", 0, 2, 32, 8, Q2, IDX, i32([2, 9])),
     "=ERR counts[1] = 9 is not in [0, K_sparse_max=8]"),
    (("ATTEND.PREFIX.QUERY_SPARSE", "e", 0, 2, 32, 8, Q2, IDX, i32([-1, 0])),
     "=ERR counts[0] = -1 is not in [0, K_sparse_max=8]"),
    (("ATTEND.PREFIX.QUERY_SPARSE", "e", 0, 2, 32, 8, Q2,
      i32([[0, 1, 2, 3, 4, 5, 6, 7], [0, 1, 2, 3, 16, 5, 6, 7]]), CNT),
     "=ERR indices[1][4] = 16 is out of range [0, N=16)"),
    (("ATTEND.PREFIX.QUERY_SPARSE", "e", 0, 2, 32, 8, Q2,
      i32([[-1, 1, 2, 3, 4, 5, 6, 7], [0, 1, 2, 3, 4, 5, 6, 7]]), CNT),
     "=ERR indices[0][0] = -1 is out of range [0, N=16)"),
    (("ATTEND.PREFIX.QUERY_SPARSE", "e", 0, 2, 32, 8, Q2,
      i32([[0, 1, 2, 3, 4, 5, 6, 7], [7, 0, 1, 2, 7, 9, 9, 9]]), i32([8, 5])),
     "=ERR indices[1][4] = 7 repeats an earlier index of head 1"),
    (("ATTEND.PREFIX.QUERY_SPARSE", "e", 0, 4, 32, 8, Q2, IDX, CNT),
     "^ERR Q_blob must be H*D*4 (H=4 D=32) = 512 bytes, got 256"),
    (("ATTEND.PREFIX.QUERY_SPARSE", "e", 0, 2, 32, 8, Q2, IDX, CNT, -2),
     "=ERR fa_window must be >= 0 (0 = no window), got -2"),
    (("ATTEND.PREFIX.QUERY_SPARSE", "e", 0, 2, 32, 8, Q2, IDX, CNT, 0, "NOPE"),
     "^ERR unexpected argument 'NOPE'"),
    # QUERY_SPARSE_AUTO (H_q=4, B=4, K_top=1, H_kv=2)
    (("ATTEND.PREFIX.QUERY_SPARSE_AUTO", "e", 0, 4, 32, 0, 1, 2, Q4, HM),
     "=ERR B must be an integer in [1, 1048576], got '0'"),
    (("ATTEND.PREFIX.QUERY_SPARSE_AUTO", "e", 0, 4, 32, "x", 1, 2, Q4, HM),
     "=ERR B must be an integer in [1, 1048576], got 'x'"),
    (("ATTEND.PREFIX.QUERY_SPARSE_AUTO", "e", 0, 4, 32, 1048577, 1, 2, Q4, HM),
     "=ERR B must be an integer in [1, 1048576], got '1048577'"),
    (("ATTEND.PREFIX.QUERY_SPARSE_AUTO", "e", 0, 4, 32, 4, "x", 2, Q4, HM),
     "=ERR K_top must be a non-negative integer, got 'x'"),
    (("ATTEND.PREFIX.QUERY_SPARSE_AUTO", "e", 0, 4, 32, 4, -1, 2, Q4, HM),
     "=ERR K_top must be a non-negative integer, got '-1'"),
    (("ATTEND.PREFIX.QUERY_SPARSE_AUTO", "e", 0, 4, 32, 4, 1, 2, Q4, HM, "SELECT", "max"),
     "=ERR SELECT must be mean or quest, got 'max'"),
    (("ATTEND.PREFIX.QUERY_SPARSE_AUTO", "e", 0, 4, 32, 4, 1, 1, Q4, i32([0, 0, 0, 0])),
     "=ERR H_kv 1 does not match the slot's 2 K/V heads"),
    (("ATTEND.PREFIX.QUERY_SPARSE_AUTO", "e", 0, 4, 32, 4, 1, 2, Q4, i32([0, 1, 5, 0])),
     "=ERR head_map[2] = 5 is not a K/V head in [0, 2)"),
    (("ATTEND.PREFIX.QUERY_SPARSE_AUTO", "e", 0, 4, 32, 4, 1, 2, Q4, HM + Z(4)),
     "=ERR head_map must be H_q*4 (H_q=4) = 16 bytes, got 20"),
    (("ATTEND.PREFIX.QUERY_SPARSE_AUTO", "e", 0, 4, 32, 4, 1, 2, Q4M2, HM),
     "^ERR Q_blob must be |got 1024"),
    (("ATTEND.PREFIX.QUERY_SPARSE_AUTO", "e", 0, 4, 32, 4, 1, 2, Q4, HM, "QPOS", "x"),
     "=ERR QPOS must be an integer in [0, 2^62], got 'x'"),
    (("ATTEND.PREFIX.QUERY_SPARSE_AUTO", "e", 0, 4, 32, 4, 1, 2, Q4, HM, -5),
     "=ERR fa_window must be >= 0 (0 = no window), got -5"),
    (("ATTEND.PREFIX.QUERY_SPARSE_AUTO", "e", 0, 4, 32, 4, 1, 2, Q4, HM, "RECEIPT", "EXTRA"),
     "^ERR unexpected argument 'EXTRA'"),
    (("ATTEND.PREFIX.QUERY_SPARSE_AUTO", "e", 0, 4, 64, 4, 1, 2, Z(4 * 64 * 4), HM),
     "=ERR D 64 does not match the slot's head_dim 32"),
    # QUERY_SPARSE_AUTO_FUSED (H_q=4, B=4, K_top=1, H_kv=2, S_suf=3)
    (("ATTEND.PREFIX.QUERY_SPARSE_AUTO_FUSED", "e", 0, 4, 32, 4, 1, 2, 3, Q4, KS3[:-4], KS3,
      HM), "=ERR K_suf must be H_kv*S_suf*D*4 (H_kv=2 S_suf=3 D=32) = 768 bytes, got 764"),
    (("ATTEND.PREFIX.QUERY_SPARSE_AUTO_FUSED", "e", 0, 4, 32, 4, 1, 2, 3, Q4, KS3, Z(4), HM),
     "=ERR V_suf must be H_kv*S_suf*D*4 (H_kv=2 S_suf=3 D=32) = 768 bytes, got 4"),
    (("ATTEND.PREFIX.QUERY_SPARSE_AUTO_FUSED", "e", 0, 4, 32, 0, 1, 2, 3, Q4, KS3, KS3, HM),
     "=ERR B must be an integer in [1, 1048576], got '0'"),
    (("ATTEND.PREFIX.QUERY_SPARSE_AUTO_FUSED", "e", 0, 4, 32, 4, 1, 2, 3, Q4, KS3, KS3, HM,
      "SELECT", "x"), "=ERR SELECT must be mean or quest, got 'x'"),
    (("ATTEND.PREFIX.QUERY_SPARSE_AUTO_FUSED", "e", 0, 4, 32, 4, 1, 2, 3, Q4, KS3, KS3, HM,
      "QPOS", 5), "^ERR unexpected argument 'QPOS'"),
    (("ATTEND.PREFIX.QUERY_SPARSE_AUTO_FUSED", "e", 0, 4, 32, 4, 1, 2, 3, Q4, KS3, KS3,
      i32([0, 0, 2, 0])), "=ERR head_map[2] = 2 is not a K/V head in [0, 2)"),
    (("ATTEND.PREFIX.QUERY_SPARSE_AUTO_FUSED", "e", 0, 4, 32, 4, 1, 4, 3, Q4,
      Z(4 * 3 * 32 * 4), Z(4 * 3 * 32 * 4), HM),
     "=ERR H_kv 4 does not match the slot's 2 K/V heads"),
    (("ATTEND.PREFIX.QUERY_SPARSE_AUTO_FUSED", "nope", 0, 4, 32, 4, 1, 2, 3, Q4, KS3, KS3, HM),
     "^MISS no attention slot for session 'nope' layer 0 "),
]


@pytest.mark.parametrize("cmd,want", BAD, ids=[str(i) for i in range(len(BAD))])
def test_bad_input(shared_pion, err_slot, cmd, want):
    got = err(shared_pion, *cmd)
    if want[0] == "=":
        assert got == want[1:]
    else:  # '^' prefix [| fragment ...]
        first, *frags = want[1:].split("|")
        assert got.startswith(first), got
        for f in frags:
            assert f in got, (f, got)


def test_after_bad_input_server_and_slots_are_fine(shared_pion, err_slot):
    k, v = err_slot
    r = shared_pion.client()
    assert r.ping()
    q = rnd(np.random.default_rng(1), 4, 2, E_D)
    out = r.execute_command("ATTEND.PREFIX.QUERY", "e", 0, 4, E_D, 0, f32(q))
    ref, ref_lse, _ = attend_ref(q, k, v, [0, 0, 1, 1], [E_N, E_N + 1], np.arange(E_N), 0)
    got, lse = parse_out(out, 4, 2, E_D, True)
    assert_close(got, ref)
    assert_lse(lse, ref_lse)
    # A failed STORE never touched a slot (the 's' stores above all failed).
    assert r.execute_command("ATTEND.PREFIX.LOOKUP", "s", 0) == b"MISS"


# ------------------------------------------------------------------------------------------
# 5. Slot lifecycle, LRU eviction, tenants
# ------------------------------------------------------------------------------------------

def test_lookup_drop_replace_info(shared_pion):
    r = shared_pion.client()
    rng = np.random.default_rng(5)
    assert r.execute_command("ATTEND.PREFIX.LOOKUP", "life", 0) == b"MISS"
    assert r.execute_command("ATTEND.PREFIX.INFO", "life") == []
    assert r.execute_command("ATTEND.PREFIX.DROP", "life") == 0
    kv = {}
    for layer in (0, 1, 5):
        kv[layer] = rnd(rng, 2, 20, 64), rnd(rng, 2, 20, 64)
        store(r, "life", layer, *kv[layer])
    for layer in range(7):
        assert r.execute_command("ATTEND.PREFIX.LOOKUP", "life", layer) == \
            (b"HIT" if layer in kv else b"MISS")
    slots = sorted(info_slots(r, "life"), key=lambda s: s["layer"])
    assert [s["layer"] for s in slots] == [0, 1, 5]
    for s in slots:
        assert s["heads"] == 2 and s["rows"] == 20 and s["head_dim"] == 64
        assert s["dtype"] == "fp32" and s["bytes"] == 2 * 2 * 20 * 64 * 4
        assert s["source"] == "" and s["backend"] == ATTENTION_BACKEND and s["generation"] >= 1
    gen1 = slots[1]["generation"]

    # Replace layer 1 with another shape: the query uses the new one.
    k, v = rnd(rng, 1, 33, 128), rnd(rng, 1, 33, 128)
    store(r, "life", 1, k, v)
    [s1] = [s for s in info_slots(r, "life") if s["layer"] == 1]
    assert (s1["heads"], s1["rows"], s1["head_dim"]) == (1, 33, 128)
    assert s1["bytes"] == 2 * 33 * 128 * 4 and s1["generation"] > gen1
    q = rnd(rng, 2, 1, 128)
    out, rc = split_reply(r.execute_command("ATTEND.PREFIX.QUERY", "life", 1, 2, 128, 0, f32(q),
                                            "RECEIPT"))
    ref, _, _ = attend_ref(q, k, v, [0, 0], [33], np.arange(33), 0)
    assert_close(parse_out(out, 2, 1, 128, False)[0], ref)
    assert rc["generation"] == s1["generation"] and rc["prefix_rows"] == 33
    e = err(shared_pion, "ATTEND.PREFIX.QUERY", "life", 1, 2, 64, 0, Z(2 * 64 * 4))
    assert e == "ERR D 64 does not match the slot's head_dim 128"

    assert r.execute_command("ATTEND.PREFIX.DROP", "life", 0) == 1
    assert r.execute_command("ATTEND.PREFIX.DROP", "life", 0) == 0
    assert r.execute_command("ATTEND.PREFIX.LOOKUP", "life", 0) == b"MISS"
    assert err(shared_pion, "ATTEND.PREFIX.QUERY", "life", 0, 2, 64, 0, Z(512)).startswith(
        "MISS no attention slot for session 'life' layer 0")
    assert r.execute_command("ATTEND.PREFIX.LOOKUP", "life", 5) == b"HIT"
    assert r.execute_command("ATTEND.PREFIX.DROP", "life") == 2
    assert r.execute_command("ATTEND.PREFIX.INFO", "life") == []
    assert r.execute_command("ATTEND.PREFIX.DROP", "life") == 0
    # Stored again after a drop: a fresh slot with a newer generation.
    store(r, "life", 0, *kv[0])
    [s0] = info_slots(r, "life")
    assert s0["generation"] > s1["generation"]


@HOST_SLOTS
def test_attention_memory_moves_lru_slots_to_disk_and_they_answer_bit_identically(
        pion_factory):
    """--attention-memory bounds the slots in host memory: the least recently used move to disk
    (nothing is evicted, every slot stays a HIT) and the next query brings them back, answering
    bit for bit what it answered before they left."""
    h, n, d = 1, 512, 64
    slot = 2 * h * n * d * 4  # 256 KiB
    srv = pion_factory("-w", "1", "--attention-memory", str(slot * 7 // 2))  # room for 3.5
    r = srv.client()
    rng = np.random.default_rng(6)
    kv = [(rnd(rng, h, n, d), rnd(rng, h, n, d)) for _ in range(5)]
    q = rnd(rng, 1, 1, d)
    first = {}
    for i in range(5):
        store(r, "lru%d" % i, 0, *kv[i])
        first[i] = r.execute_command("ATTEND.PREFIX.QUERY", "lru%d" % i, 0, 1, d, 0, f32(q))
        assert attn_info(srv)["attention_host_bytes"] <= slot * 7 // 2
    hits = [r.execute_command("ATTEND.PREFIX.LOOKUP", "lru%d" % i, 0) for i in range(5)]
    assert hits == [b"HIT"] * 5
    tiers = [info_slots(r, "lru%d" % i)[0]["tier"] for i in range(5)]
    assert tiers[:2] == ["disk", "disk"] and tiers[-1] == "host", tiers
    ai = attn_info(srv)
    assert ai["attention_slots"] == 5 and ai["attention_bytes"] == 5 * slot
    assert ai["attention_memory_limit"] == slot * 7 // 2
    for i in range(5):
        out = r.execute_command("ATTEND.PREFIX.QUERY", "lru%d" % i, 0, 1, d, 0, f32(q))
        assert out == first[i], i  # the same bytes came back: the same answer, bit for bit
        ref, _, _ = attend_ref(q, *kv[i], [0], [n], np.arange(n), 0)
        assert_close(parse_out(out, 1, 1, d, False)[0], ref)
        assert attn_info(srv)["attention_host_bytes"] <= slot * 7 // 2
    res = srv.info("residency")
    assert int(res["residency_demotions_host_disk"]) >= 2
    assert int(res["residency_promotions_disk_host"]) >= 2
    assert err(srv, "ATTEND.PREFIX.QUERY", "nope", 0, 1, d, 0, f32(q)).startswith(
        "MISS no attention slot for session 'nope' layer 0")
    # Bigger than the whole limit: -OOM, and nothing is stored under that name.
    big = rnd(rng, 1, 8 * n, d)
    e = err(srv, "ATTEND.PREFIX.STORE", "huge", 0, 1, 8 * n, d, f32(big), f32(big))
    assert e.startswith("OOM attention write of %d bytes does not fit" % (16 * n * d * 4)), e
    assert r.execute_command("ATTEND.PREFIX.LOOKUP", "huge", 0) == b"MISS"
    assert r.ping()


@HOST_SLOTS
def test_maxmemory_moves_slots_to_disk_and_refuses_only_what_never_fits(pion_factory):
    srv = pion_factory("-w", "1", "--maxmemory", "2mb")
    r = srv.client()
    rng = np.random.default_rng(15)
    slot = 2 * 1024 * 64 * 4  # 512 KiB: four fit under 2 MiB
    kv = [(rnd(rng, 1, 1024, 64), rnd(rng, 1, 1024, 64)) for _ in range(6)]
    for i in range(6):
        store(r, "mm%d" % i, 0, *kv[i])
    assert [r.execute_command("ATTEND.PREFIX.LOOKUP", "mm%d" % i, 0) for i in range(6)] == \
        [b"HIT"] * 6
    assert int(srv.info("memory")["used_memory_attention"]) <= 4 * slot
    big = rnd(rng, 1, 8192, 64)
    e = err(srv, "ATTEND.PREFIX.STORE", "big", 0, 1, 8192, 64, f32(big), f32(big))
    assert e.startswith("OOM ") and "attention write of %d bytes" % (2 * 8192 * 64 * 4) in e, e
    assert r.execute_command("ATTEND.PREFIX.LOOKUP", "big", 0) == b"MISS"
    q = rnd(rng, 1, 1, 64)
    for i in range(6):
        out = r.execute_command("ATTEND.PREFIX.QUERY", "mm%d" % i, 0, 1, 64, 0, f32(q))
        ref, _, _ = attend_ref(q, *kv[i], [0], [1024], np.arange(1024), 0)
        assert_close(parse_out(out, 1, 1, 64, False)[0], ref)


def test_kvcache_off(pion_factory):
    srv = pion_factory("--kvcache=off")
    for cmd in (("ATTEND.PREFIX.LOOKUP", "a", 0), ("ATTEND.PREFIX.STORE", "a", 0, "FROM", "n"),
                ("ATTEND.PREFIX.QUERY", "a", 0, 1, 32, 0, Z(128))):
        assert err(srv, *cmd) == "ERR state cache not enabled (use --kvcache)"


def test_tenants_do_not_share_slots(pion_factory, tmp_path):
    users = tmp_path / "users.txt"
    users.write_text("alice apw teamA\nbob bpw teamB\n")
    srv = pion_factory("-w", "2", "--users", str(users))
    a = srv.client(username="alice", password="apw")
    b = srv.client(username="bob", password="bpw")
    rng = np.random.default_rng(8)
    ka, va, kb, vb = (rnd(rng, 2, 24, 32) for _ in range(4))
    q = rnd(rng, 2, 1, 32)
    store(a, "shared", 0, ka, va)
    assert b.execute_command("ATTEND.PREFIX.LOOKUP", "shared", 0) == b"MISS"
    assert b.execute_command("ATTEND.PREFIX.INFO", "shared") == []
    with pytest.raises(Exception, match="no attention slot for session 'shared' layer 0"):
        b.execute_command("ATTEND.PREFIX.QUERY", "shared", 0, 2, 32, 0, f32(q))
    assert b.execute_command("ATTEND.PREFIX.DROP", "shared") == 0
    store(b, "shared", 0, kb, vb)
    for c, (k, v) in ((a, (ka, va)), (b, (kb, vb))):
        out = c.execute_command("ATTEND.PREFIX.QUERY", "shared", 0, 2, 32, 0, f32(q))
        ref, _, _ = attend_ref(q, k, v, [0, 1], [24], np.arange(24), 0)
        assert_close(parse_out(out, 2, 1, 32, False)[0], ref)
    assert b.execute_command("ATTEND.PREFIX.DROP", "shared") == 1
    assert a.execute_command("ATTEND.PREFIX.LOOKUP", "shared", 0) == b"HIT"
    # STORE ... FROM sees only the caller's tenant's namespaces.
    register_fill(a, "tns", 1, 16, 2, 32, "fp32", rng)
    assert a.execute_command("ATTEND.PREFIX.STORE", "t", 0, "FROM", "tns") == b"OK"
    with pytest.raises(Exception, match="no such prefix namespace 'tns'"):
        b.execute_command("ATTEND.PREFIX.STORE", "t", 0, "FROM", "tns")


# ------------------------------------------------------------------------------------------
# 6. Concurrency
# ------------------------------------------------------------------------------------------

def test_replace_while_querying_is_never_a_mix(shared_pion):
    h, n, d = 2, 512, 64
    rng = np.random.default_rng(60)
    sets = [(rnd(rng, h, n, d), rnd(rng, h, n, d)) for _ in range(2)]
    q = rnd(rng, 4, 1, d, scale=2.0)
    hm = [0, 0, 1, 1]
    refs = [attend_ref(q, k, v, hm, [n], np.arange(n), 0)[0] for k, v in sets]
    mixes = [attend_ref(q, sets[0][0], sets[1][1], hm, [n], np.arange(n), 0)[0],
             attend_ref(q, sets[1][0], sets[0][1], hm, [n], np.arange(n), 0)[0]]
    for a in refs + mixes:  # every candidate is far from every other one
        for b in refs + mixes:
            assert a is b or rel_err(a, b) > 100 * TOL
    r = shared_pion.client()
    store(r, "race", 0, *sets[0])
    stop = threading.Event()
    errors, seen, stores = [], [0, 0], [0]

    def writer():
        w = shared_pion.client()
        i = 1
        while not stop.is_set():
            store(w, "race", 0, *sets[i % 2])
            stores[0] += 1
            i += 1

    def reader():
        c = shared_pion.client()
        while not stop.is_set():
            out = c.execute_command("ATTEND.PREFIX.QUERY", "race", 0, 4, d, 0, f32(q))
            got = parse_out(out, 4, 1, d, False)[0]
            match = [i for i in range(2) if rel_err(got, refs[i]) <= TOL]
            if len(match) != 1:
                errors.append(min(rel_err(got, x) for x in refs))
            else:
                seen[match[0]] += 1

    threads = [threading.Thread(target=writer), threading.Thread(target=reader),
               threading.Thread(target=reader)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 4.0
    time.sleep(1.0)
    while time.monotonic() < deadline and min(seen) < 5:
        time.sleep(0.05)
    stop.set()
    for t in threads:
        t.join(10)
    assert not errors, "replies matching neither set (min err): %r" % errors[:5]
    assert stores[0] >= 4 and min(seen) >= 1, (stores, seen)


def test_compute_queue_full_is_busy(pion_factory):
    srv = pion_factory("-w", "2", "--compute-threads", "1", "--compute-queue-depth", "1")
    r = srv.client()
    hq, hkv, n, d, m = 8, 1, 16384, 128, 16
    rng = np.random.default_rng(61)
    k, v = rnd(rng, hkv, n, d), rnd(rng, hkv, n, d)
    q = rnd(rng, hq, m, d)
    store(r, "busy", 0, k, v)
    ref, ref_lse, _ = attend_ref(q, k, v, [0] * hq, np.arange(n, n + m), np.arange(n), 0)
    qb = f32(q)
    t0 = time.monotonic()
    r.execute_command("ATTEND.PREFIX.QUERY", "busy", 0, hq, d, 0, qb)
    one = time.monotonic() - t0
    clients = 8
    barrier = threading.Barrier(clients)
    replies, errors = [], []

    def fire():
        try:
            with srv.raw(timeout=30) as c:
                barrier.wait(10)
                for _ in range(3):
                    replies.append(c.call("ATTEND.PREFIX.QUERY", "busy", 0, hq, d, 0, qb))
        except Exception as e:  # noqa: BLE001
            errors.append(repr(e))

    threads = [threading.Thread(target=fire) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors, errors
    busy = [x for x in replies if isinstance(x, RespError)]
    ok = [x for x in replies if not isinstance(x, RespError)]
    assert len(busy) + len(ok) == clients * 3
    assert busy, "no -BUSY with 8 clients, 1 thread, queue 1 (one query takes %.3f s)" % one
    for e in busy:
        assert str(e).startswith("BUSY the compute queue is full (") and \
            str(e).endswith("queries waiting); retry later"), str(e)
    assert ok, "every query was refused"
    for x in ok:
        got, lse = parse_out(x, hq, m, d, True)
        assert_close(got, ref)
        assert_lse(lse, ref_lse)
    assert r.ping()
    got, _ = parse_out(r.execute_command("ATTEND.PREFIX.QUERY", "busy", 0, hq, d, 0, qb),
                       hq, m, d, True)
    assert_close(got, ref)
    ai = attn_info(srv)
    assert ai["compute_rejected"] == len(busy), (ai, len(busy))
    assert ai["compute_threads"] == 1 and ai["compute_queue_depth"] == 1
    assert ai["attention_queries_dense"] == len(ok) + 2
    assert int(srv.info("stats")["rejected_busy"]) >= len(busy)


# ------------------------------------------------------------------------------------------
# 7. INFO attention
# ------------------------------------------------------------------------------------------

ATTN_FIELDS = ("attention_slots", "attention_bytes", "attention_queries_dense",
               "attention_exact", "attention_approximate", "attention_host_bytes",
               "compute_rejected")


def attn_info(srv) -> dict:
    """INFO attention with numeric values as ints (xfail when the section is not there)."""
    got = srv.info("attention")
    if not any(f in got for f in ATTN_FIELDS):
        pytest.xfail("INFO has no 'attention' section yet (got %r)" % sorted(got))
    return {k: (int(v) if v.lstrip("-").isdigit() else v) for k, v in got.items()}


def test_info_attention_section(pion_factory):
    srv = pion_factory("-w", "2", "--attention-memory", "64mb")
    r = srv.client()
    before = attn_info(srv)
    for f in ATTN_FIELDS + ("attention_stores", "attention_stores_from", "attention_promotions",
                            "attention_misses",
                            "attention_sessions", "attention_queries_topk",
                            "attention_queries_fused", "attention_queries_sparse",
                            "attention_queries_sparse_auto",
                            "attention_queries_sparse_auto_fused", "attention_rows_attended",
                            "compute_completed", "attention_memory_limit",
                            "attention_queries_inline"):
        assert f in before, (f, before)
    assert before["attention_slots"] == 0 and before["attention_bytes"] == 0
    assert before["attention_backend"] == ATTENTION_BACKEND and before["attention_dtype"] == "fp32"
    assert before["attention_memory_limit"] == 64 << 20
    rng = np.random.default_rng(70)
    h, n, d = 2, 40, 64
    k, v = rnd(rng, h, n, d), rnd(rng, h, n, d)
    store(r, "ia", 0, k, v)
    store(r, "ib", 3, k, v)
    slot = 2 * h * n * d * 4
    mid = attn_info(srv)
    assert mid["attention_slots"] == 2 and mid["attention_bytes"] == 2 * slot
    assert mid["attention_sessions"] == 2
    assert mid["attention_stores"] == before["attention_stores"] + 2
    q = rnd(rng, 4, 1, d)
    hm = i32([0, 0, 1, 1])
    ks = rnd(rng, h, 2, d)
    cmds = [("ATTEND.PREFIX.QUERY", "ia", 0, 4, d, 0, f32(q)),
            ("ATTEND.PREFIX.QUERY", "ib", 3, 4, d, 0, f32(q)),
            ("ATTEND.PREFIX.QUERY", "ia", 0, 4, d, 3, f32(q)),
            ("ATTEND.PREFIX.QUERY_FUSED", "ia", 0, 4, d, 2, h, f32(q), f32(ks), f32(ks), hm),
            ("ATTEND.PREFIX.QUERY_SPARSE", "ia", 0, 4, d, 2, f32(q), i32(np.zeros((4, 2)) +
                                                                        [[0, 1]]), i32([2] * 4)),
            ("ATTEND.PREFIX.QUERY_SPARSE_AUTO", "ia", 0, 4, d, 8, 1, h, f32(q), hm),
            ("ATTEND.PREFIX.QUERY_SPARSE_AUTO_FUSED", "ia", 0, 4, d, 8, 1, h, 2, f32(q), f32(ks),
             f32(ks), hm)]
    rows = 0
    for c in cmds:
        _, rc = split_reply(r.execute_command(*c, "RECEIPT"))
        rows += rc["rows_attended"]
    with pytest.raises(Exception, match="no attention slot"):
        r.execute_command("ATTEND.PREFIX.QUERY", "ia", 1, 4, d, 0, f32(q))
    after = attn_info(srv)
    delta = {f: after[f] - mid[f] for f in after if isinstance(after[f], int)}
    for form, count in (("dense", 2), ("topk", 1), ("fused", 1), ("sparse", 1),
                        ("sparse_auto", 1), ("sparse_auto_fused", 1)):
        assert delta["attention_queries_" + form] == count, (form, delta)
    assert delta["attention_exact"] == 3 and delta["attention_approximate"] == 4, delta
    assert delta["attention_rows_attended"] == rows, (rows, delta)
    # Small host-memory queries run on the shard thread, the rest on the compute pool.
    assert delta["attention_misses"] == 1
    assert delta["compute_completed"] + delta["attention_queries_inline"] >= 7, delta
    assert delta["compute_rejected"] == 0
    assert after["attention_bytes"] == 2 * slot  # the slots' K and V, in whichever tier
    # In host memory: both slots and the B=8 summaries of slot 'ia' (mean, min, max:
    # [H][ceil(N/B)][D] fp32) — on the cpu backend.
    if ATTENTION_BACKEND == "cpu":
        assert after["attention_host_bytes"] == 2 * slot + 3 * h * (-(-n // 8)) * d * 4, after
    r.execute_command("KV.PREFIX.REGISTER", "ins", 1, 16, 2, 32, "fp32")
    for part in ("pk", "pv"):
        r.execute_command("V.STOREBATCH", "ins_" + part, 0, f32(rnd(rng, 16, 64)))
    r.execute_command("ATTEND.PREFIX.STORE", "ic", 0, "FROM", "ins")
    assert attn_info(srv)["attention_stores_from"] == after["attention_stores_from"] + 1
    assert attn_info(srv)["attention_promotions"] == after["attention_promotions"]
    assert r.execute_command("ATTEND.PREFIX.DROP", "ia") == 1
    assert r.execute_command("ATTEND.PREFIX.DROP", "ic") == 1
    end = attn_info(srv)
    assert end["attention_slots"] == 1 and end["attention_bytes"] == slot
    # The Prometheus view agrees.
    m = parse_metrics(srv.metrics_text())
    assert m['pion_attention_queries_total{form="dense"}'] == end["attention_queries_dense"]
    assert m['pion_attention_results_total{kind="approximate"}'] == end["attention_approximate"]
    assert m["pion_attention_slots"] == 1
    assert m["pion_attention_misses_total"] == end["attention_misses"]


def test_qpos_near_int64_max(shared_pion):
    """QPOS is accepted up to 2^62 and refused above (so QPOS + M never overflows). A query there
    sees every prefix key (j <= p); the server must compute that, never answer 'no key visible'."""
    r = shared_pion.client()
    rng = np.random.default_rng(93)
    k, v, q = rnd(rng, 1, 20, 32), rnd(rng, 1, 20, 32), rnd(rng, 2, 2, 32)
    store(r, "qmax", 0, k, v)
    for qpos, m in ((2 ** 62, 2), (2 ** 63 - 2, 1), (2 ** 63 - 2, 2), (2 ** 63 - 1, 1)):
        with shared_pion.raw() as c:
            got = c.call("ATTEND.PREFIX.QUERY", "qmax", 0, 2, 32, 0, f32(q[:, :m]), "QPOS", qpos)
        if qpos > 2 ** 62:
            assert isinstance(got, RespError) and str(got).startswith(
                "ERR QPOS must be an integer in [0, 2^62]"), got
            continue
        ref, _, _ = attend_ref(q[:, :m], k, v, [0, 0], [19] * m, np.arange(20), 0)  # sees all
        assert_close(parse_out(got, 2, m, 32, m > 1)[0], ref, what="QPOS %d M %d" % (qpos, m))
