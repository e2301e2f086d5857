"""Pion's 0xCA5E binary protocol (port 1975, `--binary-port`): frames instead of RESP.

    import numpy as np, pion
    b = pion.BinaryClient(port=1975)
    b.attend_create("doc", 128, 128)
    b.attend_store("doc", keys, values)        # float32 [n, 128] each, one frame
    b.attend_finalize("doc")
    hit = b.attend_query("doc", 32, q, attend=True)   # ids, positions, scores, output, lse

It carries the commands whose bytes dominate (LAYER.STORE/FETCH of per-layer state, the
ATTEND.* index) with fixed binary fields instead of decimal text. The reference is
docs/PROTOCOL.md, "Binary protocol"; this module is its executable form: `encode_frame`,
`read_frame` and `decode_value` (the typed reply encoding) are public for tools and tests.
"""
from __future__ import annotations

import itertools
import socket
import struct
from typing import Any

import numpy as np

from . import errors

MAGIC = 0xCA5E
VERSION = 1
HEADER = struct.Struct("<HBBHHQQ")  # magic, version, command, flags, status, request id, length
REPLY_BIT = 0x80

LAYER_STORE, LAYER_FETCH, PING, AUTH, LAYER_DROP = 0x01, 0x02, 0x03, 0x04, 0x05
ATTEND_CREATE, ATTEND_STORE, ATTEND_FINALIZE, ATTEND_QUERY = 0x20, 0x21, 0x22, 0x23
ATTEND_INFO, ATTEND_DROP = 0x24, 0x25

# Frame-level statuses (1..16 are the error kinds: 1 ERR, 3 OOM, 4 BUSY, 12 MISS, 14 TIMEOUT,
# 16 READONLY, ...).
BAD_FRAME, UNKNOWN_COMMAND, BAD_VERSION, TOO_LARGE = 64, 65, 66, 67
_METRICS = {"ip": 0, "l2": 1, "cos": 2}


class FrameError(errors.PionError):
    """A frame the server could not take (bad magic or version, unknown command, malformed
    fields, over the size limit). `status` is the frame status (64..67)."""

    def __init__(self, message: str, status: int):
        super().__init__(message, "FRAME")
        self.status = status


def encode_frame(command: int, payload: bytes | memoryview = b"", request_id: int = 0, *,
                 flags: int = 0, status: int = 0, version: int = VERSION,
                 magic: int = MAGIC) -> bytes:
    """One frame's bytes (the keyword arguments exist to build malformed frames in tests)."""
    return HEADER.pack(magic, version, command, flags, status, request_id, len(payload)) + \
        bytes(payload)


def _recv_exact(sock: socket.socket, n: int) -> bytearray:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise errors.PionConnectionError("connection closed by the server after %d of %d "
                                             "bytes" % (got, n))
        got += k
    return buf


def read_frame(sock: socket.socket) -> tuple[dict, bytearray]:
    """Reads one frame: (header fields, payload)."""
    magic, version, command, flags, status, rid, length = HEADER.unpack(
        _recv_exact(sock, HEADER.size))
    if magic != MAGIC:
        raise errors.PionConnectionError("bad magic 0x%04X in a reply" % magic)
    head = dict(version=version, command=command, flags=flags, status=status, request_id=rid,
                length=length)
    return head, _recv_exact(sock, length)


def decode_value(data, pos: int = 0) -> tuple[Any, int]:
    """Decodes one typed reply value at data[pos:]; returns (value, next position).

    '+' str, ':' int, ',' float, '#' bool, '$' bytes, '*' list,
    '%' dict (keys as str), '~' list, '_' None; '-' raises the error it carries."""
    mv = memoryview(data)
    t = chr(mv[pos])
    pos += 1
    if t == "_":
        return None, pos
    if t == "#":
        return bool(mv[pos]), pos + 1
    (n,) = struct.unpack_from("<Q", mv, pos)
    pos += 8
    if t == ":":
        return struct.unpack_from("<q", mv, pos - 8)[0], pos
    if t == ",":
        return struct.unpack_from("<d", mv, pos - 8)[0], pos
    if t in "+-$":
        raw = mv[pos:pos + n]
        if t == "-":
            raise errors.from_text(bytes(raw).decode("utf-8", "replace"))
        return (bytes(raw).decode() if t == "+" else bytes(raw)), pos + n
    if t in "*~":
        out = []
        for _ in range(n):
            v, pos = decode_value(mv, pos)
            out.append(v)
        return out, pos
    if t == "%":
        d = {}
        for _ in range(n):
            k, pos = decode_value(mv, pos)
            v, pos = decode_value(mv, pos)
            d[k.decode() if isinstance(k, bytes) else k] = v
        return d, pos
    raise errors.PionConnectionError("unknown reply type %r" % t)


def _str(s: str | bytes) -> bytes:
    b = s.encode() if isinstance(s, str) else bytes(s)
    if len(b) > 0xFFFF:
        raise ValueError("a string field is at most 65535 bytes")
    return struct.pack("<H", len(b)) + b


def _f32(a) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=np.float32)


