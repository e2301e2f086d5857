"""The 0xCA5E binary protocol (--binary-port) against a live server, through the package's
BinaryClient and hand-built frames.

- Round trips of every command; request ids echoed; pipelined frames answered in order.
- LAYER.STORE/FETCH share storage with SSM.PREFIX over RESP (both directions, 64 MiB too).
- ATTEND.* over frames equals ATTEND.* over RESP on the same session, and the ATTEND output
  equals numpy's exact attention over the returned rows (rel err <= 1e-5).
- Errors: every error reply carries its kind's status (MISS 12, OOM 3, NOAUTH 5, ...) and text;
  a table of malformed frames gets the documented status and text, and either the connection
  goes on (well-framed) or closes after the reply (bad header, over the limit); a truncated
  frame followed by a hang-up costs nothing; other clients keep being served.
- AUTH over frames (pre-auth payload cap), tenants isolated across protocols.
"""
from __future__ import annotations

import os
import socket
import struct
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "clients",
                                "python"))

import pion  # noqa: E402
from pion import binary as B  # noqa: E402
from pionlib import HOST, ServerFactory  # noqa: E402

STATUS = {"ERR": 1, "OOM": 3, "BUSY": 4, "NOAUTH": 5, "WRONGPASS": 6, "NOPERM": 8, "MISS": 12}


def bclient(srv, **kw) -> pion.BinaryClient:
    return pion.BinaryClient(HOST, srv.binary_port, timeout=10, **kw)


def raw_sock(srv) -> socket.socket:
    s = socket.create_connection((HOST, srv.binary_port), timeout=10)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return s


def s16(x: str) -> bytes:
    return struct.pack("<H", len(x)) + x.encode()


def is_closed(sock: socket.socket) -> bool:
    sock.settimeout(5)
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


def test_ping_ids_and_pipelining(shared_pion):
    with bclient(shared_pion) as b:
        assert b.ping() == "PONG"
        assert b.ping(b"\x00\xffbin") == b"\x00\xffbin"
        ids = [b.send(B.PING, b"%d" % i, request_id=1000 + i) for i in range(50)]
        for i, rid in enumerate(ids):
            head, body = b.receive()
            assert head["request_id"] == rid and head["command"] == B.PING | B.REPLY_BIT
            assert head["status"] == 0 and B.decode_value(body)[0] == b"%d" % i


def test_layer_store_fetch_shares_the_ssm_store(shared_pion):
    r = shared_pion.client()
    with bclient(shared_pion) as b:
        blob = os.urandom(100_000)
        b.layer_store("req:1", 7, blob)
        assert r.execute_command("SSM.PREFIX.FETCH", "req:1", 7) == blob
        r.execute_command("SSM.PREFIX.STORE", "req:1", 8, b"from resp")
        assert b.layer_fetch("req:1", 8) == b"from resp"
        assert b.layer_fetch("req:1", 9) is None
        b.layer_drop("req:1", 7)
        assert b.layer_fetch("req:1", 7) is None and b.layer_fetch("req:1", 8) == b"from resp"
        b.layer_drop("req:1")
        assert r.execute_command("SSM.PREFIX.FETCH", "req:1", 8) is None
        big = np.random.default_rng(0).integers(0, 255, 64 << 20, dtype=np.uint8)
        b.layer_store("req:big", 0, big)
        got = b.layer_fetch("req:big", 0)
        assert len(got) == big.nbytes and got == big.tobytes()
        b.layer_drop("req:big")


def exact_attention(q, keys, values, ids):
    out, lse = [], []
    for i in range(q.shape[0]):
        k, v = keys[ids[i]].astype(np.float64), values[ids[i]].astype(np.float64)
        s = k @ q[i].astype(np.float64) / np.sqrt(q.shape[1])
        m = s.max()
        p = np.exp(s - m)
        out.append(p @ v / p.sum())
        lse.append(m + np.log(p.sum()))
    return np.array(out), np.array(lse)


