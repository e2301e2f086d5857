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
connection. The shared-memory data plane (with --unixsocket) arrives in a later release.
"""
from __future__ import annotations

import redis
import redis.exceptions as rex
from redis.connection import DefaultParser

from . import _wire, errors


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
      **redis_kwargs: passed to redis.Redis (socket_timeout, socket_connect_timeout, ...).
        `decode_responses` is forced off (replies carry binary blobs).
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 1974, password: str | None = None,
                 username: str | None = None, unix_socket_path: str | None = None,
                 as_torch: bool = False, **redis_kwargs):
        redis_kwargs["decode_responses"] = False
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
        """Closes every pooled connection."""
        self.redis.connection_pool.disconnect()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # --- for the family modules -----------------------------------------------------------
    def _out(self, a, as_torch: bool | None):
        return _wire.maybe_torch(a, self.as_torch if as_torch is None else as_torch)
