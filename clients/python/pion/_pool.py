"""Reused memory for large results: `empty(shape, dtype)`.

A fetch returns fresh arrays, and a caller that drops one result before the next call frees
its memory. glibc keeps one freed 16 MiB block for the next allocation, but returns two (a
layer's K and V, 32 MiB at the top of the heap: its trim threshold) to the system, so the next
pair faults every page in again: on the 2-core bench machine a TCP fetch_layer of a 4096 x 8 x
128 fp16 layer took 16 ms where twice one K fetch took 8 (bench/bench_client.py).

Arrays of POOL_MIN bytes or more are carved from blocks this module keeps: each result is a
numpy view of a ctypes owner object whose finalizer hands its block back when the last view of
it (numpy or torch.from_numpy) is gone. Blocks come in size classes (16 an octave, so a block
is at most 1/16 larger than its array, and the owner classes stay few); freed ones are kept up
to POOL_CAP bytes in all (beyond that a freed block is simply released), so the memory held
for reuse is bounded; a block in use is an ordinary allocation the caller owns.
"""

from __future__ import annotations

import ctypes
import math
import threading

import numpy as np

POOL_MIN = 1 << 20  # smaller results: plain np.empty
POOL_CAP = 256 << 20  # freed bytes kept for reuse, at most

_lock = threading.Lock()
_free: dict[int, list[np.ndarray]] = {}  # nbytes -> free uint8 blocks of that size
_kept = 0  # bytes in _free
_owners: dict[int, type] = {}  # nbytes -> its ctypes owner class


def _give_back(block: np.ndarray) -> None:
    global _kept
    with _lock:
        if _kept + block.nbytes > POOL_CAP:
            return  # released with its last reference
        _free.setdefault(block.nbytes, []).append(block)
        _kept += block.nbytes


def _take(nbytes: int) -> np.ndarray:
    global _kept
    with _lock:
        blocks = _free.get(nbytes)
        if blocks:
            _kept -= nbytes
            return blocks.pop()
    return np.empty(nbytes, np.uint8)


def _size_class(nbytes: int) -> int:
    step = 1 << max(16, nbytes.bit_length() - 4)
    return (nbytes + step - 1) // step * step


def _owner_type(nbytes: int) -> type:
    t = _owners.get(nbytes)
    if t is None:
        class Owner(ctypes.c_uint8 * nbytes):
            """Holds one pooled block for the arrays viewing it; returns it when they are gone."""

            def __del__(self):
                try:
                    _give_back(self.block)
                except Exception:  # interpreter shutdown: the module may already be gone
                    pass

        t = _owners.setdefault(nbytes, Owner)
    return t


def empty(shape, dtype=np.float32) -> np.ndarray:
    """An uninitialized writable C-contiguous array, from the pool when it is large."""
    dtype = np.dtype(dtype)
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    count = math.prod(int(s) for s in shape)
    nbytes = count * dtype.itemsize
    if nbytes < POOL_MIN:
        return np.empty(shape, dtype)
    size = _size_class(nbytes)
    block = _take(size)
    owner = _owner_type(size).from_buffer(block)
    owner.block = block
    return np.frombuffer(owner, dtype=dtype, count=count).reshape(shape)


def kept_bytes() -> int:
    """Bytes of freed blocks the pool holds for reuse (at most POOL_CAP)."""
    with _lock:
        return _kept
