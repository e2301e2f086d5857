"""ATTEND.PREFIX.* helpers: attention computed by the server over a resident prefix slot.

Shapes (float32, C order): K/V [H, N, D]; queries [H, M, D] (or [H, D] for one row); suffix
K/V [H_kv, S, D]; head_map int [H_q] (query head -> K/V head; default: contiguous GQA
grouping h // (H_q / H_kv)). Every query returns an `AttendResult(out, lse, receipt)`:
`out` has the query's rank ([H, D] or [H, M, D]); `lse` [H, M] only where the server returns it
(QUERY with M > 1), else None; `receipt` a dict when receipt=True, else None.

`merge_lse` merges two partial attentions with their log-sum-exps exactly as docs/PROTOCOL.md
states (e.g. the server's prefix partial and the client's own suffix partial).

MLA (DeepSeek V2/V3, absorbed): a slot of latent rows [N, kv_lora_rank + rope_dim] (store_mla,
or store_from an MLA namespace); queries [H_q, dk] or [H_q, M, dk] — each head's query times
W_UK (kv_lora_rank values) then its RoPE part — with the caller's softmax scale; `out` is
[H_q, kv_lora_rank] or [H_q, M, kv_lora_rank] (apply W_UV to it) and `lse` [H_q] or [H_q, M]
always.
"""
from __future__ import annotations

import contextlib
import struct
from typing import TYPE_CHECKING, NamedTuple, Optional

import numpy as np

from . import _wire, codecs, errors

if TYPE_CHECKING:
    from .client import Client

RECEIPT_FLOATS = ("omitted_mass_estimate", "omitted_mass_bound", "omitted_mass_exact", "micros",
                  "queue_us", "piece_start_max_us", "piece_max_us", "merge_us", "estimate_us")
SELECTS = ("mean", "quest")


class AttendResult(NamedTuple):
    """out: [H, D] or [H, M, D]; lse: [H, M] or None; receipt: dict or None."""
    out: object
    lse: Optional[object]
    receipt: Optional[dict]


def _index_lists(indices, counts, n: int, owners: str, dim: str):
    """A sparse query's index lists as (indices int32 [n, K], counts int32 [n], K): `indices`
    [n, K] with `counts`, or a list of n sequences (ragged; padded here)."""
    if counts is None:
        lists = [np.asarray(_wire.to_numpy(x), np.int64).reshape(-1) for x in indices]
        if len(lists) != n:
            raise ValueError("indices has %d %s, q has %d" % (len(lists), owners, n))
        kmax = max(1, max(len(x) for x in lists))
        idx = np.zeros((n, kmax), np.int32)
        for i, x in enumerate(lists):
            idx[i, :len(x)] = x
        return idx, np.array([len(x) for x in lists], np.int32), kmax
    idx = np.asarray(_wire.to_numpy(indices), np.int32)
    cnt = np.asarray(_wire.to_numpy(counts), np.int32).reshape(-1)
    if idx.ndim != 2:
        raise ValueError("indices must be [%s, K_sparse_max], got shape %s" % (dim, idx.shape))
    return idx, cnt, idx.shape[1]


def parse_receipt(reply) -> dict:
    """A receipt map as {str: value}: `exact` bool, `omitted_mass_estimate`/`micros` float,
    `support` list of int, `blocks` list of lists of int, the rest int or str."""
    return _wire.parse_map(reply, floats=RECEIPT_FLOATS, bools=("exact",))


def merge_lse(out_a, lse_a, out_b, lse_b):
    """Merges two partial attentions over disjoint key sets (docs/PROTOCOL.md):

        m = max(lse_a, lse_b)
        o = (exp(lse_a - m)·o_a + exp(lse_b - m)·o_b) / (exp(lse_a - m) + exp(lse_b - m))
        lse = m + ln(exp(lse_a - m) + exp(lse_b - m))

    out_*: [..., D], lse_*: [...]. A row where both are −inf (no key) gives 0 and −inf.
    Computed in float64, returned as float32 (out, lse)."""
    oa, ob = np.asarray(out_a, np.float64), np.asarray(out_b, np.float64)
    la, lb = np.asarray(lse_a, np.float64), np.asarray(lse_b, np.float64)
    m = np.maximum(la, lb)
    finite = np.isfinite(m)
    ms = np.where(finite, m, 0.0)
    with np.errstate(invalid="ignore", over="ignore"):
        wa = np.where(finite, np.exp(la - ms), 0.0)
        wb = np.where(finite, np.exp(lb - ms), 0.0)
    tot = wa + wb
    safe = np.where(tot > 0, tot, 1.0)
    out = (wa[..., None] * oa + wb[..., None] * ob) / safe[..., None]
    with np.errstate(divide="ignore"):
        lse = np.where(finite, ms + np.log(safe), -np.inf)
    return out.astype(np.float32), lse.astype(np.float32)