class BinaryClient:
    """One connection to the binary port. Not thread-safe (use one per thread).

    Every method sends one frame and waits for its reply; `send`/`receive` pipeline raw
    frames. Errors raise the PionError subclass of the server's text (MissError, OomError,
    ...) or FrameError for a frame the server could not take."""

    def __init__(self, host: str = "127.0.0.1", port: int = 1975, password: str | None = None,
                 username: str = "", timeout: float | None = 30.0):
        self.sock = socket.create_connection((host, port), timeout=timeout)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._ids = itertools.count(1)
        if password is not None:
            self.auth(password, username)

    def close(self) -> None:
        self.sock.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # --- frames --------------------------------------------------------------------------
    def send(self, command: int, *parts, request_id: int | None = None) -> int:
        """Sends one request frame whose payload is the concatenation of parts (bytes-like;
        large parts are sent without copying). Returns its request id."""
        rid = next(self._ids) if request_id is None else request_id
        views = [memoryview(p).cast("B") for p in parts]
        total = sum(v.nbytes for v in views)
        head = HEADER.pack(MAGIC, VERSION, command, 0, 0, rid, total)
        if total < 65536:
            self.sock.sendall(b"".join([head, *views]))
        else:
            self.sock.sendall(head)
            for v in views:
                self.sock.sendall(v)
        return rid

    def receive(self) -> tuple[dict, bytearray]:
        return read_frame(self.sock)

    def call(self, command: int, *parts) -> Any:
        """Sends one request and returns its decoded reply."""
        rid = self.send(command, *parts)
        head, body = self.receive()
        if head["request_id"] != rid or head["command"] != (command | REPLY_BIT):
            raise errors.PionConnectionError("reply %r does not answer request %d (0x%02X)"
                                             % (head, rid, command))
        status = head["status"]
        if status >= BAD_FRAME:
            raise FrameError(bytes(body).decode("utf-8", "replace"), status)
        if status != 0:
            raise errors.from_text(bytes(body).decode("utf-8", "replace"))
        return decode_value(body)[0]

    # --- commands ------------------------------------------------------------------------
    def ping(self, message: bytes = b"") -> Any:
        return self.call(PING, message)

    def auth(self, password: str, username: str = "") -> None:
        self.call(AUTH, _str(username) + _str(password))

    def layer_store(self, sid: str, layer: int, blob) -> None:
        """Stores a layer's bytes (the SSM.PREFIX store: SSM.PREFIX.FETCH sees them)."""
        self.call(LAYER_STORE, _str(sid) + struct.pack("<I", layer), blob)

    def layer_fetch(self, sid: str, layer: int) -> bytes | None:
        return self.call(LAYER_FETCH, _str(sid) + struct.pack("<I", layer))

    def layer_drop(self, sid: str, layer: int = -1) -> None:
        self.call(LAYER_DROP, _str(sid) + struct.pack("<q", layer))

    def attend_create(self, sid: str, key_dim: int, value_dim: int, m: int = 0,
                      ef_construction: int = 0, metric: str = "ip") -> None:
        self.call(ATTEND_CREATE, _str(sid) + struct.pack("<IIIIB", key_dim, value_dim, m,
                                                          ef_construction, _METRICS[metric]))

    def attend_store(self, sid: str, keys, values, start_pos: int = -1) -> int:
        """Stages rows (float32 [n, key_dim] and [n, value_dim]); returns the rows staged."""
        k, v = _f32(keys), _f32(values)
        return self.call(ATTEND_STORE, _str(sid) + struct.pack("<qQ", start_pos, k.nbytes), k, v)

    def attend_finalize(self, sid: str) -> dict:
        """Builds the index's graph. Its time grows with the rows (seconds for 50K on two
        cores, more on a busy machine), so it waits for the reply without the socket timeout."""
        saved = self.sock.gettimeout()
        self.sock.settimeout(None)
        try:
            return self.call(ATTEND_FINALIZE, _str(sid))
        finally:
            self.sock.settimeout(saved)

    def attend_query(self, sid: str, k: int, q, ef: int = 0, attend: bool = False,
                     exact: bool = False) -> dict:
        """Top-k rows for each query (float32 [M, key_dim]): a dict with `ids` (uint32
        [M, k]), `positions` (int64), `scores` (float32), the receipt (`exact`, `ef`,
        `recall_estimate`), and with attend=True `output` (float32 [M, value_dim]) and `lse`
        (float32 [M]). ef=0: the index's calibrated plan; exact=True: scan every key."""
        qa = _f32(q)
        m = 1 if qa.ndim == 1 else qa.shape[0]
        options = (1 if attend else 0) | (2 if exact else 0)
        r = self.call(ATTEND_QUERY, _str(sid) + struct.pack("<IIB", k, ef, options), qa)
        kk = r["k"]
        out = dict(generation=r["generation"], k=kk, exact=r["exact"], ef=r["ef"],
                   recall_estimate=r["recall_estimate"],
                   ids=np.frombuffer(r["ids"], np.uint32).reshape(m, kk),
                   positions=np.frombuffer(r["positions"], np.int64).reshape(m, kk),
                   scores=np.frombuffer(r["scores"], np.float32).reshape(m, kk))
        if attend:
            out["output"] = np.frombuffer(r["output"], np.float32).reshape(m, -1)
            out["lse"] = np.frombuffer(r["lse"], np.float32).copy()
        return out

    def attend_info(self, sid: str = "") -> dict:
        return self.call(ATTEND_INFO, _str(sid))

    def attend_drop(self, sid: str) -> int:
        return self.call(ATTEND_DROP, _str(sid))
