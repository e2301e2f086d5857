"""The connection: `pion.Client` wraps one `redis.Redis` (RESP2 over TCP or a Unix socket),
turns error replies into `pion.errors` exceptions with the server's full text, and exposes the
command families as attributes:

    c = pion.Client(port=1974)
    c.state   STATE.*          (pion.state.State)
    c.v       V.*              (pion.vstore.VStore)
    c.kv      KV.PREFIX.*      (pion.kvprefix.KVPrefix)
    c.attend  ATTEND.PREFIX.*  (pion.attend.Attend)
    c.ssm     SSM.PREFIX.*     (pion.ssm.SSM)

A Client is as thread-safe as redis.Redis (a connection pool): each command takes a pooled
connection.

Same-host shared memory: with `unix_socket_path=` (server started with `--unixsocket`), V raw
range fetches (`c.v.fetch_raw(sid, start, end)`) and KV.PREFIX layer fetches
(`c.kv.fetch_layer`) read the stored bytes from the server's read-only shared-memory mappings
(pion.shm.ShmChannel, created on first use) instead of through the socket; `shm=False` opts
out. `c.last_fetch_path` says which path ("shm" or "tcp") the last such fetch took.
"""
from __future__ import annotations

import threading

import numpy as np
import redis
import redis.exceptions as rex
from redis.connection import DefaultParser

from . import _pool, _wire, codecs, errors


class _FullTextParser(DefaultParser):
    """redis-py's parser, except that an error reply keeps its whole text (redis-py strips
    the prefixes it knows, such as ERR and NOAUTH)."""

    def parse_error(self, response):
        return errors.FullTextError(response)