def test_attend_index_over_frames_equals_resp(shared_pion):
    rng = np.random.default_rng(1)
    n, dk, dv = 3000, 64, 48
    keys = rng.standard_normal((n, dk)).astype(np.float32)
    values = rng.standard_normal((n, dv)).astype(np.float32)
    q = (keys[:4] + 0.1 * rng.standard_normal((4, dk))).astype(np.float32)
    r = shared_pion.client()
    with bclient(shared_pion) as b:
        b.attend_create("bin:a", dk, dv)
        assert b.attend_store("bin:a", keys[:1000], values[:1000]) == 1000
        assert b.attend_store("bin:a", keys[1000:], values[1000:]) == n
        with pytest.raises(pion.CommandError, match="has no index yet"):
            b.attend_query("bin:a", 8, q)
        fin = b.attend_finalize("bin:a")
        assert fin["generation"] == 1 and fin["rows"] == n and fin["recall_estimate"] > 0.9
        hit = b.attend_query("bin:a", 16, q, attend=True)
        assert hit["ids"].shape == (4, 16) and hit["k"] == 16
        assert (hit["positions"] == hit["ids"]).all()  # positions continue from 0
        want_out, want_lse = exact_attention(q, keys, values, hit["ids"].astype(np.int64))
        np.testing.assert_allclose(hit["output"], want_out, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(hit["lse"], want_lse, rtol=1e-5, atol=1e-5)
        ex = b.attend_query("bin:a", 16, q, exact=True)  # options bit 1: a scan
        assert ex["exact"] == 1 and ex["ef"] == 0 and ex["recall_estimate"] == 1.0
        top = np.argsort(-(q.astype(np.float64) @ keys.T.astype(np.float64)), axis=1)[:, :16]
        np.testing.assert_array_equal(ex["ids"], top)
        # The same session over RESP: same rows, same scores.
        m = r.execute_command("ATTEND.QUERY", "bin:a", 16, q.tobytes(), "ATTEND")
        m = {m[i].decode(): m[i + 1] for i in range(0, len(m), 2)}
        assert np.frombuffer(m["ids"], np.uint32).reshape(4, 16).tolist() == hit["ids"].tolist()
        assert np.frombuffer(m["scores"], np.float32).tobytes() == hit["scores"].tobytes()
        info = b.attend_info("bin:a")
        assert info["rows"] == n and info["metric"] == "ip" and info["generation"] == 1
        assert b.attend_info()["sessions"] >= 1
        # start_pos, EF and the other metrics travel as fields.
        b.attend_create("bin:c", 4, 2, m=8, ef_construction=50, metric="cos")
        assert b.attend_store("bin:c", np.eye(4), np.ones((4, 2)), start_pos=100) == 4
        b.attend_finalize("bin:c")
        hit = b.attend_query("bin:c", 2, np.array([1, 0, 0, 0]), ef=16)
        assert hit["positions"][0, 0] == 100 and hit["scores"][0, 0] == pytest.approx(1.0)
        ri = r.execute_command("ATTEND.INFO", "bin:c")
        ri = {ri[i].decode(): ri[i + 1] for i in range(0, len(ri), 2)}
        assert ri["metric"] == b"cos" and ri["m"] == 8 and ri["ef_construction"] == 50
        assert b.attend_drop("bin:a") == 1 and b.attend_drop("bin:a") == 0
        b.attend_drop("bin:c")


def test_finalize_waits_past_the_socket_timeout(shared_pion):
    # A graph build takes as long as its rows need; a client whose socket timeout is shorter
    # still gets FINALIZE's reply, and its timeout holds again for the calls after it.
    rng = np.random.default_rng(2)
    keys = rng.standard_normal((20_000, 64)).astype(np.float32)
    with pion.BinaryClient(HOST, shared_pion.binary_port, timeout=0.05) as b:
        b.attend_create("bin:slow", 64, 8)
        b.sock.settimeout(30)
        b.attend_store("bin:slow", keys, np.zeros((20_000, 8), np.float32))
        b.sock.settimeout(0.05)
        fin = b.attend_finalize("bin:slow")
        assert fin["rows"] == 20_000 and fin["generation"] == 1
        assert b.sock.gettimeout() == 0.05
        assert b.attend_drop("bin:slow") == 1


def test_error_replies_carry_their_kind(pion_factory):
    srv = pion_factory("--workers", "2", "--maxmemory", "8mb")
    with bclient(srv) as b:
        with pytest.raises(pion.MissError, match="no attention session 'nope'"):
            b.attend_finalize("nope")
        b.attend_create("e", 8, 8)
        with pytest.raises(pion.CommandError, match="already exists"):
            b.attend_create("e", 8, 8)
        with pytest.raises(pion.CommandError, match="keys_blob must be a non-zero multiple"):
            b.attend_store("e", np.zeros(7, np.float32), np.zeros(8, np.float32))
        with pytest.raises(pion.OomError):
            b.layer_store("big", 0, b"x" * (16 << 20))
        # Raw: the status numbers and the text in the payload.
        rid = b.send(B.ATTEND_FINALIZE, s16("nope"))
        head, body = b.receive()
        assert head["request_id"] == rid and head["status"] == STATUS["MISS"]
        assert bytes(body).startswith(b"MISS no attention session")
        assert b.ping() == "PONG"  # the connection goes on after every error


OVERSIZE = 1 << 40
MALFORMED = [
    # name, bytes, status, text (start), connection stays open
    ("unknown command", B.encode_frame(0x7F, b"abc", 5), B.UNKNOWN_COMMAND,
     "unknown command 0x7F", True),
    ("reply bit set", B.encode_frame(0x83, b"", 5), B.UNKNOWN_COMMAND, "unknown command 0x83",
     True),
    ("flags set", B.encode_frame(B.PING, b"", 5, flags=4), B.BAD_FRAME,
     "flags must be 0 in protocol version 1, got 0x0004", True),
    ("status set", B.encode_frame(B.PING, b"", 5, status=1), B.BAD_FRAME,
     "status must be 0 in a request, got 1", True),
    ("field past the end", B.encode_frame(B.LAYER_FETCH, b"\x10\x00abc", 5), B.BAD_FRAME,
     "LAYER.FETCH: payload truncated: field 'sid' needs 16 bytes at offset 2, payload has 5",
     True),
    ("missing layer", B.encode_frame(B.LAYER_FETCH, s16("s"), 5), B.BAD_FRAME,
     "LAYER.FETCH: payload truncated: field 'layer' needs 4 bytes", True),
    ("bytes after the fields", B.encode_frame(B.ATTEND_DROP, s16("s") + b"!", 5), B.BAD_FRAME,
     "ATTEND.DROP: payload has 1 bytes after its fields", True),
    ("keys_len past the end",
     B.encode_frame(B.ATTEND_STORE, s16("s") + struct.pack("<qQ", -1, 1 << 30), 5), B.BAD_FRAME,
     "ATTEND.STORE: payload truncated: field 'keys' needs 1073741824 bytes", True),
    ("bad metric", B.encode_frame(B.ATTEND_CREATE, s16("s") + bytes(16) + b"\x09", 5),
     B.BAD_FRAME, "ATTEND.CREATE: metric must be 0 (ip), 1 (l2) or 2 (cos), got 9", True),
    ("bad magic", b"*1\r\n$4\r\nPING\r\n" + bytes(16), B.BAD_FRAME, "bad magic 0x312A", False),
    ("bad version", B.encode_frame(B.PING, b"", 5, version=9), B.BAD_VERSION,
     "unsupported protocol version 9 (this server speaks version 1)", False),
    ("oversized", B.HEADER.pack(B.MAGIC, 1, B.LAYER_STORE, 0, 0, 5, OVERSIZE), B.TOO_LARGE,
     "frame payload of %d bytes exceeds the client query buffer limit" % OVERSIZE, False),
]


@pytest.mark.parametrize("name,data,status,text,stays_open", MALFORMED,
                         ids=[m[0] for m in MALFORMED])
def test_malformed_frames(shared_pion, name, data, status, text, stays_open):
    with raw_sock(shared_pion) as s:
        s.sendall(data)
        head, body = B.read_frame(s)
        assert head["status"] == status, bytes(body)
        assert bytes(body).decode().startswith(text), bytes(body)
        if status != B.BAD_FRAME or stays_open:  # a bad magic has no request id to echo
            assert head["request_id"] in (5, 0)
        if stays_open:
            s.sendall(B.encode_frame(B.PING, b"", 6))
            head, body = B.read_frame(s)
            assert head["request_id"] == 6 and B.decode_value(body)[0] == "PONG"
        else:
            assert is_closed(s)
    assert shared_pion.client().ping()  # the server keeps serving
    with bclient(shared_pion) as b:
        assert b.ping() == "PONG"


def test_truncated_frames_and_hangups_cost_nothing(shared_pion):
    with bclient(shared_pion) as b:
        b.layer_store("trunc", 0, b"kept")
        for cut in (3, 24, 24 + 2, 24 + 40):
            with raw_sock(shared_pion) as s:  # a header promising 100 bytes, then a hang-up
                frame = B.encode_frame(B.LAYER_STORE, s16("trunc") + struct.pack("<I", 0) +
                                       b"y" * 100, 9)
                s.sendall(frame[:cut])
        assert b.layer_fetch("trunc", 0) == b"kept"  # nothing half-stored
        assert b.ping() == "PONG"
        b.layer_drop("trunc")


def test_auth_and_tenants_over_frames(tmp_path):
    users = tmp_path / "users.txt"
    users.write_text("alice apw tenant-a\nbob bpw tenant-b\n")
    f = ServerFactory(tmp_path)
    try:
        srv = f("--workers", "2", "--users", str(users))
        with raw_sock(srv) as s:  # before AUTH: commands refused, big frames fatal
            s.sendall(B.encode_frame(B.LAYER_FETCH, s16("x") + bytes(4), 1))
            head, body = B.read_frame(s)
            assert head["status"] == STATUS["NOAUTH"]
            assert bytes(body) == b"NOAUTH Authentication required."
            s.sendall(B.encode_frame(B.LAYER_STORE, bytes(20000), 2))
            head, body = B.read_frame(s)
            assert head["status"] == B.TOO_LARGE
            assert bytes(body) == b"frame payload of 20000 bytes exceeds the limit of 16384 " \
                                  b"before AUTH"
            assert is_closed(s)
        with bclient(srv) as b:
            with pytest.raises(pion.WrongPassError):
                b.auth("bpw", "alice")
        a = bclient(srv, password="apw", username="alice")
        bob = bclient(srv, password="bpw", username="bob")
        a.layer_store("shared-name", 0, b"alice's")
        assert bob.layer_fetch("shared-name", 0) is None  # another tenant's keyspace
        bob.layer_store("shared-name", 0, b"bob's")
        assert a.layer_fetch("shared-name", 0) == b"alice's"
        r = srv.client(username="alice", password="apw")
        assert r.execute_command("SSM.PREFIX.FETCH", "shared-name", 0) == b"alice's"
        a.close()
        bob.close()
    finally:
        f.stop_all()


def test_binary_port_in_info_and_off_switch(pion_factory, shared_pion):
    info = shared_pion.client().info("server")
    assert info["binary_port"] == shared_pion.binary_port
    srv = pion_factory("--workers", "1", "--binary-port", "0")
    assert srv.client().info("server")["binary_port"] == 0
