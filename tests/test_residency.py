"""The residency engine end to end (seed 004 §0x04, §0x08, §0x0B): every family's objects
moving host -> disk under a small memory budget and back, byte-exact; one backend read per
block for many readers of one cold object; deadlines refused in time with typed errors naming
the stage; every family surviving a restart once saved; a kill -9 loop over saves, demotions
and promotions; and (with the test build pion-server-faults) failed, short, unsynced, full,
corrupt and slow disks."""
from __future__ import annotations

import os
import random
import signal
import subprocess
import threading
import time

import numpy as np
import pytest

from pionlib import FAULT_SERVER_BIN, RespError, encode

MB = 1 << 20


def res(srv) -> dict:
    return {k: int(v) for k, v in srv.info("residency").items() if v.lstrip("-").isdigit()}


def f32(a) -> bytes:
    return np.ascontiguousarray(a, dtype=np.float32).tobytes()


def attend_dense(q, k, v):
    """Single-query dense attention in float64: q [H, D], k/v [H, N, D] (MHA)."""
    s = np.einsum("hd,hnd->hn", q.astype(np.float64), k.astype(np.float64)) / np.sqrt(q.shape[1])
    p = np.exp(s - s.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    return np.einsum("hn,hnd->hd", p, v.astype(np.float64))


def faults_binary():
    if not os.path.exists(FAULT_SERVER_BIN):
        pytest.skip("needs the fault-injection build %s (make test builds it)" % FAULT_SERVER_BIN)
    return FAULT_SERVER_BIN


# ------------------------------------------------------------------------------------------
# Pressure: four times the host budget across every family, byte-exact
# ------------------------------------------------------------------------------------------

def test_four_times_the_host_budget_across_families_is_byte_exact(pion_factory):
    budget = 4 * MB
    srv = pion_factory("-w", "2", "--maxmemory", str(budget), "--attention-backend", "cpu")
    r = srv.client()
    rng = np.random.default_rng(29)
    # ~16 MiB in all: STATE slots, SSM blobs, a V-store session, a KV.PREFIX namespace and
    # attention slots, interleaved so every family is both a victim and a reader.
    state = {f"st{i}": rng.bytes(MB) for i in range(3)}
    ssm = {i: rng.bytes(MB) for i in range(3)}
    rows = rng.standard_normal((1024, 1024)).astype(np.float32)  # 4 MiB fp32
    kv = [(rng.standard_normal((2, 512, 128)).astype(np.float32),
           rng.standard_normal((2, 512, 128)).astype(np.float32)) for _ in range(3)]  # 1 MiB each
    q = rng.standard_normal((2, 128)).astype(np.float32)
    first = {}
    for i in range(3):
        name = f"st{i}"
        assert r.execute_command("STATE.ALLOC", name, MB) == b"OK"
        assert r.execute_command("STATE.WRITE", name, 0, state[name]) == b"OK"
        assert r.execute_command("SSM.PREFIX.STORE", "h", i, ssm[i]) == b"OK"
        k, v = kv[i]
        assert r.execute_command("ATTEND.PREFIX.STORE", f"a{i}", 0, 2, 512, 128, f32(k),
                                 f32(v)) == b"OK"
        first[i] = r.execute_command("ATTEND.PREFIX.QUERY", f"a{i}", 0, 2, 128, 0, f32(q))
        assert int(srv.info("memory")["used_memory"]) <= budget
    r.execute_command("V.CREATE", "vs", 1024, "fp32")
    for start in range(0, 1024, 256):
        assert r.execute_command("V.STOREBATCH", "vs", start, f32(rows[start:start + 256])) == 256
        assert int(srv.info("memory")["used_memory"]) <= budget
    r.execute_command("KV.PREFIX.REGISTER", "ns", 2, 256, 4, 128, "fp16", "MODEL", "m")
    pk = rng.standard_normal((512, 512)).astype(np.float32)
    pv = rng.standard_normal((512, 512)).astype(np.float32)
    r.execute_command("V.STOREBATCH", "ns_pk", 0, f32(pk))
    r.execute_command("V.STOREBATCH", "ns_pv", 0, f32(pv))
    want_pk = r.execute_command("V.FETCH", "ns_pk", "RANGE", 0, 512, "RAW")
    assert int(srv.info("memory")["used_memory"]) <= budget
    before = res(srv)
    assert before["residency_demotions_host_disk"] > 0
    # Everything answers exactly, each read bringing its object back (and another one out).
    for _ in range(2):
        for name, want in state.items():
            assert r.execute_command("STATE.READ", name, 0, MB) == want, name
        for i, want in ssm.items():
            assert r.execute_command("SSM.PREFIX.FETCH", "h", i) == want, i
        got = np.frombuffer(r.execute_command("V.FETCH", "vs", "RANGE", 0, 1024, "RAW"),
                            np.float32).reshape(1024, 1024)
        assert np.array_equal(got, rows)
        assert r.execute_command("V.FETCH", "ns_pk", "RANGE", 0, 512, "RAW") == want_pk
        assert r.execute_command("KV.PREFIX.LOOKUP", "ns", "MODEL", "m") == b"HIT"
        for i in range(3):
            out = r.execute_command("ATTEND.PREFIX.QUERY", f"a{i}", 0, 2, 128, 0, f32(q))
            assert out == first[i], i  # bit-identical after the round trip through disk
            got = np.frombuffer(out, np.float32).reshape(2, 128)
            assert np.allclose(got, attend_dense(q, *kv[i]), atol=1e-5)
        assert int(srv.info("memory")["used_memory"]) <= budget
    after = res(srv)
    assert after["residency_promotions_disk_host"] > before["residency_promotions_disk_host"]
    assert after["residency_demotions_host_disk"] > before["residency_demotions_host_disk"]
    assert after["residency_lost_objects"] == 0 and after["residency_corrupt_replicas"] == 0
    m = srv.metrics_text()
    assert 'pion_residency_demotions_total{from="host",to="disk"}' in m


# ------------------------------------------------------------------------------------------
# Many readers of one cold object: one backend read per block
# ------------------------------------------------------------------------------------------

def _push_out(r, prefix, n, size, rng):
    for i in range(n):
        r.execute_command("SSM.PREFIX.STORE", prefix, i, rng.bytes(size))


def _concurrent(srv, n, fn):
    """Runs fn(client) in n threads released together; returns the results."""
    barrier = threading.Barrier(n)
    out = [None] * n
    def worker(i):
        c = srv.client(socket_timeout=30)
        barrier.wait(10)
        out[i] = fn(c)
    threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return out


@pytest.mark.parametrize("slow", [False, True], ids=["plain", "slow-disk"])
def test_fifty_readers_of_one_cold_blob_cause_one_read(pion_factory, slow):
    args = ("-w", "2", "--maxmemory", "16mb")
    srv = pion_factory(*args, binary=faults_binary() if slow else None)
    r = srv.client()
    rng = np.random.default_rng(5)
    payload = rng.bytes(8 * MB)
    r.execute_command("SSM.PREFIX.STORE", "cold", 0, payload)
    _push_out(r, "other", 3, 5 * MB, rng)
    info = dict(zip(*[iter(r.execute_command("SSM.PREFIX.INFO", "cold"))] * 2))
    assert info[b"bytes_disk_only"] == 8 * MB  # on disk only now
    r.execute_command("SSM.PREFIX.DROP", "other")  # room for it to come back and stay
    if slow:  # the read takes long enough that every reader joins it
        r.execute_command("DEBUG.FAULT", "SET", "disk.read", "slow", "COUNT", 1, "DELAY", 400)
    before = res(srv)
    got = _concurrent(srv, 50, lambda c: c.execute_command("SSM.PREFIX.FETCH", "cold", 0))
    assert all(g == payload for g in got)
    after = res(srv)
    assert after["residency_backend_reads"] - before["residency_backend_reads"] == 1
    assert after["residency_promotions_disk_host"] - before["residency_promotions_disk_host"] == 1
    if slow:
        assert after["residency_coalesced"] - before["residency_coalesced"] == 49


def test_fifty_readers_of_a_cold_namespace_read_each_chunk_once(pion_factory):
    srv = pion_factory("-w", "2")
    r = srv.client()
    rng = np.random.default_rng(6)
    L, T, H, D = 4, 256, 2, 64
    r.execute_command("KV.PREFIX.REGISTER", "cn", L, T, H, D, "fp16")
    for part in ("pk", "pv"):
        r.execute_command("V.STOREBATCH", f"cn_{part}", 0,
                          f32(rng.standard_normal((L * T, H * D))))
    want = r.execute_command("V.FETCH", "cn_pk", "RANGE", 0, L * T, "RAW")
    assert r.execute_command("KV.PREFIX.SAVE", "cn") == b"OK"
    srv.stop()
    srv.start()  # known by its saved file only: every chunk is cold
    before = res(srv)
    got = _concurrent(srv, 50,
                      lambda c: c.execute_command("V.FETCH", "cn_pk", "RANGE", 0, L * T, "RAW"))
    assert all(g == want for g in got)
    chunks = L * T // 64
    after = res(srv)
    assert after["residency_backend_reads"] - before["residency_backend_reads"] == chunks
    assert int(srv.info("persistence")["disk_warms"]) == 1  # its index: one read for all


# ------------------------------------------------------------------------------------------
# Deadlines
# ------------------------------------------------------------------------------------------

def test_deadline_a_promotion_cannot_meet_is_refused_at_once(pion_factory):
    srv = pion_factory("-w", "1", "--maxmemory", "48mb")
    r = srv.client()
    rng = np.random.default_rng(7)
    payload = rng.bytes(32 * MB)
    r.execute_command("SSM.PREFIX.STORE", "big", 0, payload)
    _push_out(r, "x", 2, 24 * MB, rng)  # big is on disk now
    r.execute_command("SSM.PREFIX.DROP", "x")
    before = res(srv)
    with srv.raw() as c:
        t0 = time.monotonic()
        reply = c.call("SSM.PREFIX.FETCH", "big", 0, "DEADLINE", 1)
        elapsed = time.monotonic() - t0
    assert isinstance(reply, RespError) and str(reply).startswith("TIMEOUT "), reply
    assert "cannot be met" in str(reply) and "disk_read" in str(reply), reply
    assert elapsed < 0.5, elapsed  # refused before any read, not after one
    after = res(srv)
    assert after["residency_backend_reads"] == before["residency_backend_reads"]
    assert after["residency_refused_disk_read_deadline"] >= 1
    assert int(srv.info("stats")["rejected_timeout"]) >= 1
    assert srv.metric('pion_residency_refusals_total{stage="disk_read",reason="deadline"}') >= 1
    # Without a deadline (or with a generous one) it comes back whole.
    assert r.execute_command("SSM.PREFIX.FETCH", "big", 0, "DEADLINE", 60000) == payload


def test_malformed_deadlines_are_named(pion_factory):
    srv = pion_factory("-w", "1")
    r = srv.client()
    r.execute_command("SSM.PREFIX.STORE", "s", 0, b"x")
    for bad in ("0", "-5", "soon", "99999999999"):
        with pytest.raises(Exception, match="DEADLINE must be a whole number of milliseconds"):
            r.execute_command("SSM.PREFIX.FETCH", "s", 0, "DEADLINE", bad)
    # A blob that reads "DEADLINE" is a blob, not an option.
    assert r.execute_command("SSM.PREFIX.STORE", "s", 1, b"DEADLINE") == b"OK"
    assert r.execute_command("SSM.PREFIX.FETCH", "s", 1) == b"DEADLINE"
    with pytest.raises(Exception, match="wrong number of arguments"):
        r.execute_command("SSM.PREFIX.FETCH", "s", 0, "extra")


def test_deadline_on_a_slow_disk_is_answered_by_the_deadline(pion_factory):
    srv = pion_factory("-w", "2", "--maxmemory", "8mb", binary=faults_binary())
    r = srv.client()
    rng = np.random.default_rng(8)
    payload = rng.bytes(2 * MB)
    r.execute_command("SSM.PREFIX.STORE", "slow", 0, payload)
    _push_out(r, "x", 2, 4 * MB, rng)
    r.execute_command("SSM.PREFIX.DROP", "x")
    r.execute_command("DEBUG.FAULT", "SET", "disk.read", "slow", "COUNT", 1, "DELAY", 800)
    with srv.raw() as c:
        t0 = time.monotonic()
        reply = c.call("SSM.PREFIX.FETCH", "slow", 0, "DEADLINE", 150)
        elapsed = time.monotonic() - t0
        # The shard was never blocked meanwhile: another client's command answers at once.
    assert isinstance(reply, RespError) and str(reply).startswith("TIMEOUT "), reply
    assert "deadline passed" in str(reply) and "disk_read" in str(reply), reply
    assert 0.14 <= elapsed <= 0.15 + 0.2, elapsed  # at its deadline, not at the read's end
    # The transfer went on for whoever reads next.
    assert r.execute_command("SSM.PREFIX.FETCH", "slow", 0) == payload


def test_slow_disk_never_stalls_other_clients(pion_factory):
    srv = pion_factory("-w", "1", "--maxmemory", "8mb", binary=faults_binary())
    r = srv.client()
    rng = np.random.default_rng(9)
    payload = rng.bytes(2 * MB)
    r.execute_command("SSM.PREFIX.STORE", "slow", 0, payload)
    _push_out(r, "x", 2, 4 * MB, rng)
    r.execute_command("SSM.PREFIX.DROP", "x")
    r.execute_command("DEBUG.FAULT", "SET", "disk.read", "slow", "COUNT", 1, "DELAY", 1000)
    got = {}
    t = threading.Thread(target=lambda: got.setdefault(
        "v", srv.client().execute_command("SSM.PREFIX.FETCH", "slow", 0)), daemon=True)
    t.start()
    time.sleep(0.1)
    t0 = time.monotonic()
    for i in range(20):  # one shard: the same event loop that waits for the slow read
        assert r.execute_command("STATE.ALLOC", "p%d" % i, 16) == b"OK"
    assert time.monotonic() - t0 < 0.5
    t.join(10)
    assert got["v"] == payload


# ------------------------------------------------------------------------------------------
# Persistence of every family
# ------------------------------------------------------------------------------------------

def test_every_family_survives_a_restart_once_saved(pion_factory):
    srv = pion_factory("-w", "2", "--attention-backend", "cpu")
    r = srv.client()
    rng = np.random.default_rng(10)
    r.execute_command("STATE.ALLOC", "kept", 64)
    r.execute_command("STATE.WRITE", "kept", 0, b"saved state")
    assert r.execute_command("STATE.SAVE", "kept") == b"OK"
    r.execute_command("STATE.WRITE", "kept", 0, b"later write")  # not saved: gone at restart
    r.execute_command("STATE.ALLOC", "unsaved", 8)
    blobs = {0: rng.bytes(100_000), 3: rng.bytes(5000)}
    for layer, b in blobs.items():
        r.execute_command("SSM.PREFIX.STORE", "hy", layer, b)
    assert r.execute_command("SSM.PREFIX.SAVE", "hy") == b"OK"
    r.execute_command("SSM.PREFIX.STORE", "lost", 0, b"never saved")
    k = rng.standard_normal((2, 300, 64)).astype(np.float32)
    v = rng.standard_normal((2, 300, 64)).astype(np.float32)
    q = rng.standard_normal((4, 64)).astype(np.float32)
    r.execute_command("ATTEND.PREFIX.STORE", "sl", 0, 2, 300, 64, f32(k), f32(v))
    r.execute_command("ATTEND.PREFIX.STORE", "sl", 1, 2, 300, 64, f32(v), f32(k))
    answer = r.execute_command("ATTEND.PREFIX.QUERY", "sl", 0, 4, 64, 0, f32(q))
    gen = dict(zip(*[iter(r.execute_command("ATTEND.PREFIX.INFO", "sl")[0])] * 2))[b"generation"]
    assert r.execute_command("ATTEND.PREFIX.SAVE", "sl") == b"OK"
    assert r.execute_command("ATTEND.PREFIX.SAVE", "sl", 0) == b"OK"  # unchanged: no-op
    srv.stop(signal.SIGKILL)  # no clean shutdown: only what was saved may come back
    srv.start()
    r = srv.client()
    assert r.execute_command("STATE.READ", "kept", 0, 11) == b"saved state"
    with pytest.raises(Exception, match="no such state slot 'unsaved'"):
        r.execute_command("STATE.READ", "unsaved", 0, 1)
    for layer, b in blobs.items():
        assert r.execute_command("SSM.PREFIX.FETCH", "hy", layer) == b
    assert r.execute_command("SSM.PREFIX.FETCH", "lost", 0) is None
    assert r.execute_command("ATTEND.PREFIX.QUERY", "sl", 0, 4, 64, 0, f32(q)) == answer
    info = [dict(zip(*[iter(m)] * 2)) for m in r.execute_command("ATTEND.PREFIX.INFO", "sl")]
    assert [m[b"layer"] for m in info] == [0, 1] and info[0][b"generation"] == gen
    # New slots get generations above the restored ones (fences outlive restarts).
    r.execute_command("ATTEND.PREFIX.STORE", "new", 0, 2, 300, 64, f32(k), f32(v))
    newgen = dict(zip(*[iter(r.execute_command("ATTEND.PREFIX.INFO", "new")[0])] * 2))
    assert newgen[b"generation"] > gen
    assert int(srv.info("persistence")["disk_objects_loaded"]) >= 4
    # Dropping deletes the saved copies too: nothing comes back after the next restart.
    assert r.execute_command("STATE.FREE", "kept") == 1
    r.execute_command("SSM.PREFIX.DROP", "hy")
    assert r.execute_command("ATTEND.PREFIX.DROP", "sl") == 2
    srv.stop()
    srv.start()
    r = srv.client()
    assert r.execute_command("SSM.PREFIX.FETCH", "hy", 0) is None
    assert r.execute_command("ATTEND.PREFIX.LOOKUP", "sl", 0) == b"MISS"
    with pytest.raises(Exception, match="no such state slot"):
        r.execute_command("STATE.READ", "kept", 0, 1)
    assert not any((srv.data_dir / "spill").iterdir())  # spills never outlive the process


def test_a_namespace_larger_than_memory_saves_and_comes_back(pion_factory):
    """SAVE streams each chunk from whichever tier holds it: a namespace four times the host
    budget is saved while most of it is on disk, and after a restart reads back exact."""
    srv = pion_factory("-w", "1", "--maxmemory", "2mb")
    r = srv.client()
    rng = np.random.default_rng(11)
    L, T, H, D = 8, 512, 4, 64  # 2 x 8 x 512 x 256 x 2 bytes = 4 MiB fp16
    r.execute_command("KV.PREFIX.REGISTER", "huge", L, T, H, D, "fp16")
    for part in ("pk", "pv"):
        for l in range(L):
            r.execute_command("V.STOREBATCH", f"huge_{part}", l * T,
                              f32(rng.standard_normal((T, H * D))))
    assert int(srv.info("memory")["used_memory"]) <= 2 * MB
    want = {p: [r.execute_command("V.FETCH", f"huge_{p}", "RANGE", l * T, (l + 1) * T, "RAW")
                for l in range(L)] for p in ("pk", "pv")}
    assert r.execute_command("KV.PREFIX.SAVE", "huge") == b"OK"
    assert int(srv.info("memory")["used_memory"]) <= 2 * MB
    srv.stop(signal.SIGKILL)
    srv.start()
    r = srv.client()
    assert r.execute_command("KV.PREFIX.LOOKUP", "huge") == b"HIT"
    for p in ("pk", "pv"):
        for l in range(L):
            got = r.execute_command("V.FETCH", f"huge_{p}", "RANGE", l * T, (l + 1) * T, "RAW")
            assert got == want[p][l], (p, l)
    assert int(srv.info("memory")["used_memory"]) <= 2 * MB


# ------------------------------------------------------------------------------------------
# Fault injection (pion-server-faults): typed errors, nothing lost, the server keeps serving
# ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("point,action", [("disk.write", "error"), ("disk.write", "short"),
                                          ("disk.fsync", "error"), ("disk.write", "nospace")])
