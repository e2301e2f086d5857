"""CUDA IPC for GPU-resident attention slots (ATTEND.PREFIX.EXPORT), through the CUDA driver
library (libcuda.so.1, present wherever a GPU driver is) and torch.

`open_view(export)` maps the exported allocation into this process (cuIpcOpenMemHandle on the
server's GPU, found by PCI bus id) and returns torch tensors K and V [H, N, D] that alias the
server's device memory — no copy. `close_view` unmaps it. The memory belongs to the server:
treat the tensors as read-only, and stop using them once the view is closed.
"""
from __future__ import annotations

import ctypes

from . import _wire, errors

_LAZY_ENABLE_PEER_ACCESS = 1
_TYPESTR = {"fp32": "<f4", "fp16": "<f2"}


class _Handle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_char * 64)]


class _CudaArray:
    """A device buffer described by __cuda_array_interface__ (torch.as_tensor reads it)."""

    def __init__(self, ptr: int, shape: tuple, typestr: str):
        self.__cuda_array_interface__ = {"shape": shape, "typestr": typestr, "data": (ptr, False),
                                         "strides": None, "version": 3}


_lib = None


def _driver():
    global _lib
    if _lib is None:
        try:
            lib = ctypes.CDLL("libcuda.so.1")
        except OSError as e:
            raise errors.PionError("CUDA IPC needs the CUDA driver (libcuda.so.1): %s" % e) from e
        lib.cuDeviceGetByPCIBusId.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_char_p]
        open_fn = getattr(lib, "cuIpcOpenMemHandle_v2", None) or lib.cuIpcOpenMemHandle
        open_fn.argtypes = [ctypes.POINTER(ctypes.c_uint64), _Handle, ctypes.c_uint]
        lib.cuIpcCloseMemHandle.argtypes = [ctypes.c_uint64]
        lib.pion_open = open_fn
        _lib = lib
    return _lib


def _check(rc: int, what: str) -> None:
    if rc != 0:
        raise errors.PionError("CUDA driver error %d in %s" % (rc, what))


class GpuView:
    """K and V of one exported slot as torch CUDA tensors, plus the export's fields."""

    def __init__(self, export: dict):
        torch = _wire.torch_module()
        if not torch.cuda.is_available():
            raise errors.PionError("CUDA IPC needs torch with CUDA")
        lib = _driver()
        dev = ctypes.c_int(-1)
        _check(lib.cuDeviceGetByPCIBusId(ctypes.byref(dev), export["device"].encode()),
               "cuDeviceGetByPCIBusId(%s)" % export["device"])
        self.device = torch.device("cuda", dev.value)
        torch.zeros(1, device=self.device)  # the device's primary context is current from here
        self.export = export
        handle = _Handle()
        ctypes.memmove(ctypes.byref(handle), export["handle"], 64)
        self._ptr = ctypes.c_uint64(0)
        with torch.cuda.device(self.device):
            _check(lib.pion_open(ctypes.byref(self._ptr), handle, _LAZY_ENABLE_PEER_ACCESS),
                   "cuIpcOpenMemHandle")
        shape = (export["heads"], export["rows"], export["head_dim"])
        typestr = _TYPESTR[export["dtype"]]
        base = self._ptr.value
        self.k = torch.as_tensor(_CudaArray(base + export["k_offset"], shape, typestr),
                                 device=self.device)
        self.v = torch.as_tensor(_CudaArray(base + export["v_offset"], shape, typestr),
                                 device=self.device)

    def close(self) -> None:
        if self._ptr.value:
            torch = _wire.torch_module()
            torch.cuda.synchronize(self.device)  # work reading the mapping is done
            self.k = self.v = None
            with torch.cuda.device(self.device):
                _check(_driver().cuIpcCloseMemHandle(self._ptr.value), "cuIpcCloseMemHandle")
            self._ptr = ctypes.c_uint64(0)
