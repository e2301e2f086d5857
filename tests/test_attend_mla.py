"""MLA attention slots (issue 52, Stage 2 on the CPU): ATTEND.PREFIX.STORE ... MLA / FROM an MLA
namespace, and ATTEND.PREFIX.QUERY_MLA, QUERY_MLA_SPARSE, QUERY_MLA_FUSED in the absorbed
formulation — every form against a float64 numpy reference written here from the definition,
the absorbed result against the un-absorbed per-head formulation (latents decompressed with
random W_UK / W_UV), LSE merges, receipts, save/restore and residency, and the errors of wrong
layouts and widths."""
from __future__ import annotations

import os
import signal
import sys

import numpy as np
import pytest

from pionlib import EXTRA_SERVER_ARGS, RespError

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "clients",
                                "python"))
import pion  # noqa: E402
from pion import codecs  # noqa: E402

R, P = 512, 64  # DeepSeek V2/V3: kv_lora_rank, qk_rope_head_dim
DK = R + P
SCALE = 1.0 / np.sqrt(192.0)  # 1/sqrt(qk_nope_head_dim + qk_rope_head_dim)
TOL = 2e-5  # fp32 kernels against float64 over the stored values: |d| <= TOL·(1 + |ref|)


def latents(seed, n, dk=DK, rank=R):
    rng = np.random.default_rng(seed)
    c = rng.standard_normal((n, dk)).astype(np.float32)
    c[:, rank:] *= 2.0
    return c


def queries(seed, hq, m, dk=DK):
    return np.random.default_rng(seed).standard_normal((hq, m, dk)).astype(np.float32)


def reference(q, c, scale, qpos, *, window=0, lists=None, key_pos0=0, rank=R):
    """float64 softmax(scale·q·c)·c[:, :rank] per head and query token, with its LSE.
    q [H, M, dk]; c [N, dk] (the stored values); query token i at position qpos + i sees key
    rows at positions <= its own (and > its own − window); lists: per token, the rows it may
    attend (else all)."""
    q, c = q.astype(np.float64), c.astype(np.float64)
    h, m, _ = q.shape
    out = np.zeros((h, m, rank))
    lse = np.full((h, m), -np.inf)
    pos = key_pos0 + np.arange(c.shape[0])
    for i in range(m):
        p = qpos + i
        ok = pos <= p
        if window > 0:
            ok &= pos > p - window
        rows = np.nonzero(ok)[0] if lists is None else np.array(
            [t for t in lists[i] if ok[t]], dtype=np.int64)
        if rows.size == 0:
            continue
        s = scale * (q[:, i, :] @ c[rows].T)  # [H, rows]
        mx = s.max(axis=1, keepdims=True)
        w = np.exp(s - mx)
        out[:, i, :] = (w @ c[rows, :rank]) / w.sum(axis=1, keepdims=True)
        lse[:, i] = mx[:, 0] + np.log(w.sum(axis=1))
    return out, lse


def split(reply, hq, m, rank=R):
    a = np.frombuffer(reply, "<f4")
    assert a.size == hq * m * (rank + 1), a.size
    return a[:hq * m * rank].reshape(hq, m, rank), a[hq * m * rank:].reshape(hq, m)


def assert_close(got, want, tol=TOL):
    out, lse = got
    wout, wlse = want
    assert np.array_equal(np.isinf(lse), np.isinf(wlse))
    fin = np.isfinite(wlse)
    np.testing.assert_array_less(np.abs(lse[fin] - wlse[fin]), tol * (1 + np.abs(wlse[fin])))
    np.testing.assert_array_less(np.abs(out - wout), tol * (1 + np.abs(wout)))


def bf16(x):
    u = x.astype(np.float32).view(np.uint32).astype(np.uint64)
    return (((u + 0x7FFF + ((u >> 16) & 1)) >> 16) << 16).astype(np.uint32).view(np.float32)


