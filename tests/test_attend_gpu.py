"""ATTEND.PREFIX.* on the CUDA backend (--attention-backend cuda): what only the GPU path has.
The whole Stage 2 suite (test_attend_prefix.py) also runs against this backend on the GPU
machine (make test-gpu); these tests cover GPU residency and the tensor-core path. Without a
GPU they check that `cuda` is refused clearly and `auto` falls back to the CPU.

Tolerances, err = |got - ref| / (1 + |ref|) against the float64 numpy reference:
- fp32 slots and fp16 decode (few query rows per K/V head): 1e-4 (fp16: vs the reference on
  K/V rounded to float16), as in test_attend_prefix.py;
- fp16 slots with >= 64 query rows per K/V head (tensor cores, Q and P as fp16): 4e-3 vs the
  fp16-rounded reference; bf16 and fp8 slots with that many rows, 4e-3 vs the bf16-rounded /
  dequantized reference (the server runs them on the eight-group tensor-core kernel: Q and P at
  16 bits, flash-attention precision).
- fp8 slots: 1e-4 vs the reference on the dequantized rows (e4m3 × row scale), and the fp8
  bound of test_attend_prefix.py (relative MSE ≤ 4e-3, ≥ 3e-4) vs the fp32 reference on the
  rows before encoding, at decode shapes up to N = 64K (the fast decode path's long ranges).
"""
from __future__ import annotations

import os
import sys
import threading

import numpy as np
import pytest

from pionlib import ATTENTION_BACKEND, RespError, parse_metrics
from test_attend_prefix import (FP8_REL_MSE_BOUND, FP8_REL_MSE_FLOOR, assert_close, assert_lse,
                                attend_ref, contiguous_map, err, f32, fp8_blob_of_layer, i32,
                                info_slots, parse_out, rel_mse, rnd, store, store_as)

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "clients",
                                "python"))
import pion  # noqa: E402

on_gpu = pytest.mark.skipif(ATTENTION_BACKEND != "cuda",
                            reason="needs --attention-backend cuda (make test-gpu on the GPU "
                                   "machine)")


def attn(srv) -> dict:
    return srv.info("attention")


@pytest.mark.skipif(ATTENTION_BACKEND == "cuda", reason="runs where there is no GPU")
def test_cuda_backend_refused_without_a_gpu(pion_factory):
    with pytest.raises(RuntimeError) as e:
        pion_factory("--attention-backend", "cuda")
    assert "--attention-backend cuda: no usable CUDA device" in str(e.value)
    srv = pion_factory("--attention-backend", "auto")
    assert attn(srv)["attention_backend"] == "cpu"
    r = srv.client()
    assert r.config_get("gpu-memory")["gpu-memory"] == "0"
    with pytest.raises(Exception) as e2:
        r.config_set("gpu-memory", "1gb")
    assert "gpu-memory applies to --attention-backend cuda" in str(e2.value)


@on_gpu
def test_info_and_metrics_describe_the_gpu(pion_factory):
    srv = pion_factory("-w", "2", "--gpu-memory", "64mb")
    a = attn(srv)
    assert a["attention_backend"] == "cuda" and a["attention_gpu_device"]
    assert int(a["attention_gpu_memory_limit"]) == 64 << 20
    r = srv.client()
    rng = np.random.default_rng(1)
    k, v = rnd(rng, 2, 300, 64), rnd(rng, 2, 300, 64)
    store(r, "g", 0, k, v)
    [s] = info_slots(r, "g")
    assert s["backend"] == "cuda" and s["bytes"] == 2 * 2 * 300 * 64 * 4
    a = attn(srv)
    assert int(a["attention_gpu_bytes"]) >= s["bytes"] and s["tier"] == "gpu"
    res = srv.info("residency")
    assert int(res["residency_promotions_host_gpu"]) == 1
    assert int(res["residency_gpu_objects"]) == 1
    m = parse_metrics(srv.metrics_text())
    assert m["pion_attention_gpu_memory_limit_bytes"] == 64 << 20
    assert m['pion_residency_promotion_bytes_total{from="host",to="gpu"}'] >= s["bytes"]


