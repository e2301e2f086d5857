"""STATE.* slots: semantics, --kvcache=off, --maxmemory accounting, cross-shard routing."""
from __future__ import annotations

import os
import random
import threading

import pytest

from pionlib import RespError, bulk, encode

MiB = 1 << 20
DISABLED = b"-ERR state cache not enabled (use --kvcache)\r\n"


# ------------------------------------------------------------------------------------------
# Semantics
# ------------------------------------------------------------------------------------------

def test_alloc_write_read_free(shared_pion):
    with shared_pion.raw() as c:
        assert c.call("STATE.ALLOC", "st:a", 16) == "OK"
        assert c.call("STATE.READ", "st:a", 0, 16) == b"\x00" * 16
        assert c.call("STATE.WRITE", "st:a", 4, b"\r\n\x00\xff") == "OK"
        assert c.call("STATE.READ", "st:a", 0, 16) == b"\x00" * 4 + b"\r\n\x00\xff" + b"\x00" * 8
        assert c.call("STATE.READ", "st:a", 5, 2) == b"\n\x00"
        c.send(encode("STATE.READ", "st:a", 16, 0))
        assert c.read_exact(6) == b"$0\r\n\r\n"
        assert c.call("STATE.READ", "st:a", 3, 0) == b""
        assert c.call("STATE.WRITE", "st:a", 16, b"") == "OK"  # empty write at the end
        assert c.call("STATE.WRITE", "st:a", 0, b"") == "OK"
        assert c.call("STATE.WRITE", "st:a", 15, b"Z") == "OK"
        assert c.call("STATE.READ", "st:a", 15, 1) == b"Z"
        # Re-allocating with the same size is a no-op that keeps the contents.
        assert c.call("STATE.ALLOC", "st:a", 16) == "OK"
        assert c.call("STATE.READ", "st:a", 4, 4) == b"\r\n\x00\xff"
        assert c.call("STATE.FREE", "st:a") == 1
        assert c.call("STATE.FREE", "st:a") == 0
        assert c.call("STATE.READ", "st:a", 0, 1) == RespError("ERR no such state slot 'st:a'")
        # After a free the id can take another size, zero-filled again.
        assert c.call("STATE.ALLOC", "st:a", 3) == "OK"
        assert c.call("STATE.READ", "st:a", 0, 3) == b"\x00\x00\x00"
        assert c.call("STATE.FREE", "st:a") == 1


def test_slot_ids_are_binary_safe(shared_pion):
    ids = [b"", b"with space", b"crlf\r\nin id", b"\x00\x01\xfe", "ünïcödé".encode(),
           b"{tag}x", b"x" * 1000]
    with shared_pion.raw() as c:
        for i, sid in enumerate(ids):
            assert c.call("STATE.ALLOC", sid, 8) == "OK", sid
            assert c.call("STATE.WRITE", sid, 0, b"%08d" % i) == "OK"
        for i, sid in enumerate(ids):
            assert c.call("STATE.READ", sid, 0, 8) == b"%08d" % i
        for sid in ids:
            assert c.call("STATE.FREE", sid) == 1


def test_large_slot_round_trip(shared_pion):
    data = os.urandom(16 * MiB)
    with shared_pion.raw(timeout=30) as c:
        assert c.call("STATE.ALLOC", "st:big", len(data)) == "OK"
        assert c.call("STATE.WRITE", "st:big", 0, data) == "OK"
        assert c.call("STATE.READ", "st:big", 0, len(data)) == data
        part = os.urandom(3 * MiB + 5)
        assert c.call("STATE.WRITE", "st:big", 5 * MiB + 1, part) == "OK"
        want = data[:5 * MiB + 1] + part + data[5 * MiB + 1 + len(part):]
        assert c.call("STATE.READ", "st:big", 0, len(data)) == want
        assert c.call("STATE.READ", "st:big", 5 * MiB, MiB) == want[5 * MiB:6 * MiB]
        assert c.call("STATE.WRITE", "st:big", len(data) - 1, b"ab") == RespError(
            "ERR write of 2 bytes at offset %d exceeds slot 'st:big' of %d bytes"
            % (len(data) - 1, len(data)))
        assert c.call("STATE.FREE", "st:big") == 1


