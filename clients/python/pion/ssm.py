"""SSM.PREFIX.* helpers: per-layer recurrent state (Mamba conv/ssm state, RWKV, GatedDeltaNet)
as opaque blobs, with seed 002's reference serialization of a list of arrays.

Serialization (little-endian):

    uint32 version = 1
    uint32 n_arrays
    per array: uint32 ndim, uint32 shape[ndim], uint32 dtype_code, 4·prod(shape) bytes of fp32

dtype_code 0 = fp32, 1 = fp16, 2 = bf16; fp16 and bf16 values travel widened to fp32
(lossless). numpy has no bfloat16: a bf16 array is given as a torch bfloat16 tensor, an
ml_dtypes bfloat16 array, or a float32 array with dtype code 2 named in `dtype_codes`; it comes
back as float32 (or torch.bfloat16 with as_torch).
"""
from __future__ import annotations

import struct
from typing import TYPE_CHECKING, Sequence

import numpy as np

from . import _wire

if TYPE_CHECKING:
    from .client import Client

VERSION = 1
FP32, FP16, BF16 = 0, 1, 2
_CODE_BY_NAME = {"float32": FP32, "float16": FP16, "bfloat16": BF16}


def _code_and_values(a, code: int | None):
    """(dtype code, float32 numpy values) of one input array."""
    name = str(getattr(a, "dtype", "")).replace("torch.", "")
    if code is None:
        if name not in _CODE_BY_NAME:
            raise ValueError("SSM arrays must be float32, float16 or bfloat16, got %s" % name)
        code = _CODE_BY_NAME[name]
    vals = np.ascontiguousarray(_wire.to_numpy(a), dtype="<f4")
    if code == BF16 and np.any(vals.view(np.uint32) & 0xFFFF):
        raise ValueError("dtype code 2 (bf16) given for values that are not bf16 (the low 16 "
                         "bits of an fp32 must be 0)")
    if code == FP16 and name == "float32" and not np.array_equal(
            vals.astype(np.float16).astype(np.float32), vals, equal_nan=True):
        raise ValueError("dtype code 1 (fp16) given for values that are not fp16")
    if code not in (FP32, FP16, BF16):
        raise ValueError("dtype code must be 0 (fp32), 1 (fp16) or 2 (bf16), got %r" % code)
    return code, vals


def serialize_arrays(arrays: Sequence, dtype_codes: Sequence[int | None] | None = None) -> bytes:
    """Seed 002 serialization of `arrays` (numpy arrays or torch tensors of float32, float16
    or bfloat16). `dtype_codes` overrides the code per array (None = from the dtype), e.g. 2
    to mark a float32 array holding bf16 values."""
    arrays = list(arrays)
    codes = list(dtype_codes) if dtype_codes is not None else [None] * len(arrays)
    if len(codes) != len(arrays):
        raise ValueError("%d dtype_codes for %d arrays" % (len(codes), len(arrays)))
    parts = [struct.pack("<II", VERSION, len(arrays))]
    for a, c in zip(arrays, codes):
        code, vals = _code_and_values(a, c)
        parts.append(struct.pack("<I%dI" % vals.ndim, vals.ndim, *vals.shape))
        parts.append(struct.pack("<I", code))
        parts.append(vals.tobytes())
    return b"".join(parts)


def deserialize_arrays(blob, as_torch: bool = False) -> list:
    """The arrays of a seed 002 blob: code 0 -> float32, 1 -> float16, 2 -> float32 (numpy
    has no bf16) or torch.bfloat16 with as_torch. Raises ValueError on a malformed blob."""
    mv = memoryview(blob)
    if len(mv) < 8:
        raise ValueError("SSM blob of %d bytes is shorter than its 8-byte header" % len(mv))
    version, n = struct.unpack_from("<II", mv, 0)
    if version != VERSION:
        raise ValueError("SSM blob version %d, expected %d" % (version, VERSION))
    off, out = 8, []
    for i in range(n):
        try:
            (ndim,) = struct.unpack_from("<I", mv, off)
            shape = struct.unpack_from("<%dI" % ndim, mv, off + 4)
            (code,) = struct.unpack_from("<I", mv, off + 4 + 4 * ndim)
        except struct.error as e:
            raise ValueError("SSM blob truncated in the header of array %d" % i) from e
        off += 8 + 4 * ndim
        count = int(np.prod(shape, dtype=np.int64))
        if off + 4 * count > len(mv):
            raise ValueError("SSM blob truncated in the values of array %d" % i)
        vals = np.frombuffer(mv, "<f4", count, off).reshape(shape)
        off += 4 * count
        out.append(_restore(vals, code, as_torch))
    if off != len(mv):
        raise ValueError("SSM blob has %d trailing bytes" % (len(mv) - off))
    return out


def _restore(vals: np.ndarray, code: int, as_torch: bool):
    if code not in (FP32, FP16, BF16):
        raise ValueError("unknown dtype code %d" % code)
    a = vals.astype(np.float16) if code == FP16 else vals.copy()
    if not as_torch:
        return a
    t = _wire.torch_module().from_numpy(a)
    return t.to(_wire.torch_module().bfloat16) if code == BF16 else t


class SSM:
    """`client.ssm`: SSM.PREFIX.STORE / FETCH / DROP, as arrays or raw blobs."""

    def __init__(self, client: "Client"):
        self._c = client

    def store(self, sid: str, layer: int, arrays: Sequence,
              dtype_codes: Sequence[int | None] | None = None) -> None:
        """Stores layer `layer`'s state arrays with the seed 002 serialization."""
        self.store_blob(sid, layer, serialize_arrays(arrays, dtype_codes))

    def fetch(self, sid: str, layer: int, as_torch: bool | None = None) -> list | None:
        """The layer's arrays, or None when absent."""
        blob = self.fetch_blob(sid, layer)
        if blob is None:
            return None
        return deserialize_arrays(blob, self._c.as_torch if as_torch is None else as_torch)

    def store_blob(self, sid: str, layer: int, blob, *, deadline_ms: int | None = None) -> None:
        """Stores an opaque blob (replaces the layer's previous one)."""
        self._c.execute("SSM.PREFIX.STORE", sid, int(layer), blob, *_wire.admission(deadline_ms))

    def fetch_blob(self, sid: str, layer: int, *,
                   deadline_ms: int | None = None) -> bytes | None:
        """The layer's blob, or None when absent."""
        return self._c.execute("SSM.PREFIX.FETCH", sid, int(layer),
                               *_wire.admission(deadline_ms))

    def drop(self, sid: str, layer: int | None = None) -> None:
        """Drops one layer, or every layer of the session and its saved copy (idempotent)."""
        args = ["SSM.PREFIX.DROP", sid] + ([int(layer)] if layer is not None else [])
        self._c.execute(*args)

    def save(self, sid: str) -> None:
        """SSM.PREFIX.SAVE: every layer of the session durably on disk (returns once it is);
        it survives a restart."""
        self._c.execute("SSM.PREFIX.SAVE", sid)

    def info(self, sid: str) -> dict:
        """{'layers', 'bytes', 'bytes_host', 'bytes_disk_only', 'saved_version', 'dirty'}."""
        return _wire.parse_map(self._c.execute("SSM.PREFIX.INFO", sid))
