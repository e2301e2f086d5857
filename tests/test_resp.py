"""RESP2 and RESP3 on the wire: redis-py, redis-cli (-2/-3, interactive) and raw sockets
with exact reply bytes; 64 MiB binary ECHO; 10,000-command pipelines."""
from __future__ import annotations

import os
import pty
import random
import select
import subprocess
import threading
import time

import pytest

from pionlib import RawConn, bulk, encode

MiB = 1 << 20


# ------------------------------------------------------------------------------------------
# redis-py (RESP2)
# ------------------------------------------------------------------------------------------

def test_redis_py_basic_resp2(shared_pion):
    r = shared_pion.client()
    assert r.ping() is True
    assert r.echo(b"hello\x00\r\nworld") == b"hello\x00\r\nworld"
    cid = r.client_id()
    assert isinstance(cid, int) and cid > 0
    assert r.client_setname("py-client") is True
    assert r.client_getname() == "py-client"
    assert r.execute_command("STATE.ALLOC", "py:slot", 8) == b"OK"
    assert r.execute_command("STATE.WRITE", "py:slot", 2, b"\x01\x02") == b"OK"
    assert r.execute_command("STATE.READ", "py:slot", 0, 8) == b"\x00\x00\x01\x02\x00\x00\x00\x00"
    info = r.execute_command("STATE.INFO")
    assert info[0] == b"slots" and info[2] == b"bytes"  # a flat array in RESP2
    assert r.execute_command("STATE.FREE", "py:slot") == 1
    assert r.execute_command("STATE.FREE", "py:slot") == 0
    assert r.config_get("port") == {"port": str(shared_pion.port)}
    info = r.info("server")
    assert info["tcp_port"] == shared_pion.port
    assert info["pion_version"] == "0.1.0"


def test_redis_py_errors_are_response_errors(shared_pion):
    import redis
    r = shared_pion.client()
    with pytest.raises(redis.ResponseError, match="unknown command 'NOPE'"):
        r.execute_command("NOPE", "x")
    with pytest.raises(redis.ResponseError, match="no such state slot 'missing'"):
        r.execute_command("STATE.READ", "missing", 0, 1)
    assert r.ping() is True  # the connection is still usable


# ------------------------------------------------------------------------------------------
# redis-cli, RESP2 and RESP3
# ------------------------------------------------------------------------------------------

def test_redis_cli_resp2(shared_pion):
    s = shared_pion
    assert s.redis_cli("PING").stdout == "PONG\n"
    assert s.redis_cli("ECHO", "hello world").stdout == "hello world\n"
    assert s.redis_cli("--no-raw", "CONFIG", "GET", "port").stdout == \
        '1) "port"\n2) "%d"\n' % s.port
    assert s.redis_cli("--no-raw", "CLIENT", "GETNAME").stdout == "(nil)\n"
    assert s.redis_cli("--no-raw", "STATE.READ", "cli:none", "0", "1").stdout == \
        "(error) ERR no such state slot 'cli:none'\n"
    # Commands from stdin (no tty): one reply per line, in order.
    out = s.redis_cli(input="PING\nECHO hi\nSTATE.ALLOC cli:a 4\nSTATE.READ cli:a 0 4\n"
                            "STATE.FREE cli:a\n").stdout
    assert out == "PONG\nhi\nOK\n\x00\x00\x00\x00\n1\n"


def test_redis_cli_resp3(shared_pion):
    s = shared_pion
    out = s.redis_cli("--no-raw", "HELLO", "3", resp3=True).stdout
    lines = out.splitlines()
    assert lines[0] == '1# "server" => "pion"'
    assert lines[1] == '2# "version" => "0.1.0"'
    assert lines[2] == '3# "proto" => (integer) 3'
    assert lines[3].startswith('4# "id" => (integer) ')
    assert lines[4:] == ['5# "mode" => "standalone"', '6# "role" => "master"',
                         '7# "modules" => (empty array)']
    assert s.redis_cli("--no-raw", "CONFIG", "GET", "port", resp3=True).stdout == \
        '1# "port" => "%d"\n' % s.port
    assert s.redis_cli("--no-raw", "CLIENT", "GETNAME", resp3=True).stdout == "(nil)\n"
    out = s.redis_cli("--no-raw", "STATE.INFO", resp3=True).stdout
    assert out.startswith('1# "slots" => (integer) ') and '2# "bytes" => (integer) ' in out
    out = s.redis_cli("--no-raw", "COMMAND", "INFO", "ping", "nope", resp3=True).stdout
    assert '1~ no_auth' in out and '2~ fast' in out and out.endswith("2) (nil)\n")
    assert s.redis_cli("INFO", "keyspace", resp3=True).stdout.startswith("# Keyspace\n")