def test_read_reply_is_a_snapshot(shared_pion):
    """A large READ reply still waiting in the output buffer is not changed by a later WRITE
    to the same slot (the slot is copied on write while a reply references it)."""
    old = os.urandom(4 * MiB)
    new = os.urandom(4 * MiB)
    with shared_pion.raw(timeout=30) as setup:
        assert setup.call("STATE.ALLOC", "st:cow", len(old)) == "OK"
        assert setup.call("STATE.WRITE", "st:cow", 0, old) == "OK"
    with shared_pion.raw(timeout=30, rcvbuf=8192) as c:
        c.send(encode("STATE.READ", "st:cow", 0, len(old)) +
               encode("STATE.WRITE", "st:cow", 0, new) +
               encode("STATE.READ", "st:cow", 0, len(old)) +
               encode("STATE.WRITE", "st:cow", 0, old[:100]))
        assert c.read_reply() == old
        assert c.read_reply() == "OK"
        assert c.read_reply() == new
        assert c.read_reply() == "OK"
        assert c.call("STATE.READ", "st:cow", 0, 200) == old[:100] + new[100:200]
        assert c.call("STATE.FREE", "st:cow") == 1


def test_state_info_and_keyspace(pion):
    with pion.raw() as c:
        assert c.call("STATE.INFO") == [b"slots", 0, b"bytes", 0]
        for i in range(10):
            assert c.call("STATE.ALLOC", "ks:%d" % i, 100 + i) == "OK"
        assert c.call("STATE.INFO") == [b"slots", 10, b"bytes", 1045]
        assert c.call("INFO", "keyspace") == (b"# Keyspace\r\nstate:slots=10,bytes=1045\r\n"
                                              b"vstore:sessions=0,rows=0,bytes=0\r\n"
                                              b"ssm:sessions=0,blobs=0,bytes=0\r\n")
        c.call("HELLO", "3")
        assert c.call("STATE.INFO") == {b"slots": 10, b"bytes": 1045}
        for i in range(10):
            assert c.call("STATE.FREE", "ks:%d" % i) == 1
        assert c.call("STATE.INFO") == {b"slots": 0, b"bytes": 0}
    assert pion.info("memory")["used_memory_state"] == "0"


# ------------------------------------------------------------------------------------------
# --kvcache=off
# ------------------------------------------------------------------------------------------

STATE_CMDS = [("STATE.ALLOC", "a", "1"), ("STATE.WRITE", "a", "0", "x"),
              ("STATE.READ", "a", "0", "1"), ("STATE.FREE", "a"), ("STATE.INFO",)]


@pytest.mark.parametrize("flag", [["--kvcache=off"], ["--kvcache", "off"], ["--kvcache=no"],
                                  ["--kvcache=0"], ["--kvcache=false"]],
                         ids=lambda f: " ".join(f))
def test_kvcache_off(pion_factory, flag):
    srv = pion_factory("--workers", "2", *flag)
    with srv.raw() as c:
        # Pipelined, in both protocols.
        c.send(b"".join(encode(*cmd) for cmd in STATE_CMDS))
        assert c.read_exact(len(DISABLED) * 5) == DISABLED * 5
        c.call("HELLO", "3")
        for cmd in STATE_CMDS:
            c.send(encode(*cmd))
            assert c.read_exact(len(DISABLED)) == DISABLED, cmd
        # Inline and lower-case too.
        c.send(b"state.alloc b 10\r\n")
        assert c.read_exact(len(DISABLED)) == DISABLED
        # Arity is checked before the gate.
        c.send(encode("STATE.READ", "a"))
        assert c.read_line() == b"-ERR wrong number of arguments for 'state.read' command"
        # Everything else works.
        assert c.call("PING") == "PONG"
        assert c.call("ECHO", "x") == b"x"
        assert c.call("CONFIG", "GET", "kvcache") == {b"kvcache": b"off"}
    assert srv.info("server")["kvcache"] == "off"
    assert srv.info("stats")["rejected_kvcache_disabled"] == "11"
    assert srv.metric('pion_rejected_total{reason="kvcache_disabled"}') == 11
    assert srv.metric('pion_command_rejected_total{cmd="state.alloc"}') == 3
    assert "kvcache off" in srv.log_text()


@pytest.mark.parametrize("flag", [[], ["--kvcache"], ["--kvcache=on"], ["--kvcache", "yes"]],
                         ids=["default", "bare", "on", "yes"])