def mla_namespace(r, ns, c, fmt, layers=1):
    """An MLA namespace of `layers` copies of c; returns the stored values of layer 0."""
    n = c.shape[0]
    r.execute_command("KV.PREFIX.REGISTER", ns, layers, n, "MLA", R, P, fmt, "MODEL", "dsv3")
    r.execute_command("V.STOREBATCH", ns + "_pl", 0, np.tile(c, (layers, 1)).tobytes())
    raw = r.execute_command("V.FETCH", ns + "_pl", "RANGE", 0, n, "RAW")
    return codecs.decode(fmt, DK, 0, raw)


def q_mla(r, sid, q, *tail, scale=SCALE, layer=0, rank=R, rope=P):
    return r.execute_command("ATTEND.PREFIX.QUERY_MLA", sid, layer, q.shape[0], rank, rope,
                             repr(float(scale)), q.tobytes(), *tail)


# ---- every form against the float64 reference --------------------------------------------------

@pytest.mark.parametrize("fmt", ["bf16", "fp8_ds_mla", "fp16", "fp8", "fp32"])
def test_decode_from_an_mla_namespace(shared_pion, fmt):
    r = shared_pion.client()
    n = 1000
    stored = mla_namespace(r, "dec_" + fmt, latents(1, n), fmt)
    assert r.execute_command("ATTEND.PREFIX.STORE", "s_" + fmt, 0, "FROM", "dec_" + fmt,
                             "MODEL", "dsv3") == b"OK"
    q = queries(2, 128, 1)
    reply, receipt = q_mla(r, "s_" + fmt, q, "RECEIPT")
    assert_close(split(reply, 128, 1), reference(q, stored, SCALE, n))
    assert q_mla(r, "s_" + fmt, q, "DEADLINE", 60000) == reply  # admitted, the same answer
    rc = {receipt[i].decode(): receipt[i + 1] for i in range(0, len(receipt), 2)}
    assert rc["form"] == b"mla" and rc["exact"] == 1 and rc["backend"] == b"cpu"
    assert rc["tier"] == b"host"
    if "cuda" in EXTRA_SERVER_ARGS:  # scripts/test-gpu.sh: the GPU backend says where it ran
        assert rc["fallback"] == (b"cpu: no CUDA MLA kernel yet; MLA slots stay in host memory "
                                  b"and are computed on the CPU")
    else:
        assert rc["fallback"] == b""
    assert rc["dtype"] == fmt.encode() and rc["prefix_rows"] == n and rc["query_rows"] == 128
    assert rc["rows_attended"] == 128 * n == rc["visible_rows"] and rc["support"][7] == n
    info = r.execute_command("ATTEND.PREFIX.INFO", "s_" + fmt)[0]
    info = {info[i].decode(): info[i + 1] for i in range(0, len(info), 2)}
    assert info["layout"] == b"mla" and info["kv_lora_rank"] == R and info["rope_dim"] == P
    assert info["heads"] == 1 and info["head_dim"] == DK and info["dtype"] == fmt.encode()
    assert info["bytes"] == n * codecs.row_bytes(fmt, DK) and info["source"].startswith(b"dec_")


def test_mtp_tokens_are_causal_among_themselves(shared_pion):
    """M = 3 speculative tokens whose latents are the slot's last 3 rows (QPOS N−3): token i sees
    rows up to N−3+i; without QPOS (after the prefix) every token sees all rows."""
    r = shared_pion.client()
    n = 700
    c = latents(3, n)
    r.execute_command("ATTEND.PREFIX.STORE", "mtp", 0, "MLA", n, R, P, c.tobytes())
    q = queries(4, 32, 3)
    assert_close(split(q_mla(r, "mtp", q, "QPOS", n - 3), 32, 3), reference(q, c, SCALE, n - 3))
    assert_close(split(q_mla(r, "mtp", q), 32, 3), reference(q, c, SCALE, n))
    # Each of M = 2..4 rows equals that token asked alone at its position.
    for m in (2, 4):
        qm = q[:, :1].repeat(m, axis=1) if m == 2 else queries(5, 32, 4)
        got = split(q_mla(r, "mtp", qm, "QPOS", n - m), 32, m)
        for i in range(m):
            one = split(q_mla(r, "mtp", qm[:, i:i + 1], "QPOS", n - m + i), 32, 1)
            np.testing.assert_allclose(got[0][:, i], one[0][:, 0], rtol=1e-5, atol=1e-6)
    # A sliding window applies like every form's.
    assert_close(split(q_mla(r, "mtp", q, 50, "QPOS", n - 3), 32, 3),
                 reference(q, c, SCALE, n - 3, window=50))