def test_redis_cli_command_docs(shared_pion):
    out = shared_pion.redis_cli("COMMAND", "DOCS", "ping").stdout
    assert out == ("ping\nsummary\nReplies PONG, or the message given.\nsince\n0.1.0\n"
                   "group\nconnection\nsyntax\nping [message]\n")
    out = shared_pion.redis_cli("--no-raw", "COMMAND", "DOCS", "state.read", resp3=True).stdout
    assert '"state.read"' in out and '"syntax" => "state.read <id> <offset> <len> [DEADLINE <ms>]"' in out


def _pty_read_until(fd: int, needle: bytes, timeout: float) -> bytes:
    out = b""
    deadline = time.monotonic() + timeout
    while needle not in out:
        left = deadline - time.monotonic()
        if left <= 0:
            raise AssertionError("redis-cli did not print %r; got %r" % (needle, out[-500:]))
        r, _, _ = select.select([fd], [], [], left)
        if fd in r:
            try:
                chunk = os.read(fd, 65536)
            except OSError:
                break
            if not chunk:
                break
            out += chunk
    return out


@pytest.mark.parametrize("resp3", [False, True], ids=["resp2", "resp3"])
def test_redis_cli_interactive(shared_pion, resp3):
    """redis-cli on a terminal: it fetches COMMAND DOCS for hints, then runs commands."""
    cmd = ["redis-cli", "-h", "127.0.0.1", "-p", str(shared_pion.port)]
    if resp3:
        cmd.append("-3")
    master, slave = pty.openpty()
    env = dict(os.environ, TERM="dumb", HOME=str(shared_pion.workdir))
    proc = subprocess.Popen(cmd, stdin=slave, stdout=slave, stderr=slave, env=env,
                            close_fds=True)
    os.close(slave)
    try:
        prompt = b"127.0.0.1:%d> " % shared_pion.port
        _pty_read_until(master, prompt, 10)
        os.write(master, b"PING\r")
        _pty_read_until(master, b"PONG", 10)
        os.write(master, b"ECHO interactive\r")
        _pty_read_until(master, b'"interactive"', 10)
        os.write(master, b"CONFIG GET port\r")
        want = b'1# "port" => "%d"' % shared_pion.port if resp3 else b'2) "%d"' % shared_pion.port
        _pty_read_until(master, want, 10)
        os.write(master, b"quit\r")
        proc.wait(timeout=10)
        assert proc.returncode == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=5)
        os.close(master)
    assert shared_pion.alive()


# ------------------------------------------------------------------------------------------
# Raw sockets: exact bytes
# ------------------------------------------------------------------------------------------

def hello_bytes(proto: int, cid: int) -> bytes:
    head = b"%7\r\n" if proto == 3 else b"*14\r\n"
    return (head + bulk("server") + bulk("pion") + bulk("version") + bulk("0.1.0") +
            bulk("proto") + b":%d\r\n" % proto + bulk("id") + b":%d\r\n" % cid +
            bulk("mode") + bulk("standalone") + bulk("role") + bulk("master") +
            bulk("modules") + b"*0\r\n")


def test_raw_resp2_exact_bytes(shared_pion):
    with shared_pion.raw() as c:
        c.send(b"PING\r\n")
        assert c.read_exact(7) == b"+PONG\r\n"
        c.send(encode("CLIENT", "ID"))
        cid = c.read_reply()
        c.send(encode("HELLO"))  # no version: stays on RESP2
        assert c.read_exact(len(hello_bytes(2, cid))) == hello_bytes(2, cid)
        c.send(encode("HELLO", "2"))
        assert c.read_exact(len(hello_bytes(2, cid))) == hello_bytes(2, cid)
        c.send(encode("CLIENT", "GETNAME"))
        assert c.read_exact(5) == b"$-1\r\n"
        want = b"*2\r\n" + bulk("port") + bulk(str(shared_pion.port))
        c.send(encode("CONFIG", "GET", "port"))
        assert c.read_exact(len(want)) == want
        c.send(encode("COMMAND", "INFO", "nope"))
        assert c.read_exact(9) == b"*1\r\n*-1\r\n"
        c.send(encode("ECHO", ""))
        assert c.read_exact(6) == b"$0\r\n\r\n"
        c.send(encode("PING", "x y"))
        assert c.read_exact(9) == b"$3\r\nx y\r\n"
        c.send(encode("STATE.FREE", "raw:never"))
        assert c.read_exact(4) == b":0\r\n"