def contiguous_head_map(h_q: int, h_kv: int) -> np.ndarray:
    """Query head h -> K/V head h // (h_q / h_kv)."""
    if h_kv <= 0 or h_q % h_kv:
        raise ValueError("H_q %d is not a multiple of H_kv %d" % (h_q, h_kv))
    return (np.arange(h_q) // (h_q // h_kv)).astype(np.int32)


def _queries(q):
    """(q as float32 [H, M, D], whether the caller gave [H, D])."""
    a = _wire.to_numpy(q, np.float32)
    if a.ndim == 2:
        return a[:, None, :], True
    if a.ndim != 3:
        raise ValueError("queries must be [H, D] or [H, M, D], got shape %s" % (a.shape,))
    return a, False


def _single(q, form: str):
    a, _ = _queries(q)
    if a.shape[1] != 1:
        raise ValueError("%s takes one query row per head ([H, D]), got M=%d" % (form, a.shape[1]))
    return a[:, 0, :]


def _kv(x, what: str) -> np.ndarray:
    a = _wire.to_numpy(x, np.float32)
    if a.ndim != 3:
        raise ValueError("%s must be [H, N, D], got shape %s" % (what, a.shape))
    return a


def _tail(window=0, qpos=None, select=None, receipt=False, shared=False, deadline_ms=None,
          allow_approx=False, recent=0) -> list:
    args = []
    if window:
        args.append(int(window))
    if qpos is not None:
        args += ["QPOS", int(qpos)]
    if select is not None:
        if select not in SELECTS:
            raise ValueError("select must be 'mean' or 'quest', got %r" % (select,))
        args += ["SELECT", select]
    if shared:
        args.append("SHARED")
    if recent:
        args += ["RECENT", int(recent)]
    if receipt == "audit":  # a receipt with omitted_mass_exact (every visible key scored)
        args.append("AUDIT")
    elif receipt:
        args.append("RECEIPT")
    return args + _wire.admission(deadline_ms, allow_approx)


def _parse_export(reply) -> dict:
    """An ATTEND.PREFIX.EXPORT reply as a dict; `handle` stays raw bytes (not text)."""
    pairs = list(reply.items()) if isinstance(reply, dict) else \
        [(reply[i], reply[i + 1]) for i in range(0, len(reply), 2)]
    handle = next(bytes(v) for k, v in pairs if _wire.text(k) == "handle")
    out = _wire.parse_map([x for k, v in pairs if _wire.text(k) != "handle" for x in (k, v)])
    out["handle"] = handle
    return out


_PACKED_EXPORT = struct.Struct("<64s16sQQQIIIIQQQ16x")  # ATTEND.PREFIX.EXPORT ... PACKED
_DTYPE_NAMES = ("fp32", "fp16", "bf16", "fp8")  # fp8: e4m3 bytes, then f32 row scales


def _unpack_exports(blob) -> list[dict]:
    """The PACKED reply of ATTEND.PREFIX.EXPORT as export dicts (as _parse_export gives)."""
    blob = bytes(blob)
    if len(blob) % _PACKED_EXPORT.size:
        raise errors.PionError("ATTEND.PREFIX.EXPORT PACKED: %d bytes is not a whole number of "
                               "%d-byte records" % (len(blob), _PACKED_EXPORT.size))
    out = []
    for (handle, device, k_off, v_off, n, heads, rows, d, dtype, gen, lease,
         ttl) in _PACKED_EXPORT.iter_unpack(blob):
        out.append({"handle": handle, "device": device.rstrip(b"\0").decode(), "k_offset": k_off,
                    "v_offset": v_off, "bytes": n, "heads": heads, "rows": rows, "head_dim": d,
                    "dtype": _DTYPE_NAMES[dtype], "generation": gen, "lease": lease,
                    "ttl_ms": ttl})
    return out


class Attend:
    """`client.attend`: ATTEND.PREFIX.STORE / LOOKUP / DROP / INFO and the QUERY forms."""

    def __init__(self, client: "Client"):
        self._c = client

    # --- slots ------------------------------------------------------------------------------
    def store(self, sid: str, layer: int, k, v, *, deadline_ms: int | None = None) -> None:
        """Stores one layer's K and V ([H, N, D] float32) as slot (sid, layer), replacing any
        previous one atomically."""
        k, v = _kv(k, "K"), _kv(v, "V")
        h, n, d = k.shape
        self._c.execute("ATTEND.PREFIX.STORE", sid, int(layer), h, n, d, _wire.f32(k),
                        _wire.f32(v), *_wire.admission(deadline_ms))

    def store_from(self, sid: str, layer: int, ns: str, model: str | None = None,
                   position: str | None = None, *, deadline_ms: int | None = None) -> None:
        """Binds layer `layer` of the complete KV.PREFIX namespace `ns` as slot (sid, layer),
        server-side (no bytes cross the network)."""
        args = ["ATTEND.PREFIX.STORE", sid, int(layer), "FROM", ns]
        if model is not None:
            args += ["MODEL", model]
        if position is not None:
            args += ["POSITION", position]
        self._c.execute(*args, *_wire.admission(deadline_ms))

    def store_mla(self, sid: str, layer: int, latents, kv_lora_rank: int = 512,
                  rope_dim: int | None = None, dtype: str = "fp32", *,
                  deadline_ms: int | None = None) -> None:
        """Stores an MLA slot: N latent rows of kv_lora_rank + rope_dim values (ATTEND.PREFIX.STORE
        ... MLA). dtype "fp32": latents float32 [N, kv_lora_rank + rope_dim]; "fp16", "bf16",
        "fp8", "fp8_ds_mla": latents are the rows in that codec's RAW layout (bytes, or uint8
        [N, row_bytes]: what V.FETCH ... RAW of such a session returns; pion.codecs)."""
        if dtype == "fp32":
            c = _wire.to_numpy(latents, np.float32)
            if c.ndim != 2 or c.shape[1] < kv_lora_rank:
                raise ValueError("latents must be [N, kv_lora_rank + rope_dim], got shape %s"
                                 % (c.shape,))
            rope = c.shape[1] - int(kv_lora_rank) if rope_dim is None else int(rope_dim)
            n, blob = c.shape[0], _wire.f32(c)
        else:
            rope = 64 if rope_dim is None else int(rope_dim)
            blob = bytes(np.asarray(latents, dtype=np.uint8).tobytes()) \
                if not isinstance(latents, (bytes, bytearray, memoryview)) else bytes(latents)
            rb = codecs.row_bytes(dtype, int(kv_lora_rank) + rope)
            if len(blob) % rb:
                raise ValueError("%d bytes is not a whole number of %s rows of %d bytes"
                                 % (len(blob), dtype, rb))
            n = len(blob) // rb
        self._c.execute("ATTEND.PREFIX.STORE", sid, int(layer), "MLA", n, int(kv_lora_rank),
                        rope, blob, "DTYPE", dtype, *_wire.admission(deadline_ms))

    def lookup(self, sid: str, layer: int) -> bool:
        """True when the slot exists (on the GPU, in memory or on disk)."""
        return _wire.status(self._c.execute("ATTEND.PREFIX.LOOKUP", sid, int(layer))) == "HIT"

    def drop(self, sid: str, layer: int | None = None) -> int:
        """Drops one layer's slot, or every layer of the session; returns the count."""
        args = ["ATTEND.PREFIX.DROP", sid] + ([int(layer)] if layer is not None else [])
        return int(self._c.execute(*args))

    def save(self, sid: str, layer: int | None = None) -> None:
        """ATTEND.PREFIX.SAVE: one layer's slot, or every layer of the session, durably on disk
        (returns once they are); saved slots survive a restart."""
        args = ["ATTEND.PREFIX.SAVE", sid] + ([int(layer)] if layer is not None else [])
        self._c.execute(*args)

    def info(self, sid: str) -> list[dict]:
        """One dict per layer: layer, heads, rows, head_dim, dtype, layout ("heads" or "mla"),
        kv_lora_rank, rope_dim (0 for per-head slots), bytes, tier (gpu, host or disk),
        generation, source, backend."""
        return [_wire.parse_map(m) for m in self._c.execute("ATTEND.PREFIX.INFO", sid)]

    def export(self, sid: str, layer: int) -> dict:
        """ATTEND.PREFIX.EXPORT: a CUDA IPC handle to the GPU copy of slot (sid, layer), pinned
        under a lease on this client's shared-memory channel (needs unix_socket_path and a server
        with --attention-backend cuda). Keys: handle (64 bytes), device (PCI bus id), k_offset,
        v_offset, bytes, heads, rows, head_dim, dtype, generation, lease, ttl_ms. Release it with
        release_export(lease) — or use gpu_view()."""
        return self.export_many(sid, [layer])[0]

    def export_many(self, sid: str, layers, packed: bool = True) -> list[dict]:
        """ATTEND.PREFIX.EXPORT of several layers of sid in one command (one round trip, one
        hop to the session's shard): a list of export dicts, one lease each. All or nothing:
        when one layer cannot be exported the server keeps no lease and its error is raised.
        packed: the reply as fixed binary records (the PACKED form: far cheaper to parse than
        a map per layer); the dicts are the same either way."""
        layers = [int(j) for j in layers]
        if not layers:
            return []
        ch = self._shm("ATTEND.PREFIX.EXPORT")
        if packed:
            return _unpack_exports(ch.call("ATTEND.PREFIX.EXPORT", sid, *layers, "PACKED"))
        reply = ch.call("ATTEND.PREFIX.EXPORT", sid, *layers)
        return [_parse_export(reply)] if len(layers) == 1 else \
            [_parse_export(r) for r in reply]

    def release_export(self, lease: int) -> bool:
        """SHM.RELEASE of an export's lease (the slot's GPU copy may leave the GPU again)."""
        return self.release_exports([lease]) == 1

    def release_exports(self, leases, wait: bool = True) -> int | None:
        """SHM.RELEASE of several exports' leases, pipelined; returns how many were held. With
        wait=False the releases are sent and their replies read with the channel's next
        command (returns None)."""
        ch = self._c._shm_channel()
        if ch is None:
            return 0
        if not wait:
            ch.release_later(*leases)
            return None
        return ch.release_many(leases)

    def _shm(self, what: str):
        ch = self._c._shm_channel()
        if ch is None:
            raise errors.PionError("%s needs a Unix-socket client "
                                   "(pion.Client(unix_socket_path=...))" % what)
        return ch

    @contextlib.contextmanager
    def gpu_view(self, sid: str, layer: int):
        """Context manager: the GPU-resident slot's K and V as torch CUDA tensors [H, N, D]
        (float32, float16, bfloat16 or float8_e4m3fn — then with .k_scale/.v_scale [H, N]
        float32 beside them) that alias the server's device memory through CUDA IPC — no copy,
        device to device. Yields a GpuView (.k, .v, .export); on exit the view's work is
        synchronized and the lease released (the IPC mapping itself stays open for the next
        export of the same allocation: pion.cuda_ipc.close_all() unmaps). The memory is the
        server's: read it, do not write it."""
        from .cuda_ipc import GpuView
        ex = self.export(sid, layer)
        try:
            view = GpuView(ex)
        except BaseException:
            self.release_export(ex["lease"])
            raise
        try:
            yield view
        finally:
            try:
                view.close()
            finally:
                self.release_export(ex["lease"])

    @contextlib.contextmanager
    def lease(self, sid: str, layer: int, k, v):
        """Context manager: stores the slot, yields an AttendLease bound to it, drops the slot
        on exit (also on error)."""
        self.store(sid, layer, k, v)
        try:
            yield AttendLease(self, sid, int(layer))
        finally:
            self.drop(sid, layer)

    # --- queries ------------------------------------------------------------------------------
    def query(self, sid: str, layer: int, q, top_k: int = 0, window: int = 0,
              qpos: int | None = None, receipt: bool = False,
              as_torch: bool | None = None, deadline_ms: int | None = None,
              allow_approx: bool = False) -> AttendResult:
        """ATTEND.PREFIX.QUERY: q [H, D] or [H, M, D]; query row i sits at position qpos + i
        (default N, right after the prefix). top_k 0 is exact; top_k > 0 attends each row's
        top_k keys. Returns out of q's shape, and lse [H, M] when M > 1.

        Every query form takes `deadline_ms` (answered within it, or DeadlineError at once
        when this machine's measured rate says it cannot be) and `allow_approx` (a dense
        decode step that would miss the deadline may be answered sparse where that is
        faster; the receipt says so: `exact` False, `fallback`)."""
        qa, squeeze = _queries(q)
        h, m, d = qa.shape
        reply = self._c.execute("ATTEND.PREFIX.QUERY", sid, int(layer), h, d, int(top_k),
                                _wire.f32(qa), *_tail(window, qpos, None, receipt,
                                                      deadline_ms=deadline_ms,
                                                      allow_approx=allow_approx))
        return self._result(reply, receipt, h, m, d, m > 1, squeeze, as_torch)

    def query_fused(self, sid: str, layer: int, q, k_suf, v_suf, head_map=None,
                    window: int = 0, receipt: bool = False,
                    as_torch: bool | None = None, deadline_ms: int | None = None,
                    allow_approx: bool = False) -> AttendResult:
        """ATTEND.PREFIX.QUERY_FUSED: the M queries (q [H_q, D] or [H_q, M, D]) are the last M
        of the S suffix positions; each attends the prefix and the suffix (k_suf, v_suf
        [H_kv, S, D]) causally, merged by the server. Exact; no lse."""
        qa, squeeze = _queries(q)
        ks, vs = _kv(k_suf, "K_suf"), _kv(v_suf, "V_suf")
        hq, m, d = qa.shape
        hkv, s, _ = ks.shape
        hm = contiguous_head_map(hq, hkv) if head_map is None else head_map
        reply = self._c.execute("ATTEND.PREFIX.QUERY_FUSED", sid, int(layer), hq, d, s, hkv,
                                _wire.f32(qa), _wire.f32(ks), _wire.f32(vs), _wire.i32(hm),
                                *_tail(window, None, None, receipt, deadline_ms=deadline_ms,
                                       allow_approx=allow_approx))
        return self._result(reply, receipt, hq, m, d, False, squeeze, as_torch)

    def query_sparse(self, sid: str, layer: int, q, indices, counts=None, window: int = 0,
                     qpos: int | None = None, receipt: bool = False,
                     as_torch: bool | None = None, deadline_ms: int | None = None,
                     allow_approx: bool = False) -> AttendResult:
        """ATTEND.PREFIX.QUERY_SPARSE: head h attends the prefix rows it lists. `indices` is
        either int [H, K] with `counts` [H] (rows indices[h, :counts[h]]), or a list of H
        sequences of row indexes (ragged; padded here). q [H, D]; out [H, D]."""
        qa = _single(q, "QUERY_SPARSE")
        h, d = qa.shape
        idx, cnt, kmax = _index_lists(indices, counts, h, "heads", "H")
        reply = self._c.execute("ATTEND.PREFIX.QUERY_SPARSE", sid, int(layer), h, d, kmax,
                                _wire.f32(qa), _wire.i32(idx), _wire.i32(cnt),
                                *_tail(window, qpos, None, receipt, deadline_ms=deadline_ms,
                                       allow_approx=allow_approx))
        return self._result(reply, receipt, h, 1, d, False, True, as_torch)

    def query_sparse_auto(self, sid: str, layer: int, q, block_size: int, k_top: int,
                          h_kv: int | None = None, head_map=None, window: int = 0,
                          qpos: int | None = None, select: str = "mean", shared: bool = False,
                          receipt: bool = False, as_torch: bool | None = None,
                          deadline_ms: int | None = None,
                          allow_approx: bool = False, recent: int = 0) -> AttendResult:
        """ATTEND.PREFIX.QUERY_SPARSE_AUTO: each query head (q [H_q, D]) scores the prefix's
        blocks of `block_size` rows (`select` "mean" or "quest") and attends the k_top best
        plus the first and last visible block; with `shared` the query heads of one K/V head
        choose one set together (each block ranked by their highest score), so the server
        reads each chosen row once per group; `recent` blocks before the last are always
        among the k_top (a decode step's local context). `h_kv` is the slot's K/V head count (None:
        read with ATTEND.PREFIX.INFO, one more round trip). out [H_q, D]."""
        qa = _single(q, "QUERY_SPARSE_AUTO")
        hq, d = qa.shape
        if h_kv is None:
            h_kv = self._slot_heads(sid, layer)
        hm = contiguous_head_map(hq, h_kv) if head_map is None else head_map
        reply = self._c.execute("ATTEND.PREFIX.QUERY_SPARSE_AUTO", sid, int(layer), hq, d,
                                int(block_size), int(k_top), int(h_kv), _wire.f32(qa),
                                _wire.i32(hm), *_tail(window, qpos, select, receipt, shared,
                                                      deadline_ms, allow_approx, recent))
        return self._result(reply, receipt, hq, 1, d, False, True, as_torch)

    def query_sparse_auto_fused(self, sid: str, layer: int, q, k_suf, v_suf, block_size: int,
                                k_top: int, head_map=None, window: int = 0,
                                select: str = "mean", shared: bool = False,
                                receipt: bool = False,
                                as_torch: bool | None = None, deadline_ms: int | None = None,
                                allow_approx: bool = False, recent: int = 0) -> AttendResult:
        """ATTEND.PREFIX.QUERY_SPARSE_AUTO_FUSED: one query per head (q [H_q, D]) at the last
        suffix position: sparse-auto over the prefix plus the dense causal suffix (k_suf,
        v_suf [H_kv, S, D]), merged (`recent` as in query_sparse_auto). out [H_q, D]."""
        qa = _single(q, "QUERY_SPARSE_AUTO_FUSED")
        ks, vs = _kv(k_suf, "K_suf"), _kv(v_suf, "V_suf")
        hq, d = qa.shape
        hkv, s, _ = ks.shape
        hm = contiguous_head_map(hq, hkv) if head_map is None else head_map
        reply = self._c.execute("ATTEND.PREFIX.QUERY_SPARSE_AUTO_FUSED", sid, int(layer), hq, d,
                                int(block_size), int(k_top), hkv, s, _wire.f32(qa),
                                _wire.f32(ks), _wire.f32(vs), _wire.i32(hm),
                                *_tail(window, None, select, receipt, shared, deadline_ms,
                                       allow_approx, recent))
        return self._result(reply, receipt, hq, 1, d, False, True, as_torch)

    # --- MLA --------------------------------------------------------------------------------------
    def query_mla(self, sid: str, layer: int, q, scale: float, kv_lora_rank: int = 512,
                  window: int = 0, qpos: int | None = None, receipt: bool = False,
                  as_torch: bool | None = None,
                  deadline_ms: int | None = None) -> AttendResult:
        """ATTEND.PREFIX.QUERY_MLA: q [H_q, dk] (decode) or [H_q, M, dk] (MTP / speculative: row
        i at position qpos + i, default N; inside the rows they are causal among themselves),
        dk = kv_lora_rank + rope_dim; `scale` the softmax scale. out [H_q(, M), kv_lora_rank],
        lse [H_q(, M)]."""
        qa, squeeze = _queries(q)
        hq, m, dk = qa.shape
        reply = self._c.execute("ATTEND.PREFIX.QUERY_MLA", sid, int(layer), hq, int(kv_lora_rank),
                                dk - int(kv_lora_rank), repr(float(scale)), _wire.f32(qa),
                                *_tail(window, qpos, None, receipt, deadline_ms=deadline_ms))
        return self._mla_result(reply, receipt, hq, m, int(kv_lora_rank), squeeze, as_torch)

    def query_mla_sparse(self, sid: str, layer: int, q, indices, scale: float, counts=None,
                         kv_lora_rank: int = 512, window: int = 0, qpos: int | None = None,
                         receipt: bool = False, as_torch: bool | None = None,
                         deadline_ms: int | None = None) -> AttendResult:
        """ATTEND.PREFIX.QUERY_MLA_SPARSE: query token i (all its heads) attends the latent rows
        it lists — `indices` int [M, K] with `counts` [M], or a list of M sequences (ragged;
        padded here): DeepSeek-V3.2's indexer output per token. q as query_mla."""
        qa, squeeze = _queries(q)
        hq, m, dk = qa.shape
        idx, cnt, kmax = _index_lists(indices, counts, m, "tokens", "M")
        reply = self._c.execute("ATTEND.PREFIX.QUERY_MLA_SPARSE", sid, int(layer), hq,
                                int(kv_lora_rank), dk - int(kv_lora_rank), repr(float(scale)),
                                kmax, _wire.f32(qa), _wire.i32(idx), _wire.i32(cnt),
                                *_tail(window, qpos, None, receipt, deadline_ms=deadline_ms))
        return self._mla_result(reply, receipt, hq, m, int(kv_lora_rank), squeeze, as_torch)

    def query_mla_fused(self, sid: str, layer: int, q, c_suf, scale: float,
                        kv_lora_rank: int = 512, window: int = 0, receipt: bool = False,
                        as_torch: bool | None = None,
                        deadline_ms: int | None = None) -> AttendResult:
        """ATTEND.PREFIX.QUERY_MLA_FUSED: c_suf float32 [S, dk] are the client's latents after
        the prefix; the M queries are the last M of them and attend the prefix and the suffix
        causally, merged by the server. q as query_mla; out and lse of the merged attention."""
        qa, squeeze = _queries(q)
        hq, m, dk = qa.shape
        cs = _wire.to_numpy(c_suf, np.float32)
        if cs.ndim != 2:
            raise ValueError("c_suf must be [S, dk], got shape %s" % (cs.shape,))
        reply = self._c.execute("ATTEND.PREFIX.QUERY_MLA_FUSED", sid, int(layer), hq,
                                int(kv_lora_rank), dk - int(kv_lora_rank), repr(float(scale)),
                                cs.shape[0], _wire.f32(qa), _wire.f32(cs),
                                *_tail(window, None, None, receipt, deadline_ms=deadline_ms))
        return self._mla_result(reply, receipt, hq, m, int(kv_lora_rank), squeeze, as_torch)

    def _mla_result(self, reply, receipt, hq, m, dv, squeeze, as_torch) -> AttendResult:
        rc = None
        if receipt:
            reply, rc_raw = reply
            rc = parse_receipt(rc_raw)
        a = np.frombuffer(reply, dtype="<f4")
        if a.size != hq * m * (dv + 1):
            raise ValueError("reply has %d floats, expected %d" % (a.size, hq * m * (dv + 1)))
        out = a[:hq * m * dv].reshape((hq, dv) if squeeze else (hq, m, dv))
        lse = a[hq * m * dv:].reshape((hq,) if squeeze else (hq, m))
        return AttendResult(self._c._out(out, as_torch), self._c._out(lse, as_torch), rc)

    # --- internals ----------------------------------------------------------------------------
    def _slot_heads(self, sid: str, layer: int) -> int:
        for slot in self.info(sid):
            if slot["layer"] == int(layer):
                return int(slot["heads"])
        raise ValueError("no resident attention slot for session %r layer %d; pass h_kv"
                         % (sid, int(layer)))

    def _result(self, reply, receipt, h, m, d, with_lse, squeeze, as_torch) -> AttendResult:
        rc = None
        if receipt:
            reply, rc_raw = reply
            rc = parse_receipt(rc_raw)
        a = np.frombuffer(reply, dtype="<f4")
        want = h * m * d + (h * m if with_lse else 0)
        if a.size != want:
            raise ValueError("reply has %d floats, expected %d" % (a.size, want))
        out = a[:h * m * d].reshape((h, d) if squeeze else (h, m, d))
        lse = a[h * m * d:].reshape(h, m) if with_lse else None
        return AttendResult(self._c._out(out, as_torch), self._c._out(lse, as_torch), rc)


class AttendLease:
    """A stored slot (sid, layer); `query(q, ...)` etc. call the Attend methods on it."""

    def __init__(self, attend: Attend, sid: str, layer: int):
        self.sid, self.layer, self._a = sid, layer, attend

    def query(self, q, **kw) -> AttendResult:
        return self._a.query(self.sid, self.layer, q, **kw)

    def query_fused(self, q, k_suf, v_suf, **kw) -> AttendResult:
        return self._a.query_fused(self.sid, self.layer, q, k_suf, v_suf, **kw)