def test_sparse_indices_per_query_token(shared_pion):
    r = shared_pion.client()
    n = 900
    stored = mla_namespace(r, "sp", latents(6, n), "fp8_ds_mla")
    r.execute_command("ATTEND.PREFIX.STORE", "sps", 0, "FROM", "sp")
    rng = np.random.default_rng(7)
    m, kmax = 3, 300
    lists = [rng.choice(n, size=300, replace=False), rng.choice(n - 1, size=17, replace=False),
             np.zeros(0, np.int64)]
    lists[1][0] = n - 1  # a row after token 1's position (QPOS n−3 + 1): masked
    idx = np.zeros((m, kmax), np.int32)
    cnt = np.array([len(x) for x in lists], np.int32)
    for i, x in enumerate(lists):
        idx[i, :len(x)] = x
    q = queries(8, 64, m)
    reply, receipt = r.execute_command("ATTEND.PREFIX.QUERY_MLA_SPARSE", "sps", 0, 64, R, P,
                                       repr(SCALE), kmax, q.tobytes(), idx.tobytes(),
                                       cnt.tobytes(), "QPOS", n - 3, "RECEIPT")
    want = reference(q, stored, SCALE, n - 3, lists=lists)
    assert_close(split(reply, 64, m), want)
    rc = {receipt[i].decode(): receipt[i + 1] for i in range(0, len(receipt), 2)}
    seen = [sum(1 for t in x if t <= n - 3 + i) for i, x in enumerate(lists)]
    assert rc["form"] == b"mla_sparse" and rc["exact"] == 0
    assert rc["rows_attended"] == 64 * sum(seen) and rc["support"][0] == sum(seen)
    assert np.all(np.isinf(split(reply, 64, m)[1][:, 2]))  # token 2 listed nothing
    # Lists that cover every visible row are exact and equal the dense form.
    full = np.tile(np.arange(n, dtype=np.int32), (2, 1))
    c = pion.Client("127.0.0.1", shared_pion.port)
    res = c.attend.query_mla_sparse("sps", 0, q[:, :2], full, SCALE, counts=[n, n], receipt=True)
    assert res.receipt["exact"]
    np.testing.assert_allclose(res.out, c.attend.query_mla("sps", 0, q[:, :2], SCALE).out,
                               rtol=1e-5, atol=1e-6)
    # Ragged lists through the client.
    res = c.attend.query_mla_sparse("sps", 0, q[:, :1], [lists[0]], SCALE)
    assert_close((res.out, res.lse), reference(q[:, :1], stored, SCALE, n, lists=lists[:1]))