def test_kvcache_on(pion_factory, flag):
    srv = pion_factory("--workers", "1", *flag)
    with srv.raw() as c:
        assert c.call("STATE.ALLOC", "a", 1) == "OK"
        assert c.call("CONFIG", "GET", "kvcache") == [b"kvcache", b"on"]


# ------------------------------------------------------------------------------------------
# --maxmemory
# ------------------------------------------------------------------------------------------

def oom(n, free, maxmem, human):
    return RespError("OOM command not allowed when used memory > 'maxmemory': state write of %d "
                     "bytes, %d bytes free of maxmemory %d (%s)" % (n, free, maxmem, human))


def test_maxmemory_bounds_host_memory_and_overflow_moves_to_disk(pion_factory):
    """--maxmemory bounds the host tier: slots beyond it move to disk (least recently used
    first) and come back on access; only when the disk quota is full too is a write refused,
    with the tier named. One slot larger than all of maxmemory is refused at once."""
    M = 1 << 20
    srv = pion_factory("--workers", "2", "--maxmemory", "1mb", "--disk-quota", "3mb")
    with srv.raw() as c:
        assert c.call("STATE.ALLOC", "mm:a", 600_000) == "OK"
        assert c.call("STATE.WRITE", "mm:a", 0, b"slot a") == "OK"
        assert c.call("STATE.ALLOC", "mm:b", 600_000) == "OK"  # a moves to disk
        assert c.call("STATE.WRITE", "mm:b", 0, b"slot b") == "OK"
        mem = srv.info("memory")
        assert int(mem["used_memory_state"]) <= M and mem["maxmemory"] == str(M)
        assert int(srv.info("residency")["residency_demotions_host_disk"]) >= 1
        assert c.call("STATE.READ", "mm:a", 0, 6) == b"slot a"  # back, b goes out
        assert c.call("STATE.READ", "mm:b", 0, 6) == b"slot b"
        assert int(srv.info("memory")["used_memory_state"]) <= M
        # One slot over all of maxmemory: refused now, in the accountant's words.
        reply = c.call("STATE.ALLOC", "mm:big", 2 * M)
        assert isinstance(reply, RespError) and str(reply).startswith(
            "OOM command not allowed when used memory > 'maxmemory': state write of 2097152")
        # Fill both tiers: the disk quota ends it with a typed error naming the disk.
        allocated = []
        for i in range(20):
            reply = c.call("STATE.ALLOC", "mm:f%d" % i, 300_000)
            if reply != "OK":
                assert isinstance(reply, RespError) and str(reply).startswith("OOM")
                assert "tier=disk" in str(reply), reply
                break
            allocated.append(i)
        else:
            raise AssertionError("the disk quota never refused")
        assert 4 <= len(allocated) < 20
        # Both tiers full: bringing a slot back may need room neither tier has — a typed
        # refusal that changes nothing. Freeing two slots makes room, and then nothing stored
        # was lost on the way: every slot reads back.
        reply = c.call("STATE.READ", "mm:a", 0, 6)
        assert reply == b"slot a" or ("tier=disk" in str(reply) and str(reply).startswith("OOM"))
        for i in allocated[-2:]:
            assert c.call("STATE.FREE", "mm:f%d" % i) == 1
        allocated = allocated[:-2]
        assert c.call("STATE.READ", "mm:a", 0, 6) == b"slot a"
        assert c.call("STATE.READ", "mm:b", 0, 6) == b"slot b"
        for i in allocated:
            assert c.call("STATE.READ", "mm:f%d" % i, 299_990, 10) == b"\0" * 10
        # Freeing makes room again.
        assert c.call("STATE.FREE", "mm:a") == 1
        assert c.call("STATE.FREE", "mm:b") == 1
        assert c.call("STATE.ALLOC", "mm:c", 600_000) == "OK"
        assert c.call("CONFIG", "SET", "maxmemory", "0") == "OK"  # unlimited
        assert c.call("STATE.ALLOC", "mm:e", 5 * M) == "OK"
        assert int(srv.info("memory")["used_memory_state"]) >= 5 * M
    assert srv.metric("pion_memory_max_bytes") == float("inf")  # no limit: +Inf
    assert int(srv.info("stats")["rejected_oom"]) >= 2


