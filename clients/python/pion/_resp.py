"""A raw RESP2 connection for the large replies of the fetch helpers. Internal.

redis-py's pure-Python parser assembles a bulk reply in a growing buffer and copies it out
again (about 1 GB/s); here a bulk of LARGE bytes or more is received straight into its
destination with `socket.recv_into` — a fresh uint8 array, or the caller's `into=` array — so
the bytes are copied once, by the kernel. Small replies (sizes, errors, maps) are parsed from a
read buffer. The connection pipelines: `call_many` writes every command, then reads every
reply in order.
"""
from __future__ import annotations

import socket

import numpy as np

from . import _pool, errors

LARGE = 64 << 10  # bulk replies this large go straight into their destination
_READ = 256 << 10
SCRATCH_MAX = 256 << 20  # most bytes a connection keeps for replies decoded before it is reused


class Connection:
    """One raw connection (TCP or Unix socket), authenticated on connect. Not thread-safe:
    the Client's pool hands it to one caller at a time."""

    def __init__(self, host: str = "127.0.0.1", port: int = 1974,
                 unix_socket_path: str | None = None, password: str | None = None,
                 username: str | None = None, timeout: float | None = 20.0):
        if unix_socket_path:
            self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            where = unix_socket_path
        else:
            self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            where = (host, port)
        self._rb = bytearray(_READ)
        self._view = memoryview(self._rb)
        self._start = self._end = 0
        # Reused destination for replies the caller decodes before handing the connection
        # back (call_many(scratch=True)): their pages stay mapped, where a fresh array per
        # call is faulted in again once glibc has returned the memory (tens of MiB).
        self._scratch = None
        self._soff = 0
        self._use_scratch = False
        self.closed = False
        try:
            self.sock.settimeout(timeout)
            self.sock.connect(where)
            if password is not None:
                auth = ("AUTH", password) if username is None else ("AUTH", username, password)
                reply = self.call_many([auth])[0]
                if isinstance(reply, errors.PionError):
                    raise reply
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        self.closed = True
        try:
            self.sock.close()
        except OSError:
            pass

    # --- requests -------------------------------------------------------------------------
    @staticmethod
    def _encode(args, out: list) -> None:
        head = [b"*%d\r\n" % len(args)]
        for a in args:
            if isinstance(a, (bytes, bytearray, memoryview)):
                n = a.nbytes if isinstance(a, memoryview) else len(a)
                if n >= LARGE:  # sent from where it is
                    head.append(b"$%d\r\n" % n)
                    out.append(b"".join(head))
                    out.append(a)
                    head = [b"\r\n"]
                    continue
                head.append(b"$%d\r\n%s\r\n" % (n, bytes(a)))
            else:
                s = str(a).encode()
                head.append(b"$%d\r\n%s\r\n" % (len(s), s))
        out.append(b"".join(head))

    def call_many(self, commands, intos=None, scratch: bool = False) -> list:
        """Sends the commands (tuples of arguments) in one write and returns their replies in
        order: an error reply as its PionError (not raised), a bulk reply of LARGE bytes or
        more as a writable uint8 array — the array intos[i] names for command i, when given
        (ValueError if it is too small; the connection is then closed) — smaller ones as bytes.
        With scratch, large bulks without an into= land in this connection's reused scratch
        memory (up to SCRATCH_MAX bytes a call, fresh arrays beyond): valid only until the
        connection's next call, so the caller must be done with them before handing it back.
        A failed or closed connection raises PionConnectionError and is closed."""
        parts: list = []
        for c in commands:
            self._encode(c, parts)
        self._use_scratch, self._soff = scratch, 0
        try:
            if len(parts) == 1:
                self.sock.sendall(parts[0])
            else:
                for p in parts:
                    self.sock.sendall(p)
            return [self._reply(intos[i] if intos is not None else None)
                    for i in range(len(commands))]
        except (OSError, errors.PionConnectionError) as e:
            self.close()
            if isinstance(e, errors.PionConnectionError):
                raise
            raise errors.PionConnectionError("connection: %s" % e) from e
        except ValueError:
            self.close()  # the stream is out of step now
            raise

    # --- replies --------------------------------------------------------------------------
    def _fill(self) -> None:
        if self._start == self._end:
            self._start = self._end = 0
        elif self._end == len(self._rb):  # keep what is unread, at the front
            n = self._end - self._start
            self._rb[:n] = self._rb[self._start:self._end]
            self._start, self._end = 0, n
        k = self.sock.recv_into(self._view[self._end:])
        if k == 0:
            raise errors.PionConnectionError("connection closed by the server")
        self._end += k

    def _line(self) -> bytes:
        while True:
            i = self._rb.find(b"\r\n", self._start, self._end)
            if i >= 0:
                line = bytes(self._view[self._start:i])
                self._start = i + 2
                return line
            if self._end - self._start >= len(self._rb):
                raise errors.PionConnectionError("reply line longer than %d bytes" % len(self._rb))
            self._fill()

    def _take(self, n: int) -> bytes:
        """n bytes from the stream; n is below LARGE, so they fit in the read buffer."""
        while self._end - self._start < n:
            self._fill()
        out = bytes(self._view[self._start:self._start + n])
        self._start += n
        return out

    def _into(self, dst: memoryview, n: int) -> None:
        have = min(n, self._end - self._start)
        dst[:have] = self._view[self._start:self._start + have]
        self._start += have
        off = have
        while off < n:
            k = self.sock.recv_into(dst[off:n])
            if k == 0:
                raise errors.PionConnectionError("connection closed by the server")
            off += k

    def _scratch_take(self, n: int) -> np.ndarray:
        end = self._soff + n
        if self._scratch is None or self._scratch.size < end:
            # Big enough for everything this call has taken so far, so that the next call
            # with the same replies fits; slices already handed out keep the old one alive.
            self._scratch = np.empty(end, np.uint8)
        out = self._scratch[self._soff:end]
        self._soff = end
        return out

    def _crlf(self) -> None:
        if self._take(2) != b"\r\n":
            raise errors.PionConnectionError("malformed reply: a bulk without its CRLF")

    def _reply(self, into=None):
        line = self._line()
        t, rest = line[:1], line[1:]
        if t == b"$":
            n = int(rest)
            if n < 0:
                return None
            if n < LARGE and into is None:
                out = self._take(n)
                self._crlf()
                return out
            if into is not None:
                if into.size < n:
                    raise ValueError("into= holds %d bytes, the fetch needs %d" % (into.size, n))
                out = into[:n]
            elif self._use_scratch and self._soff + n <= SCRATCH_MAX:
                out = self._scratch_take(n)
            else:
                out = _pool.empty(n, np.uint8)
            self._into(memoryview(out), n)
            self._crlf()
            return out
        if t == b"+":
            return rest.decode()
        if t == b"-":
            return errors.from_text(rest.decode("utf-8", "replace"))
        if t == b":":
            return int(rest)
        if t == b"*":
            n = int(rest)
            return None if n < 0 else [self._reply() for _ in range(n)]
        raise errors.PionConnectionError("unexpected reply %r" % (line[:64],))
