"""CUDA IPC for GPU-resident attention slots (ATTEND.PREFIX.EXPORT), through the CUDA driver
library (libcuda.so.1, present wherever a GPU driver is) and torch.

`GpuView(export)` maps the exported allocation into this process (cuIpcOpenMemHandle on the
server's GPU, found by PCI bus id) and gives torch tensors K and V [H, N, D] that alias the
server's device memory — no copy. The memory belongs to the server: treat the tensors as
read-only, and stop using them once the view is closed and the export's lease released.

Opening a handle costs far more than a copy of a small slot, so mappings are kept open, one per
exported allocation (a handle names one allocation: cudaIpcGetMemHandle gives a new handle to
new memory even at a reused address), and reused by later exports of it; at most MAX_OPEN
stay open (least recently used closed first), and close_all() unmaps them all. Reading is
only valid under an export's lease: the lease, not the mapping, keeps the slot's bytes.
"""
from __future__ import annotations

import collections
import ctypes
import threading

from . import _wire, errors

_LAZY_ENABLE_PEER_ACCESS = 1
_DTYPE = {"fp32": lambda torch: torch.float32, "fp16": lambda torch: torch.float16,
          "bf16": lambda torch: torch.bfloat16, "fp8": lambda torch: torch.float8_e4m3fn}


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


MAX_OPEN = 256

_open: "collections.OrderedDict[bytes, _Mapping]" = collections.OrderedDict()  # by handle
_devices: dict[str, int] = {}  # PCI bus id -> device ordinal
_ready: set[int] = set()  # devices whose primary context torch has made current
_mu = threading.Lock()


def _device_of(bus_id: str) -> int:
    if bus_id not in _devices:
        dev = ctypes.c_int(-1)
        _check(_driver().cuDeviceGetByPCIBusId(ctypes.byref(dev), bus_id.encode()),
               "cuDeviceGetByPCIBusId(%s)" % bus_id)
        _devices[bus_id] = dev.value
    return _devices[bus_id]


class _Mapping:
    """One opened allocation: its base address, a uint8 tensor over the bytes seen so far and
    the K/V views made of it, by layout (a later export of the same allocation reuses them:
    building tensors costs more than looking them up)."""

    def __init__(self, ptr: int):
        self.ptr = ptr
        self.bytes = None
        self.views: dict[tuple, tuple] = {}

    def span(self, torch, device, n: int):
        if self.bytes is None or self.bytes.numel() < n:
            self.bytes = torch.as_tensor(_CudaArray(self.ptr, (n,), "|u1"), device=device)
        return self.bytes


def _map(torch, device, raw: bytes) -> _Mapping:
    """The mapping of the allocation `raw` names, opened once and cached."""
    with _mu:
        m = _open.get(raw)
        if m is not None:
            _open.move_to_end(raw)
            return m
        handle = _Handle()
        ctypes.memmove(ctypes.byref(handle), raw, 64)
        out = ctypes.c_uint64(0)
        with torch.cuda.device(device):
            _check(_driver().pion_open(ctypes.byref(out), handle, _LAZY_ENABLE_PEER_ACCESS),
                   "cuIpcOpenMemHandle")
        m = _open[raw] = _Mapping(out.value)
        while len(_open) > MAX_OPEN:
            _unmap(torch, *_open.popitem(last=False))
        return m


def _unmap(torch, raw: bytes, m: _Mapping) -> None:
    torch.cuda.synchronize()  # work reading the mapping is done
    # An error here (the exporting server has exited, say) leaves nothing to undo.
    m.bytes = None
    m.views.clear()
    _driver().cuIpcCloseMemHandle(m.ptr)


def close_all() -> None:
    """Unmaps every cached IPC mapping (views of them must not be used afterwards)."""
    if not _open:
        return
    torch = _wire.torch_module()
    with _mu:
        while _open:
            _unmap(torch, *_open.popitem())


class GpuView:
    """K and V of one exported slot as torch CUDA tensors, plus the export's fields. An fp8
    slot's K and V are float8_e4m3fn [H, N, D] with k_scale / v_scale float32 [H, N] (element
    = value × its row's scale; dense() applies them); other slots have no scales."""

    def __init__(self, export: dict):
        torch = _wire.torch_module()
        if not torch.cuda.is_available():
            raise errors.PionError("CUDA IPC needs torch with CUDA")
        self.device = torch.device("cuda", _device_of(export["device"]))
        if self.device.index not in _ready:  # the device's primary context is current from here
            torch.zeros(1, device=self.device)
            _ready.add(self.device.index)
        self.export = export
        m = _map(torch, self.device, bytes(export["handle"]))
        shape = (export["heads"], export["rows"], export["head_dim"])
        n = int(export["bytes"])
        k0, v0 = int(export["k_offset"]), int(export["v_offset"])
        key = (k0, v0, n, export["dtype"], shape)
        views = m.views.get(key)
        if views is None:
            dtype = _DTYPE[export["dtype"]](torch)
            span = m.span(torch, self.device, max(k0, v0) + n)
            scales = (None, None)
            if export["dtype"] == "fp8":  # the e4m3 bytes, then the rows' f32 scales
                elems = shape[0] * shape[1] * shape[2]
                scales = tuple(span[x + elems:x + n].view(torch.float32).view(shape[:2])
                               for x in (k0, v0))
                n = elems
            k = span[k0:k0 + n].view(dtype).view(shape)
            v = span[v0:v0 + n].view(dtype).view(shape)
            views = m.views[key] = (k, v, k[None], v[None]) + scales
        self.k, self.v, self._k1, self._v1, self.k_scale, self.v_scale = views

    def dense(self, dtype=None):
        """K and V as [H, N, D] tensors of `dtype` (default the slot's; fp8 slots: float32),
        the rows' scales applied for fp8 — copies, except the views themselves when nothing
        changes."""
        torch = _wire.torch_module()
        out = []
        for x, s in ((self.k, self.k_scale), (self.v, self.v_scale)):
            if s is not None:
                x = x.to(torch.float32) * s[..., None]
            out.append(x if dtype is None else x.to(dtype))
        return tuple(out)

    def batched(self):
        """K and V as [1, H, N, D] views (a transformers cache layer's layout)."""
        return self._k1, self._v1

    def close(self) -> None:
        """Waits for the work queued on the view's device (it may read the mapping), then drops
        the tensors; the mapping stays cached for the allocation's next export."""
        if self.k is not None:
            _wire.torch_module().cuda.synchronize(self.device)
            self.k = self.v = self._k1 = self._v1 = self.k_scale = self.v_scale = None