def test_a_failed_save_is_typed_and_keeps_the_previous_version(pion_factory, point, action):
    srv = pion_factory("-w", "2", binary=faults_binary())
    r = srv.client()
    r.execute_command("SSM.PREFIX.STORE", "s", 0, b"version one")
    assert r.execute_command("SSM.PREFIX.SAVE", "s") == b"OK"
    r.execute_command("SSM.PREFIX.STORE", "s", 0, b"version two")
    r.execute_command("DEBUG.FAULT", "SET", point, action, "COUNT", -1, "TARGET", "ssm")
    with srv.raw() as c:
        reply = c.call("SSM.PREFIX.SAVE", "s")
    assert isinstance(reply, RespError) and str(reply).startswith("IOERR "), reply
    # Other objects, other families: served as before, saves elsewhere still work.
    r.execute_command("STATE.ALLOC", "other", 4)
    assert r.execute_command("STATE.SAVE", "other") == b"OK"
    assert r.execute_command("SSM.PREFIX.FETCH", "s", 0) == b"version two"  # memory intact
    assert int(srv.info("persistence")["disk_save_failures"]) >= 1
    r.execute_command("DEBUG.FAULT", "CLEAR")
    assert list((srv.data_dir / "ssm").glob("*.tmp")) == []  # nothing half-written left
    srv.stop(signal.SIGKILL)
    srv.start()
    r = srv.client()
    assert r.execute_command("SSM.PREFIX.FETCH", "s", 0) == b"version one"  # the acked save
    assert int(srv.info("persistence")["disk_objects_corrupt"]) == 0