@on_gpu
def test_gpu_memory_demotes_lru_slots_to_host_and_promotes_them_back(pion_factory):
    """--gpu-memory bounds the GPU tier: the least recently used slot copies leave the GPU
    (their host copies stay), every slot stays a HIT, and the next query brings one back,
    answering bit for bit what it answered before."""
    n, d = 4096, 128
    slot = 2 * 1 * n * d * 4  # 4 MiB
    srv = pion_factory("-w", "2", "--gpu-memory", str(slot * 7 // 2))  # room for 3.5 slots
    r = srv.client()
    rng = np.random.default_rng(2)
    kv = [(rnd(rng, 1, n, d), rnd(rng, 1, n, d)) for _ in range(5)]
    q = rnd(rng, 1, 1, d)
    first = {}
    for i in range(5):
        store(r, "e%d" % i, 0, *kv[i])
        first[i] = r.execute_command("ATTEND.PREFIX.QUERY", "e%d" % i, 0, 1, d, 0, f32(q))
        assert int(attn(srv)["attention_gpu_bytes"]) <= slot * 7 // 2
    hits = [r.execute_command("ATTEND.PREFIX.LOOKUP", "e%d" % i, 0) for i in range(5)]
    assert hits == [b"HIT"] * 5
    tiers = [info_slots(r, "e%d" % i)[0]["tier"] for i in range(5)]
    assert tiers[:2] == ["host", "host"] and tiers[-1] == "gpu", tiers
    for i in range(5):
        out = r.execute_command("ATTEND.PREFIX.QUERY", "e%d" % i, 0, 1, d, 0, f32(q))
        assert out == first[i], i
        ref, _, _ = attend_ref(q, *kv[i], [0], [n], np.arange(n), 0)
        assert_close(parse_out(out, 1, 1, d, False)[0], ref)
    res = srv.info("residency")
    assert int(res["residency_drops_gpu"]) >= 2 and int(res["residency_promotions_host_gpu"]) >= 7
    # Larger than all of --gpu-memory: -OOM naming the GPU tier; nothing stored.
    big = rnd(rng, 1, 4 * n, d)
    e = err(srv, "ATTEND.PREFIX.STORE", "big", 0, 1, 4 * n, d, f32(big), f32(big))
    assert e.startswith("OOM tier=gpu") and "--gpu-memory" in e, e
    assert r.execute_command("ATTEND.PREFIX.LOOKUP", "big", 0) == b"MISS"
    # CONFIG SET gpu-memory shrinks the budget: LRU copies leave at once; all still answer.
    r.config_set("gpu-memory", str(slot + slot // 2))
    assert int(attn(srv)["attention_gpu_bytes"]) <= slot + slot // 2
    out = r.execute_command("ATTEND.PREFIX.QUERY", "e0", 0, 1, d, 0, f32(q))
    assert out == first[0]
    assert r.ping()


@on_gpu
@pytest.mark.parametrize("hq,hkv,m,d", [(32, 8, 16, 128), (8, 2, 64, 64), (16, 2, 20, 256),
                                        (8, 8, 80, 96)])
def test_fp16_batched_tensor_core_path(pion_factory, hq, hkv, m, d):
    srv = pion_factory("-w", "1", "--attention-fp16")
    r = srv.client()
    rng = np.random.default_rng(hq * m + d)
    n = 1500
    k, v, q = rnd(rng, hkv, n, d), rnd(rng, hkv, n, d), rnd(rng, hq, m, d)
    k16 = k.astype(np.float16).astype(np.float32)
    v16 = v.astype(np.float16).astype(np.float32)
    store(r, "tc", 0, k, v)
    hm = contiguous_map(hq, hkv)
    for qpos, window in ((n, 0), (700, 0), (n, 300)):
        out = r.execute_command("ATTEND.PREFIX.QUERY", "tc", 0, hq, d, 0, f32(q), window, "QPOS",
                                qpos)
        got, lse = parse_out(out, hq, m, d, True)
        ref, ref_lse, _ = attend_ref(q, k16, v16, hm, np.arange(qpos, qpos + m), np.arange(n),
                                     window)
        assert_close(got, ref, 4e-3, "fp16 batched qpos=%d window=%d" % (qpos, window))
        assert_lse(lse, ref_lse, 4e-3)


def bf16_round(x):
    """float32 -> nearest bf16 (ties to even), as float32."""
    u = np.ascontiguousarray(x, np.float32).view(np.uint32).astype(np.uint64)
    u = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) << 16
    return u.astype(np.uint32).view(np.float32)


@on_gpu
@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
@pytest.mark.parametrize("hq,hkv,m,d,n", [(32, 8, 16, 128, 1500), (8, 2, 64, 64, 1000),
                                          (8, 8, 80, 96, 777), (4, 1, 40, 32, 2000),
                                          (32, 8, 64, 128, 20000)])
def test_bf16_and_fp8_slots_with_many_query_rows(pion_factory, dtype, hq, hkv, m, d, n):
    """Many query rows per K/V head (prefill, or a few positions of a wide GQA group) over bf16
    and fp8 slots, against the reference over the values the slot holds (4e-3), with and without
    a window and a query inside the prefix; fp8 also within its storage bound of the fp32
    reference. (They run on the eight-group tensor-core kernel; GpuExecutor.LowpBatched also
    tests them on the SIMT kernel.)"""
    srv = pion_factory("-w", "1")
    r = srv.client()
    rng = np.random.default_rng(hq * m + d + n)
    k, v, q = rnd(rng, hkv, n, d), rnd(rng, hkv, n, d), rnd(rng, hq, m, d)
    if dtype == "bf16":
        kd, vd = bf16_round(k), bf16_round(v)
        half = lambda x: (np.ascontiguousarray(x, np.float32).view(np.uint32) >> 16).astype(
            np.uint16).tobytes()
        assert r.execute_command("ATTEND.PREFIX.STORE", "b", 0, hkv, n, d, half(kd), half(vd),
                                 "DTYPE", "bf16") == b"OK"
    else:
        kd, vd = store_as(r, "b", 0, k, v, "fp8")
    [s] = info_slots(r, "b")
    assert (s["dtype"], s["tier"]) == (dtype, "gpu")
    hm = contiguous_map(hq, hkv)
    for qpos, window in ((n, 0), (n // 2, 0), (n, n // 3)):
        out = r.execute_command("ATTEND.PREFIX.QUERY", "b", 0, hq, d, 0, f32(q), window, "QPOS",
                                qpos)
        got, lse = parse_out(out, hq, m, d, True)
        pos_q = np.arange(qpos, qpos + m)
        ref, ref_lse, _ = attend_ref(q, kd, vd, hm, pos_q, np.arange(n), window)
        what = "%s batched qpos=%d window=%d" % (dtype, qpos, window)
        assert_close(got, ref, 4e-3, what)
        assert_lse(lse, ref_lse, 4e-3)
        if dtype == "fp8":
            e = rel_mse(got, attend_ref(q, k, v, hm, pos_q, np.arange(n), window)[0])
            assert FP8_REL_MSE_FLOOR <= e <= FP8_REL_MSE_BOUND, (what, e)
    assert r.ping()


@on_gpu
@pytest.mark.parametrize("hq,hkv,n,d,m", [(32, 8, 65536, 128, 1), (8, 8, 20000, 64, 1),
                                          (64, 8, 9000, 128, 1), (32, 8, 5000, 128, 3),
                                          (8, 2, 3000, 96, 1), (4, 1, 2000, 256, 2)])
def test_fp8_slots_on_the_gpu(pion_factory, hq, hkv, n, d, m):
    """fp8 slots in GPU memory (e4m3 bytes + row scales, D + 4 bytes a row): decode (the fast
    path where it applies) and a few rows, with and without a window, against the dequantized
    reference (1e-4) and the fp32 reference (the fp8 bound); top_k and sparse-auto on the same
    slot against the dequantized reference."""
    srv = pion_factory("-w", "1")
    r = srv.client()
    rng = np.random.default_rng(hq + n + d)
    k, v, q = rnd(rng, hkv, n, d), rnd(rng, hkv, n, d), rnd(rng, hq, m, d)
    k8, v8 = store_as(r, "f8", 0, k, v, "fp8")
    [s] = info_slots(r, "f8")
    assert (s["dtype"], s["bytes"], s["tier"]) == ("fp8", 2 * hkv * n * (d + 4), "gpu")
    hm = contiguous_map(hq, hkv)
    for qpos, window in ((n, 0), (n // 2, 0), (n, 1000)):
        pos_q = np.arange(qpos, qpos + m)
        blob, rc = r.execute_command("ATTEND.PREFIX.QUERY", "f8", 0, hq, d, 0, f32(q), window,
                                     "QPOS", qpos, "RECEIPT")
        assert dict(zip(rc[::2], rc[1::2]))[b"dtype"] == b"fp8"
        got, lse = parse_out(blob, hq, m, d, m > 1)
        ref8, lse8, _ = attend_ref(q, k8, v8, hm, pos_q, np.arange(n), window)
        ref32, _, _ = attend_ref(q, k, v, hm, pos_q, np.arange(n), window)
        what = "fp8 qpos=%d window=%d" % (qpos, window)
        assert_close(got, ref8, what=what)
        if m > 1:
            assert_lse(lse, lse8)
        e = rel_mse(got, ref32)
        assert FP8_REL_MSE_FLOOR <= e <= FP8_REL_MSE_BOUND, (what, e)
    if n <= 20000:  # top_k and sparse-auto over the fp8 scores
        from test_attend_prefix import sparse_auto_ref, topk_allow
        allow, _ = topk_allow(q, k8, hm, np.arange(n, n + m), 0, 50)
        out = r.execute_command("ATTEND.PREFIX.QUERY", "f8", 0, hq, d, 50, f32(q))
        assert_close(parse_out(out, hq, m, d, m > 1)[0],
                     attend_ref(q, k8, v8, hm, np.arange(n, n + m), np.arange(n), 0, allow)[0],
                     what="fp8 top_k")
        if m == 1:
            # The mean selector: with 64 query heads over fp8 keys, some head's quest bounds sit
            # within sparse_auto_ref's near-tie margin for every seed tried (quest on fp8 slots
            # runs in test_attend_prefix.py, which test-gpu.sh also runs on the GPU).
            chosen, _, allow, _ = sparse_auto_ref(q[:, 0], k8, hm, 64, 8, n, 0, "mean")
            out, rc = r.execute_command("ATTEND.PREFIX.QUERY_SPARSE_AUTO", "f8", 0, hq, d, 64, 8,
                                        hkv, f32(q), i32(hm), "SELECT", "mean", "RECEIPT")
            assert_close(parse_out(out, hq, 1, d, False)[0],
                         attend_ref(q, k8, v8, hm, [n], np.arange(n), 0, allow)[0],
                         what="fp8 sparse-auto")


@on_gpu
def test_fp8_store_from_namespace_keeps_its_bytes_on_the_gpu(pion_factory):
    """STORE FROM an fp8 namespace: the GPU slot is fp8 and answers bit-identically to a blob
    STORE of the namespace's own RAW bytes (DTYPE fp8)."""
    srv = pion_factory("-w", "2")
    r = srv.client()
    rng = np.random.default_rng(41)
    T, H, D = 3000, 4, 128
    r.execute_command("KV.PREFIX.REGISTER", "n8", 1, T, H, D, "fp8")
    r.execute_command("V.STOREBATCH", "n8_pk", 0, f32(rnd(rng, T, H * D)))
    r.execute_command("V.STOREBATCH", "n8_pv", 0, f32(rnd(rng, T, H * D)))
    assert r.execute_command("ATTEND.PREFIX.STORE", "from8", 0, "FROM", "n8") == b"OK"
    blobs = [fp8_blob_of_layer(r, "n8", part, 0, T, H, D) for part in ("pk", "pv")]
    assert r.execute_command("ATTEND.PREFIX.STORE", "blob8", 0, H, T, D, *blobs, "DTYPE",
                             "fp8") == b"OK"
    for sid in ("from8", "blob8"):
        [s] = info_slots(r, sid)
        assert (s["dtype"], s["backend"], s["bytes"]) == ("fp8", "cuda", 2 * H * T * (D + 4))
    q = rnd(rng, 16, 1, D)
    for args in ((16, D, 0, f32(q)), (16, D, 0, f32(q), 500), (16, D, 30, f32(q))):
        assert (r.execute_command("ATTEND.PREFIX.QUERY", "from8", 0, *args) ==
                r.execute_command("ATTEND.PREFIX.QUERY", "blob8", 0, *args))


@on_gpu
def test_query_racing_store_sees_old_or_new_on_gpu(pion_factory):
    """Queries while STOREs replace the slot: every reply equals the old or the new slot's
    reference, never a mix (the GPU copy is published only after its upload completed)."""
    srv = pion_factory("-w", "2")
    rng = np.random.default_rng(3)
    hq, hkv, n, d = 8, 2, 20000, 128
    kvs = [(rnd(rng, hkv, n, d), rnd(rng, hkv, n, d)) for _ in range(2)]
    q = rnd(rng, hq, 1, d)
    hm = contiguous_map(hq, hkv)
    refs = [attend_ref(q, k, v, hm, [n], np.arange(n), 0)[0] for k, v in kvs]
    r = srv.client()
    store(r, "race", 0, *kvs[0])
    stop = threading.Event()
    errors: list[str] = []

    def writer():
        w = srv.client()
        i = 1
        while not stop.is_set():
            store(w, "race", 0, *kvs[i % 2])
            i += 1

    t = threading.Thread(target=writer)
    t.start()
    try:
        for _ in range(60):
            out = r.execute_command("ATTEND.PREFIX.QUERY", "race", 0, hq, d, 0, f32(q))
            got = parse_out(out, hq, 1, d, False)[0]
            errs = [float(np.max(np.abs(got - ref) / (1 + np.abs(ref)))) for ref in refs]
            if min(errs) > 1e-4:
                errors.append("reply matches neither slot: %r" % errs)
    finally:
        stop.set()
        t.join(timeout=60)
    assert not errors, errors[:3]


@on_gpu
def test_store_from_namespace_lands_on_gpu(pion_factory):
    srv = pion_factory("-w", "2")
    r = srv.client()
    rng = np.random.default_rng(4)
    T, H, D = 300, 2, 64
    r.execute_command("KV.PREFIX.REGISTER", "ns", 1, T, H, D, "fp16")
    kt, vt = rnd(rng, T, H * D), rnd(rng, T, H * D)
    r.execute_command("V.STOREBATCH", "ns_pk", 0, f32(kt))
    r.execute_command("V.STOREBATCH", "ns_pv", 0, f32(vt))
    assert r.execute_command("ATTEND.PREFIX.STORE", "s", 0, "FROM", "ns") == b"OK"
    [s] = info_slots(r, "s")
    assert s["backend"] == "cuda" and s["source"].startswith("ns@")
    k = kt.reshape(T, H, D).transpose(1, 0, 2).astype(np.float16).astype(np.float32)
    v = vt.reshape(T, H, D).transpose(1, 0, 2).astype(np.float16).astype(np.float32)
    q = rnd(rng, 4, 1, D)
    out = r.execute_command("ATTEND.PREFIX.QUERY", "s", 0, 4, D, 0, f32(q))
    ref, _, _ = attend_ref(q, k, v, contiguous_map(4, 2), [T], np.arange(T), 0)
    assert_close(parse_out(out, 4, 1, D, False)[0], ref)
    assert int(attn(srv)["attention_stores_from"]) == 1


def test_export_needs_the_unix_socket_and_the_gpu(pion_factory, tmp_path):
    path = str(tmp_path / "pion.sock")
    srv = pion_factory("-w", "1", "--unixsocket", path)
    r = srv.client()
    rng = np.random.default_rng(5)
    store(r, "x", 0, rnd(rng, 2, 64, 64), rnd(rng, 2, 64, 64))
    for layers in ((0,), (0, 1), (0, 1, "PACKED")):
        e = err(srv, "ATTEND.PREFIX.EXPORT", "x", *layers)
        assert e == ("ERR ATTEND.PREFIX.EXPORT is for same-host clients: connect over the "
                     "--unixsocket socket"), e
    assert err(srv, "ATTEND.PREFIX.EXPORT", "x", 0, "two").startswith("ERR "), "bad layer"
    c = pion.Client(unix_socket_path=path)
    try:
        if ATTENTION_BACKEND == "cuda":
            with pytest.raises(pion.MissError):
                c.attend.export("nope", 0)
        else:
            with pytest.raises(pion.CommandError) as ex:
                c.attend.export("x", 0)
            assert "needs slots on the GPU (--attention-backend cuda)" in str(ex.value)
    finally:
        c.close()


def _torch_cuda():
    try:
        import torch
    except ImportError:
        return None
    return torch if torch.cuda.is_available() else None


@on_gpu
def test_export_gpu_view_reads_the_slot_device_to_device(pion_factory, tmp_path):
    """ATTEND.PREFIX.EXPORT + CUDA IPC: another process (this test) maps the slot's GPU copy
    and reads exactly the stored K/V; the lease pins the copy against eviction and replacement;
    released, the copy is evictable again."""
    torch = _torch_cuda()
    if torch is None:
        pytest.skip("needs torch with CUDA in the test process")
    path = str(tmp_path / "pion.sock")
    h, n, d = 2, 4096, 128
    slot = 2 * h * n * d * 4  # 8 MiB
    srv = pion_factory("-w", "2", "--unixsocket", path, "--gpu-memory", str(2 * slot + slot // 2))
    r = srv.client()
    rng = np.random.default_rng(6)
    kv = [(rnd(rng, h, n, d), rnd(rng, h, n, d)) for _ in range(4)]
    store(r, "a", 0, *kv[0])
    c = pion.Client(unix_socket_path=path)
    try:
        with c.attend.gpu_view("a", 0) as view:
            assert view.export["dtype"] == "fp32" and view.export["rows"] == n
            assert view.k.is_cuda and tuple(view.k.shape) == (h, n, d)
            assert np.array_equal(view.k.cpu().numpy(), kv[0][0])
            assert np.array_equal(view.v.cpu().numpy(), kv[0][1])
            # Replaced while exported: the view keeps reading the old copy.
            store(r, "a", 0, *kv[1])
            assert np.array_equal(view.k.cpu().numpy(), kv[0][0])
            assert np.array_equal(view.v.cpu().numpy(), kv[0][1])
            # old (leased) and new
            assert int(attn(srv)["attention_gpu_bytes"]) >= 2 * slot
        # Released: the old copy is gone, the current slot reads its new values.
        with c.attend.gpu_view("a", 0) as view:
            assert np.array_equal(view.k.cpu().numpy(), kv[1][0])
    finally:
        c.close()
    # fp8 slots export their e4m3 bytes as float8_e4m3fn with the row scales beside them.
    k8, v8 = store_as(r, "f8", 0, kv[2][0], kv[2][1], "fp8")
    c8 = pion.Client(unix_socket_path=path)
    try:
        with c8.attend.gpu_view("f8", 0) as view:
            assert view.export["dtype"] == "fp8" and view.export["bytes"] == h * n * (d + 4)
            assert view.k.dtype == torch.float8_e4m3fn and tuple(view.k.shape) == (h, n, d)
            assert tuple(view.k_scale.shape) == (h, n)
            kd, vd = view.dense()
            assert np.array_equal(kd.cpu().numpy(), k8) and np.array_equal(vd.cpu().numpy(), v8)
    finally:
        c8.close()
    # fp16 slots export as float16.
    srv16 = pion_factory("-w", "1", "--unixsocket", str(tmp_path / "p16.sock"),
                         "--attention-fp16")
    store(srv16.client(), "h", 0, *kv[3])
    c16 = pion.Client(unix_socket_path=str(tmp_path / "p16.sock"))
    try:
        with c16.attend.gpu_view("h", 0) as view:
            assert view.k.dtype == torch.float16
            assert np.array_equal(view.k.cpu().numpy(), kv[3][0].astype(np.float16))
    finally:
        c16.close()


@on_gpu
def test_export_lease_pins_the_copy_against_eviction(pion_factory, tmp_path):
    path = str(tmp_path / "pion.sock")
    h, n, d = 1, 4096, 128
    slot = 2 * h * n * d * 4  # 4 MiB
    srv = pion_factory("-w", "1", "--unixsocket", path, "--gpu-memory", str(2 * slot))
    r = srv.client()
    rng = np.random.default_rng(7)
    kv = [(rnd(rng, h, n, d), rnd(rng, h, n, d)) for _ in range(3)]
    store(r, "p0", 0, *kv[0])
    store(r, "p1", 0, *kv[1])
    c = pion.Client(unix_socket_path=path)
    try:
        ex = c.attend.export("p0", 0)
        assert len(ex["handle"]) == 64 and ex["lease"] > 0 and ex["ttl_ms"] > 0
        q = rnd(rng, 1, 1, d)
        r.execute_command("ATTEND.PREFIX.QUERY", "p1", 0, 1, d, 0, f32(q))  # p0 is now LRU
        store(r, "p2", 0, *kv[2])  # needs room: p0 is leased, so p1 leaves the GPU
        tier = lambda i: info_slots(r, "p%d" % i)[0]["tier"]  # noqa: E731
        assert [tier(i) for i in range(3)] == ["gpu", "host", "gpu"]
        assert c.attend.release_export(ex["lease"])
        r.execute_command("ATTEND.PREFIX.QUERY", "p1", 0, 1, d, 0, f32(q))  # p1 back: p0 goes
        assert [tier(i) for i in range(3)] == ["host", "gpu", "gpu"]
    finally:
        c.close()


@on_gpu
def test_export_of_several_layers_is_one_command_all_or_nothing(pion_factory, tmp_path):
    """ATTEND.PREFIX.EXPORT <sid> <l0> <l1> …: an array of exports, one lease each, every view
    reading its own layer; a missing layer fails the whole command and leaves no lease."""
    torch = _torch_cuda()
    if torch is None:
        pytest.skip("needs torch with CUDA in the test process")
    path = str(tmp_path / "pion.sock")
    srv = pion_factory("-w", "2", "--unixsocket", path)
    r = srv.client()
    rng = np.random.default_rng(8)
    h, n, d = 2, 256, 64
    kv = [(rnd(rng, h, n, d), rnd(rng, h, n, d)) for _ in range(3)]
    for j, (k, v) in enumerate(kv):
        store(r, "m", j, k, v)
    c = pion.Client(unix_socket_path=path)
    try:
        exports = c.attend.export_many("m", [2, 0, 1])
        assert [e["rows"] for e in exports] == [n] * 3
        assert len({e["lease"] for e in exports}) == 3
        assert pion._wire.parse_map(c.execute("SHM.INFO"))["leases"] == 3
        from pion.cuda_ipc import GpuView
        for j, e in zip([2, 0, 1], exports):
            view = GpuView(e)
            assert np.array_equal(view.k.cpu().numpy(), kv[j][0])
            assert np.array_equal(view.v.cpu().numpy(), kv[j][1])
            view.close()
        assert c.attend.release_exports([e["lease"] for e in exports]) == 3
        # The map form (export_many uses PACKED) describes the same copies.
        maps = c.attend.export_many("m", [2, 0, 1], packed=False)
        for a, b in zip(exports, maps):
            assert {k: v for k, v in a.items() if k != "lease"} == \
                {k: v for k, v in b.items() if k != "lease"}
        assert c.attend.release_exports([e["lease"] for e in maps]) == 3
        for packed in (True, False):
            with pytest.raises(pion.MissError):
                c.attend.export_many("m", [0, 1, 7], packed=packed)  # layer 7 does not exist
        assert pion._wire.parse_map(c.execute("SHM.INFO"))["leases"] == 0
    finally:
        c.close()