def test_raw_resp3_exact_bytes(shared_pion):
    with shared_pion.raw() as c:
        c.send(encode("CLIENT", "ID"))
        cid = c.read_reply()
        c.send(encode("HELLO", "3"))
        want = hello_bytes(3, cid)
        assert want.startswith(b"%7\r\n")
        assert c.read_exact(len(want)) == want
        # Nulls are '_'.
        c.send(encode("CLIENT", "GETNAME"))
        assert c.read_exact(3) == b"_\r\n"
        c.send(encode("COMMAND", "INFO", "nope"))
        assert c.read_exact(7) == b"*1\r\n_\r\n"
        # CONFIG GET is a map.
        want = b"%1\r\n" + bulk("port") + bulk(str(shared_pion.port))
        c.send(encode("CONFIG", "GET", "port"))
        assert c.read_exact(len(want)) == want
        # Table order (bind before port), whatever the order of the patterns.
        want = b"%2\r\n" + bulk("bind") + bulk("127.0.0.1") + bulk("port") + \
            bulk(str(shared_pion.port))
        c.send(encode("CONFIG", "GET", "port", "bind"))
        assert c.read_exact(len(want)) == want
        c.send(encode("CONFIG", "GET", "no-such-param*"))
        assert c.read_exact(4) == b"%0\r\n"
        # STATE.INFO is a map of this tenant's slots and bytes.
        c.send(encode("STATE.ALLOC", "r3:slot", "100") + encode("STATE.INFO"))
        assert c.read_exact(5) == b"+OK\r\n"
        reply = c.read_reply()
        assert isinstance(reply, dict) and set(reply) == {b"slots", b"bytes"}
        assert reply[b"slots"] >= 1 and reply[b"bytes"] >= 100
        c.send(encode("STATE.FREE", "r3:slot"))
        assert c.read_exact(4) == b":1\r\n"
        # INFO is a verbatim string: =<len>\r\ntxt:<text>\r\n
        c.send(encode("INFO", "persistence"))
        text = ("# Persistence\r\nloading:0\r\ndir:%s\r\ndisk_objects_loaded:0\r\n"
                "disk_objects_corrupt:0\r\ndisk_saves:0\r\ndisk_save_failures:0\r\n"
                "disk_warms:0\r\ndisk_demotions:0\r\nevictions:0\r\nio_queued:0\r\n" % shared_pion.data_dir)
        want = b"=%d\r\ntxt:%s\r\n" % (len(text) + 4, text.encode())
        assert c.read_exact(len(want)) == want
        # COMMAND INFO flags are a set ('~').
        c.send(encode("COMMAND", "INFO", "ping"))
        want = (b"*1\r\n*10\r\n" + bulk("ping") + b":-1\r\n~2\r\n+no_auth\r\n+fast\r\n"
                b":0\r\n:0\r\n:0\r\n~0\r\n~0\r\n*0\r\n*0\r\n")
        assert c.read_exact(len(want)) == want
        # Errors and simple replies are the same in both protocols.
        c.send(encode("PING"))
        assert c.read_exact(7) == b"+PONG\r\n"
        c.send(encode("NOPE"))
        assert c.read_line() == b"-ERR unknown command 'NOPE', with args beginning with: "
        # HELLO 2 switches back.
        c.send(encode("HELLO", "2"))
        want = hello_bytes(2, cid)
        assert c.read_exact(len(want)) == want
        c.send(encode("CLIENT", "GETNAME"))
        assert c.read_exact(5) == b"$-1\r\n"


def test_hello_setname_and_errors(shared_pion):
    with shared_pion.raw() as c:
        cid = c.call("CLIENT", "ID")
        c.send(encode("HELLO", "3", "SETNAME", "via-hello"))
        want = hello_bytes(3, cid)
        assert c.read_exact(len(want)) == want
        c.send(encode("CLIENT", "GETNAME"))
        assert c.read_exact(len(bulk("via-hello"))) == bulk("via-hello")
        c.send(encode("HELLO", "4"))
        assert c.read_line() == b"-NOPROTO unsupported protocol version"
        c.send(encode("HELLO", "three"))
        assert c.read_line() == b"-ERR Protocol version is not an integer or out of range"
        c.send(encode("HELLO", "3", "BOGUS"))
        assert c.read_line() == b"-ERR Syntax error in HELLO option 'BOGUS'"
        # A failed HELLO leaves the protocol unchanged (still RESP3).
        c.send(encode("CLIENT", "GETNAME"))
        assert c.read_exact(len(bulk("via-hello"))) == bulk("via-hello")
        c.send(encode("COMMAND", "INFO", "nope"))
        assert c.read_exact(7) == b"*1\r\n_\r\n"


