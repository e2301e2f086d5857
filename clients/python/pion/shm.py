"""The same-host data plane (server started with `--unixsocket`): `ShmChannel`.

One ShmChannel owns one raw connection on the server's Unix socket. It is separate from the
Client's redis-py pool because (1) a lease belongs to the connection that fetched it, and (2)
only a raw socket can receive the segments' file descriptors (SCM_RIGHTS, `socket.recv_fds`).

    ch = ShmChannel("/tmp/pion.sock", password=None)
    lease, pieces, row_bytes, nbytes = ch.fetch_range("sid", 0, 128)
    out = np.empty(nbytes, np.uint8); ch.read_into(pieces, out)
    ch.release(lease)

`SHM.ATTACH` returns one read-only memfd per segment of the tenant's arena; each is mapped
read-only once (`{segment id: mmap}`) and re-attached when a fetch names a segment created
since. While a lease is held the bytes it names do not change (the server copies on write);
they may be reused after `release`. Closing the channel (or the connection dropping) releases
every lease it holds. Thread-safe: one lock serializes the connection.
"""
from __future__ import annotations

import mmap
import os
import socket
import threading
import zlib

import numpy as np

from . import errors

_MAX_FDS = 1024
PARALLEL_BYTES = 4 << 20  # reads this large are shared between threads
_pool = None
_helpers = 0
_pool_lock = threading.Lock()


def _copy_pool():
    """The shared copy pool (helpers for the calling thread: up to 3), or None on a
    single-core machine."""
    global _pool, _helpers
    helpers = min(4, os.cpu_count() or 1) - 1
    if helpers < 1:
        return None
    with _pool_lock:
        if _pool is None:
            from concurrent.futures import ThreadPoolExecutor
            _pool = ThreadPoolExecutor(helpers, thread_name_prefix="pion-shm-copy")
            _helpers = helpers
    return _pool


class Pieces(list):
    """A fetch's (segment, offset, length) pieces. Strided (a HEADS fetch in the stored
    encoding): the pieces hold whole stored rows of `row_stride` bytes and each row of the
    reply is the `row_parts` byte ranges [(offset, length), ...] of one of them; otherwise
    (row_parts None) the reply is the pieces' concatenation."""

    def __init__(self, items=(), row_stride: int = 0, row_parts=None):
        super().__init__(items)
        self.row_stride = row_stride
        self.row_parts = row_parts