@pytest.mark.parametrize("action", ["error", "short", "nospace"])
def test_a_failed_spill_loses_nothing_and_says_why(pion_factory, action):
    srv = pion_factory("-w", "1", "--maxmemory", "2mb", binary=faults_binary())
    r = srv.client()
    rng = np.random.default_rng(12)
    blobs = {i: rng.bytes(600_000) for i in range(3)}
    for i, b in blobs.items():
        r.execute_command("SSM.PREFIX.STORE", "f", i, b)
    r.execute_command("DEBUG.FAULT", "SET", "disk.write", action, "COUNT", -1, "TARGET", "spill")
    with srv.raw() as c:
        reply = c.call("SSM.PREFIX.STORE", "f", 9, rng.bytes(900_000))
    assert isinstance(reply, RespError), reply
    assert str(reply).startswith(("OOM tier=host", "IOERR")), reply
    assert "nothing was lost" in str(reply), reply
    for i, b in blobs.items():  # every stored blob still answers exactly
        assert r.execute_command("SSM.PREFIX.FETCH", "f", i) == b
    assert r.execute_command("SSM.PREFIX.FETCH", "f", 9) is None  # the refused one changed nothing
    assert res(srv)["residency_refused"] >= 1
    r.execute_command("DEBUG.FAULT", "CLEAR")
    assert r.execute_command("SSM.PREFIX.STORE", "f", 9, b"fits again") == b"OK"
    for i, b in blobs.items():
        assert r.execute_command("SSM.PREFIX.FETCH", "f", i) == b


