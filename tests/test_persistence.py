"""The disk tier: KV.PREFIX.SAVE/WARM, restart, corruption, coalesced promotion, and a crash
loop that kill -9s the server during saves and then checks that every acknowledged save is
intact and nothing torn is served."""
from __future__ import annotations

import random
import signal
import socket
import threading
import time

import numpy as np
import pytest

from pionlib import RespError, encode

L, T, H, D = 4, 256, 2, 64
DIM = H * D


def make_prefix(r, ns, fmt="fp16", seed=0, model="m", rows=L * T):
    """A namespace with its first `rows` rows written (all: complete, so published)."""
    r.execute_command("KV.PREFIX.REGISTER", ns, L, T, H, D, fmt, "MODEL", model, "PREFILL_MS", 50)
    rng = np.random.default_rng(seed)
    for part in ("pk", "pv"):
        x = rng.standard_normal((rows, DIM)).astype(np.float32)
        r.execute_command("V.STOREBATCH", f"{ns}_{part}", 0, x.tobytes())
    return {part: r.execute_command("V.FETCH", f"{ns}_{part}", "RANGE", 0, rows, "RAW")
            for part in ("pk", "pv")}


def info(r, ns):
    flat = r.execute_command("KV.PREFIX.INFO", ns)
    return {flat[i].decode(): flat[i + 1] for i in range(0, len(flat), 2)}


def restart(srv, sig=signal.SIGTERM):
    srv.stop(sig)
    return srv.start()


@pytest.mark.parametrize("fmt", ["fp32", "bf16", "int8", "turbo3", "fp8", "fp8_e5m2"])
def test_saved_prefix_survives_restart_byte_exact(pion_factory, fmt):
    srv = pion_factory("-w", "2")
    r = srv.client()
    want = make_prefix(r, "p", fmt=fmt, seed=3)
    assert r.execute_command("KV.PREFIX.SAVE", "p") == b"OK"
    i = info(r, "p")
    assert i["saved_version"] >= 1 and i["bytes_disk"] > 0 and i["resident"] == 1
    restart(srv)
    r = srv.client()
    i = info(r, "p")
    assert i["resident"] == 0 and i["complete"] == 1 and i["model"] == b"m"
    assert i["cache_generation"] == 1
    blocks = r.execute_command("KV.PREFIX.BLOCKS", "p")
    assert all(b[b.index(b"tier") + 1] == b"disk" and b[b.index(b"saved") + 1] == 1 for b in blocks)
    # A LOOKUP naming another model never brings anything in.
    assert r.execute_command("KV.PREFIX.LOOKUP", "p", "MODEL", "other") == b"MISS"
    assert r.execute_command("KV.PREFIX.LOOKUP", "p", "MODEL", "m") == b"HIT"  # promotes
    for part in ("pk", "pv"):
        assert r.execute_command("V.FETCH", f"p_{part}", "RANGE", 0, L * T, "RAW") == want[part]
    assert info(r, "p")["resident"] == 1
    assert int(srv.info("persistence")["disk_objects_loaded"]) == 1
    # Same identity after restart: idempotent; another identity: refused.
    assert r.execute_command("KV.PREFIX.REGISTER", "p", L, T, H, D, fmt, "MODEL", "m") == b"OK"
    with pytest.raises(Exception, match="is registered with model 'm'"):
        r.execute_command("KV.PREFIX.REGISTER", "p", L, T, H, D, fmt, "MODEL", "m2")


def test_warm_explicit_and_save_is_point_in_time(pion_factory):
    srv = pion_factory()
    r = srv.client()
    # Not complete (a published namespace never changes): written but its last row.
    want = make_prefix(r, "w", seed=1, rows=L * T - 1)
    assert r.execute_command("KV.PREFIX.SAVE", "w") == b"OK"
    # Writes after the save are not in the saved version.
    r.execute_command("V.STOREBATCH", "w_pk", 0, np.zeros((T, DIM), np.float32).tobytes())
    restart(srv)
    r = srv.client()
    assert r.execute_command("KV.PREFIX.WARM", "w") == b"OK"
    assert r.execute_command("KV.PREFIX.WARM", "w") == b"OK"  # already resident
    assert r.execute_command("V.FETCH", "w_pk", "RANGE", 0, L * T - 1, "RAW") == want["pk"]