def test_host_memory_stays_bounded_under_concurrency(pion_factory):
    """Shards reserve against one budget: with 4 connections racing, host memory never passes
    the limit, every allocation succeeds (the overflow is on disk) and reads back zeros."""
    srv = pion_factory("--workers", "2", "--maxmemory", "1mb")
    size = 20_000
    results = []
    lock = threading.Lock()

    def worker(n):
        with srv.raw(timeout=30) as c:
            c.send(b"".join(encode("STATE.ALLOC", "cc:%d:%d" % (n, i), size) for i in range(40)))
            replies = [c.read_reply() for _ in range(40)]
        with lock:
            results.extend(replies)

    threads = [threading.Thread(target=worker, args=(n,), daemon=True) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert results == ["OK"] * 160
    assert int(srv.info("memory")["used_memory_state"]) <= 1 << 20
    assert srv.info("keyspace")["state"] == "slots=160,bytes=%d" % (160 * size)
    with srv.raw() as c:
        for n in range(4):
            for i in range(0, 40, 7):
                assert c.call("STATE.READ", "cc:%d:%d" % (n, i), 0, size) == b"\0" * size


# ------------------------------------------------------------------------------------------
# Cross-shard routing
# ------------------------------------------------------------------------------------------

def test_cross_shard_2000_slots(pion_factory):
    srv = pion_factory("--workers", "4")
    n_conns, per_conn = 4, 500
    rnd = random.Random(3)
    contents = {"x:%d:%d" % (n, i): rnd.randbytes(rnd.randrange(1, 200))
                for n in range(n_conns) for i in range(per_conn)}
    barrier = threading.Barrier(n_conns, timeout=30)
    errors = []

    def worker(n):
        try:
            mine = ["x:%d:%d" % (n, i) for i in range(per_conn)]
            with srv.raw(timeout=30) as c:
                c.send(b"".join(encode("STATE.ALLOC", k, len(contents[k])) +
                                encode("STATE.WRITE", k, 0, contents[k]) for k in mine))
                for _ in range(2 * per_conn):
                    assert c.read_reply() == "OK"
                barrier.wait()
                # Everyone reads every slot, including the other connections' ones.
                keys = sorted(contents)
                random.Random(n).shuffle(keys)
                c.send(b"".join(encode("STATE.READ", k, 0, len(contents[k])) for k in keys))
                for k in keys:
                    want = bulk(contents[k])
                    got = c.read_exact(len(want))
                    assert got == want, "slot %s read back wrong on connection %d" % (k, n)
        except BaseException as e:
            errors.append(e)
            barrier.abort()

    threads = [threading.Thread(target=worker, args=(n,), daemon=True) for n in range(n_conns)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors[0]
    total = sum(len(v) for v in contents.values())
    with srv.raw() as c:
        assert c.call("STATE.INFO") == [b"slots", 2000, b"bytes", total]
    stats = srv.info("stats")
    forwarded = int(stats["total_forwarded_commands"])
    assert forwarded > 0
    # With 4 shards about 3/4 of the 12,000 keyed commands go to another shard.
    assert 6000 < forwarded < 12000
    assert srv.metric("pion_forwarded_commands_total") >= forwarded
    assert srv.info("keyspace")["state"] == "slots=2000,bytes=%d" % total
    assert srv.info("server")["workers"] == "4"


def test_hash_tags_route_to_one_shard(pion_factory):
    """Keys sharing a {tag} live on one shard: from one connection either none or all of
    their commands are forwarded."""
    srv = pion_factory("--workers", "4")
    with srv.raw(timeout=30) as c:
        for tag in ("alpha", "beta", "gamma", "delta", "eps"):
            before = int(srv.info("stats")["total_forwarded_commands"])
            c.send(b"".join(encode("STATE.ALLOC", "{%s}:%d" % (tag, i), 4) for i in range(100)))
            for _ in range(100):
                assert c.read_reply() == "OK"
            delta = int(srv.info("stats")["total_forwarded_commands"]) - before
            assert delta in (0, 100), (tag, delta)
        # Ids with an empty tag "{}" are hashed whole, and still work.
        assert c.call("STATE.ALLOC", "{}:a", 1) == "OK"
        assert c.call("STATE.READ", "{}:a", 0, 1) == b"\x00"