def test_fused_with_client_suffix_latents_and_lse_merge(shared_pion):
    r = shared_pion.client()
    n, s, m = 600, 5, 2
    prefix = latents(9, n)
    suffix = latents(10, s)
    r.execute_command("ATTEND.PREFIX.STORE", "fu", 0, "MLA", n, R, P, bf16(prefix).tobytes())
    q = queries(11, 128, m)
    reply = r.execute_command("ATTEND.PREFIX.QUERY_MLA_FUSED", "fu", 0, 128, R, P, repr(SCALE), s,
                              q.tobytes(), suffix.tobytes())
    # The same as one row set: the prefix then the suffix, queries at its last m positions.
    both = np.concatenate([bf16(prefix), suffix])
    got = split(reply, 128, m)
    assert_close(got, reference(q, both, SCALE, n + s - m))
    # Mergeable like every Stage 2 reply: the server's prefix partial (QPOS at the same
    # positions) merged with the client's own suffix partial gives the fused answer.
    pre = split(q_mla(r, "fu", q, "QPOS", n + s - m), 128, m)
    own = reference(q, suffix, SCALE, n + s - m, key_pos0=n)
    out, lse = pion.merge_lse(pre[0], pre[1], own[0], own[1])
    assert_close((out, lse), reference(q, both, SCALE, n + s - m), tol=5e-5)
    c = pion.Client("127.0.0.1", shared_pion.port)
    res = c.attend.query_mla_fused("fu", 0, q, suffix, SCALE, receipt=True)
    assert res.receipt["form"] == "mla_fused" and res.receipt["suffix_rows"] == s
    assert res.receipt["rows_attended"] == 128 * (2 * n + (s - 1) + s)
    np.testing.assert_array_equal(res.out, got[0])
    np.testing.assert_array_equal(res.lse, got[1])


def test_absorbed_equals_the_per_head_formulation(shared_pion):
    """Decompress the latents with random W_UK / W_UV: per head K_h = [c·W_UK_hᵀ ; k_rope],
    V_h = c·W_UV_hᵀ, q_h = [q_nope_h ; q_rope_h]; the server's absorbed answer, times W_UV_h,
    is softmax(scale·q_h·K_hᵀ)·V_h."""
    r = shared_pion.client()
    rng = np.random.default_rng(12)
    n, h, nope, vdim = 400, 16, 128, 128  # DeepSeek: qk_nope_head_dim 128, v_head_dim 128
    c = latents(13, n)
    r.execute_command("ATTEND.PREFIX.STORE", "ab", 0, "MLA", n, R, P, c.tobytes())
    w_uk = rng.standard_normal((h, nope, R)) / np.sqrt(R)
    w_uv = rng.standard_normal((h, vdim, R)) / np.sqrt(R)
    q_nope = rng.standard_normal((h, nope))
    q_rope = rng.standard_normal((h, P))
    absorbed = np.concatenate([np.einsum("hdr,hd->hr", w_uk, q_nope), q_rope], axis=1)
    res = pion.Client("127.0.0.1", shared_pion.port).attend.query_mla(
        "ab", 0, absorbed.astype(np.float32), SCALE)
    got = np.einsum("hvr,hr->hv", w_uv, res.out.astype(np.float64))
    cd = c.astype(np.float64)
    want = np.zeros((h, vdim))
    for j in range(h):
        k = np.concatenate([cd[:, :R] @ w_uk[j].T, cd[:, R:]], axis=1)  # [n, nope + rope]
        v = cd[:, :R] @ w_uv[j].T
        s = SCALE * (k @ np.concatenate([q_nope[j], q_rope[j]]))
        p = np.exp(s - s.max())
        want[j] = (p / p.sum()) @ v
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_python_client_store_and_query_raw_dtypes(shared_pion):
    c = pion.Client("127.0.0.1", shared_pion.port)
    r = shared_pion.client()
    n = 300
    x = latents(14, n)
    r.execute_command("V.CREATE", "enc", DK, "fp8_ds_mla")
    r.execute_command("V.STOREBATCH", "enc", 0, x.tobytes())
    raw = r.execute_command("V.FETCH", "enc", "RANGE", 0, n, "RAW")
    c.attend.store_mla("raw", 0, raw, R, P, dtype="fp8_ds_mla")
    q = queries(15, 8, 1)[:, 0]
    res = c.attend.query_mla("raw", 0, q, SCALE, receipt=True)
    assert res.out.shape == (8, R) and res.lse.shape == (8,)
    assert res.receipt["dtype"] == "fp8_ds_mla"
    want = reference(q[:, None], codecs.decode("fp8_ds_mla", DK, 128, raw), SCALE, n)
    assert_close((res.out[:, None], res.lse[:, None]), want)
    info = c.attend.info("raw")[0]
    assert info["layout"] == "mla" and info["bytes"] == n * 656