def _mount_tmpfs(path, size):
    path.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        return False
    return subprocess.run(["mount", "-t", "tmpfs", "-o", "size=%s" % size, "tmpfs", str(path)],
                          capture_output=True).returncode == 0


def test_a_full_disk_refuses_typed_and_keeps_what_was_saved(pion_factory, tmp_path):
    """--dir on a 6 MiB tmpfs (or, without mount rights, ENOSPC from the fault switch once the
    saves pass 4 MiB): saves past it fail with a typed error, acknowledged ones stay intact."""
    disk = tmp_path / "small"
    mounted = _mount_tmpfs(disk, "6m")
    try:
        srv = pion_factory("-w", "2", "--dir", str(disk), "--disk-quota", "0",
                           binary=faults_binary())
        r = srv.client()
        rng = np.random.default_rng(13)
        saved = {}
        refused = None
        for i in range(12):
            payload = rng.bytes(MB)
            if not mounted and i == 4:
                r.execute_command("DEBUG.FAULT", "SET", "disk.write", "nospace", "COUNT", -1)
            r.execute_command("SSM.PREFIX.STORE", f"d{i}", 0, payload)
            with srv.raw() as c:
                reply = c.call("SSM.PREFIX.SAVE", f"d{i}")
            if reply == "OK":
                saved[f"d{i}"] = payload
            else:
                refused = reply
                assert str(reply).startswith(("IOERR", "OOM")), reply
                assert "No space left" in str(reply) or "tier=disk" in str(reply), reply
        assert refused is not None and len(saved) >= 3
        assert r.execute_command("PING") is True
        r.execute_command("DEBUG.FAULT", "CLEAR")
        srv.stop(signal.SIGKILL)
        srv.start()
        r = srv.client()
        for name, payload in saved.items():
            assert r.execute_command("SSM.PREFIX.FETCH", name, 0) == payload, name
        assert int(srv.info("persistence")["disk_objects_corrupt"]) == 0
        srv.stop()
    finally:
        if mounted:
            subprocess.run(["umount", str(disk)], capture_output=True)