def test_inline_commands(shared_pion):
    with shared_pion.raw() as c:
        c.send(b"PING\r\n" b"ECHO \"a\\x41\\n\\t\\\"q\\\"\"\r\n" b"ECHO 'it\\'s'\n" b"\r\n"
               b"   \r\n" b"ping   spaced\r\n")
        assert c.read_reply() == "PONG"
        assert c.read_reply() == b"aA\n\t\"q\""
        assert c.read_reply() == b"it's"
        assert c.read_reply() == b"spaced"
        # Empty multibulks are skipped, like blank inline lines.
        c.send(b"*0\r\n*-1\r\nPING\r\n")
        assert c.read_exact(7) == b"+PONG\r\n"


# ------------------------------------------------------------------------------------------
# 64 MiB binary ECHO
# ------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def blob64():
    return os.urandom(64 * MiB)


def test_echo_64mib_redis_py(shared_pion, blob64):
    r = shared_pion.client(socket_timeout=60)
    got = r.echo(blob64)
    assert len(got) == len(blob64)
    assert got == blob64
    assert r.ping() is True


@pytest.mark.parametrize("proto", [2, 3])
def test_echo_64mib_raw(shared_pion, blob64, proto):
    with shared_pion.raw(timeout=60) as c:
        if proto == 3:
            c.call("HELLO", "3")
        c.send(encode("ECHO", blob64) + encode("PING"))
        head = c.read_line()
        assert head == b"$%d" % len(blob64)
        got = c.read_exact(len(blob64) + 2)
        assert got[-2:] == b"\r\n"
        assert got[:-2] == blob64
        assert c.read_exact(7) == b"+PONG\r\n"


def test_echo_binary_sizes_raw(shared_pion):
    """Bulk sizes around the parser's internal thresholds (16 KiB refs, 32 KiB big args)."""
    rnd = random.Random(7)
    sizes = [0, 1, 2, 15, 16383, 16384, 16385, 32767, 32768, 32769, 65536, 1 * MiB + 3]
    with shared_pion.raw(timeout=30) as c:
        payloads = [rnd.randbytes(n) for n in sizes]
        c.send(b"".join(encode("ECHO", p) for p in payloads))
        for p in payloads:
            want = bulk(p)
            assert c.read_exact(len(want)) == want


def test_echo_sent_byte_by_byte(shared_pion):
    """A command trickled one byte per segment is reassembled exactly."""
    data = bytes(range(256)) * 2
    with shared_pion.raw() as c:
        msg = encode("ECHO", data)
        for i in range(len(msg)):
            c.send(msg[i:i + 1])
        want = bulk(data)
        assert c.read_exact(len(want)) == want


# ------------------------------------------------------------------------------------------
# 10,000-command pipelines
# ------------------------------------------------------------------------------------------

def build_mixed_pipeline(n: int, prefix: str, seed: int):
    """n commands (PING / PING msg / ECHO / STATE.*) over many keys and their exact replies."""
    rnd = random.Random(seed)
    cmds, replies = [], []
    slots: dict[str, bytearray] = {}
    i = 0
    while len(cmds) < n:
        i += 1
        kind = rnd.randrange(8)
        if kind == 0:
            cmds.append(encode("PING"))
            replies.append(b"+PONG\r\n")
        elif kind == 1:
            m = b"m%d" % i
            cmds.append(encode("PING", m))
            replies.append(bulk(m))
        elif kind == 2:
            m = rnd.randbytes(rnd.randrange(0, 300))
            cmds.append(encode("ECHO", m))
            replies.append(bulk(m))
        elif kind == 3 or not slots:
            key = "%s:%d" % (prefix, len(slots))
            size = rnd.randrange(8, 64)
            cmds.append(encode("STATE.ALLOC", key, size))
            replies.append(b"+OK\r\n")
            slots[key] = bytearray(size)
        elif kind in (4, 5):
            key = rnd.choice(list(slots))
            buf = slots[key]
            off = rnd.randrange(len(buf))
            data = rnd.randbytes(rnd.randrange(1, len(buf) - off + 1))
            cmds.append(encode("STATE.WRITE", key, off, data))
            replies.append(b"+OK\r\n")
            buf[off:off + len(data)] = data
        elif kind == 6:
            key = rnd.choice(list(slots))
            buf = slots[key]
            off = rnd.randrange(len(buf))
            ln = rnd.randrange(0, len(buf) - off + 1)
            cmds.append(encode("STATE.READ", key, off, ln))
            replies.append(bulk(bytes(buf[off:off + ln])))
        else:
            key = "%s:missing%d" % (prefix, i)
            cmds.append(encode("STATE.READ", key, 0, 1))
            replies.append(b"-ERR no such state slot '%s'\r\n" % key.encode())
    return cmds, replies, slots