# ---- errors ---------------------------------------------------------------------------------------

def test_wrong_layouts_widths_and_arguments(shared_pion):
    r = shared_pion.client()
    c = latents(16, 64)
    r.execute_command("ATTEND.PREFIX.STORE", "e_mla", 0, "MLA", 64, R, P, c.tobytes())
    k = np.zeros((2, 64, 128), np.float32)
    r.execute_command("ATTEND.PREFIX.STORE", "e_ph", 0, 2, 64, 128, k.tobytes(), k.tobytes())
    q1 = np.zeros((4, DK), np.float32).tobytes()
    with shared_pion.raw() as raw:
        cases = [
            (("ATTEND.PREFIX.QUERY", "e_mla", 0, 8, 128, 0, np.zeros((8, 128), np.float32).tobytes()),
             "ERR the slot of session 'e_mla' layer 0 holds MLA latents (kv_lora_rank 512 + "
             "rope_dim 64, one row per token for every head), not per-head K/V: query it with "
             "ATTEND.PREFIX.QUERY_MLA, QUERY_MLA_SPARSE or QUERY_MLA_FUSED"),
            (("ATTEND.PREFIX.QUERY_SPARSE_AUTO", "e_mla", 0, 8, 576, 64, 4, 1, b"q", b"m"),
             "ERR the slot of session 'e_mla' layer 0 holds MLA latents (kv_lora_rank 512 + "
             "rope_dim 64, one row per token for every head), not per-head K/V: query it with "
             "ATTEND.PREFIX.QUERY_MLA, QUERY_MLA_SPARSE or QUERY_MLA_FUSED"),
            (("ATTEND.PREFIX.QUERY_MLA", "e_ph", 0, 4, R, P, "0.1", q1),
             "ERR the slot of session 'e_ph' layer 0 holds per-head K/V (2 heads of 128), not MLA "
             "latents: store an MLA slot (ATTEND.PREFIX.STORE ... MLA ..., or FROM an MLA "
             "namespace) or query it with ATTEND.PREFIX.QUERY"),
            (("ATTEND.PREFIX.QUERY_MLA", "e_mla", 0, 4, 256, P, "0.1", q1),
             "ERR kv_lora_rank 256 + rope_dim 64 do not match the slot's kv_lora_rank 512 + "
             "rope_dim 64"),
            (("ATTEND.PREFIX.QUERY_MLA", "e_mla", 0, 4, R, P, "0.1", q1[:-4]),
             "ERR Q_blob must be H_q*M*(kv_lora_rank+rope_dim)*4 bytes (H_q=4 kv_lora_rank=512 "
             "rope_dim=64), a non-zero multiple of 9216, got 9212"),
            (("ATTEND.PREFIX.QUERY_MLA", "e_mla", 0, 4, R, P, "0.1", q1 * 65),
             "ERR M 65 (from Q_blob) exceeds 64: an MLA call takes up to 64 query tokens (decode, "
             "MTP / speculative)"),
            (("ATTEND.PREFIX.QUERY_MLA", "e_mla", 0, 129, R, P, "0.1", q1),
             "ERR H_q must be an integer in [1, 128], got '129'"),
            (("ATTEND.PREFIX.QUERY_MLA", "e_mla", 0, 4, R, P, "-1", q1),
             "ERR scale must be a finite number > 0 (the softmax scale: DeepSeek's is "
             "1/sqrt(qk_nope_head_dim + qk_rope_head_dim), times its YaRN mscale^2), got '-1'"),
            (("ATTEND.PREFIX.QUERY_MLA", "e_mla", 0, 4, R, P, "nan", q1),
             "ERR scale must be a finite number > 0 (the softmax scale: DeepSeek's is "
             "1/sqrt(qk_nope_head_dim + qk_rope_head_dim), times its YaRN mscale^2), got 'nan'"),
            (("ATTEND.PREFIX.QUERY_MLA", "e_mla", 0, 4, R, P, "0.1", q1, "SHARED"),
             "ERR unexpected argument 'SHARED'; expected [<fa_window>] then any of QPOS, RECEIPT, "
             "DEADLINE <ms>"),
            (("ATTEND.PREFIX.QUERY_MLA", "e_mla", 9, 4, R, P, "0.1", q1),
             "MISS no attention slot for session 'e_mla' layer 9 (never stored, or dropped); "
             "ATTEND.PREFIX.STORE it"),
            (("ATTEND.PREFIX.QUERY_MLA_SPARSE", "e_mla", 0, 4, R, P, "0.1", 2, q1,
              np.array([1, 64], np.int32).tobytes(), np.array([2], np.int32).tobytes()),
             "ERR indices[0][1] = 64 is out of range [0, N=64)"),
            (("ATTEND.PREFIX.QUERY_MLA_SPARSE", "e_mla", 0, 4, R, P, "0.1", 2, q1,
              np.array([5, 5], np.int32).tobytes(), np.array([2], np.int32).tobytes()),
             "ERR indices[0][1] = 5 repeats an earlier index of token 0"),
            (("ATTEND.PREFIX.QUERY_MLA_SPARSE", "e_mla", 0, 4, R, P, "0.1", 2, q1,
              np.array([5, 5], np.int32).tobytes(), np.array([3], np.int32).tobytes()),
             "ERR counts[0] = 3 is not in [0, K_sparse_max=2]"),
            (("ATTEND.PREFIX.QUERY_MLA_SPARSE", "e_mla", 0, 4, R, P, "0.1", 2, q1, b"123",
              np.array([3], np.int32).tobytes()),
             "ERR indices must be M*K_sparse_max*4 (M=1 K_sparse_max=2) = 8 bytes, got 3"),
            (("ATTEND.PREFIX.QUERY_MLA_FUSED", "e_mla", 0, 4, R, P, "0.1", 2, q1, b"x" * 7),
             "ERR C_suf must be S_suf*(kv_lora_rank+rope_dim)*4 (S_suf=2 kv_lora_rank=512 "
             "rope_dim=64) = 4608 bytes, got 7"),
            (("ATTEND.PREFIX.QUERY_MLA_FUSED", "e_mla", 0, 4, R, P, "0.1", 1, q1 * 2, b"x" * 2304),
             "ERR M 2 (from Q_blob) exceeds S_suf 1: the queries are the last M suffix positions"),
            (("ATTEND.PREFIX.STORE", "e2", 0, "MLA", 64, R, P, c.tobytes()[:-1]),
             "ERR latent_blob must be N*(kv_lora_rank+rope_dim)*4 (N=64 kv_lora_rank=512 "
             "rope_dim=64) = 147456 bytes, got 147455"),
            (("ATTEND.PREFIX.STORE", "e2", 0, "MLA", 2, R, P, b"x" * 4, "DTYPE", "int8"),
             "ERR DTYPE of MLA latents must be one of fp32, fp16, bf16, fp8, fp8_ds_mla, got "
             "'int8'"),
            (("ATTEND.PREFIX.STORE", "e2", 0, "MLA", 2, 512, 32, b"x" * 4, "DTYPE", "fp8_ds_mla"),
             "ERR fp8_ds_mla holds kv_lora_rank (a multiple of 128) + 64 RoPE values, got "
             "kv_lora_rank 512 rope_dim 32"),
            (("ATTEND.PREFIX.STORE", "e2", 0, "MLA", 2, 500, 64, b"x" * 4),
             "ERR the latent_blob has kv_lora_rank 500 and rope_dim 64; MLA attention needs "
             "multiples of 16 (kv_lora_rank in [16, 2048], the sum at most 4096)"),
        ]
        for cmd, want in cases:
            got = raw.call(*cmd)
            assert got == RespError(want), (cmd[:2], got)
        # fp8 scales must be finite and >= 0, as the codec writes them.
        row = bytearray(656)
        row[512:516] = np.array([-1.0], "<f4").tobytes()
        assert raw.call("ATTEND.PREFIX.STORE", "e3", 0, "MLA", 1, R, P, bytes(row), "DTYPE",
                        "fp8_ds_mla") == RespError(
            "ERR latent_blob row 0 has scale -1.000000; fp8 scales must be finite and >= 0")
    # STORE FROM an MLA namespace the kernels cannot take.
    r.execute_command("KV.PREFIX.REGISTER", "odd", 1, 64, "MLA", 500, 64, "bf16")
    r.execute_command("V.STOREBATCH", "odd_pl", 0, np.zeros((64, 564), np.float32).tobytes())
    with pytest.raises(Exception, match="namespace 'odd' has kv_lora_rank 500 and rope_dim 64; "
                                        "MLA attention needs multiples of 16"):
        r.execute_command("ATTEND.PREFIX.STORE", "odd", 0, "FROM", "odd")


