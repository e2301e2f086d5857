"""V.* helpers: token-indexed value sessions (rows of `dim` fp32 values stored in a codec)."""
from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Sequence

import numpy as np

from . import _pool, _wire, codecs

if TYPE_CHECKING:
    from .client import Client


def _identity(model, generation) -> list:
    args = []
    if model is not None:
        args += ["MODEL", model]
    if generation is not None:
        args += ["GENERATION", int(generation)]
    return args


def _rows(rows) -> np.ndarray:
    a = _wire.to_numpy(rows)
    if a.ndim == 1:
        a = a[None, :]
    if a.ndim != 2:
        raise ValueError("rows must be [n, dim], got shape %s" % (a.shape,))
    return a


# Below this a store's round trip dominates: the bytes go inline.
SHM_STORE_MIN_BYTES = 64 << 10


class VStore:
    """`client.v`: V.CREATE / STOREBATCH / FETCH / INFO / DROP / SNAPSHOT / COMMIT / RESTORE.

    Rows travel as float32 [n, dim]; fetched arrays are read-only views of the reply."""

    def __init__(self, client: "Client"):
        self._c = client
        self._formats: dict[str, str] = {}  # sid -> its format, as V.INFO last reported

    def create(self, sid: str, dim: int, fmt: str = "fp32", block: int | None = None) -> None:
        """Creates session `sid` of rows of `dim` values stored as `fmt` (fp32, fp16, bf16,
        int8, turbo4, turbo3, turbo2, fp8, fp8_e5m2); `block` is the turbo block (default
        128)."""
        args = ["V.CREATE", sid, int(dim), fmt]
        if block is not None:
            args += ["BLOCK", int(block)]
        self._c.execute(*args)

    def store_batch(self, sid: str, start: int, rows, *, checksum: bool = False) -> int:
        """Stores rows [n, dim] (float32) at ids start .. start+n-1; returns n. On the Unix
        socket, batches of 64 KiB or more go through shared memory (SHM.RESERVE + commit), and
        `last_store_path` says which path ("shm" or "tcp") was taken. checksum=True has the
        server verify the shared-memory region's CRC32 before storing (TCP is checked by the
        socket already)."""
        rows = _rows(rows)
        ch = self._c._shm_channel() if rows.nbytes >= SHM_STORE_MIN_BYTES else None
        if ch is not None:
            self._c.last_store_path = "shm"
            return ch.store_rows(sid, int(start), rows, checksum=checksum)
        self._c.last_store_path = "tcp"
        return self._c.execute("V.STOREBATCH", sid, int(start), _wire.f32(rows))

    def store_ids(self, sid: str, ids: Sequence[int], rows, *,
                  deadline_ms: int | None = None) -> int:
        """Stores rows [n, dim] at the given int64 ids (a repeated id: the last row wins)."""
        return self._c.execute("V.STOREBATCH", sid, "IDS", _wire.i64(ids),
                               _wire.f32(_rows(rows)), *_wire.admission(deadline_ms))

    def fetch(self, sid: str, start: int, end: int, *, model: str | None = None,
              generation: int | None = None, as_torch: bool | None = None):
        """Rows start <= id < end decoded: float32 [end-start, dim].
        `model`/`generation` state the identity expected of a KV.PREFIX session
        (MismatchError otherwise). Over TCP fp16/bf16 rows travel in their stored encoding
        and are decoded here, bit-identical (from the second fetch of a session on: the first
        tells this client the format), other formats are decoded by the server. On a Unix-socket Client
        (shm=True) fp32/fp16/bf16 rows are decoded here, straight from the shared-memory
        mapping under a lease (half the bytes of decoded fp16 through the socket; the same
        floats: `last_fetch_path` "shm"); other formats are decoded by the server ("tcp")."""
        ch = self._c._shm_channel()
        if ch is not None:
            info = _wire.parse_map(self._c.execute("V.INFO", sid))
            if info["format"] in codecs.ELEMENTWISE:
                self._c.last_fetch_path = "shm"
                rows, = self._c._shm_decode(ch, [(sid, int(start), int(end))], info["format"],
                                            info["dim"], model, generation)
                return self._c._out(rows, as_torch)
        self._c.last_fetch_path = "tcp"
        # fp16/bf16 (the format V.INFO gave last time): the stored bytes, decoded here from
        # the connection's scratch (half the bytes of the decoded rows over the socket);
        # others decoded by the server (fp32 is the same bytes; int8/fp8/turbo the server
        # decodes faster than numpy). V.INFO rides in the same round trip: the decode always
        # follows the session's format as it is now.
        n = int(end) - int(start)
        ident = _identity(model, generation)
        if self._formats.get(sid) in ("fp16", "bf16"):
            def decode(replies):
                self._remember(sid, _wire.parse_map(replies[1])["format"])
                return _decode_reply((replies[1], replies[0]))

            rows = self._c.fetch_decode(
                [("V.FETCH", sid, "RANGE", int(start), int(end), "RAW", *ident),
                 ("V.INFO", sid)], decode)
            return self._c._out(rows, as_torch)
        data, info = self._c.fetch_many([("V.FETCH", sid, "RANGE", int(start), int(end), *ident),
                                         ("V.INFO", sid)])
        self._remember(sid, _wire.parse_map(info)["format"])
        return self._c._out(_wire.from_f32(data, (n, -1)), as_torch)

    def _remember(self, sid: str, fmt: str) -> None:
        """The format V.INFO reported for `sid` (which form fetch asks for next; bounded)."""
        if len(self._formats) >= 4096 and sid not in self._formats:
            self._formats.clear()
        self._formats[sid] = fmt

    def fetch_ids(self, sid: str, ids: Sequence[int], *, model: str | None = None,
                  generation: int | None = None, as_torch: bool | None = None,
                  deadline_ms: int | None = None):
        """Rows at `ids`, in that order: float32 [len(ids), dim] (within `deadline_ms`, or
        DeadlineError)."""
        ids = [int(i) for i in ids]
        data = self._c.fetch_many([("V.FETCH", sid, *ids, *_identity(model, generation),
                                    *_wire.admission(deadline_ms))])[0]
        return self._c._out(_wire.from_f32(data, (len(ids), -1)), as_torch)

    def fetch_raw(self, sid: str, start: int, end: int, *, decode: bool = True,
                  model: str | None = None, generation: int | None = None,
                  as_torch: bool | None = None, into=None):
        """Rows start <= id < end in the stored encoding. With decode (default) they are
        decoded here in numpy (pion.codecs; bit-identical to `fetch`) into float32
        [n, dim]; with decode=False the stored bytes are returned as a memoryview (no copy
        beyond the one out of the socket or the mapping; bytes(...) makes a bytes object).
        The session's format is read with V.INFO (same round trip over TCP). Over TCP the
        reply is received straight into its array (pion._resp), not through redis-py.

        On a Unix-socket Client (shm=True, the default) the bytes are copied out of the
        server's shared-memory mapping under a lease that is released before returning
        (`client.last_fetch_path == "shm"`); otherwise they come in the reply ("tcp").
        The result is the same either way.

        into: a writable C-contiguous numpy array (e.g. a pinned host buffer's numpy view)
        that receives the stored bytes straight from the mapping (or the reply); it must hold
        at least n * row_bytes bytes. Then decode=False returns the uint8 view of `into`
        holding them, and decode=True decodes from it."""
        start, end = int(start), int(end)
        ch = self._c._shm_channel()
        if ch is None:
            self._c.last_fetch_path = "tcp"
            from .client import _byte_view
            dst = _byte_view(into) if into is not None else None
            fetch = ("V.FETCH", sid, "RANGE", start, end, "RAW", *_identity(model, generation))
            if decode and into is None:  # received into scratch, decoded into a fresh array
                rows = self._c.fetch_decode([("V.INFO", sid), fetch], _decode_reply)
                return self._c._out(rows, as_torch)
            if decode:
                info_reply, data = self._c.fetch_many([("V.INFO", sid), fetch], [None, dst])
            else:
                info_reply, data = None, self._c.fetch_many([fetch], [dst])[0]
            buf = data if isinstance(data, np.ndarray) else np.frombuffer(data, np.uint8)
        else:
            info_reply = self._c.execute("V.INFO", sid) if decode else None
            self._c.last_fetch_path = "shm"
            info = _wire.parse_map(info_reply) if decode else {}
            fmt = info.get("format")
            # Decoded straight from the mapping; with into= (fp16/bf16: fp32 rows decode to a
            # view of into below) into also gets the stored bytes, piece by piece, each decoded
            # while in cache.
            if fmt in codecs.ELEMENTWISE and (into is None or fmt != "fp32"):
                from .client import _byte_view
                rows, = self._c._shm_decode(ch, [(sid, start, end)], fmt, info["dim"], model,
                                            generation,
                                            copies=None if into is None else [_byte_view(into)])
                return self._c._out(rows, as_torch)
            buf = self._c._shm_copy(ch, sid, start, end, model, generation, into)
        if not decode and into is None:
            return memoryview(buf)
        if not decode:
            return buf
        info = _wire.parse_map(info_reply)
        rows = codecs.decode(info["format"], info["dim"], info["block"], buf)
        return self._c._out(rows, as_torch)

    @contextlib.contextmanager
    def lease_range(self, sid: str, start: int, end: int, *, model: str | None = None,
                    generation: int | None = None):
        """Zero-copy access to rows start <= id < end in the stored encoding (Unix-socket
        Client with shm=True only; CommandError otherwise):

            with c.v.lease_range("sid", 0, 128) as views:
                ...  # read views

        yields the read-only numpy uint8 views straight into the server's shared-memory
        mappings: a single array when the rows lie in one piece, else a list of arrays
        whose concatenation is the RAW reply. While inside the `with` the bytes do not
        change (a concurrent write copies instead of writing under the lease). The lease is
        released on exit: the views must NOT be used after the `with` (the server may then
        reuse the memory; copy what you keep)."""
        ch = self._c._shm_channel()
        if ch is None:
            from .errors import CommandError
            raise CommandError("ERR lease_range needs the shared-memory path: a Client on "
                               "the server's Unix socket (unix_socket_path=) with shm=True")
        lease, pieces, _row_bytes, _nbytes = ch.fetch_range(sid, int(start), int(end), model,
                                                             generation)
        self._c.last_fetch_path = "shm"
        try:
            views = ch.views(pieces)
            yield views[0] if len(views) == 1 else views
        finally:
            if not ch.closed:
                ch.release(lease)

    def fetch_raw_ids(self, sid: str, ids: Sequence[int], *, decode: bool = True,
                      model: str | None = None, generation: int | None = None,
                      as_torch: bool | None = None):
        """As fetch_raw, for the rows at `ids`."""
        return self._raw(sid, [int(i) for i in ids], decode, model, generation, as_torch)

    def _raw(self, sid, which, decode, model, generation, as_torch):
        fetch = ("V.FETCH", sid, *which, "RAW", *_identity(model, generation))
        if not decode:
            return memoryview(self._c.fetch_many([fetch])[0])
        rows = self._c.fetch_decode([("V.INFO", sid), fetch], _decode_reply)
        return self._c._out(rows, as_torch)

    def info(self, sid: str | None = None) -> dict:
        """V.INFO <sid>: {dim, format, block, row_bytes, rows, chunks, bytes, snapshots,
        sealed}; without sid: {sessions, rows, snapshots} of the caller's tenant."""
        reply = self._c.execute("V.INFO", sid) if sid is not None else self._c.execute("V.INFO")
        return _wire.parse_map(reply)

    def drop(self, sid: str) -> bool:
        """Drops the session (and its snapshots); True when it existed."""
        return bool(self._c.execute("V.DROP", sid))

    def snapshot(self, sid: str) -> int:
        """A point-in-time snapshot (copy-on-write); returns its id."""
        return int(self._c.execute("V.SNAPSHOT", sid))

    def commit(self, sid: str, snapshot: int) -> None:
        """Seals the snapshot durably in the disk tier."""
        self._c.execute("V.COMMIT", sid, int(snapshot))

    def restore(self, sid: str, snapshot: int) -> None:
        """Sets the session's content to the snapshot (in memory or sealed on disk)."""
        self._c.execute("V.RESTORE", sid, int(snapshot))


def _decode_reply(replies):
    """(V.INFO reply, V.FETCH RAW reply) -> the rows decoded into a fresh float32 array."""
    info = _wire.parse_map(replies[0])
    rows = codecs.decode(info["format"], info["dim"], info["block"], replies[1])
    # fp32 decodes to a view of the received bytes: those are the connection's scratch
    if info["format"] != "fp32":
        return rows
    out = _pool.empty(rows.shape, np.float32)
    np.copyto(out, rows)
    return out
