"""Python client of Pion, a Redis-protocol server for shared inference state.

    import pion
    c = pion.Client(port=1974)
    c.v.create("s", 128, "int8")
    c.v.store_batch("s", 0, rows)            # float32 [n, 128]
    c.v.fetch("s", 0, n)                     # float32 [n, 128]

Families: c.state (STATE.*), c.v (V.*), c.kv (KV.PREFIX.*), c.attend (ATTEND.PREFIX.*),
c.ssm (SSM.PREFIX.*). pion.BinaryClient speaks the 0xCA5E binary protocol (port 1975).
Errors raise pion.PionError subclasses carrying the server's text.
"""
from .attend import AttendResult, merge_lse, parse_receipt
from .binary import BinaryClient, FrameError
from .client import Client
from .cluster import ClusterClient, key_slot
from .kvprefix import tp_heads
from .errors import (AuthError, BusyError, CommandError, CorruptError, DeadlineError,
                     DeviceError, IoError, MismatchError, MissError, NoAuthError, NoPermError,
                     OomError, PionConnectionError, PionError, ReadOnlyError, WrongPassError)
from .ssm import deserialize_arrays, serialize_arrays

__version__ = "0.1.0"

__all__ = [
    "Client", "ClusterClient", "tp_heads", "key_slot", "BinaryClient", "FrameError", "AttendResult", "merge_lse", "parse_receipt", "serialize_arrays",
    "deserialize_arrays", "PionError", "CommandError", "OomError", "BusyError",
    "MismatchError", "MissError", "CorruptError", "IoError", "DeviceError", "DeadlineError",
    "ReadOnlyError",
    "AuthError",
    "NoAuthError",
    "WrongPassError", "NoPermError", "PionConnectionError",
]