def test_corrupt_replicas_heal_when_transient_and_are_refused_when_not(pion_factory):
    srv = pion_factory("-w", "1", "--maxmemory", "4mb", binary=faults_binary())
    r = srv.client()
    rng = np.random.default_rng(14)
    blobs = {i: rng.bytes(MB) for i in range(6)}
    for i, b in blobs.items():
        r.execute_command("SSM.PREFIX.STORE", "c", i, b)
    # A byte flipped on its way in from disk: read again, then served exactly.
    r.execute_command("DEBUG.FAULT", "SET", "disk.read", "corrupt", "COUNT", 1)
    assert r.execute_command("SSM.PREFIX.FETCH", "c", 0) == blobs[0]
    # A corrupted spill file: whatever lived in the damaged block is refused, never served;
    # every other blob still answers exactly.
    for f in (srv.data_dir / "spill").iterdir():
        data = bytearray(f.read_bytes())
        data[len(data) // 2] ^= 0xFF
        f.write_bytes(bytes(data))
    corrupt = 0
    for i, b in blobs.items():
        with srv.raw() as c:
            got = c.call("SSM.PREFIX.FETCH", "c", i)
        if isinstance(got, RespError):
            assert str(got).startswith("CORRUPT "), got
            corrupt += 1
        else:
            assert got == b, i
    assert corrupt >= 1
    assert res(srv)["residency_corrupt_replicas"] >= 1
    assert r.execute_command("PING") is True


def test_a_failed_gpu_copy_is_typed(pion_factory):
    srv = pion_factory("-w", "1", binary=faults_binary())
    if srv.info("attention")["attention_backend"] != "cuda":
        pytest.skip("needs the cuda backend (scripts/test-gpu.sh runs it on the GPU machine)")
    r = srv.client()
    k = np.ones((1, 64, 64), np.float32)
    r.execute_command("DEBUG.FAULT", "SET", "gpu.copy", "error", "COUNT", 1)
    with srv.raw() as c:
        reply = c.call("ATTEND.PREFIX.STORE", "g", 0, 1, 64, 64, f32(k), f32(k))
    assert isinstance(reply, RespError) and str(reply).startswith("DEVERR "), reply
    assert r.execute_command("ATTEND.PREFIX.LOOKUP", "g", 0) == b"MISS"
    assert r.execute_command("ATTEND.PREFIX.STORE", "g", 0, 1, 64, 64, f32(k), f32(k)) == b"OK"


def test_fault_switch_is_not_in_the_release_server(pion):
    with pion.raw() as c:
        reply = c.call("DEBUG.FAULT", "LIST")
    assert isinstance(reply, RespError) and "unknown command" in str(reply)


# ------------------------------------------------------------------------------------------
# kill -9 at random moments during saves, demotions and promotions of every family
# ------------------------------------------------------------------------------------------

class Ledger:
    """What each key may hold after a crash: its last acknowledged save, or any value whose
    save was sent after it (a save may complete without its reply being read)."""

    def __init__(self):
        self.acked: dict = {}
        self.maybe: dict = {}

    def sent(self, key, value):
        self.maybe.setdefault(key, []).append(value)

    def ok(self, key, value):
        self.acked[key] = value
        self.maybe[key] = []

    def allowed(self, key):
        return ([self.acked[key]] if key in self.acked else []) + self.maybe.get(key, [])


def _read(r, key):
    fam, name = key
    if fam == "ssm":
        return r.execute_command("SSM.PREFIX.FETCH", name, 0)
    if fam == "state":
        try:
            return r.execute_command("STATE.READ", name, 0, 4096)
        except Exception as e:  # noqa: BLE001
            if "no such state slot" in str(e):
                return None
            raise
    if fam == "attn":
        if r.execute_command("ATTEND.PREFIX.LOOKUP", name, 0) == b"MISS":
            return None
        q = np.ones((1, 64), np.float32)
        return r.execute_command("ATTEND.PREFIX.QUERY", name, 0, 1, 64, 0, f32(q))
    if fam == "kv":
        if r.execute_command("KV.PREFIX.LOOKUP", name) == b"MISS":
            return None
        return r.execute_command("V.FETCH", name + "_pk", "RANGE", 0, 256, "RAW")
    raise AssertionError(fam)


def _write_and_save(r, key, seed, ledger):
    """Writes a new value of `key`, then its save command; returns (value as _read returns it,
    the save command)."""
    fam, name = key
    rng = np.random.default_rng(seed)
    if fam == "ssm":
        v = rng.bytes(48 * 1024)
        r.execute_command("SSM.PREFIX.STORE", name, 0, v)
        return v, ("SSM.PREFIX.SAVE", name)
    if fam == "state":
        v = rng.bytes(4096)
        r.execute_command("STATE.ALLOC", name, 4096)
        r.execute_command("STATE.WRITE", name, 0, v)
        return v, ("STATE.SAVE", name)
    if fam == "attn":
        k = rng.standard_normal((1, 256, 64)).astype(np.float32)
        r.execute_command("ATTEND.PREFIX.STORE", name, 0, 1, 256, 64, f32(k), f32(k[:, ::-1]))
        q = np.ones((1, 64), np.float32)
        return (r.execute_command("ATTEND.PREFIX.QUERY", name, 0, 1, 64, 0, f32(q)),
                ("ATTEND.PREFIX.SAVE", name))
    if fam == "kv":
        ledger.sent(key, None)  # a DROP may take effect without its reply being read
        r.execute_command("KV.PREFIX.DROP", name)  # acknowledged: the old save is gone
        ledger.ok(key, None)
        r.execute_command("KV.PREFIX.REGISTER", name, 1, 256, 2, 64, "fp16")
        for part in ("pk", "pv"):
            r.execute_command("V.STOREBATCH", f"{name}_{part}", 0,
                              f32(rng.standard_normal((256, 128))))
        return (r.execute_command("V.FETCH", name + "_pk", "RANGE", 0, 256, "RAW"),
                ("KV.PREFIX.SAVE", name))
    raise AssertionError(fam)


@pytest.mark.time_limit(420)
def test_kill_loop_loses_no_acknowledged_save_and_serves_nothing_torn(pion_factory):
    rng = random.Random(404)
    # A small host budget: the workload's writes and reads demote and promote all the time.
    srv = pion_factory("-w", "2", "--maxmemory", "512kb", "--attention-backend", "cpu")
    keys = [(fam, f"{fam}{i}") for fam in ("ssm", "state", "attn", "kv") for i in range(4)]
    ledger = Ledger()
    kills = acked = promoted = demoted = 0
    for round_ in range(100):
        r = srv.client(socket_timeout=30)
        # After the crash: every key holds its last acknowledged save or a later one sent —
        # never anything else, never a torn value (reads promote from disk: the kill below may
        # land in these too, from the second round on they run under the killer's timer).
        for key in keys:
            got = _read(r, key)
            allowed = ledger.allowed(key)
            if key in ledger.acked:
                assert got in allowed, (round_, key)
            else:
                assert got is None or got in allowed, (round_, key)
        moved = res(srv)
        promoted += moved["residency_promotions_disk_host"]
        demoted += moved["residency_demotions_host_disk"] + moved["residency_drops_host"]
        # New values and their saves, with reads of other keys in between (under the 512 KiB
        # budget the writes demote and the reads promote), while a timer kills the server at a
        # random moment: during a write, a demotion, a save or a promotion.
        killer = threading.Timer(rng.uniform(0.0, 0.25),
                                 lambda: srv.proc.send_signal(signal.SIGKILL))
        killer.start()
        try:
            w = srv.client(socket_timeout=10)
            for key in rng.sample(keys, 6):
                value, save = _write_and_save(w, key, round_ * 1000 + keys.index(key), ledger)
                ledger.sent(key, value)
                if w.execute_command(*save) == b"OK":
                    ledger.ok(key, value)
                    acked += 1
                _read(w, rng.choice(keys))
        except Exception:  # noqa: BLE001 - the kill closes the connection at any point
            pass
        killer.join()
        if srv.proc.poll() is None:
            srv.proc.send_signal(signal.SIGKILL)
        srv.proc.wait(10)
        kills += 1
        srv.start()
    assert kills >= 100 and acked > 50, (kills, acked)
    assert promoted > 100 and demoted > 100, (promoted, demoted)
    r = srv.client()
    for key in keys:
        if key in ledger.acked:
            assert _read(r, key) in ledger.allowed(key), key
    for sub in ("ssm", "state", "attention", "prefixes"):
        assert list((srv.data_dir / sub).glob("*.tmp")) == []
    assert int(srv.info("persistence")["disk_objects_corrupt"]) == 0


# ------------------------------------------------------------------------------------------
# Deadlines at the compute stage, and the typed approximate fallback
# ------------------------------------------------------------------------------------------

def _kv_dict(flat):
    return {flat[i].decode() if isinstance(flat[i], bytes) else flat[i]: flat[i + 1]
            for i in range(0, len(flat), 2)}


def test_exact_query_is_refused_not_degraded_and_allow_approx_is_told(pion_factory):
    srv = pion_factory("-w", "1", "--attention-backend", "cpu")
    r = srv.client()
    rng = np.random.default_rng(30)
    h, n, d = 8, 16384, 128  # 64 MiB of K/V: a dense decode step takes milliseconds here
    k = rng.standard_normal((h, n, d)).astype(np.float32)
    v = rng.standard_normal((h, n, d)).astype(np.float32)
    assert r.execute_command("ATTEND.PREFIX.STORE", "big", 0, h, n, d, f32(k), f32(v)) == b"OK"
    q = rng.standard_normal((h, d)).astype(np.float32)
    for _ in range(3):  # the measured rate the admission uses
        exact = r.execute_command("ATTEND.PREFIX.QUERY", "big", 0, h, d, 0, f32(q))
    # The slot's block summaries (B = 64) made once beforehand: the fallback's first use would
    # build them inside its budget, a cost its estimate does not count (what this test checks is
    # the refusal and the told fallback, not that cost).
    r.execute_command("ATTEND.PREFIX.QUERY_SPARSE_AUTO", "big", 0, h, d, 64, 1, h, f32(q),
                      np.arange(h, dtype=np.int32).tobytes())
    _, rc = r.execute_command("ATTEND.PREFIX.QUERY", "big", 0, h, d, 0, f32(q), "RECEIPT")
    dense_us = float(_kv_dict(rc)["micros"])
    if dense_us < 2000:  # deadlines are whole milliseconds: none is below this step
        pytest.skip("a dense step of %.0f us here leaves no deadline below it" % dense_us)
    # Half the dense step's time: never enough for it, room for sparse.
    allowed_ms = max(1, int(dense_us / 2000))
    # An exact request that cannot be met is refused, naming the stage — never answered sparse.
    with srv.raw() as c:
        reply = c.call("ATTEND.PREFIX.QUERY", "big", 0, h, d, 0, f32(q), "DEADLINE", 1)
    assert isinstance(reply, RespError) and str(reply).startswith("TIMEOUT "), reply
    assert "compute stage" in str(reply) and "ALLOW APPROX" in str(reply), reply
    assert res(srv)["residency_refused_compute_deadline"] >= 1
    # Allowed: a sparse answer, with a receipt that says so.
    blob, receipt = r.execute_command("ATTEND.PREFIX.QUERY", "big", 0, h, d, 0, f32(q), "RECEIPT",
                                      "DEADLINE", allowed_ms, "ALLOW", "APPROX")
    rc = _kv_dict(receipt)
    assert rc["exact"] in (0, False) and rc["form"] == b"sparse_auto", rc
    assert b"approx" in rc["fallback"] and rc["blocks_chosen"] > 0, rc
    assert rc["rows_attended"] < h * n
    # It is exactly the sparse-auto answer the caller could have asked for.
    k_top = int(rc["fallback"].split(b" over ")[2].split(b" blocks")[0])
    same = r.execute_command("ATTEND.PREFIX.QUERY_SPARSE_AUTO", "big", 0, h, d, 64, k_top, h,
                             f32(q), np.arange(h, dtype=np.int32).tobytes(), "SHARED")
    assert same == blob
    assert np.abs(np.frombuffer(blob, np.float32) - np.frombuffer(exact, np.float32)).max() < 1.0
    assert int(srv.info("attention")["attention_approx_fallbacks"]) == 1
    # With time enough, ALLOW APPROX changes nothing: the exact answer.
    assert r.execute_command("ATTEND.PREFIX.QUERY", "big", 0, h, d, 0, f32(q), "DEADLINE", 60000,
                             "ALLOW", "APPROX") == exact


# ------------------------------------------------------------------------------------------
# Issue 54 §2: DEADLINE and ALLOW APPROX where the docs say, in any order, judged by rates
# measured on this machine
# ------------------------------------------------------------------------------------------

def test_deadline_on_vstore_commands_and_in_any_order(pion_factory):
    srv = pion_factory("-w", "1", "--attention-backend", "cpu")
    r = srv.client()
    rows = np.arange(64 * 16, dtype=np.float32).reshape(64, 16)
    r.execute_command("V.CREATE", "vd", 16, "fp32")
    assert r.execute_command("V.STOREBATCH", "vd", 0, rows.tobytes(), "DEADLINE", 1000) == 64
    assert r.execute_command("V.STOREBATCH", "vd", "IDS", np.array([70], np.int64).tobytes(),
                             rows[:1].tobytes(), "DEADLINE", 1000) == 1
    raw = r.execute_command("V.FETCH", "vd", "RANGE", 0, 64, "RAW")
    assert raw == rows.tobytes()
    for tail in (["RAW", "DEADLINE", 1000], ["DEADLINE", 1000, "RAW"]):
        assert r.execute_command("V.FETCH", "vd", "RANGE", 0, 64, *tail) == raw
    assert r.execute_command("V.FETCH", "vd", 3, 70, "DEADLINE", 500) == \
        np.concatenate([rows[3], rows[0]]).tobytes()
    with pytest.raises(Exception, match="DEADLINE must be a whole number"):
        r.execute_command("V.FETCH", "vd", "RANGE", 0, 64, "DEADLINE", "soon", "RAW")
    with srv.raw() as c:
        e = str(c.call("V.FETCH", "vd", "RANGE", 0))
    assert "MODEL <id>" in e and "GENERATION <g>" in e and "SHM" in e and "DEADLINE <ms>" in e, e
    # Attention: trailing options in any order, and an unknown one names all of them.
    rng = np.random.default_rng(4)
    k = rng.standard_normal((2, 128, 32)).astype(np.float32)
    r.execute_command("ATTEND.PREFIX.STORE", "ad", 0, 2, 128, 32, f32(k), f32(k))
    q = rng.standard_normal((4, 32)).astype(np.float32)
    want = r.execute_command("ATTEND.PREFIX.QUERY", "ad", 0, 4, 32, 0, f32(q))
    for tail in (["RECEIPT", "DEADLINE", 1000], ["DEADLINE", 1000, "RECEIPT"],
                 ["ALLOW", "APPROX", "RECEIPT", "DEADLINE", 1000],
                 ["DEADLINE", 1000, "QPOS", 128, "ALLOW", "APPROX", "RECEIPT"]):
        out, rc = r.execute_command("ATTEND.PREFIX.QUERY", "ad", 0, 4, 32, 0, f32(q), *tail)
        assert out == want, tail
        assert float(_kv_dict(rc)["estimate_us"]) >= 0
    with srv.raw() as c:
        e = str(c.call("ATTEND.PREFIX.QUERY", "ad", 0, 4, 32, 0, f32(q), "DEADLINE", 1000,
                       "SOON"))
    assert e.startswith("ERR unexpected argument 'SOON'"), e
    assert "DEADLINE <ms>" in e and "ALLOW APPROX" in e and "RECEIPT" in e, e


def _wall_ms(fn, reps=5):
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return sorted(times)[len(times) // 2]


def test_deadline_estimate_is_this_machines_measured_rate(pion_factory):
    """The user's case: CPU slot H=8 N=32768 D=128, 32 query heads. A query that takes T is
    never refused with a deadline >= 1.5·T, on a fresh server (the first deadline measures the
    rate) and after queries ran; the refusal of one that cannot be met names the estimate."""
    srv = pion_factory("-w", "1", "--attention-backend", "cpu")
    r = srv.client()
    rng = np.random.default_rng(54)
    h, n, d, hq = 8, 32768, 128, 32
    k = rng.standard_normal((h, n, d)).astype(np.float32)
    v = rng.standard_normal((h, n, d)).astype(np.float32)
    assert r.execute_command("ATTEND.PREFIX.STORE", "u", 0, h, n, d, f32(k), f32(v)) == b"OK"
    q = rng.standard_normal((hq, d)).astype(np.float32)
    query = ["ATTEND.PREFIX.QUERY", "u", 0, hq, d, 0, f32(q)]
    # Fresh: a generous deadline is met (the key is measured on first use, not guessed).
    assert r.execute_command(*query, "DEADLINE", 60000) == r.execute_command(*query)
    t_ms = _wall_ms(lambda: r.execute_command(*query))
    deadline = max(2, int(np.ceil(1.5 * t_ms)))
    refused = 0
    for _ in range(10):
        try:
            r.execute_command(*query, "DEADLINE", deadline)
        except Exception as e:  # noqa: BLE001 - counted, then asserted with the text
            assert "TIMEOUT" in str(e) or "deadline" in str(e), e
            refused += 1
    assert refused == 0, "refused %d of 10 with DEADLINE %d ms >= 1.5 x %.2f ms" % (
        refused, deadline, t_ms)
    _, rc = r.execute_command(*query, "RECEIPT")
    rc = _kv_dict(rc)
    est, took = float(rc["estimate_us"]), float(rc["micros"])
    assert 0 < est and 0.5 < est / took < 1.5, rc
    with srv.raw() as c:
        e = str(c.call(*query, "DEADLINE", 1))
    if t_ms > 3:  # a machine fast enough to answer in a millisecond has nothing to refuse
        assert e.startswith("TIMEOUT deadline cannot be met: dense attention is estimated at"), e
        assert "rate measured here for cpu dense fp32 m1 pool" in e, e


def test_allow_approx_only_where_sparse_is_faster(pion_factory):
    """ALLOW APPROX answers sparse only where the sparse pass is estimated to finish sooner than
    the exact one; its receipt carries both estimates, and the measured time agrees."""
    srv = pion_factory("-w", "1", "--attention-backend", "cpu")
    r = srv.client()
    rng = np.random.default_rng(55)
    h, n, d, hq = 8, 32768, 128, 32
    k = rng.standard_normal((h, n, d)).astype(np.float32)
    v = rng.standard_normal((h, n, d)).astype(np.float32)
    r.execute_command("ATTEND.PREFIX.STORE", "ap", 0, h, n, d, f32(k), f32(v))
    q = rng.standard_normal((hq, d)).astype(np.float32)
    query = ["ATTEND.PREFIX.QUERY", "ap", 0, hq, d, 0, f32(q)]
    for _ in range(3):
        _, rc = r.execute_command(*query, "RECEIPT")
    dense_us = float(_kv_dict(rc)["micros"])
    # The slot's block summaries, built once beforehand (a first fallback would count reading
    # all of K for them in its estimate, and could not beat the exact step).
    hm = np.repeat(np.arange(h, dtype=np.int32), hq // h)
    r.execute_command("ATTEND.PREFIX.QUERY_SPARSE_AUTO", "ap", 0, hq, d, 64, 8, h, f32(q),
                      hm.tobytes(), "SHARED")  # builds them (and measures the sparse kind)
    if dense_us < 2000:  # deadlines are whole milliseconds: none is below this step
        pytest.skip("a dense step of %.0f us leaves no deadline to fall back under" % dense_us)
    deadline = max(1, int(dense_us / 2000))  # half the dense step
    out, rc = r.execute_command(*query, "RECEIPT", "DEADLINE", deadline, "ALLOW", "APPROX")
    rc = _kv_dict(rc)
    assert rc["exact"] in (0, False) and rc["form"] == b"sparse_auto", rc
    fallback = rc["fallback"].decode()
    dense_est = float(fallback.split("estimated at ")[1].split(" ms")[0])
    sparse_est = float(fallback.split("estimated at ")[2].split(" ms")[0])
    assert sparse_est < dense_est and sparse_est <= deadline, fallback
    # One millisecond: a few blocks' sparse pass where that fits, else refused.
    with srv.raw() as c:
        reply = c.call(*query, "RECEIPT", "DEADLINE", 1, "ALLOW", "APPROX")
    if isinstance(reply, RespError):
        assert str(reply).startswith("TIMEOUT deadline cannot be met"), reply
    else:
        rc = _kv_dict(reply[1])
        assert rc["form"] == b"sparse_auto" and float(rc["estimate_us"]) <= 1000, rc


def test_python_helpers_take_deadline_and_allow_approx(pion_factory):
    import sys
    sys.path.insert(0, str(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..",
                                        "clients", "python")))
    import pion
    srv = pion_factory("-w", "1", "--attention-backend", "cpu")
    rng = np.random.default_rng(56)
    h, n, d = 8, 16384, 128
    k = rng.standard_normal((h, n, d)).astype(np.float32)
    with pion.Client(port=srv.port) as c:
        c.attend.store("py", 0, k, k, deadline_ms=60000)
        q = rng.standard_normal((h, d)).astype(np.float32)
        for _ in range(3):
            res_ = c.attend.query("py", 0, q, receipt=True, deadline_ms=60000)
        if float(res_.receipt["micros"]) > 3000:
            with pytest.raises(pion.DeadlineError, match="deadline cannot be met"):
                c.attend.query("py", 0, q, deadline_ms=1)
        ok = c.attend.query("py", 0, q, receipt=True, deadline_ms=60000, allow_approx=True)
        assert ok.receipt["exact"] is True
        c.state.alloc("st", 16, deadline_ms=100)
        c.state.write("st", 0, b"x" * 16, deadline_ms=100)
        assert c.state.read("st", 0, 16, deadline_ms=100) == b"x" * 16
        c.ssm.store_blob("sm", 0, b"blob", deadline_ms=100)
        assert c.ssm.fetch_blob("sm", 0, deadline_ms=100) == b"blob"
        with pytest.raises(ValueError, match="deadline_ms"):
            c.state.read("st", 0, 16, deadline_ms=0)


# Clean copies: an object with a valid disk copy can always give up its host copy
# ------------------------------------------------------------------------------------------

def _saved_mix(r, rng, namespaces, slots):
    """KV.PREFIX namespaces of 512 KiB (fp16, 256 x 4 x 128 per session) and, per slot, a 1 MiB
    ATTEND.PREFIX slot, a 512 KiB STATE slot and a 256 KiB SSM layer — all saved."""
    for i in range(namespaces):
        ns = "ns%d" % i
        r.execute_command("KV.PREFIX.REGISTER", ns, 1, 256, 4, 128, "fp16")
        for part in ("pk", "pv"):
            r.execute_command("V.STOREBATCH", f"{ns}_{part}", 0,
                              f32(rng.standard_normal((256, 512))))
        assert r.execute_command("KV.PREFIX.SAVE", ns) == b"OK"
    q = rng.standard_normal((4, 128)).astype(np.float32)
    want = {}
    for i in range(slots):
        k = rng.standard_normal((4, 256, 128)).astype(np.float32)
        r.execute_command("ATTEND.PREFIX.STORE", f"a{i}", 0, 4, 256, 128, f32(k), f32(k[:, ::-1]))
        assert r.execute_command("ATTEND.PREFIX.SAVE", f"a{i}") == b"OK"
        want[("attn", i)] = r.execute_command("ATTEND.PREFIX.QUERY", f"a{i}", 0, 4, 128, 0, f32(q))
        want[("state", i)] = rng.bytes(MB // 2)
        r.execute_command("STATE.ALLOC", f"s{i}", MB // 2)
        r.execute_command("STATE.WRITE", f"s{i}", 0, want[("state", i)])
        assert r.execute_command("STATE.SAVE", f"s{i}") == b"OK"
        want[("ssm", i)] = rng.bytes(MB // 4)
        r.execute_command("SSM.PREFIX.STORE", f"h{i}", 0, want[("ssm", i)])
        assert r.execute_command("SSM.PREFIX.SAVE", f"h{i}") == b"OK"
    return q, want


def _read_saved(r, fam, i, q):
    if fam == "attn":
        return r.execute_command("ATTEND.PREFIX.QUERY", f"a{i}", 0, 4, 128, 0, f32(q))
    if fam == "state":
        return r.execute_command("STATE.READ", f"s{i}", 0, MB // 2)
    return r.execute_command("SSM.PREFIX.FETCH", f"h{i}", 0)


def test_saved_objects_always_give_up_memory_after_a_restart(pion_factory):
    """Issue 51: after a restart every object is known by its saved file; reading twice the
    host budget of KV.PREFIX chunks, then every other family's saved objects, one client at a
    time, must never answer -OOM: each host copy read from a saved file can be dropped (nothing
    is in flight, nothing needs a write)."""
    srv = pion_factory("-w", "2", "--maxmemory", "16mb", "--attention-backend", "cpu")
    r = srv.client(socket_timeout=30)
    rng = np.random.default_rng(51)
    q, want = _saved_mix(r, rng, namespaces=32, slots=12)
    srv.stop()
    srv.start()
    r = srv.client(socket_timeout=30)
    refused = []
    for _ in range(2):
        for i in range(32):  # 32 MiB of chunks through a 16 MiB budget
            for part in ("pk", "pv"):
                r.execute_command("V.FETCH", f"ns{i}_{part}", "RANGE", 0, 256, "RAW")
        for fam in ("attn", "state", "ssm"):
            for i in range(12):
                try:
                    got = _read_saved(r, fam, i, q)
                except Exception as e:  # noqa: BLE001 - a refusal is the finding
                    refused.append((fam, i, str(e)))
                    continue
                assert got == want[(fam, i)], (fam, i)
    assert not refused, refused[:3]
    after = res(srv)
    assert after["residency_demotions_host_disk"] == 0  # dropped, never written
    assert after["residency_drops_host"] > 0
    assert int(srv.info("memory")["used_memory"]) <= 16 * MB


def test_a_full_spill_disk_still_serves_saved_objects(pion_factory):
    """Issue 51: with every spill write failing for want of space, saved objects still read back
    under memory pressure (their host copies go without a write, before any unsaved object is
    written out), and a write that would need a spill is refused -OOM tier=host (PROTOCOL.md §
    Errors common to every command), nothing lost."""
    srv = pion_factory("-w", "2", "--maxmemory", "8mb", "--attention-backend", "cpu",
                       binary=faults_binary())
    r = srv.client(socket_timeout=30)
    rng = np.random.default_rng(52)
    q, want = _saved_mix(r, rng, namespaces=16, slots=8)
    srv.stop()
    srv.start()  # every saved object is known by its file only
    r = srv.client(socket_timeout=30)
    unsaved = {i: rng.bytes(MB // 2) for i in range(4)}  # 2 MiB only in memory
    for i, value in unsaved.items():
        r.execute_command("SSM.PREFIX.STORE", "u", i, value)
    r.execute_command("DEBUG.FAULT", "SET", "disk.write", "nospace", "COUNT", -1, "TARGET", "spill")
    for _ in range(2):  # twice the budget of chunks, then every other saved object
        for i in range(16):
            for part in ("pk", "pv"):
                r.execute_command("V.FETCH", f"ns{i}_{part}", "RANGE", 0, 256, "RAW")
        for fam in ("attn", "state", "ssm"):
            for i in range(8):
                assert _read_saved(r, fam, i, q) == want[(fam, i)], (fam, i)
    for i, value in unsaved.items():
        assert r.execute_command("SSM.PREFIX.FETCH", "u", i) == value, i
    assert res(srv)["residency_demotions_host_disk"] == 0
    # Memory full of unsaved bytes: more of them would need a spill, and the disk is full.
    refused = None
    for i in range(4, 40):
        with srv.raw() as c:
            reply = c.call("SSM.PREFIX.STORE", "u", i, rng.bytes(MB // 2))
        if isinstance(reply, RespError):
            refused = str(reply)
            break
    assert refused is not None
    assert refused.startswith("OOM tier=host: demotion to disk failed, nothing was lost"), refused
    assert "No space left on device" in refused, refused
    r.execute_command("DEBUG.FAULT", "CLEAR")
    for i, value in unsaved.items():
        assert r.execute_command("SSM.PREFIX.FETCH", "u", i) == value, i
    for fam in ("attn", "state", "ssm"):
        for i in range(8):
            assert _read_saved(r, fam, i, q) == want[(fam, i)], (fam, i)