class ShmChannel:
    """A raw RESP2 connection on the Unix socket that maps the tenant's SHM segments."""

    def __init__(self, path: str, password: str | None = None, username: str | None = None,
                 timeout: float | None = 20.0):
        self.path = path
        self.maps: dict[int, mmap.mmap] = {}
        self.wmaps: dict[int, mmap.mmap] = {}  # this connection's writable staging segments
        self.cuda_registered: dict[int, int] = {}  # segment -> host address registered with CUDA
        self.cuda_epoch: dict[int, int] = {}  # segment -> the arena's punch epoch when registered
        self.epoch = 0  # the punch epoch of the last fetch_range reply
        self.leases: set[int] = set()
        self._lock = threading.RLock()
        self._buf = b""
        self._pending = 0  # replies of release_later not read yet
        self._fds: list[int] = []
        self._closed = False
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self.sock.settimeout(timeout)
            self.sock.connect(path)
            if password is not None:
                if username is not None:
                    self.call("AUTH", username, password)
                else:
                    self.call("AUTH", password)
            self.attach()
        except BaseException:
            self.close()
            raise

    # --- RESP -----------------------------------------------------------------------------
    def _fill(self) -> None:
        try:
            data, fds, _flags, _addr = socket.recv_fds(self.sock, 1 << 20, _MAX_FDS)
        except OSError as e:
            raise errors.PionConnectionError("SHM channel: %s" % e) from e
        self._fds += fds
        if not data:
            raise errors.PionConnectionError("SHM channel: connection closed by the server")
        self._buf += data

    def _line(self) -> bytes:
        while True:
            i = self._buf.find(b"\r\n")
            if i >= 0:
                line, self._buf = self._buf[:i], self._buf[i + 2:]
                return line
            self._fill()

    def _reply(self):
        line = self._line()
        t, rest = line[:1], line[1:]
        if t == b"+":
            return rest.decode()
        if t == b"-":
            return errors.from_text(rest.decode("utf-8", "replace"))
        if t == b":":
            return int(rest)
        if t == b"$":
            n = int(rest)
            if n < 0:
                return None
            while len(self._buf) < n + 2:
                self._fill()
            out, self._buf = self._buf[:n], self._buf[n + 2:]
            return out
        if t == b"*":
            n = int(rest)
            return None if n < 0 else [self._reply() for _ in range(n)]
        raise errors.PionConnectionError("SHM channel: unexpected reply %r" % (line[:64],))

    @staticmethod
    def _encode(args) -> bytes:
        out = [b"*%d\r\n" % len(args)]
        for a in args:
            a = a if isinstance(a, bytes) else str(a).encode()
            out.append(b"$%d\r\n%s\r\n" % (len(a), a))
        return b"".join(out)

    def _exchange(self, payload: bytes, n: int) -> list:
        """Sends the encoded commands, reads their n replies (lock held by the caller)."""
        if self._closed:
            raise errors.PionConnectionError("SHM channel is closed")
        try:
            self.sock.sendall(payload)
            for _ in range(self._pending):  # replies of release_later, sent before these
                self._reply()
            self._pending = 0
            return [self._reply() for _ in range(n)]
        except OSError as e:  # socket.timeout included
            self.close()  # the stream is out of step now; the Client opens a new one
            raise errors.PionConnectionError("SHM channel: %s" % e) from e
        except errors.PionConnectionError:
            self.close()
            raise

    def call(self, *args):
        """Sends one command and returns its reply; an error reply raises its PionError."""
        with self._lock:
            reply = self._exchange(self._encode(args), 1)[0]
            stray, self._fds = self._fds, []
            if args[0] in ("SHM.ATTACH", "SHM.RESERVE"):
                return reply, stray
            for fd in stray:  # descriptors only come with SHM.ATTACH
                os.close(fd)
        if isinstance(reply, errors.PionError):
            raise reply
        return reply

    def call_many(self, commands) -> list:
        """Pipelines commands (tuples of arguments; not SHM.ATTACH / SHM.RESERVE): one write,
        then every reply, in order. An error reply is returned in its place as a PionError
        (not raised), so that the caller sees — and can release — what the others granted."""
        commands = list(commands)
        if any(c[0] in ("SHM.ATTACH", "SHM.RESERVE") for c in commands):
            raise ValueError("call_many does not take SHM.ATTACH / SHM.RESERVE")
        with self._lock:
            replies = self._exchange(b"".join(self._encode(c) for c in commands), len(commands))
            stray, self._fds = self._fds, []
            for fd in stray:
                os.close(fd)
        return replies

    # --- segments ---------------------------------------------------------------------------
    def attach(self) -> None:
        """SHM.ATTACH: maps (read-only) every segment not mapped yet."""
        with self._lock:
            segs, fds = self.call("SHM.ATTACH")
            try:
                if isinstance(segs, errors.PionError):
                    raise segs
                if len(fds) != len(segs):
                    raise errors.PionConnectionError(
                        "SHM.ATTACH: %d segments but %d descriptors" % (len(segs), len(fds)))
                for (seg, size), fd in zip(segs, fds):
                    if seg not in self.maps:
                        # mmap keeps its own duplicate of fd; ours is closed below.
                        self.maps[seg] = mmap.mmap(fd, size, flags=mmap.MAP_SHARED,
                                                   prot=mmap.PROT_READ)
            finally:
                for fd in fds:
                    os.close(fd)

    def fetch_range(self, sid: str, start: int, end: int, model: str | None = None,
                    generation: int | None = None, extra=()):
        """V.FETCH <sid> RANGE <start> <end> SHM → (lease, pieces, row_bytes, nbytes), pieces a
        Pieces of (segment, offset, length) whose concatenation is the RAW reply. The lease
        must be released (`release`) once the bytes have been read. `extra`: more options
        (HEADS <first> <count>: strided pieces, the stored rows with the byte ranges of each
        to copy — read them with read_into; AS <codec>: the transcoded rows, one piece)."""
        return self.fetch_ranges([(sid, start, end)], model, generation, extra)[0]

    def fetch_ranges(self, ranges, model: str | None = None, generation: int | None = None,
                     extra=()):
        """fetch_range of several (sid, start, end), pipelined (one round trip); a list of
        (lease, pieces, row_bytes, nbytes) in order. All or nothing: when one fails, the
        leases the others got are released and its error raised."""
        tail = (["MODEL", model] if model is not None else []) + \
            (["GENERATION", int(generation)] if generation is not None else []) + list(extra)
        cmds = [("V.FETCH", sid, "RANGE", int(a), int(b), "SHM", *tail) for sid, a, b in ranges]
        with self._lock:
            out, failed = [], None
            for reply in self.call_many(cmds):
                if isinstance(reply, errors.PionError):
                    failed = failed or reply
                    continue
                r = {k.decode() if isinstance(k, bytes) else k: v
                     for k, v in zip(reply[::2], reply[1::2])}
                lease = int(r["lease"])
                self.leases.add(lease)
                pieces = Pieces((int(s), int(o), int(n)) for s, o, n in r["pieces"])
                if "row_parts" in r:
                    pieces.row_stride = int(r["row_stride"])
                    pieces.row_parts = [(int(o), int(n)) for o, n in r["row_parts"]]
                self.epoch = int(r.get("epoch", 0))
                out.append((lease, pieces, int(r["row_bytes"]), int(r["bytes"])))
            if failed is not None:
                self.release_many([x[0] for x in out])
                raise failed
            if any(s not in self.maps for x in out for s, _, _ in x[1]):
                self.attach()  # a segment added since the last attach
        return out

    def views(self, pieces) -> list[np.ndarray]:
        """Read-only numpy uint8 views of the pieces, straight into the mappings (valid only
        while the lease that named them is held). Not for strided pieces (read_into)."""
        if getattr(pieces, "row_parts", None) is not None:
            raise ValueError("strided pieces (HEADS) are not the reply's bytes: use read_into")
        return [np.frombuffer(self.maps[s], dtype=np.uint8, count=n, offset=o)
                for s, o, n in pieces]

    def read_into(self, pieces, out: np.ndarray) -> int:
        """Copies the pieces, concatenated, into `out` (a contiguous array, viewed as uint8);
        returns the number of bytes written. Large reads (PARALLEL_BYTES or more) are shared
        between the calling thread and a small pool (numpy releases the GIL while it
        copies): one core's copy of pieces this size runs without the non-temporal stores
        glibc keeps for larger sizes, and two cores reach the machine's memcpy rate
        (bench/results/shm-2026-12-01.md)."""
        dst = out.reshape(-1).view(np.uint8) if out.dtype != np.uint8 or out.ndim != 1 else out
        if getattr(pieces, "row_parts", None) is not None:
            return self._read_strided(pieces, dst)
        total = sum(n for _, _, n in pieces)
        if total > dst.size:
            raise ValueError("into= holds %d bytes, the fetch needs %d" % (dst.size, total))
        jobs, pos = [], 0
        for s, o, n in pieces:
            jobs.append((np.frombuffer(self.maps[s], dtype=np.uint8, count=n, offset=o), pos))
            pos += n
        pool = _copy_pool() if total >= PARALLEL_BYTES else None
        if pool is None:
            for src, at in jobs:
                dst[at:at + src.size] = src
            return pos
        # One share of the bytes per worker (the calling thread copies the last), each share
        # a list of (source slice, destination offset).
        workers = _helpers + 1
        share = -(-pos // workers)
        shares: list[list] = [[] for _ in range(workers)]
        for src, at in jobs:
            i = 0
            while i < src.size:
                w = (at + i) // share
                n = min(src.size - i, (w + 1) * share - (at + i))
                shares[w].append((src[i:i + n], at + i))
                i += n

        def copy(parts):
            for src, at in parts:
                dst[at:at + src.size] = src
        futures = [pool.submit(copy, p) for p in shares[:-1] if p]
        copy(shares[-1])
        for f in futures:
            f.result()
        return pos

    def _read_strided(self, pieces: Pieces, dst: np.ndarray) -> int:
        """read_into of strided pieces: each stored row's parts, in order, into the next row of
        `dst` — one pass over the bytes the reply needs, shared with the copy pool by rows
        when large."""
        stride, parts = pieces.row_stride, pieces.row_parts
        row = sum(n for _, n in parts)
        rows = sum(n for _, _, n in pieces) // stride
        if rows * row > dst.size:
            raise ValueError("into= holds %d bytes, the fetch needs %d" % (dst.size, rows * row))
        # Copied in the widest words every offset and length allows (numpy's strided copy
        # moves a word per step: 8-byte words take about 0.7x the time of bytes).
        word = 8
        while word > 1 and any(x % word for x in (stride, row, dst.ctypes.data,
                                                  *(v for p in parts for v in p),
                                                  *(o for _, o, _ in pieces))):
            word //= 2
        wt = np.dtype("u%d" % word)
        out = dst[:rows * row].view(wt).reshape(rows, row // word)
        parts = [(o // word, n // word) for o, n in parts]
        # (source rows [r, stride], destination row offset) per piece
        srcs, at = [], 0
        for s, o, n in pieces:
            srcs.append((np.frombuffer(self.maps[s], dtype=wt, count=n // word,
                                       offset=o).reshape(-1, stride // word), at))
            at += n // stride

        def copy(jobs):
            for src, r0 in jobs:
                pos = 0
                for off, n in parts:
                    out[r0:r0 + src.shape[0], pos:pos + n] = src[:, off:off + n]
                    pos += n
        pool = _copy_pool() if rows * row >= PARALLEL_BYTES else None
        if pool is None:
            copy(srcs)
            return rows * row
        workers = _helpers + 1
        share = -(-rows // workers)
        shares: list[list] = [[] for _ in range(workers)]
        for src, r0 in srcs:
            i = 0
            while i < src.shape[0]:
                w = (r0 + i) // share
                n = min(src.shape[0] - i, (w + 1) * share - (r0 + i))
                shares[w].append((src[i:i + n], r0 + i))
                i += n
        futures = [pool.submit(copy, p) for p in shares[:-1] if p]
        copy(shares[-1])
        for f in futures:
            f.result()
        return rows * row

    def store_rows(self, sid: str, start: int, rows, checksum: bool = False) -> int:
        """Stores float32 rows [n, dim] at ids start.. through shared memory: SHM.RESERVE a
        region of this connection's writable staging segment, copy the rows in, commit with
        V.STOREBATCH <sid> <start> SHM <lease>. No row byte crosses the socket. Returns n.
        checksum=True sends the rows' CRC32: the server stores nothing (CorruptError) unless
        the region holds exactly those bytes."""
        data = np.ascontiguousarray(rows, dtype=np.float32).reshape(-1).view(np.uint8)
        with self._lock:
            reply, fds = self.call("SHM.RESERVE", int(data.size))
            try:
                if isinstance(reply, errors.PionError):
                    raise reply
                lease, seg, off, length = (int(x) for x in reply)
                if seg not in self.wmaps:
                    if not fds:
                        raise errors.PionConnectionError("SHM.RESERVE: no descriptor came")
                    size = os.fstat(fds[0]).st_size
                    self.wmaps[seg] = mmap.mmap(fds[0], size, flags=mmap.MAP_SHARED,
                                                prot=mmap.PROT_READ | mmap.PROT_WRITE)
            finally:
                for fd in fds:
                    os.close(fd)
            region = np.frombuffer(self.wmaps[seg], dtype=np.uint8, count=length, offset=off)
            region[:] = data
            del region
            extra = ["CRC32", zlib.crc32(data)] if checksum else []
            return int(self.call("V.STOREBATCH", sid, int(start), "SHM", lease, *extra))

    def cuda_register(self, seg: int) -> bool:
        """Registers segment `seg`'s mapping with CUDA (cudaHostRegister, read-only flag) so
        the GPU can DMA straight from it: measured 2.3x faster than a pinned bounce buffer on
        an H200 (bench/results/shm-gpu-2026-11-29.md). Once per segment; False if CUDA refuses
        (callers fall back to the pinned path)."""
        import torch  # only on this path
        if seg in self.cuda_registered:
            if self.cuda_epoch.get(seg) == self.epoch:
                return True
            # The server gave pages of this arena back since: the pages pinned then are not
            # the ones it writes now. Pin the segment again.
            torch.cuda.cudart().cudaHostUnregister(self.cuda_registered.pop(seg))
        arr = np.frombuffer(self.maps[seg], dtype=np.uint8)
        addr, size = arr.ctypes.data, arr.nbytes
        del arr  # no lasting export of the mapping
        err = torch.cuda.cudart().cudaHostRegister(addr, size, 8)  # cudaHostRegisterReadOnly
        if int(getattr(err, "value", err)) != 0:
            return False
        self.cuda_registered[seg] = addr
        self.cuda_epoch[seg] = self.epoch
        return True

    def release(self, lease: int) -> bool:
        """SHM.RELEASE: True when this connection held the lease (False once the channel is
        closed: closing it released every lease)."""
        return self.release_many([lease]) == 1

    def release_later(self, *leases: int) -> None:
        """SHM.RELEASE of the leases without waiting for the replies: the server releases each
        as soon as it reads the command (in order with this connection's others); the replies
        are read with the next command's. Saves a round trip per fetch."""
        leases = tuple(int(x) for x in leases)
        with self._lock:
            self.leases.difference_update(leases)
            if self._closed or not leases:
                return
            try:
                self.sock.sendall(b"".join(self._encode(("SHM.RELEASE", x)) for x in leases))
            except OSError as e:
                self.close()
                raise errors.PionConnectionError("SHM channel: %s" % e) from e
            self._pending += len(leases)

    def release_many(self, leases) -> int:
        """SHM.RELEASE of several leases, pipelined; returns how many this connection held."""
        leases = [int(x) for x in leases]
        with self._lock:
            self.leases.difference_update(leases)
            if self._closed or not leases:
                return 0
            replies = self.call_many(("SHM.RELEASE", x) for x in leases)
        return sum(1 for r in replies if r == 1)

    def close(self) -> None:
        """Closes the connection (the server releases its leases) and the mappings. A mapping
        still exported to a live numpy view is left to the garbage collector."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self.leases.clear()
            try:
                self.sock.close()
            finally:
                for fd in self._fds:
                    os.close(fd)
                self._fds = []
                if self.cuda_registered:
                    import torch
                    for addr in self.cuda_registered.values():
                        torch.cuda.cudart().cudaHostUnregister(addr)
                    self.cuda_registered.clear()
                for m in list(self.maps.values()) + list(self.wmaps.values()):
                    try:
                        m.close()
                    except BufferError:
                        pass  # a view still exports it; freed with the view
                self.maps.clear()
                self.wmaps.clear()

    @property
    def closed(self) -> bool:
        return self._closed