# ---- generic over slots: save/restore, residency, the compute pool -------------------------------

def test_saved_mla_slot_answers_bit_identically_after_restart(pion_factory):
    srv = pion_factory("-w", "2")
    r = srv.client()
    n = 500
    mla_namespace(r, "svn", latents(17, n), "fp8_ds_mla", layers=2)
    r.execute_command("ATTEND.PREFIX.STORE", "sv", 1, "FROM", "svn")
    q = queries(18, 128, 1)
    before = q_mla(r, "sv", q, layer=1)
    assert r.execute_command("ATTEND.PREFIX.SAVE", "sv") == b"OK"
    srv.stop(signal.SIGTERM)
    srv.start()
    r = srv.client()
    info = r.execute_command("ATTEND.PREFIX.INFO", "sv")[0]
    info = {info[i].decode(): info[i + 1] for i in range(0, len(info), 2)}
    assert info["layout"] == b"mla" and info["tier"] == b"disk" and info["dtype"] == b"fp8_ds_mla"
    assert q_mla(r, "sv", q, layer=1) == before


def test_mla_slots_move_to_disk_under_pressure_and_come_back(pion_factory):
    n = 2000
    per_slot = n * 656
    srv = pion_factory("-w", "1", "--attention-memory", str(int(per_slot * 2.5)))
    r = srv.client()
    mla_namespace(r, "pr", latents(19, n), "fp8_ds_mla", layers=4)
    q = queries(20, 16, 1)
    want = {}
    for layer in range(4):
        r.execute_command("ATTEND.PREFIX.STORE", "pr", layer, "FROM", "pr")
        want[layer] = q_mla(r, "pr", q, layer=layer)
    tiers = set()
    for layer in range(4):
        info = r.execute_command("ATTEND.PREFIX.INFO", "pr")[layer]
        tiers.add(info[info.index(b"tier") + 1])
    assert b"disk" in tiers
    for layer in (0, 3, 1, 2):
        assert q_mla(r, "pr", q, layer=layer) == want[layer]


def test_split_across_compute_threads_equals_one_thread(pion_factory):
    one = pion_factory("-w", "1", "--compute-threads", "1")
    four = pion_factory("-w", "1", "--compute-threads", "4")
    n = 6000
    c = latents(21, n)
    q = queries(22, 128, 1)
    replies = []
    for srv in (one, four):
        r = srv.client()
        r.execute_command("ATTEND.PREFIX.STORE", "x", 0, "MLA", n, R, P, bf16(c).tobytes(),
                          "DTYPE", "fp32")
        reply, receipt = q_mla(r, "x", q, "RECEIPT")
        replies.append(split(reply, 128, 1))
        rc = {receipt[i].decode(): receipt[i + 1] for i in range(0, len(receipt), 2)}
        assert (rc["splits"] == 1) == (srv is one), rc["splits"]
    assert_close(replies[1], replies[0], tol=1e-5)
    assert_close(replies[1], reference(q, bf16(c), SCALE, n))
