"""KV.PREFIX.* helpers: shared prefix K/V namespaces.

A namespace `ns` of L layers, T tokens, H kv heads and head dim D keeps K in V-store session
`<ns>_pk` and V in `<ns>_pv` (dim H·D); layer l's token t is row l·T + t. These helpers move
whole layers with one V.STOREBATCH / V.FETCH RANGE per tensor, pipelined.

Layouts of a layer's K or V (the `layout=` argument):
  "nhd" (default): [n_tokens, kv_heads, head_dim], the row order on the wire;
  "hnd":           [kv_heads, n_tokens, head_dim], transposed here.

An MLA namespace (DeepSeek V2/V3's Multi-head Latent Attention: register_mla) keeps one latent
row per token and layer instead, kv_lora_rank compressed values then rope_dim RoPE key values
shared by every head, in one session `<ns>_pl` (store_latents / fetch_latents). Its layout is
part of its identity: a per-head reader's lookup misses it, and reading its `_pk` raises
MismatchError.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from . import _wire, codecs, errors
from .vstore import _identity

if TYPE_CHECKING:
    from .client import Client

LAYOUTS = ("nhd", "hnd")


LOSSLESS = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}  # codec -> torch dtype


def torch_dtype(torch, codec: str):
    """The torch dtype whose bytes are the codec's rows (fp32/fp16/bf16), or None (int8,
    turbo*: those are decoded, not viewed; fp8 / fp8_e5m2 rows carry a scale before their
    bytes: pion.codecs.fp8_parts splits them, and torch.float8_e4m3fn / torch.float8_e5m2
    (pion.codecs.TORCH_FP8) views the bytes)."""
    name = LOSSLESS.get(codec)
    return None if name is None else getattr(torch, name)


def tp_heads(kv_heads: int, rank: int, size: int) -> tuple[int, int]:
    """The (first, count) K/V heads of tensor-parallel rank `rank` of `size` (contiguous
    shares, as the engines split them); fetch_layer(heads=...) reads just those."""
    if size < 1 or not 0 <= rank < size:
        raise ValueError("tp rank %d of size %d" % (rank, size))
    if kv_heads % size:
        if size % kv_heads:
            raise ValueError("%d K/V heads do not split over TP %d" % (kv_heads, size))
        return rank // (size // kv_heads), 1  # more ranks than heads: replicated heads
    per = kv_heads // size
    return rank * per, per


def coalesce(pieces) -> list[list[int]]:
    """(segment, offset, length) pieces with runs adjacent in one segment merged: one copy each."""
    out: list[list[int]] = []
    for s, o, n in pieces:
        if out and out[-1][0] == s and out[-1][1] + out[-1][2] == o:
            out[-1][2] += n
        else:
            out.append([s, o, n])
    return out


def _identity_options(model, position, prefill_ms) -> list:
    """KV.PREFIX.REGISTER's MODEL / POSITION / PREFILL_MS options, those given."""
    out = []
    if model is not None:
        out += ["MODEL", model]
    if position is not None:
        out += ["POSITION", position]
    if prefill_ms is not None:
        out += ["PREFILL_MS", repr(float(prefill_ms))]
    return out


def _check_layout(layout: str) -> str:
    layout = layout.lower()
    if layout not in LAYOUTS:
        raise ValueError("layout must be 'nhd' or 'hnd', got %r" % (layout,))
    return layout


def _to_rows(x, layout: str) -> np.ndarray:
    """[T, H, D] (nhd) or [H, T, D] (hnd) -> float32 rows [T, H·D]."""
    a = _wire.to_numpy(x, np.float32)
    if a.ndim != 3:
        raise ValueError("K/V of a layer must be 3-d (%s), got shape %s" % (layout, a.shape))
    if layout == "hnd":
        a = a.transpose(1, 0, 2)
    return a.reshape(a.shape[0], -1)


def _from_rows(rows: np.ndarray, heads: int, head_dim: int, layout: str) -> np.ndarray:
    a = rows.reshape(rows.shape[0], heads, head_dim)
    return np.ascontiguousarray(a.transpose(1, 0, 2)) if layout == "hnd" else a


