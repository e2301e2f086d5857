"""Exceptions raised by the Pion client, one class per RESP error prefix of the server.

Every exception carries the server's full error text, prefix included (`str(e)` shows it,
e.g. "OOM command not allowed when used memory > 'maxmemory': ..."), and the prefix alone in
`e.prefix`. redis-py strips some prefixes (`ERR`, `NOAUTH`, `NOPERM`) before raising;
`from_redis` puts them back so that the text is always what the server sent.
"""
from __future__ import annotations

import redis.exceptions as rex


class PionError(Exception):
    """Base class: an error reply from the server (or a failed connection).

    Attributes: `prefix` (e.g. "ERR", "OOM"; "" for client-side failures) and `message`
    (the server's full text, prefix included)."""

    prefix = ""

    def __init__(self, message: str, prefix: str | None = None):
        super().__init__(message)
        self.message = message
        if prefix is not None:
            self.prefix = prefix


class CommandError(PionError):
    """-ERR: a malformed or refused command (arity, argument, no such key, ...)."""
    prefix = "ERR"


class OomError(PionError):
    """-OOM: the write does not fit under --maxmemory (nothing was stored)."""
    prefix = "OOM"


class BusyError(PionError):
    """-BUSY: a shard inbox, the compute queue or the disk I/O queue is full; retry later."""
    prefix = "BUSY"


class MismatchError(PionError):
    """-MISMATCH: the stored identity (model, position, generation, shape) differs from the
    one the request names."""
    prefix = "MISMATCH"


class MissError(PionError):
    """-MISS: no such object (e.g. an attention slot never stored, or dropped)."""
    prefix = "MISS"


class CorruptError(PionError):
    """-CORRUPT: a disk copy failed validation (checksum, truncation); never served."""
    prefix = "CORRUPT"


class DeadlineError(PionError):
    """-TIMEOUT: the request's DEADLINE cannot be (or was not) met; the message names the stage
    (disk_read, gpu_upload, host_room, compute, ...). Nothing was changed."""
    prefix = "TIMEOUT"


class IoError(PionError):
    """-IOERR: the disk tier failed."""
    prefix = "IOERR"


class DeviceError(PionError):
    """-DEVERR: the server's GPU failed a copy or a kernel (--attention-backend cuda)."""
    prefix = "DEVERR"


class ReadOnlyError(PionError):
    """-READONLY: the object is published and immutable (a complete KV.PREFIX namespace):
    nothing was changed. Drop it and register it again to publish other K/V."""
    prefix = "READONLY"


class AuthError(PionError):
    """Base of the authentication errors."""


class NoAuthError(AuthError):
    """-NOAUTH: authentication is required (or HELLO was called without AUTH)."""
    prefix = "NOAUTH"


class WrongPassError(AuthError):
    """-WRONGPASS: invalid username-password pair."""
    prefix = "WRONGPASS"


class NoPermError(PionError):
    """-NOPERM: the user's tenant may not run this (administrative) command."""
    prefix = "NOPERM"


class PionConnectionError(PionError):
    """The connection failed or was closed (no server error text; see __cause__)."""


class FullTextError(rex.ResponseError):
    """An error reply as redis-py raises it on a pion.Client connection: the full text."""


_BY_PREFIX = {cls.prefix: cls for cls in (CommandError, OomError, BusyError, MismatchError,
                                          MissError, CorruptError, IoError, DeviceError,
                                          DeadlineError, ReadOnlyError,
                                          NoAuthError, WrongPassError, NoPermError)}

# Prefixes redis-py leaves in the message (it only strips those it knows).
_UNSTRIPPED = set(_BY_PREFIX) - {"ERR", "NOAUTH", "NOPERM", "READONLY"} | {"NOPROTO",
                                                                     "WRONGTYPE"}


def from_text(text: str) -> PionError:
    """The exception for one error reply's full text ("PREFIX message")."""
    prefix = text.split(" ", 1)[0]
    return _BY_PREFIX.get(prefix, PionError)(text, prefix)


def server_text(exc: rex.RedisError) -> str | None:
    """The server's full error text behind a redis-py exception, or None when the exception
    did not come from an error reply.

    Connections made by `pion.Client` use a parser that keeps the text whole (a
    FullTextError); for other connections the prefixes redis-py strips are put back."""
    msg = str(exc)
    if isinstance(exc, FullTextError):
        return msg
    if isinstance(exc, rex.NoPermissionError):
        return "NOPERM " + msg
    if isinstance(exc, rex.ReadOnlyError):
        return "READONLY " + msg
    if isinstance(exc, rex.AuthenticationError):
        if msg.startswith(("NOAUTH", "WRONGPASS")):
            return msg
        if msg.startswith("Authentication required") or msg.startswith("HELLO must be called"):
            return "NOAUTH " + msg
        return None  # raised by redis-py itself
    if isinstance(exc, (rex.ConnectionError, rex.TimeoutError)):
        return None
    if isinstance(exc, rex.ResponseError):
        if msg.split(" ", 1)[0] in _UNSTRIPPED:
            return msg
        return "ERR " + msg
    return None


def from_redis(exc: rex.RedisError) -> PionError:
    """Converts a redis-py exception into the matching PionError (chained by the caller)."""
    text = server_text(exc)
    if text is None:
        return PionConnectionError(str(exc))
    return from_text(text)