def _read_in_thread(conn: RawConn, nbytes: int, result: dict):
    try:
        result["data"] = conn.read_exact(nbytes)
    except BaseException as e:  # reported by the main thread
        result["error"] = e


@pytest.mark.parametrize("proto", [2, 3])
def test_pipeline_10000_raw_in_order(pion_factory, proto):
    srv = pion_factory("--workers", "2")
    cmds, replies, slots = build_mixed_pipeline(10_000, "pipe%d" % proto, seed=proto)
    # STATE.INFO at the end: the slot count must match (a map in RESP3, an array in RESP2).
    nbytes = sum(len(s) for s in slots.values())
    cmds.append(encode("STATE.INFO"))
    if proto == 3:
        replies.append(b"%2\r\n" + bulk("slots") + b":%d\r\n" % len(slots) + bulk("bytes") +
                       b":%d\r\n" % nbytes)
    else:
        replies.append(b"*4\r\n" + bulk("slots") + b":%d\r\n" % len(slots) + bulk("bytes") +
                       b":%d\r\n" % nbytes)
    want = b"".join(replies)
    with srv.raw(timeout=60) as c:
        if proto == 3:
            c.call("HELLO", "3")
        result: dict = {}
        t = threading.Thread(target=_read_in_thread, args=(c, len(want), result), daemon=True)
        t.start()
        c.send(b"".join(cmds))
        t.join(60)
        assert not t.is_alive(), "replies did not arrive"
        assert "error" not in result, result.get("error")
        got = result["data"]
        if got != want:
            # Locate the first differing reply for a readable failure.
            off = 0
            for idx, r in enumerate(replies):
                if got[off:off + len(r)] != r:
                    raise AssertionError("reply %d differs: want %r got %r"
                                         % (idx, r[:200], got[off:off + len(r) + 50][:250]))
                off += len(r)
        assert got == want
        c.send(encode("PING"))
        assert c.read_exact(7) == b"+PONG\r\n"
    assert int(srv.info("stats")["total_forwarded_commands"]) > 0


def test_pipeline_10000_redis_py(shared_pion):
    r = shared_pion.client(socket_timeout=60)
    rnd = random.Random(11)
    p = r.pipeline(transaction=False)
    expected = []
    for i in range(10_000):
        k = i % 5
        if k == 0:
            p.ping()
            expected.append(True)
        elif k == 1:
            v = rnd.randbytes(rnd.randrange(0, 64))
            p.echo(v)
            expected.append(v)
        elif k == 2:
            p.execute_command("STATE.ALLOC", "rp:%d" % i, 16)
            expected.append(b"OK")
        elif k == 3:
            v = rnd.randbytes(16)
            p.execute_command("STATE.WRITE", "rp:%d" % (i - 1), 0, v)
            expected.append(b"OK")
            last = v
        else:
            p.execute_command("STATE.READ", "rp:%d" % (i - 2), 0, 16)
            expected.append(last)
    got = p.execute()
    assert len(got) == len(expected)
    for i, (g, e) in enumerate(zip(got, expected)):
        assert g == e, "reply %d: %r != %r" % (i, g, e)
    # Clean up so the shared server's keyspace stays small.
    p = r.pipeline(transaction=False)
    for i in range(2, 10_000, 5):
        p.execute_command("STATE.FREE", "rp:%d" % i)
    assert all(x == 1 for x in p.execute())


def test_pipeline_many_connections_interleaved(shared_pion):
    """Several connections pipelining at once each get their own replies, in order."""
    errors = []

    def worker(n):
        try:
            cmds, replies, _ = build_mixed_pipeline(2000, "multi%d" % n, seed=100 + n)
            want = b"".join(replies)
            with shared_pion.raw(timeout=60) as c:
                res: dict = {}
                t = threading.Thread(target=_read_in_thread, args=(c, len(want), res),
                                     daemon=True)
                t.start()
                c.send(b"".join(cmds))
                t.join(60)
                assert "error" not in res and res.get("data") == want, "conn %d mismatch" % n
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(n,), daemon=True) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(90)
    assert not errors, errors
    assert all(not t.is_alive() for t in threads)