class KVPrefix:
    """`client.kv`: KV.PREFIX.REGISTER / LOOKUP / INFO / BLOCKS / MEMBERSHIP / OWNER / DROP /
    SAVE / WARM, plus store_layer / fetch_layer over the namespace's V sessions."""

    INFO_FLOATS = ("prefill_ms", "saved_prefill_ms")

    def __init__(self, client: "Client"):
        self._c = client
        # ns -> (n_layers, n_tokens, kv_heads, head_dim): what this client registered or read,
        # to check store_layer's arguments before sending (refreshed once when they disagree).
        self._shapes: dict[str, tuple[int, int, int, int]] = {}

    def _shape(self, ns: str, fresh: bool = False) -> tuple[int, int, int, int]:
        if fresh or ns not in self._shapes:
            self.info(ns)
        return self._shapes[ns]

    def register(self, ns: str, n_layers: int, n_tokens: int, kv_heads: int, head_dim: int,
                 fmt: str = "fp16", model: str | None = None, position: str | None = None,
                 prefill_ms: float | None = None) -> None:
        """Creates the namespace's manifest and its `<ns>_pk`/`<ns>_pv` sessions. The same
        manifest again is a no-op (prefill_ms may change); another raises MismatchError."""
        args = ["KV.PREFIX.REGISTER", ns, int(n_layers), int(n_tokens), int(kv_heads),
                int(head_dim), fmt]
        self._c.execute(*args, *_identity_options(model, position, prefill_ms))
        self._shapes[ns] = (int(n_layers), int(n_tokens), int(kv_heads), int(head_dim))

    def register_mla(self, ns: str, n_layers: int, n_tokens: int, kv_lora_rank: int = 512,
                     rope_dim: int = 64, fmt: str = "bf16", model: str | None = None,
                     position: str | None = None, prefill_ms: float | None = None) -> None:
        """Creates an MLA namespace (KV.PREFIX.REGISTER ... MLA <kv_lora_rank> <rope_dim>): per
        layer and token one latent row of kv_lora_rank + rope_dim values in session `<ns>_pl`.
        fmt: fp32, fp16, bf16, fp8 (e4m3, one scale per row) or fp8_ds_mla (DeepSeek-V3.2's
        656-byte rows: 512 e4m3 with a scale per 128, 64 RoPE values in bf16)."""
        args = ["KV.PREFIX.REGISTER", ns, int(n_layers), int(n_tokens), "MLA", int(kv_lora_rank),
                int(rope_dim), fmt]
        self._c.execute(*args, *_identity_options(model, position, prefill_ms))
        self._shapes[ns] = (int(n_layers), int(n_tokens), 1, int(kv_lora_rank) + int(rope_dim))

    def store_latents(self, ns: str, layer: int, c, *, token_offset: int = 0) -> int:
        """Writes layer `layer`'s latent rows of an MLA namespace: c float32 [t, kv_lora_rank +
        rope_dim] (the compressed c_KV then the RoPE'd k_pe of each token) at tokens
        token_offset .. token_offset+t. Returns t. Shapes are checked against the manifest
        first (ValueError)."""
        ca = _wire.to_numpy(c, np.float32)
        n_layers, t_all, _, dk = self._shape(ns)
        if ca.ndim != 2 or ca.shape[1] != dk:
            n_layers, t_all, _, dk = self._shape(ns, fresh=True)
        if ca.ndim != 2 or ca.shape[1] != dk:
            raise ValueError("latents of shape %s do not match MLA namespace %r: expected "
                             "(t, %d)" % (ca.shape, ns, dk))
        if not 0 <= int(layer) < n_layers:
            raise ValueError("layer %d is outside namespace %r's %d layers" % (layer, ns, n_layers))
        t = ca.shape[0]
        if token_offset < 0 or token_offset + t > t_all or t == 0:
            raise ValueError("tokens [%d, %d) are outside namespace %r's %d tokens"
                             % (token_offset, token_offset + t, ns, t_all))
        self._c.execute("V.STOREBATCH", ns + "_pl", int(layer) * t_all + int(token_offset),
                        _wire.f32(ca))
        return t

    def fetch_latents(self, ns: str, layer: int, *, decode: bool = True, model: str | None = None,
                      generation: int | None = None, as_torch: bool | None = None):
        """Layer `layer`'s latent rows of an MLA namespace: float32 [n_tokens, kv_lora_rank +
        rope_dim], decoded here from the stored bytes (bit-identical to the server's decode);
        decode=False: the stored rows themselves, uint8 [n_tokens, row_bytes] (fp8_ds_mla: what
        FlashMLA's fp8 decode reads; pion.codecs.ds_mla_parts splits them). Over a Unix-socket
        Client the bytes come from the shared-memory mapping."""
        replies = self._c.execute_many([("KV.PREFIX.INFO", ns), ("V.INFO", ns + "_pl")])
        m, vi = (_wire.parse_map(r) for r in replies)
        t = m["n_tokens"]
        lo, hi = int(layer) * t, (int(layer) + 1) * t
        ch = self._c._shm_channel()
        if ch is not None:
            data = self._c._shm_copy(ch, ns + "_pl", lo, hi, model, generation)
            self._c.last_fetch_path = "shm"
        else:
            data = self._c.execute("V.FETCH", ns + "_pl", "RANGE", lo, hi, "RAW",
                                   *_identity(model, generation))
            self._c.last_fetch_path = "tcp"
        if not decode:
            rows = np.frombuffer(data, dtype=np.uint8).reshape(t, vi["row_bytes"])
            return self._c._out(rows, as_torch)
        return self._c._out(codecs.decode(vi["format"], vi["dim"], vi["block"], data, t),
                            as_torch)

    def store_layer(self, ns: str, layer: int, k, v, *, layout: str = "nhd",
                    token_offset: int = 0, n_tokens: int | None = None) -> int:
        """Writes layer `layer`'s K and V (each [t, kv_heads, head_dim] for layout "nhd", or
        [kv_heads, t, head_dim] for "hnd"; float32) at tokens token_offset .. token_offset+t
        (default: the whole layer). Returns t.

        The layer index and the arrays' shape are checked against the namespace's manifest
        before anything is sent (ValueError naming both): the manifest this client registered,
        else KV.PREFIX.INFO (one round trip). `n_tokens`, when given, must be the manifest's.
        A namespace that is already complete is published and immutable: the server refuses
        the write with ReadOnlyError (drop and register it again to store other K/V)."""
        layout = _check_layout(layout)
        ka, va = _wire.to_numpy(k, np.float32), _wire.to_numpy(v, np.float32)
        if ka.shape != va.shape:
            raise ValueError("K %s and V %s differ in shape" % (ka.shape, va.shape))
        try:
            self._check_layer(ns, self._shape(ns), layer, ka.shape, layout, token_offset,
                              n_tokens)
        except ValueError:  # what this client knew may be stale: check against the server's
            self._check_layer(ns, self._shape(ns, fresh=True), layer, ka.shape, layout,
                              token_offset, n_tokens)
        n_tokens = self._shapes[ns][1]
        kr, vr = _to_rows(ka, layout), _to_rows(va, layout)
        start = int(layer) * int(n_tokens) + int(token_offset)
        self._c.execute_many([("V.STOREBATCH", ns + "_pk", start, _wire.f32(kr)),
                              ("V.STOREBATCH", ns + "_pv", start, _wire.f32(vr))])
        return kr.shape[0]

    @staticmethod
    def _check_layer(ns, shape, layer, array_shape, layout, token_offset, n_tokens):
        n_layers, t_all, heads, head_dim = shape
        if n_tokens is not None and int(n_tokens) != t_all:
            raise ValueError("n_tokens %d is not namespace %r's %d" % (n_tokens, ns, t_all))
        if not 0 <= int(layer) < n_layers:
            raise ValueError("layer %d is outside namespace %r's %d layers"
                             % (layer, ns, n_layers))
        if len(array_shape) != 3:
            raise ValueError("K/V of a layer must be 3-d (%s), got shape %s"
                             % (layout, array_shape))
        t, h, d = array_shape if layout == "nhd" else (array_shape[1], array_shape[0],
                                                       array_shape[2])
        if (h, d) != (heads, head_dim):
            want = (("t", heads, head_dim) if layout == "nhd" else (heads, "t", head_dim))
            raise ValueError("K/V of shape %s (%s) do not match namespace %r: expected %s "
                             "(kv_heads %d, head_dim %d)" % (tuple(array_shape), layout, ns,
                                                             str(want).replace("'", ""),
                                                             heads, head_dim))
        if token_offset < 0 or token_offset + t > t_all or t == 0:
            raise ValueError("tokens [%d, %d) are outside namespace %r's %d tokens"
                             % (token_offset, token_offset + t, ns, t_all))

    def fetch_layer(self, ns: str, layer: int, *, raw: bool = False, layout: str = "nhd",
                    model: str | None = None, generation: int | None = None,
                    as_torch: bool | None = None, device: str | None = None,
                    heads: tuple[int, int] | None = None, as_codec: str | None = None):
        """Layer `layer`'s (K, V), each float32 [n_tokens, kv_heads, head_dim] ("nhd") or
        [kv_heads, n_tokens, head_dim] ("hnd"). With raw=True (and always for fp16/bf16
        storage) the stored encoding is fetched and decoded here (pion.codecs; bit-identical
        to the server's decode). `model` /
        `generation` are checked by the server (MismatchError).

        On a Unix-socket Client (shm=True) the stored bytes are always read from the shared-
        memory mapping under a lease (released before returning) and decoded here: the
        result is bit-identical to the TCP path (`client.last_fetch_path` tells which).

        device: e.g. "cuda" or "cuda:1" (needs torch with CUDA; torch is imported only then;
        exercised by bench/bench_shm_gpu.py on the GPU machine, not by the CI tests). Over
        shared memory with fp32/fp16/bf16 storage the mapping is registered with CUDA once
        and the GPU copies straight from it (`last_fetch_path` "shm-cuda"; 128 MiB of K+V in
        10 ms on an H200); otherwise K and V are staged in pinned host tensors and copied with
        non_blocking=True. The result equals the host path and lives on `device`; as_torch
        is implied.

        heads=(first, count): only those K/V heads — a tensor-parallel rank's share of a prefix
        written at any TP degree (`tp_heads(kv_heads, rank, size)`), moving only their bytes
        (V.FETCH ... HEADS); the result has `count` heads. as_codec="fp8" (fp16, bf16, int8,
        fp32, ...): the rows travel in that codec, transcoded by the server (V.FETCH ... AS),
        and are decoded here — what an engine computing in that codec gets, in fewer bytes."""
        layout = _check_layout(layout)
        if heads is not None or as_codec is not None:
            return self._fetch_layer_shaped(ns, layer, layout, model, generation, as_torch,
                                            device, heads, as_codec)
        ch = self._c._shm_channel()
        replies = self._c.execute_many([("KV.PREFIX.INFO", ns), ("V.INFO", ns + "_pk")])
        m = _wire.parse_map(replies[0])
        t, h, d = m["n_tokens"], m["kv_heads"], m["head_dim"]
        lo, hi = int(layer) * t, (int(layer) + 1) * t
        vi = _wire.parse_map(replies[1])
        # fp16/bf16 over TCP: the stored bytes, decoded here (half the bytes of the decoded
        # rows over the socket, the same floats); other formats as asked.
        raw = raw or vi["format"] in ("fp16", "bf16")
        if device is not None and str(device) != "cpu":
            return self._fetch_layer_device(ns, ch, vi, lo, hi, t, h, d, layout, raw, model,
                                            generation, device)
        if ch is not None and vi["format"] in codecs.ELEMENTWISE:
            # Decoded straight from the mapping, K and V each under its lease.
            self._c.last_fetch_path = "shm"
            kr, vr = self._c._shm_decode(ch, [(ns + "_pk", lo, hi), (ns + "_pv", lo, hi)],
                                         vi["format"], vi["dim"], model, generation)
        elif ch is not None:
            kb = self._c._shm_copy(ch, ns + "_pk", lo, hi, model, generation)
            vb = self._c._shm_copy(ch, ns + "_pv", lo, hi, model, generation)
            self._c.last_fetch_path = "shm"
            kr = codecs.decode(vi["format"], vi["dim"], vi["block"], kb, t)
            vr = codecs.decode(vi["format"], vi["dim"], vi["block"], vb, t)
        else:
            self._c.last_fetch_path = "tcp"
            kr, vr = self._fetch_rows_tcp(ns, lo, hi, t, h, d, raw, vi, model, generation)
        return (self._c._out(_from_rows(kr, h, d, layout), as_torch),
                self._c._out(_from_rows(vr, h, d, layout), as_torch))

    def _fetch_layer_shaped(self, ns, layer, layout, model, generation, as_torch, device, heads,
                            as_codec):
        """fetch_layer with heads= and/or as_codec=: the server shapes the rows (HEADS, AS), and
        they are decoded here from the bytes that crossed."""
        replies = self._c.execute_many([("KV.PREFIX.INFO", ns), ("V.INFO", ns + "_pk")])
        m, vi = (_wire.parse_map(r) for r in replies)
        t, h, d = m["n_tokens"], m["kv_heads"], m["head_dim"]
        first, count = (0, h) if heads is None else (int(heads[0]), int(heads[1]))
        extra = [] if heads is None else ["HEADS", first, count]
        if as_codec is not None:
            extra += ["AS", as_codec]
        fmt = as_codec or vi["format"]
        block = vi["block"] if fmt == vi["format"] else codecs.default_block(fmt)
        lo, hi = int(layer) * t, (int(layer) + 1) * t
        ch = self._c._shm_channel()
        out = []
        if ch is not None:
            self._c.last_fetch_path = "shm"
            for data in self._c._shm_copy_many(ch, [(ns + sfx, lo, hi) for sfx in ("_pk", "_pv")],
                                               model, generation, extra=extra):
                out.append(codecs.decode(fmt, count * d, block, data, t))
        else:
            self._c.last_fetch_path = "tcp"
            tail = ["RAW", *extra, *_identity(model, generation)]
            cmds = [("V.FETCH", ns + sfx, "RANGE", lo, hi, *tail) for sfx in ("_pk", "_pv")]
            out = list(self._c.fetch_decode(cmds, lambda r: tuple(
                codecs.decode(fmt, count * d, block, x, t) for x in r)))
        k, v = (_from_rows(rows, count, d, layout) for rows in out)
        if device is not None and str(device) != "cpu":
            torch = _wire.torch_module()
            return tuple(torch.from_numpy(np.ascontiguousarray(x)).to(device) for x in (k, v))
        return self._c._out(k, as_torch), self._c._out(v, as_torch)

    def _fetch_rows_tcp(self, ns, lo, hi, t, h, d, raw, vi, model, generation):
        tail = ["RAW"] if raw else []
        tail += _identity(model, generation)
        cmds = [("V.FETCH", ns + "_pk", "RANGE", lo, hi, *tail),
                ("V.FETCH", ns + "_pv", "RANGE", lo, hi, *tail)]
        if raw and vi["format"] != "fp32":  # into the connection's scratch, decoded to fresh
            # arrays (fp32 decodes to a view of what was received: that takes fresh ones)
            return self._c.fetch_decode(cmds, lambda r: tuple(
                codecs.decode(vi["format"], vi["dim"], vi["block"], x, t) for x in r))
        kd, vd = self._c.fetch_many(cmds)
        if raw:
            return (codecs.decode("fp32", vi["dim"], vi["block"], kd, t),
                    codecs.decode("fp32", vi["dim"], vi["block"], vd, t))
        return _wire.from_f32(kd, (t, h * d)), _wire.from_f32(vd, (t, h * d))

    def _fetch_layer_device(self, ns, ch, vi, lo, hi, t, h, d, layout, raw, model,
                            generation, device):
        """fetch_layer(device=...): fp32/fp16/bf16 storage over SHM goes mapping -> device
        directly (cudaHostRegister); otherwise mapping (or socket) -> pinned host tensor ->
        device (non-blocking)."""
        torch = _wire.torch_module()
        src = torch_dtype(torch, vi["format"])
        if ch is not None and src is not None:
            kv = self._fetch_layers_shm(torch, ch, ns, [lo // t], t, h, d, src, torch.float32,
                                        layout, device, model, generation)
            if kv is not None:
                self._c.last_fetch_path = "shm-cuda"
                return kv[0]
        outs = []
        for sid in (ns + "_pk", ns + "_pv"):
            shape = (t, h, d) if layout == "nhd" else (h, t, d)
            pinned = torch.empty(shape, dtype=torch.float32, pin_memory=True)
            if ch is not None and vi["format"] == "fp32" and layout == "nhd":
                self._c._shm_copy(ch, sid, lo, hi, model, generation, into=pinned.numpy())
                self._c.last_fetch_path = "shm"
            else:
                if ch is not None:
                    buf = self._c._shm_copy(ch, sid, lo, hi, model, generation)
                    self._c.last_fetch_path = "shm"
                else:
                    tail = ["RAW", *_identity(model, generation)]
                    buf = self._c.execute("V.FETCH", sid, "RANGE", lo, hi, *tail)
                    self._c.last_fetch_path = "tcp"
                rows = codecs.decode(vi["format"], vi["dim"], vi["block"], buf, t)
                pinned.numpy()[...] = _from_rows(rows, h, d, layout)
            outs.append(pinned.to(device, non_blocking=True))
        return tuple(outs)

    def fetch_layers(self, ns: str, layers=None, *, device="cuda", dtype=None,
                     layout: str = "hnd", model: str | None = None,
                     generation: int | None = None) -> list:
        """Several layers (default: all) of `ns` as torch tensors on a CUDA `device`: a list of
        (K, V), each [kv_heads, n_tokens, head_dim] ("hnd", default) or [n_tokens, kv_heads,
        head_dim] ("nhd"), in `dtype` (default: the stored dtype for fp32/fp16/bf16 storage,
        else float32).

        On a Unix-socket Client with fp32/fp16/bf16 storage this is the fast same-host path:
        one pipelined V.FETCH … SHM for every layer's K and V (leases), the mapping registered
        with CUDA once, each run of adjacent chunks DMA'd straight into a device staging buffer
        (4 GiB at 51 GB/s on an H200, 93 % of torch's pinned copy:
        bench/results/shm-gpu-2026-12-01.md), then laid out and converted on the GPU; the
        leases are released once the stream has finished. Otherwise each layer goes through
        fetch_layer(device=...). `client.last_fetch_path` tells which ("shm-cuda" / ...)."""
        torch = _wire.torch_module()
        layout = _check_layout(layout)
        m, vi = (_wire.parse_map(r) for r in self._c.execute_many(
            [("KV.PREFIX.INFO", ns), ("V.INFO", ns + "_pk")]))
        t, h, d = m["n_tokens"], m["kv_heads"], m["head_dim"]
        layers = list(range(m["n_layers"])) if layers is None else [int(x) for x in layers]
        src = torch_dtype(torch, vi["format"])
        dtype = dtype or src or torch.float32
        ch = self._c._shm_channel()
        if ch is not None and src is not None and torch.device(device).type == "cuda":
            out = self._fetch_layers_shm(torch, ch, ns, layers, t, h, d, src, dtype, layout,
                                         device, model, generation)
            if out is not None:
                self._c.last_fetch_path = "shm-cuda"
                return out
        out = []
        for j in layers:
            k, v = self.fetch_layer(ns, j, layout=layout, model=model, generation=generation,
                                    device=device)
            out.append((k.to(dtype), v.to(dtype)))
        return out

    def _fetch_layers_shm(self, torch, ch, ns, layers, t, h, d, src, dtype, layout, device,
                          model, generation, on_layer=None):
        """fetch_layers over shared memory; None when CUDA will not register a mapping.
        on_layer(i, k, v, event): called as each layer's copies are issued (event recorded
        after them on the current stream), for a reader that starts on a layer before the
        others landed."""
        import warnings
        nbytes = t * h * d * torch.empty(0, dtype=src).element_size()
        fetched = ch.fetch_ranges([(ns + sfx, j * t, (j + 1) * t) for j in layers
                                   for sfx in ("_pk", "_pv")], model, generation)
        staging = torch.empty((2, nbytes), dtype=torch.uint8, device=device)
        out = []
        try:
            if not all(ch.cuda_register(s) for s in {p[0] for f in fetched for p in f[1]}):
                return None
            for i in range(len(layers)):
                pair = []
                for x in range(2):
                    _lease, pieces, _rb, got = fetched[2 * i + x]
                    if got != nbytes:
                        raise errors.PionError("%s layer %d holds %d bytes, expected %d" % (
                            ns, layers[i], got, nbytes))
                    pos = 0
                    with warnings.catch_warnings():  # torch warns on read-only sources
                        warnings.simplefilter("ignore")
                        for s, o, n in coalesce(pieces):
                            piece = torch.from_numpy(np.frombuffer(ch.maps[s], np.uint8, n, o))
                            staging[x, pos:pos + n].copy_(piece, non_blocking=True)
                            pos += n
                    rows = staging[x].view(src).view(t, h, d)
                    shape = (h, t, d) if layout == "hnd" else (t, h, d)
                    dst = torch.empty(shape, dtype=dtype, device=device)
                    dst.copy_(rows.transpose(0, 1) if layout == "hnd" else rows)
                    pair.append(dst)
                out.append(tuple(pair))
                if on_layer is not None:
                    done = torch.cuda.Event()
                    done.record(torch.cuda.current_stream(staging.device))
                    on_layer(i, pair[0], pair[1], done)
        finally:
            # The copies are done with the leased bytes before the leases go.
            torch.cuda.current_stream(staging.device).synchronize()
            ch.release_later(*(f[0] for f in fetched))  # replies read with the next command
        return out

    def lookup(self, ns: str, model: str | None = None, position: str | None = None,
               generation: int | None = None, explain: bool = False, layout: str | None = None):
        """True (+HIT) when the namespace is complete and MODEL/POSITION match; False (+MISS)
        otherwise. A GENERATION other than the namespace's raises MismatchError. layout="mla"
        looks up an MLA namespace (a lookup without it is a per-head reader's: an MLA namespace
        misses it, reason "layout_differs").

        explain=True returns why instead, as a dict (KV.PREFIX.LOOKUP ... EXPLAIN): `result`
        ("HIT", "MISS" or "MISMATCH"), `reason` ("" for a hit; "not_registered",
        "layout_differs", "model_differs", "position_differs", "generation_differs",
        "incomplete", "corrupt", "sessions_lost"), `detail` (a sentence), `expected` / `held` (the identity field that
        differs), `committed_frontier` / `n_tokens`, `cache_generation`."""
        args = ["KV.PREFIX.LOOKUP", ns]
        if model is not None:
            args += ["MODEL", model]
        if position is not None:
            args += ["POSITION", position]
        if layout is not None:
            args += ["LAYOUT", layout]
        if generation is not None:
            args += ["GENERATION", int(generation)]
        if explain:
            return _wire.parse_map(self._c.execute(*args, "EXPLAIN"))
        return _wire.status(self._c.execute(*args)) == "HIT"

    def info(self, ns: str | None = None) -> dict:
        """KV.PREFIX.INFO <ns> (manifest, generations, frontier, `complete` as bool, ...), or
        the tenant's totals without ns."""
        reply = self._c.execute("KV.PREFIX.INFO", ns) if ns is not None else \
            self._c.execute("KV.PREFIX.INFO")
        m = _wire.parse_map(reply, floats=self.INFO_FLOATS, bools=("complete",))
        if ns is not None:
            self._shapes[ns] = (m["n_layers"], m["n_tokens"], m["kv_heads"], m["head_dim"])
        return m

    def blocks(self, ns: str) -> list[dict]:
        """Per 64-token block: {block, written (bool), rows, tier, saved (bool)}."""
        return [_wire.parse_map(b, bools=("written", "saved"))
                for b in self._c.execute("KV.PREFIX.BLOCKS", ns)]

    def membership(self, ns: str) -> list[int]:
        """Indexes of the blocks resident in memory."""
        return [int(i) for i in self._c.execute("KV.PREFIX.MEMBERSHIP", ns)]

    def owner(self, ns: str) -> int:
        """The shard that owns the namespace."""
        return int(self._c.execute("KV.PREFIX.OWNER", ns))

    def drop(self, ns: str) -> bool:
        """Drops the namespace, its sessions and disk copies; True when it existed."""
        self._shapes.pop(ns, None)
        return bool(self._c.execute("KV.PREFIX.DROP", ns))

    def save(self, ns: str) -> None:
        """Makes the namespace's current content durable in the disk tier."""
        self._c.execute("KV.PREFIX.SAVE", ns)

    def warm(self, ns: str) -> None:
        """Brings a saved namespace into memory (checksums verified; CorruptError if not)."""
        self._c.execute("KV.PREFIX.WARM", ns)
