"""STATE.* helpers: fixed-size byte slots, reserved once and overwritten in place."""
from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

import numpy as np

from . import _wire

if TYPE_CHECKING:
    from .client import Client


class State:
    """`client.state`: STATE.ALLOC / WRITE / READ / FREE / INFO."""

    def __init__(self, client: "Client"):
        self._c = client

    def alloc(self, slot_id: str, nbytes: int, *, deadline_ms: int | None = None) -> None:
        """Reserves a zero-filled slot of `nbytes` (again with the same size keeps the
        contents). Raises CommandError when the slot exists with another size, OomError over
        --maxmemory."""
        self._c.execute("STATE.ALLOC", slot_id, int(nbytes), *_wire.admission(deadline_ms))

    def write(self, slot_id: str, offset: int, data, *, deadline_ms: int | None = None) -> None:
        """Writes `data` (bytes-like, or a numpy array/torch tensor: its raw bytes in C order)
        at byte `offset`."""
        if not isinstance(data, (bytes, bytearray, memoryview)):
            a = np.ascontiguousarray(_wire.to_numpy(data))
            data = a.reshape(-1).view(np.uint8).data
        self._c.execute("STATE.WRITE", slot_id, int(offset), data,
                        *_wire.admission(deadline_ms))

    def read(self, slot_id: str, offset: int = 0, length: int | None = None, dtype=None,
             shape=None, as_torch: bool | None = None, deadline_ms: int | None = None):
        """Reads `length` bytes at `offset` (within `deadline_ms` or DeadlineError). Without `dtype`, returns bytes. With `dtype`
        (and optionally `shape`), returns a numpy array (read-only view of the reply; a torch
        tensor with as_torch); `length` then defaults to prod(shape)·itemsize."""
        if dtype is None:
            if length is None:
                raise ValueError("STATE.READ needs a length (or a dtype and shape)")
            return self._c.execute("STATE.READ", slot_id, int(offset), int(length),
                                   *_wire.admission(deadline_ms))
        dt = np.dtype(dtype)
        if length is None:
            if shape is None:
                raise ValueError("give length or shape with dtype")
            length = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
        data = self._c.execute("STATE.READ", slot_id, int(offset), int(length),
                               *_wire.admission(deadline_ms))
        a = np.frombuffer(data, dtype=dt)
        if shape is not None:
            a = a.reshape(shape)
        return self._c._out(a, as_torch)

    def free(self, slot_id: str) -> bool:
        """Frees the slot; True when it existed."""
        return bool(self._c.execute("STATE.FREE", slot_id))

    def save(self, slot_id: str) -> None:
        """STATE.SAVE: the slot's bytes durably on disk (returns once they are); it survives a
        restart with them."""
        self._c.execute("STATE.SAVE", slot_id)

    def info(self) -> dict:
        """{'slots', 'bytes'} of the caller's tenant."""
        return _wire.parse_map(self._c.execute("STATE.INFO"))

    @contextlib.contextmanager
    def lease(self, slot_id: str, nbytes: int):
        """Context manager: allocates the slot, yields a StateLease bound to it, frees it on
        exit (also on error). With the shared-memory data plane (later) the lease will map
        the slot instead of copying."""
        self.alloc(slot_id, nbytes)
        try:
            yield StateLease(self, slot_id, nbytes)
        finally:
            self.free(slot_id)


class StateLease:
    """One allocated slot: `write(offset, data)`, `read(offset, length, dtype, shape)`."""

    def __init__(self, state: State, slot_id: str, nbytes: int):
        self.slot_id = slot_id
        self.nbytes = nbytes
        self._state = state

    def write(self, offset: int, data) -> None:
        self._state.write(self.slot_id, offset, data)

    def read(self, offset: int = 0, length: int | None = None, dtype=None, shape=None,
             as_torch: bool | None = None):
        if length is None and dtype is None:
            length = self.nbytes - offset
        return self._state.read(self.slot_id, offset, length, dtype, shape, as_torch)
