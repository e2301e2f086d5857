"""Conversions between numpy/torch values and the server's wire forms: little-endian blobs,
RESP2 maps (flat key, value, ... arrays) and optional torch outputs. Internal."""
from __future__ import annotations

import sys
from typing import Any, Iterable

import numpy as np

if sys.byteorder != "little":  # every blob is little-endian; views below assume it
    raise ImportError("pion's numpy helpers assume a little-endian host")


def to_numpy(x, dtype=None) -> np.ndarray:
    """A numpy array from a numpy array, a torch tensor (any device; bf16 widened to fp32) or
    a nested sequence."""
    mod = type(x).__module__
    if mod.startswith("torch"):
        x = x.detach().cpu()
        if str(x.dtype) == "torch.bfloat16":
            x = x.float()
        x = x.numpy()
    return np.asarray(x) if dtype is None else np.asarray(x, dtype=dtype)


def blob(x, dtype: str) -> memoryview:
    """The little-endian bytes of x as `dtype` ("<f4", "<i4", "<i8"), C order, without a copy
    when x already has that layout."""
    a = np.ascontiguousarray(to_numpy(x), dtype=dtype)
    return a.reshape(-1).view(np.uint8).data


def f32(x) -> memoryview:
    return blob(x, "<f4")


def i32(x) -> memoryview:
    return blob(x, "<i4")


def i64(x) -> memoryview:
    return blob(x, "<i8")


def from_f32(data: bytes, shape) -> np.ndarray:
    """float32 array of `shape` viewing the reply bytes (read-only; no copy)."""
    return np.frombuffer(data, dtype="<f4").reshape(shape)


def text(x):
    """bytes -> str, recursively through lists; other values unchanged."""
    if isinstance(x, bytes):
        return x.decode("utf-8", "replace")
    if isinstance(x, list):
        return [text(y) for y in x]
    return x


def admission(deadline_ms=None, allow_approx: bool = False) -> list:
    """The trailing admission options: DEADLINE <ms> (the request is answered within that many
    milliseconds or refused with DeadlineError) and ALLOW APPROX (attention queries: an
    approximate answer, told by the receipt, rather than a refusal)."""
    out = []
    if deadline_ms is not None:
        ms = int(deadline_ms)
        if ms < 1:
            raise ValueError("deadline_ms must be a whole number of milliseconds >= 1, got %r"
                             % (deadline_ms,))
        out += ["DEADLINE", ms]
    if allow_approx:
        out += ["ALLOW", "APPROX"]
    return out


def parse_map(reply, floats: Iterable[str] = (), bools: Iterable[str] = ()) -> dict[str, Any]:
    """A RESP2 flat map (or a RESP3 dict) as {str: value}; bulk strings become str, the keys in
    `floats` become float (RESP2 sends doubles as bulk strings), those in `bools` bool."""
    if isinstance(reply, dict):
        items = list(reply.items())
    else:
        if len(reply) % 2:
            raise ValueError("map reply with an odd number of elements: %r" % (reply,))
        items = [(reply[i], reply[i + 1]) for i in range(0, len(reply), 2)]
    out = {text(k): text(v) for k, v in items}
    for k in floats:
        if k in out and out[k] is not None and not isinstance(out[k], list):
            out[k] = float(out[k])
    for k in bools:
        if k in out and out[k] is not None:
            out[k] = bool(int(out[k]))
    return out


def status(reply) -> str:
    """A simple-string reply (b"OK", "HIT") as str."""
    return reply.decode() if isinstance(reply, bytes) else str(reply)


_torch = None


def torch_module():
    """Imports torch on first use; ImportError with a clear text when it is not installed."""
    global _torch
    if _torch is None:
        try:
            import torch  # noqa: PLC0415 (optional dependency, imported lazily)
        except ImportError as e:
            raise ImportError("as_torch=True needs PyTorch: pip install 'pion[torch]'") from e
        _torch = torch
    return _torch


def maybe_torch(a, as_torch: bool):
    """`a` (a numpy array, or None) as a torch tensor when as_torch, else unchanged."""
    if not as_torch or a is None:
        return a
    torch = torch_module()
    if not a.flags.writeable:
        a = a.copy()
    return torch.from_numpy(a)