def test_concurrent_lookups_promote_once(pion_factory):
    srv = pion_factory("-w", "2")
    r = srv.client()
    make_prefix(r, "hot", seed=2)
    r.execute_command("KV.PREFIX.SAVE", "hot")
    restart(srv)
    results, barrier = [], threading.Barrier(30)

    def lookup():
        c = srv.client()
        barrier.wait(10)
        results.append(c.execute_command("KV.PREFIX.LOOKUP", "hot"))

    threads = [threading.Thread(target=lookup) for _ in range(30)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert results == [b"HIT"] * 30
    assert int(srv.info("persistence")["disk_warms"]) == 1  # one read served every client


def test_corrupted_object_is_reported_and_never_served(pion_factory):
    srv = pion_factory()
    r = srv.client()
    make_prefix(r, "good", seed=4)
    make_prefix(r, "bad", seed=5)
    make_prefix(r, "torn", seed=6)
    for ns in ("good", "bad", "torn"):
        assert r.execute_command("KV.PREFIX.SAVE", ns) == b"OK"
    paths = {ns: info(r, ns) for ns in ("bad", "torn")}
    srv.stop()
    files = sorted((srv.data_dir / "prefixes").glob("*.pobj"))
    assert len(files) == 3
    by_name = {}
    for f in files:
        for ns in ("good", "bad", "torn"):
            if f.name.split(".")[0].endswith(ns.encode().hex()):
                by_name[ns] = f
    data = bytearray(by_name["bad"].read_bytes())
    data[len(data) - 1000] ^= 0xFF  # inside the last chunk: found when the blocks are read
    by_name["bad"].write_bytes(bytes(data))
    raw = by_name["torn"].read_bytes()
    by_name["torn"].write_bytes(raw[: len(raw) // 2])  # truncated: refused at start-up
    srv.start()
    r = srv.client()
    assert int(srv.info("persistence")["disk_objects_corrupt"]) == 1  # the torn one, at start
    assert r.execute_command("KV.PREFIX.LOOKUP", "torn") == b"MISS"
    with srv.raw() as c:
        assert str(c.call("KV.PREFIX.WARM", "torn")).startswith("CORRUPT ")
        assert str(c.call("KV.PREFIX.WARM", "bad")).startswith("CORRUPT ")
        assert "block" in str(c.call("KV.PREFIX.WARM", "bad"))
    assert r.execute_command("KV.PREFIX.LOOKUP", "bad") == b"MISS"
    with pytest.raises(Exception, match="^CORRUPT namespace 'bad'"):  # not one row of it
        r.execute_command("V.FETCH", "bad_pk", 0)
    assert int(srv.info("persistence")["disk_objects_corrupt"]) == 2
    assert r.execute_command("KV.PREFIX.LOOKUP", "good") == b"HIT"
    assert "corrupt" in srv.log_text().lower()
    # A corrupt namespace can be dropped (deleted from disk) and registered anew.
    assert r.execute_command("KV.PREFIX.DROP", "bad") == 1
    assert not by_name["bad"].exists()


def test_drop_deletes_from_disk_and_generation_keeps_rising(pion_factory):
    srv = pion_factory()
    r = srv.client()
    make_prefix(r, "d", seed=7)
    r.execute_command("KV.PREFIX.SAVE", "d")
    g1 = info(r, "d")["cache_generation"]
    assert r.execute_command("KV.PREFIX.DROP", "d") == 1
    assert list((srv.data_dir / "prefixes").glob("*.pobj")) == []
    make_prefix(r, "d", seed=8)
    r.execute_command("KV.PREFIX.SAVE", "d")
    g2 = info(r, "d")["cache_generation"]
    assert g2 > g1
    restart(srv)
    r = srv.client()
    assert info(r, "d")["cache_generation"] == g2
    with srv.raw() as c:
        assert str(c.call("KV.PREFIX.LOOKUP", "d", "GENERATION", g1)).startswith("MISMATCH")
    assert r.execute_command("KV.PREFIX.DROP", "d") == 1
    make_prefix(r, "d", seed=9)
    assert info(r, "d")["cache_generation"] > g2  # above what was on disk


def test_save_errors(pion_factory):
    srv = pion_factory()
    with srv.raw() as c:
        assert str(c.call("KV.PREFIX.SAVE", "nope")) == "ERR no such prefix namespace 'nope'"
        assert str(c.call("KV.PREFIX.WARM", "nope")) == "ERR no such prefix namespace 'nope'"
        c.call("KV.PREFIX.REGISTER", "v", L, T, H, D, "fp16")
        c.call("V.DROP", "v_pk")
        assert "has lost its sessions" in str(c.call("KV.PREFIX.SAVE", "v"))


def test_crash_loop_acknowledged_saves_survive(pion_factory):
    """kill -9 at random moments during saves, 50 times. Every save that was acknowledged
    must come back byte-exact; nothing torn is ever served."""
    rng = random.Random(2026)
    srv = pion_factory("-w", "2", "--io-threads", "2")
    acked: dict[str, tuple[int, dict]] = {}  # ns -> (seed, raw bytes) of its last acked save
    names = [f"c{i}" for i in range(6)]
    acked_saves = interrupted_saves = 0
    for round_ in range(50):
        r = srv.client(socket_timeout=20)
        # Every acknowledged save so far is intact (promoted from disk after the crash).
        for ns, (seed, want) in acked.items():
            assert r.execute_command("KV.PREFIX.LOOKUP", ns) == b"HIT", (round_, ns)
            for part in ("pk", "pv"):
                got = r.execute_command("V.FETCH", f"{ns}_{part}", "RANGE", 0, L * T, "RAW")
                assert got == want[part], (round_, ns, part)
        # Overwrite some namespaces with new contents and save them, pipelined, while a
        # timer kills the server at a random moment.
        batch = rng.sample(names, 3)
        pending = {}
        for ns in batch:
            seed = round_ * 100 + names.index(ns)
            r.execute_command("KV.PREFIX.DROP", ns)
            if ns in acked:
                del acked[ns]  # the drop was acknowledged: the old save is gone
            pending[ns] = (seed, make_prefix(r, ns, seed=seed))
        killer = threading.Timer(rng.uniform(0.0, 0.03), lambda: srv.proc.send_signal(signal.SIGKILL))
        killer.start()
        try:
            with socket.create_connection(("127.0.0.1", srv.port), timeout=5) as s:
                s.sendall(b"".join(encode("KV.PREFIX.SAVE", ns) for ns in batch))
                buf = b""
                while buf.count(b"\r\n") < len(batch):
                    chunk = s.recv(4096)
                    if not chunk:
                        break
                    buf += chunk
                for ns, line in zip(batch, buf.split(b"\r\n")):
                    if line == b"+OK":
                        acked[ns] = pending[ns]
                        acked_saves += 1
        except OSError:
            pass
        interrupted_saves += len(batch) - sum(1 for ns in batch if ns in acked)
        killer.join()
        srv.proc.wait(10)
        srv.start()
    # The kills really landed in the middle of saves, and some saves did complete.
    assert acked_saves > 10 and interrupted_saves > 10, (acked_saves, interrupted_saves)
    r = srv.client()
    for ns, (seed, want) in acked.items():
        assert r.execute_command("KV.PREFIX.LOOKUP", ns) == b"HIT"
        assert r.execute_command("V.FETCH", f"{ns}_pv", "RANGE", 0, L * T, "RAW") == want["pv"]
    # No temp file survives a restart, and nothing that failed validation was served.
    assert list((srv.data_dir / "prefixes").glob("*.tmp")) == []
    assert int(srv.info("persistence")["disk_objects_corrupt"]) == 0


def test_memory_pressure_moves_chunks_to_disk_and_loses_nothing(pion_factory):
    """--maxmemory: the least recently used chunks leave memory — a saved, unmodified chunk
    without any write (its saved copy is its disk copy), an unsaved one by a verified spill
    write — and come back when read. Nothing is evicted, every namespace stays a HIT."""
    prefix_bytes = 2 * L * T * DIM * 2  # K and V, fp16: 512 KiB
    budget = int(prefix_bytes * 2.5)
    srv = pion_factory("-w", "1", "--maxmemory", str(budget))
    r = srv.client()
    want = {ns: make_prefix(r, ns, seed=i) for i, ns in enumerate(("a", "b"))}
    for ns in ("a", "b"):
        assert r.execute_command("KV.PREFIX.SAVE", ns) == b"OK"
    spills_before = int(srv.info("residency")["residency_spill_files"])
    want["c"] = make_prefix(r, "c", seed=2)  # needs room: saved chunks go, no write needed
    res = srv.info("residency")
    assert int(res["residency_drops_host"]) >= 1
    assert int(res["residency_spill_files"]) == spills_before
    assert int(srv.info("memory")["used_memory"]) <= budget
    want["d"] = make_prefix(r, "d", seed=3)  # c and d are unsaved: a spill now
    want["e"] = make_prefix(r, "e", seed=4)
    assert int(srv.info("residency")["residency_demotions_host_disk"]) >= 1
    assert int(srv.info("memory")["used_memory"]) <= budget
    for ns in ("a", "b", "c", "d", "e"):
        assert r.execute_command("KV.PREFIX.LOOKUP", ns) == b"HIT"
        for part in ("pk", "pv"):
            assert r.execute_command("V.FETCH", f"{ns}_{part}", "RANGE", 0, L * T, "RAW") == \
                want[ns][part], (ns, part)
        assert int(srv.info("memory")["used_memory"]) <= budget
    blocks = r.execute_command("KV.PREFIX.BLOCKS", "a")
    assert {b[b.index(b"tier") + 1] for b in blocks} <= {b"ram", b"disk"}
    assert int(srv.info("persistence")["evictions"]) == 0


def test_vcommit_seals_a_snapshot_that_survives_restart(pion_factory):
    srv = pion_factory("-w", "2")
    r = srv.client()
    dim = 96
    r.execute_command("V.CREATE", "sess", dim, "int8")
    a = np.random.default_rng(1).standard_normal((300, dim)).astype(np.float32)
    r.execute_command("V.STOREBATCH", "sess", 0, a.tobytes())
    snap = r.execute_command("V.SNAPSHOT", "sess")
    want = r.execute_command("V.FETCH", "sess", "RANGE", 0, 300, "RAW")
    # Writes after the snapshot are not sealed.
    r.execute_command("V.STOREBATCH", "sess", 0, np.zeros((10, dim), np.float32).tobytes())
    assert r.execute_command("V.COMMIT", "sess", snap) == b"OK"
    assert r.execute_command("V.COMMIT", "sess", snap) == b"OK"  # idempotent
    info = r.execute_command("V.INFO", "sess")
    assert info[info.index(b"sealed") + 1] == 1
    restart(srv, signal.SIGKILL)  # not even a clean shutdown
    r = srv.client()
    with pytest.raises(Exception, match="no such session 'sess'"):
        r.execute_command("V.FETCH", "sess", 0)
    assert r.execute_command("V.RESTORE", "sess", snap) == b"OK"
    assert r.execute_command("V.FETCH", "sess", "RANGE", 0, 300, "RAW") == want
    assert r.execute_command("V.SNAPSHOT", "sess") > snap  # ids continue above sealed ones
    with srv.raw() as c:
        assert str(c.call("V.RESTORE", "sess", 999)) == "ERR no snapshot 999 of session 'sess'"
        assert str(c.call("V.COMMIT", "sess", 999)) == "ERR no snapshot 999 of session 'sess'"
        assert str(c.call("V.COMMIT", "nope", 1)) == "ERR no such session 'nope'"
    assert r.execute_command("V.DROP", "sess") == 1
    assert list((srv.data_dir / "vsnap").glob("*.pobj")) == []
    restart(srv)
    with srv.raw() as c:
        assert str(c.call("V.RESTORE", "sess", snap)) == "ERR no such session 'sess'"


def _everything_unsaved(r):
    """One object of every family, none of them (wholly) saved: returns what must come back."""
    rng = np.random.default_rng(54)
    want = {}
    r.execute_command("STATE.ALLOC", "saved", 8)
    r.execute_command("STATE.WRITE", "saved", 0, b"old-old!")
    assert r.execute_command("STATE.SAVE", "saved") == b"OK"
    r.execute_command("STATE.WRITE", "saved", 0, b"new-new!")  # after the last SAVE
    r.execute_command("STATE.ALLOC", "unsaved", 8)               # never saved
    r.execute_command("STATE.WRITE", "unsaved", 0, b"fresh!!!")
    want["state"] = {"saved": b"new-new!", "unsaved": b"fresh!!!"}
    want["prefix"] = make_prefix(r, "ns", seed=7)                 # never saved
    blob = rng.bytes(5000)
    r.execute_command("SSM.PREFIX.STORE", "ssm", 3, blob)
    want["ssm"] = blob
    k = rng.standard_normal((2, 100, 32)).astype(np.float32)
    v = rng.standard_normal((2, 100, 32)).astype(np.float32)
    r.execute_command("ATTEND.PREFIX.STORE", "slot", 0, 2, 100, 32, k.tobytes(), v.tobytes())
    q = rng.standard_normal((4, 32)).astype(np.float32)
    want["attend"] = (q, r.execute_command("ATTEND.PREFIX.QUERY", "slot", 0, 4, 32, 0, q.tobytes()))
    rows = rng.standard_normal((130, 24)).astype(np.float32)
    r.execute_command("V.CREATE", "vs", 24, "bf16")
    r.execute_command("V.STOREBATCH", "vs", 0, rows.tobytes())
    want["v"] = r.execute_command("V.FETCH", "vs", "RANGE", 0, 130, "RAW")
    r.execute_command("V.CREATE", "empty", 8, "fp32")  # a session with no rows is kept too
    return want


def _shutdown(srv, *args):
    with srv.raw() as c:
        c.send(encode("SHUTDOWN", *args))
        c.expect_closed()  # like Redis: no reply on success
    srv.proc.wait(timeout=30)
    assert srv.proc.returncode == 0


def test_shutdown_save_saves_every_family(pion_factory):
    """Issue 54 §3: SHUTDOWN SAVE persists every dirty object of every family before it exits
    (a slot written after its last STATE.SAVE, a slot never saved, a prefix, an SSM session, an
    attention slot, V sessions); the restart serves them all, byte-exact."""
    srv = pion_factory("-w", "2")
    want = _everything_unsaved(srv.client())
    _shutdown(srv, "SAVE")
    log = srv.log_text()
    assert "SHUTDOWN SAVE: saved" in log and "STATE 2" in log and "KV.PREFIX 1" in log, log
    assert "every stored object is saved" in log
    srv.start()
    r = srv.client()
    for key, data in want["state"].items():
        assert r.execute_command("STATE.READ", key, 0, 8) == data
    assert r.execute_command("KV.PREFIX.LOOKUP", "ns", "MODEL", "m") == b"HIT"
    for part in ("pk", "pv"):
        assert r.execute_command("V.FETCH", f"ns_{part}", "RANGE", 0, L * T, "RAW") == \
            want["prefix"][part]
    assert r.execute_command("SSM.PREFIX.FETCH", "ssm", 3) == want["ssm"]
    q, out = want["attend"]
    assert r.execute_command("ATTEND.PREFIX.QUERY", "slot", 0, 4, 32, 0, q.tobytes()) == out
    assert r.execute_command("V.FETCH", "vs", "RANGE", 0, 130, "RAW") == want["v"]
    assert r.execute_command("V.INFO", "empty")[1] == 8
    # Unchanged since: a second SHUTDOWN SAVE writes nothing, and the sessions come back again
    # from one image each (the older ones are replaced, not piled up).
    _shutdown(srv, "SAVE")
    assert srv.log_text().count("SHUTDOWN SAVE: saved nothing") == 1
    srv.start()
    r = srv.client()
    assert r.execute_command("V.FETCH", "vs", "RANGE", 0, 130, "RAW") == want["v"]
    info = dict(zip(*[iter(r.execute_command("V.INFO", "vs"))] * 2))
    assert info[b"sealed"] == 1


@pytest.mark.parametrize("how", ["nosave", "sigterm"])
def test_exit_without_save_drops_and_says_what(pion_factory, how):
    """SHUTDOWN NOSAVE (or a SIGTERM) saves nothing: what was never saved is gone after the
    restart, the last saved bytes come back, and the log names what was dropped per family."""
    srv = pion_factory("-w", "2")
    _everything_unsaved(srv.client())
    if how == "nosave":
        _shutdown(srv, "NOSAVE")
    else:
        srv.stop(signal.SIGTERM)
    log = srv.log_text()
    assert "exit: unsaved objects are dropped" in log, log
    line = [x for x in log.splitlines() if "exit: unsaved objects are dropped" in x][0]
    for family in ("KV.PREFIX 1", "STATE 2", "SSM.PREFIX 1", "ATTEND.PREFIX 1", "V 2"):
        assert family in line, line
    srv.start()
    r = srv.client()
    assert r.execute_command("STATE.READ", "saved", 0, 8) == b"old-old!"
    with pytest.raises(Exception, match="no such state slot"):
        r.execute_command("STATE.READ", "unsaved", 0, 8)
    assert r.execute_command("KV.PREFIX.LOOKUP", "ns") == b"MISS"


def test_shutdown_save_pauses_writes_and_fails_loudly(pion_factory, tmp_path):
    """A save that fails (the disk tier refuses it: quota) answers an error naming it, and the
    server keeps running with writes allowed again; FORCE exits anyway."""
    srv = pion_factory("--disk-quota", "64kb")
    r = srv.client()
    r.execute_command("STATE.ALLOC", "big", 200000)
    with srv.raw() as c:
        e = str(c.call("SHUTDOWN", "SAVE"))
    assert e.startswith("ERR Errors trying to SHUTDOWN: 1 save(s) failed (STATE 0 (0B), 1 failed"), e
    assert "SHUTDOWN SAVE FORCE exits anyway" in e
    assert srv.alive()
    r.execute_command("STATE.WRITE", "big", 0, b"still writable")
    _shutdown(srv, "SAVE", "FORCE")
    assert "exiting with 1 failed save(s)" in srv.log_text()