class Client:
    """A connection pool to one Pion server.

    Args:
      host, port: the RESP endpoint (default 127.0.0.1:1974).
      password, username: AUTH on connect (username None = the `default` user).
      unix_socket_path: connect through a Unix socket instead of TCP.
      as_torch: return torch tensors instead of numpy arrays (torch is imported lazily; every
        helper also takes `as_torch=` per call).
      shm: with unix_socket_path, use the shared-memory data plane for raw range fetches
        (default True); False keeps every byte on the socket.
      **redis_kwargs: passed to redis.Redis (socket_timeout, socket_connect_timeout, ...).
        `decode_responses` is forced off (replies carry binary blobs).
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 1974, password: str | None = None,
                 username: str | None = None, unix_socket_path: str | None = None,
                 as_torch: bool = False, shm: bool = True, **redis_kwargs):
        redis_kwargs["decode_responses"] = False
        self._unix_socket_path = unix_socket_path
        self._password, self._username = password, username
        self._shm_timeout = redis_kwargs.get("socket_timeout", 20.0)
        self._where = dict(host=host, port=port, unix_socket_path=unix_socket_path,
                           password=password, username=username,
                           timeout=redis_kwargs.get("socket_timeout"))
        self._raw_pool: list = []  # pion._resp connections for the fetch helpers
        self._raw_lock = threading.Lock()
        self.shm_enabled = bool(shm and unix_socket_path)
        self._shm = None
        self._shm_lock = threading.Lock()
        self.last_fetch_path: str | None = None  # "shm" | "tcp", set by raw range fetches
        self.last_store_path: str | None = None  # "shm" | "tcp", set by V store_batch
        self.redis = redis.Redis(host=host, port=port, password=password, username=username,
                                 unix_socket_path=unix_socket_path, **redis_kwargs)
        self.redis.connection_pool.connection_kwargs["parser_class"] = _FullTextParser
        self.as_torch = as_torch
        # Imported here: the family modules import this one for type names only.
        from .attend import Attend
        from .kvprefix import KVPrefix
        from .ssm import SSM
        from .state import State
        from .vstore import VStore
        self.state = State(self)
        self.v = VStore(self)
        self.kv = KVPrefix(self)
        self.attend = Attend(self)
        self.ssm = SSM(self)

    # --- commands -------------------------------------------------------------------------
    def execute(self, *args):
        """Sends one command and returns the raw reply (bytes, int, list, None). An error
        reply raises the matching PionError subclass; a connection failure raises
        PionConnectionError."""
        try:
            return self.redis.execute_command(*args)
        except rex.RedisError as e:
            raise errors.from_redis(e) from e

    def execute_many(self, commands):
        """Sends several commands in one round trip (a non-transactional pipeline) and returns
        their raw replies in order; the first error reply raises (the other commands still
        ran)."""
        pipe = self.redis.pipeline(transaction=False)
        for cmd in commands:
            pipe.execute_command(*cmd)
        try:
            replies = pipe.execute(raise_on_error=False)
        except rex.RedisError as e:
            raise errors.from_redis(e) from e
        for r in replies:
            if isinstance(r, rex.RedisError):
                raise errors.from_redis(r) from r
        return replies

    def fetch_many(self, commands, intos=None) -> list:
        """Sends commands in one round trip on a raw connection (pion._resp) and returns their
        replies: bulk replies of 64 KiB or more come as writable uint8 numpy arrays received
        straight from the socket (into intos[i] for command i, when given), smaller ones as
        bytes. The first error reply raises (the other commands still ran). The fetch helpers
        use this for their large replies."""
        return self.fetch_decode(commands, None, intos)

    def fetch_decode(self, commands, decode, intos=None):
        """As fetch_many, then decode(replies) while the connection is still held, with the
        large bulks (those without an into=) in the connection's reused scratch memory:
        for replies that are decoded into fresh arrays anyway, this spares faulting in a
        fresh receive buffer per call. decode must not keep the scratch arrays; its result
        is returned. decode=None returns the replies themselves (in fresh arrays)."""
        with self._raw_lock:
            conn = self._raw_pool.pop() if self._raw_pool else None
        if conn is None:
            from ._resp import Connection
            conn = Connection(**self._where)
        try:
            replies = conn.call_many(commands, intos, scratch=decode is not None)
            for r in replies:
                if isinstance(r, errors.PionError):
                    raise r
            out = replies if decode is None else decode(replies)
        except errors.PionError as e:
            if isinstance(e, errors.PionConnectionError):
                conn.close()
                raise
            self._give_back(conn)
            raise
        except BaseException:
            conn.close()
            raise
        self._give_back(conn)
        return out

    def _give_back(self, conn) -> None:
        with self._raw_lock:
            self._raw_pool.append(conn)

    def ping(self) -> bool:
        """True when the server answers PONG."""
        reply = self.execute("PING")  # redis-py turns +PONG into True
        return reply is True or _wire.status(reply) == "PONG"

    def info(self, section: str = "default") -> dict:
        """INFO as {field: value}, `# Section` headers dropped (numbers converted the way
        redis-py's INFO parser converts them)."""
        reply = self.execute("INFO", section)
        if isinstance(reply, dict):  # redis-py's INFO callback already parsed it
            return reply
        out = {}
        for line in _wire.text(reply).splitlines():
            if line and not line.startswith("#"):
                k, _, v = line.partition(":")
                out[k] = v
        return out

    def close(self) -> None:
        """Closes every pooled connection and the shared-memory channel (the server releases
        the leases it still held)."""
        with self._shm_lock:
            ch, self._shm = self._shm, None
        if ch is not None:
            ch.close()
        with self._raw_lock:
            pool, self._raw_pool = self._raw_pool, []
        for conn in pool:
            conn.close()
        self.redis.connection_pool.disconnect()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # --- for the family modules -----------------------------------------------------------
    def _out(self, a, as_torch: bool | None):
        return _wire.maybe_torch(a, self.as_torch if as_torch is None else as_torch)

    def _shm_channel(self):
        """The ShmChannel (created on first use), or None when the shared-memory path is off
        (TCP connection, or shm=False)."""
        if not self.shm_enabled:
            return None
        with self._shm_lock:
            if self._shm is None or self._shm.closed:
                from .shm import ShmChannel
                self._shm = ShmChannel(self._unix_socket_path, password=self._password,
                                       username=self._username, timeout=self._shm_timeout)
            return self._shm

    def _shm_copy(self, ch, sid, start, end, model=None, generation=None, into=None, extra=()):
        """Fetches rows start..end over SHM, copies them into `into` (or a fresh uint8 array)
        and releases the lease; returns the uint8 array holding exactly the bytes. `extra`:
        HEADS / AS options (HEADS: copied out of the stored rows here; AS: the server's
        transcoded rows, one leased piece)."""
        return self._shm_copy_many(ch, [(sid, start, end)], model, generation,
                                   None if into is None else [into], extra)[0]

    def _shm_copy_many(self, ch, ranges, model=None, generation=None, intos=None, extra=()):
        """_shm_copy of several (sid, start, end), their leases taken in one round trip (and
        released with the channel's next command)."""
        got = ch.fetch_ranges(ranges, model, generation, extra)
        outs = []
        try:
            for i, (_lease, pieces, _row_bytes, nbytes) in enumerate(got):
                if intos is None or intos[i] is None:
                    out = _pool.empty(nbytes, np.uint8)
                else:
                    out = _byte_view(intos[i])[:nbytes]
                ch.read_into(pieces, out)
                outs.append(out)
        finally:
            ch.release_later(*[x[0] for x in got])
        return outs


    def _shm_decode(self, ch, ranges, fmt, dim, model=None, generation=None, copies=None):
        """Rows [(sid, start, end), ...] of an element-wise format (fp32/fp16/bf16) decoded
        into fresh float32 [n, dim] arrays straight from the shared-memory mapping, under
        leases taken in one round trip and released after (no copy of the stored bytes first;
        all ranges decode together over the copy threads); bit-identical to
        pion.codecs.decode. copies: per range, None or a uint8 array that also receives its
        stored bytes (codecs.decode_pieces_many)."""
        got = ch.fetch_ranges(ranges, model, generation)
        try:
            for cp, (_lease, _pieces, _rb, nbytes) in zip(copies or (), got):
                if cp is not None and cp.size < nbytes:
                    raise ValueError("into= holds %d bytes, the fetch needs %d" % (cp.size, nbytes))
            outs = [_pool.empty(nbytes // codecs.ELEMENTWISE[fmt], np.float32)
                    for _lease, _pieces, _rb, nbytes in got]
            codecs.decode_pieces_many(fmt, [(ch.views(pieces), out)
                                            for (_l, pieces, _rb, _n), out in zip(got, outs)],
                                      copies)
        finally:
            ch.release_later(*(lease for lease, *_ in got))
        return [out.reshape(-1, dim) for out in outs]


def _byte_view(a) -> np.ndarray:
    """A writable, C-contiguous numpy array (or torch CPU tensor) as a flat uint8 view."""
    if type(a).__module__.startswith("torch"):
        a = a.numpy()
    if not isinstance(a, np.ndarray):
        raise TypeError("into= must be a numpy array (or a CPU torch tensor)")
    if not a.flags.c_contiguous or not a.flags.writeable:
        raise ValueError("into= must be C-contiguous and writable")
    return a.reshape(-1).view(np.uint8)
