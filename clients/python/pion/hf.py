"""Hugging Face transformers integration: a prompt cache backed by Pion (Stage 1) and prefix
attention computed by Pion (Stage 2). transformers and torch are imported here only.

Stage 1 — the K/V of a prefix prefilled once, fetched by any process:

    import pion, pion.hf
    client = pion.Client(port=1974)                      # or unix_socket_path=... (shared memory)
    pc = pion.hf.PionPromptCache(model, client)
    cache = pc.get_or_prefill(prefix_ids)               # a DynamicCache holding the prefix
    out = model.generate(full_ids, past_key_values=cache, max_new_tokens=32)

On a miss the model prefills the prefix and its cache is stored (KV.PREFIX namespaces for the
attention layers, SSM.PREFIX for recurrent layers); on a hit the cache is filled from Pion in
the model's dtype, layout and device. A prefix is identified by the model (config, weights
fingerprint, dtype: `model_identity`) and its token ids: another model's or another prefix's
K/V never fill the cache, and a half-written prefix is never a hit (KV.PREFIX.LOOKUP).

Stage 2 — the prefix K/V stay in Pion after the first push; full-attention layers send their
queries (and the few local K/V rows) to ATTEND.PREFIX.QUERY_FUSED, exact:

    off = pion.hf.PionAttentionOffload(pc)              # registers the "pion" attention
    cache = off.prepare(prefix_ids)                      # binds the slots FROM the namespace
    with off.session(cache):
        out = model.generate(full_ids, past_key_values=cache, max_new_tokens=32)

Sliding-window and recurrent layers stay local (filled from Pion as in Stage 1); batch size 1.
"""
from __future__ import annotations

import contextlib
import contextvars
import hashlib
import json
import threading
import time
import warnings
import weakref
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from . import _wire, errors
from .kvprefix import LOSSLESS, torch_dtype
from .ssm import serialize_arrays

_CODEC_BY_DTYPE = {"torch.float32": "fp32", "torch.float16": "fp16", "torch.bfloat16": "bf16"}


def _torch():
    return _wire.torch_module()


def model_identity(model) -> str:
    """The MODEL id of a transformers model: its architecture, a digest of its full config
    (name/revision included), its dtype and a fingerprint of its weights (a strided sample of
    the first and last parameter tensors) — two models that would produce different K/V for
    the same tokens get different ids."""
    torch = _torch()
    cfg = model.config
    h = hashlib.sha256()
    h.update(cfg.to_json_string(use_diff=False).encode())
    for attr in ("_name_or_path", "_commit_hash"):
        h.update(str(getattr(cfg, attr, "")).encode())
    params = list(model.parameters())
    h.update(str(params[0].dtype).encode())
    with torch.no_grad():
        for p in (params[0], params[-1]):
            flat = p.detach().reshape(-1)
            step = max(1, flat.numel() // 4096)
            h.update(flat[::step][:4096].float().cpu().numpy().tobytes())
    return "%s-%s" % (cfg.model_type, h.hexdigest()[:24])


def prefix_digest(prefix_ids) -> str:
    ids = np.ascontiguousarray(_wire.to_numpy(prefix_ids).reshape(-1), dtype="<i8")
    return hashlib.sha256(ids.tobytes()).hexdigest()[:24]


def position_digest(config, prefix_ids, digest: str | None = None) -> str:
    """The POSITION digest: the rotary/position settings of the config and the prefix's token
    ids, so that a namespace is only a hit for the same tokens at the same positions. `digest`:
    prefix_digest(prefix_ids) when the caller has it already."""
    c = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    pos = {k: getattr(c, k, None) for k in ("rope_parameters", "rope_scaling", "rope_theta",
                                              "max_position_embeddings", "sliding_window")}
    h = hashlib.sha256(json.dumps(pos, sort_keys=True, default=str).encode())
    h.update((digest or prefix_digest(prefix_ids)).encode())
    return h.hexdigest()[:24]


@dataclass
class _Plan:
    """Which cache layer goes where: attention layers in KV.PREFIX groups (one namespace per
    kind: "full" or "swa<W>"), recurrent layers in SSM.PREFIX."""
    groups: dict[str, list[int]] = field(default_factory=dict)  # group -> model layer indexes
    windows: dict[str, int] = field(default_factory=dict)       # swa group -> window
    linear: list[int] = field(default_factory=list)
    n_layers: int = 0


def _plan(model) -> _Plan:
    from transformers.cache_utils import CacheLayerMixin, DynamicCache
    try:
        from transformers.cache_utils import LinearAttentionCacheLayerMixin as _Linear
    except ImportError:  # older transformers: no recurrent cache layers
        _Linear = ()
    probe = DynamicCache(config=model.config)
    layers = probe.layers
    if not layers:
        n = model.config.get_text_config(decoder=True).num_hidden_layers
        layers = [None] * n
    plan = _Plan(n_layers=len(layers))
    for i, layer in enumerate(layers):
        if layer is None or isinstance(layer, CacheLayerMixin):
            if getattr(layer, "is_sliding", False):
                w = int(layer.sliding_window)
                g = "swa%d" % w
                plan.windows[g] = w
            else:
                g = "full"
            plan.groups.setdefault(g, []).append(i)
        if _Linear and isinstance(layer, _Linear):
            plan.linear.append(i)
    return plan


def _sync(device) -> None:
    torch = _torch()
    if torch.cuda.is_available() and str(device).startswith("cuda"):
        torch.cuda.synchronize(device)


_UNBOUND = "unbound"  # _complete_and_export: the group's slots are not resident


class _Hold:
    """The export lease a cache layer's aliased prefix tensors are read under."""
    __slots__ = ("lease", "deadline", "ptr", "owner")

    def __init__(self, lease: int, deadline: float, ptr: int, owner):
        self.lease, self.deadline, self.ptr, self.owner = lease, deadline, ptr, owner


_HELD: dict[type, type] = {}  # cache layer class -> its lease-holding subclass


def _held_class(base: type) -> type:
    """`base` whose first update retires the layer's export lease (PionPromptCache, ipc)."""
    cls = _HELD.get(base)
    if cls is not None:
        return cls

    def update(self, *args, **kwargs):
        hold = self.__dict__.get("_pion_hold")
        aliased = hold is not None and self.keys is not None and self.keys.data_ptr() == hold.ptr
        if aliased and time.monotonic() > hold.deadline:
            from .errors import PionError
            raise PionError("this Pion cache aliased the server's GPU slots under leases that "
                            "expired (--shm-lease-ttl-ms) before its first use; fetch it again")
        self.__dict__.pop("_pion_hold", None)
        self.__class__ = base  # the class's own update from now on
        try:
            return base.update(self, *args, **kwargs)
        finally:
            owner = hold.owner() if aliased else None
            if owner is not None:
                owner._retired.append(hold.lease)

    cls = _HELD[base] = type(base.__name__, (base,), {"update": update,
                                                      "__module__": base.__module__})
    return cls


class _Arrivals:
    """The layers a layerwise cache waits for: put by the fetching thread, taken by the update
    that needs them; an error of the fetch is raised there."""

    def __init__(self, layers):
        self._cv = threading.Condition()
        self._pending = set(layers)
        self._got: dict[int, tuple] = {}
        self._error: BaseException | None = None

    def put(self, i, k, v, done) -> None:
        with self._cv:
            self._got[i] = (k, v, done)
            self._cv.notify_all()

    def fail(self, e: BaseException) -> None:
        with self._cv:
            self._error = e
            self._cv.notify_all()

    def pending(self, i) -> bool:
        with self._cv:
            return i in self._pending

    def take(self, i):
        """The layer's (k, v, event) once it arrived; None when it is not one it waits for."""
        with self._cv:
            if i not in self._pending:
                return None
            while i not in self._got:
                if self._error is not None:
                    raise self._error
                self._cv.wait()
            self._pending.discard(i)
            return self._got.pop(i)


_LAYERWISE = None


def _layerwise_cache_type():
    """DynamicCache with layers that arrive while the forward runs (PionPromptCache(layerwise=
    True)): an update of a layer first waits for it (and, on a GPU, orders the compute after
    its copy); the sequence length is the prefix's from the start."""
    global _LAYERWISE
    if _LAYERWISE is not None:
        return _LAYERWISE
    from transformers.cache_utils import DynamicCache

    class LayerwiseCache(DynamicCache):
        def __init__(self, config, tokens: int, arrivals: _Arrivals):
            super().__init__(config=config)
            self._pion_tokens = tokens
            self._pion_arrivals = arrivals

        def arrive(self, i: int) -> None:
            got = self._pion_arrivals.take(i)
            if got is None:
                return
            k, v, done = got
            if done is not None:
                _torch().cuda.current_stream().wait_event(done)
            layer = self.layers[i]
            layer.lazy_initialization(k, v)
            layer.keys, layer.values = k, v
            if getattr(layer, "is_sliding", False):
                layer.cumulative_length = self._pion_tokens

        def update(self, key_states, value_states, layer_idx, cache_kwargs=None):
            self.arrive(layer_idx)
            return super().update(key_states, value_states, layer_idx, cache_kwargs)

        def get_seq_length(self, layer_idx: int = 0) -> int:
            if self._pion_arrivals.pending(layer_idx):
                return self._pion_tokens
            return super().get_seq_length(layer_idx)

        def get_mask_sizes(self, cache_position, layer_idx: int = 0):
            self.arrive(layer_idx)  # the first layer of its kind: early in the order
            return super().get_mask_sizes(cache_position, layer_idx)

    _LAYERWISE = LayerwiseCache
    return _LAYERWISE


class PionPromptCache:
    """Stage 1: `get_or_prefill(prefix_ids)` returns a transformers DynamicCache holding the
    prefix — fetched from Pion on a hit, prefilled by the model and stored on a miss.

    Args:
      model: a transformers causal LM (batch size 1).
      client: a pion.Client; over its Unix socket the shared-memory path is used.
      codec: the V-store codec of stored K/V; default the model's dtype (fp32, fp16 or bf16:
        lossless). int8 / fp8 / fp8_e5m2 / turbo4 / turbo3 / turbo2 are lossy. fp8 namespaces
        bind fp8 attention slots (transport="ipc", Stage 2): the server attends over the e4m3
        bytes; fp8_e5m2 ones bind fp32 slots.
      persist: KV.PREFIX.SAVE every stored namespace (it survives a server restart).
      model_id: the MODEL identity (default `model_identity(model)`).
      transport: how a hit moves the K/V. "auto": the socket's bytes (TCP), or the shared-
        memory mapping on a Unix-socket client (straight to the GPU when the model is there).
        "ipc": device to device — the server binds the namespace into GPU-resident attention
        slots (once; --attention-backend cuda, same GPU) and the cache reads them through CUDA
        IPC (ATTEND.PREFIX.EXPORT); needs a Unix-socket client. When the slots hold the model's
        dtype (a bf16 model's bf16 namespace binds bf16 slots; fp32 likewise) the cache's
        prefix tensors alias the server's memory — nothing is copied before the forward,
        whose first cache update concatenates them into the model's own tensors anyway. Their
        exports' leases are held until that update and released with a later request; use the
        cache within --shm-lease-ttl-ms (default 30 s) of the fetch, else its first update
        raises (fetch again). Otherwise the slots are copied into tensors of the model's dtype.

      layerwise: a hit returns at once with the first attention layer in place and the others
        arriving in model order on a background thread (transport "auto", TCP or shared
        memory), each layer waited for by the model's first update of it: the forward computes
        layer l while layer l+1 travels, so a warm start waits about for the longer of the
        transfer and the compute rather than their sum.
      tp_rank, tp_size: a tensor-parallel rank's cache — only its K/V heads (`tp_heads`) are
        fetched, whatever TP degree stored the prefix (the namespace's layout is the identity).

    After each call `last` tells what happened: hit, prefill_ms, fetch_ms, store_ms, bytes,
    path ("tcp", "shm", "shm-cuda", "ipc")."""

    def __init__(self, model, client, codec: str | None = None, persist: bool = False,
                 model_id: str | None = None, transport: str = "auto",
                 layerwise: bool = False, tp_rank: int = 0, tp_size: int = 1):
        self.model = model
        self.client = client
        p = next(model.parameters())
        self.dtype, self.device = p.dtype, p.device
        self.codec = codec or _CODEC_BY_DTYPE.get(str(self.dtype), "fp32")
        self.persist = persist
        if transport not in ("auto", "ipc"):
            raise ValueError("transport must be 'auto' or 'ipc', got %r" % (transport,))
        self.transport = transport
        if layerwise and transport == "ipc":
            raise ValueError("layerwise applies to transport 'auto' (ipc aliases, nothing moves)")
        self.layerwise = layerwise
        if tp_size < 1 or not 0 <= tp_rank < tp_size:
            raise ValueError("tp_rank %d of tp_size %d" % (tp_rank, tp_size))
        if tp_size > 1 and transport == "ipc":
            raise ValueError("tp_size > 1 applies to transport 'auto'")
        self.tp = (tp_rank, tp_size)
        self.model_id = model_id or model_identity(model)
        self.plan = _plan(model)
        self.last: dict[str, Any] = {}
        self._shape: dict[str, tuple[int, int, int]] = {}  # namespace -> (tokens, heads, dim)
        self._retired: list[int] = []  # leases of zero-copy layers updated since (ipc)

    # --- names ---------------------------------------------------------------------------
    def namespace_for(self, prefix_ids, digest: str | None = None) -> str:
        return "pc:%s:%s" % (self.model_id[-12:], digest or prefix_digest(prefix_ids))

    def _identity(self, ids, namespace: str | None) -> tuple[str, str]:
        """(namespace base, POSITION digest) of token ids, hashing them once."""
        digest = prefix_digest(ids)
        return (namespace or self.namespace_for(ids, digest),
                position_digest(self.model.config, ids, digest))

    def _ns(self, base: str, group: str) -> str:
        return "%s/%s" % (base, group)

    def _ssm_sid(self, base: str) -> str:
        return "%s/ssm:%s" % (base, self.model_id)

    def _slot_sid(self, base: str, group: str) -> str:
        return "hf:%s/%s" % (base, group)

    def bind(self, base: str, group: str, pos: str) -> float:
        """Makes the group's layers resident as ATTEND.PREFIX slots (session _slot_sid),
        bound from its namespace inside the server; slots already resident are kept. Returns
        the milliseconds it took."""
        t0 = time.perf_counter()
        sid, n = self._slot_sid(base, group), len(self.plan.groups[group])
        resident = self.client.execute_many([("ATTEND.PREFIX.LOOKUP", sid, j)
                                             for j in range(n)])
        for j, hit in enumerate(resident):
            if _wire.status(hit) != "HIT":
                self.client.attend.store_from(sid, j, self._ns(base, group),
                                              model=self.model_id, position=pos)
        return (time.perf_counter() - t0) * 1e3

    # --- API -----------------------------------------------------------------------------
    def get_or_prefill(self, prefix_ids, namespace: str | None = None):
        """The cache of `prefix_ids` (1-d or [1, T] token ids): from Pion when stored for this
        model, else prefilled by the model (and stored)."""
        ids = self._ids(prefix_ids)
        cache = self.fetch(ids, namespace)
        if cache is not None:
            return cache
        return self.prefill_and_store(ids, namespace)

    def lookup(self, prefix_ids, namespace: str | None = None) -> bool:
        ids = self._ids(prefix_ids)
        return self._complete(*self._identity(ids, namespace))

    def prefill_and_store(self, prefix_ids, namespace: str | None = None):
        """Prefills with the model and stores the cache; returns the cache."""
        from transformers.cache_utils import DynamicCache
        torch = _torch()
        ids = self._ids(prefix_ids)
        base = namespace or self.namespace_for(ids)
        self._release_retired()
        cache = DynamicCache(config=self.model.config)
        _sync(self.device)
        t0 = time.perf_counter()
        with torch.no_grad():
            self.model(input_ids=ids[None].to(self.device), past_key_values=cache, use_cache=True)
        _sync(self.device)
        prefill_ms = (time.perf_counter() - t0) * 1e3
        t1 = time.perf_counter()
        nbytes = self.store(cache, ids, base, prefill_ms)
        self.last = dict(hit=False, prefill_ms=prefill_ms, store_ms=(time.perf_counter() - t1)
                         * 1e3, bytes=nbytes, namespace=base)
        return cache

    def store(self, cache, prefix_ids, namespace: str, prefill_ms: float = 0.0) -> int:
        """Stores a prefilled cache of `prefix_ids` under `namespace`: recurrent layers first,
        then one KV.PREFIX namespace per attention group (a namespace is a hit only once every
        row of every layer is written). Returns the bytes sent."""
        pos = position_digest(self.model.config, self._ids(prefix_ids))
        sent = 0
        for i in self.plan.linear:
            layer = cache.layers[i]
            arrays = []
            for s in range(layer.number_of_states):
                for st in (layer.conv_states[s], layer.recurrent_states[s]):
                    arrays.append(np.zeros(0, np.float32) if st is None else st[0])
            blob = serialize_arrays(arrays)
            self.client.ssm.store_blob(self._ssm_sid(namespace), i, blob)
            sent += len(blob)
        for g, idxs in self.plan.groups.items():
            ks = [cache.layers[i].keys for i in idxs]
            b, h, n, d = ks[0].shape
            if b != 1:
                raise ValueError("PionPromptCache handles batch size 1, got %d" % b)
            if any(k.shape != ks[0].shape for k in ks):
                raise NotImplementedError("attention layers of group %s differ in shape" % g)
            ns = self._ns(namespace, g)
            self.client.kv.register(ns, len(idxs), n, h, d, self.codec, model=self.model_id,
                                    position=pos, prefill_ms=prefill_ms)
            try:
                for j, i in enumerate(idxs):
                    layer = cache.layers[i]
                    self.client.kv.store_layer(ns, j, layer.keys[0], layer.values[0],
                                               layout="hnd")
                    sent += 2 * h * n * d * 4
            except errors.ReadOnlyError:
                # Another writer of the same prefix (same model, tokens and position digest:
                # the same K/V) completed it first; it is published and stays as it is.
                pass
            if self.persist:
                self.client.execute("KV.PREFIX.SAVE", ns)
        return sent

    def fetch(self, prefix_ids, namespace: str | None = None):
        """The stored cache of `prefix_ids`, or None when it is not (completely) stored for this
        model and these tokens."""
        from transformers.cache_utils import DynamicCache
        ids = self._ids(prefix_ids)
        t0 = time.perf_counter()
        base, pos = self._identity(ids, namespace)
        self._release_retired()
        exports = None
        if self.transport == "ipc":  # identity check and exports in one round trip
            exports = self._complete_and_export(base, pos)
            if exports is None:
                return None
        elif not self._complete(base, pos):
            return None
        states = self._fetch_states(base)
        if states is None:
            self._release_exports(exports)
            return None
        cache = DynamicCache(config=self.model.config)
        if self.layerwise and cache.layers and self.plan.groups:
            cache, nbytes = self._layerwise_cache(base, int(ids.numel()))
        else:
            nbytes = self._fill_attention(cache, base, int(ids.numel()), list(self.plan.groups),
                                          pos, exports)
        self._fill_states(cache, states)
        _sync(self.device)
        self.last = dict(hit=True, fetch_ms=(time.perf_counter() - t0) * 1e3, bytes=nbytes,
                         path="ipc" if self.transport == "ipc" else self.client.last_fetch_path,
                         namespace=base)
        return cache

    def drop(self, prefix_ids, namespace: str | None = None) -> None:
        ids = self._ids(prefix_ids)
        base = namespace or self.namespace_for(ids)
        for g in self.plan.groups:
            self.client.execute("KV.PREFIX.DROP", self._ns(base, g))
        if self.plan.linear:
            self.client.ssm.drop(self._ssm_sid(base))

    # --- internals -----------------------------------------------------------------------
    def _ids(self, prefix_ids):
        torch = _torch()
        ids = prefix_ids if isinstance(prefix_ids, torch.Tensor) else torch.as_tensor(
            np.asarray(prefix_ids))
        if ids.dim() == 2:
            if ids.shape[0] != 1:
                raise ValueError("PionPromptCache handles batch size 1, got %d" % ids.shape[0])
            ids = ids[0]
        return ids.long().cpu()

    def _lookups(self, base: str, pos: str) -> list[tuple]:
        """KV.PREFIX.LOOKUP of every attention group's namespace, with this model's identity."""
        return [("KV.PREFIX.LOOKUP", self._ns(base, g), "MODEL", self.model_id, "POSITION", pos)
                for g in self.plan.groups]

    def _complete(self, base: str, pos: str) -> bool:
        cmds = self._lookups(base, pos)
        replies = self.client.execute_many(cmds) if cmds else []
        return all(_wire.status(r) == "HIT" for r in replies)

    def _complete_and_export(self, base: str, pos: str) -> dict | None:
        """transport="ipc": KV.PREFIX.LOOKUP of every group and ATTEND.PREFIX.EXPORT of its
        slots, pipelined on the shared-memory channel (one round trip). None when a group is
        not stored for this model and tokens (exports granted are released); else, per group,
        its exports or _UNBOUND where the slots are not resident (bound on the way)."""
        ch = self.client.attend._shm("transport='ipc'")
        groups = list(self.plan.groups)
        cmds = self._lookups(base, pos) + [("ATTEND.PREFIX.EXPORT", self._slot_sid(base, g),
                  *range(len(self.plan.groups[g])), "PACKED") for g in groups]
        granted = time.monotonic()  # the leases' TTL runs from (before) their grant
        replies = ch.call_many(cmds)
        lookups, exported = replies[:len(groups)], replies[len(groups):]
        from .attend import _unpack_exports
        from .errors import MissError, PionError
        out = {}
        for g, r in zip(groups, exported):
            if isinstance(r, MissError):
                out[g] = _UNBOUND
            elif isinstance(r, PionError):
                self._release_exports(out)
                raise r
            else:
                out[g] = _unpack_exports(r)
                for e in out[g]:
                    e["granted"] = granted
        for r in lookups:
            if isinstance(r, PionError) and not isinstance(r, MissError):
                self._release_exports(out)
                raise r
        if not all(not isinstance(r, PionError) and _wire.status(r) == "HIT" for r in lookups):
            self._release_exports(out)
            return None
        return out

    def _release_exports(self, exports: dict | None) -> None:
        leases = [e["lease"] for ex in (exports or {}).values() if ex is not _UNBOUND
                  for e in ex]
        if leases:
            self.client.attend.release_exports(leases, wait=False)

    def _fetch_states(self, base: str) -> dict | None:
        """The recurrent layers' state arrays, or None when one is missing."""
        states = {}
        for i in self.plan.linear:
            arrays = self.client.ssm.fetch(self._ssm_sid(base), i, as_torch=True)
            if arrays is None:
                return None
            states[i] = arrays
        return states

    def _fill_attention(self, cache, base: str, t: int, groups: list[str],
                        pos: str | None = None, exports: dict | None = None) -> int:
        """Fills the attention layers of `groups` from their namespaces; returns the bytes.
        exports: per group, ATTEND.PREFIX.EXPORTs already made (transport="ipc")."""
        nbytes = 0
        for g in groups:
            ns, idxs = self._ns(base, g), self.plan.groups[g]
            leases = [None] * len(idxs)
            if self.transport == "ipc":
                kvs, leases = self._fetch_group_ipc(base, g, pos, (exports or {}).get(g))
            else:
                kvs = self._fetch_group_shm(ns, len(idxs)) if self.tp[1] == 1 else None
                if kvs is None:
                    kvs = [self._fetch_layer(ns, j) for j in range(len(idxs))]
            for (k, v), i, lease in zip(kvs, idxs, leases):
                nbytes += 2 * k.numel() * k.element_size()
                if not cache.layers:  # a cache without per-layer types: grows by update
                    cache.update(k, v, i)  # copies (concatenates onto nothing)
                    if lease is not None:
                        self._retired.append(lease[0])
                    continue
                layer = cache.layers[i]
                layer.lazy_initialization(k, v)
                layer.keys, layer.values = k, v
                if getattr(layer, "is_sliding", False):
                    layer.cumulative_length = t  # tokens seen, not tokens kept
                if lease is not None:
                    self._hold_until_update(layer, *lease)
        return nbytes

    def _layer_shape(self, ns: str) -> tuple[int, int, int]:
        """(tokens, kv heads, head dim) of namespace ns (KV.PREFIX.INFO once per namespace)."""
        if ns not in self._shape:
            m = _wire.parse_map(self.client.execute("KV.PREFIX.INFO", ns))
            self._shape[ns] = (m["n_tokens"], m["kv_heads"], m["head_dim"])
        return self._shape[ns]

    def _fetch_group_shm(self, ns: str, n: int):
        """Layers 0..n-1 of namespace ns over shared memory to the GPU (client.kv.fetch_layers:
        lossless codecs in one pipelined fetch, DMA from the CUDA-registered mapping, laid out
        in the model's dtype on the device; others decoded per layer), or None when this path
        does not apply (TCP client, model not on a GPU)."""
        if self.client._shm_channel() is None or self.device.type != "cuda":
            return None
        kvs = self.client.kv.fetch_layers(ns, range(n), device=self.device, dtype=self.dtype,
                                          model=self.model_id)
        return [(k[None], v[None]) for k, v in kvs]

    def _fetch_group_ipc(self, base: str, group: str, pos: str | None,
                         exports: list | None = None):
        """The group's slots through CUDA IPC as [1, H, T, D] tensors of the model's dtype, and
        per layer the (lease, deadline) its tensors are read under (None when copied). Slots of
        the model's dtype on its device are aliased, not copied (their leases are held until
        the layer's first update); others are copied device to device, and their leases
        released once the copies finished. Slots not resident in the server's GPU memory are
        bound from the namespace first. `exports`: made already (by _complete_and_export), or
        _UNBOUND when that found the slots missing."""
        from .cuda_ipc import GpuView
        from .errors import MissError
        torch = _torch()
        sid, n = self._slot_sid(base, group), len(self.plan.groups[group])
        t0 = time.monotonic()
        if exports is None:
            try:
                exports = self.client.attend.export_many(sid, range(n))  # one round trip
            except MissError:
                exports = _UNBOUND
        if exports is _UNBOUND:  # first request of this prefix, or evicted: bind, then export
            self.bind(base, group, pos)
            t0 = time.monotonic()
            exports = self.client.attend.export_many(sid, range(n))
        out, leases, copied = [], [], []
        try:
            for ex in exports:
                view = GpuView(ex)
                if (view.k.dtype == self.dtype and view.device == self.device
                        and view.k_scale is None):
                    out.append(view.batched())
                    leases.append((ex["lease"], ex.get("granted", t0) + int(ex["ttl_ms"]) / 1e3))
                    continue
                pair = []
                # fp8 slots (from an fp8 namespace): e4m3 times the rows' scales.
                for x in (view.dense() if view.k_scale is not None else (view.k, view.v)):
                    dst = torch.empty((1, *x.shape), dtype=self.dtype, device=self.device)
                    dst[0].copy_(x)
                    pair.append(dst)
                out.append(tuple(pair))
                leases.append(None)
                copied.append(ex["lease"])
            if copied:
                _sync(self.device)
        except BaseException:
            _sync(self.device)
            self.client.attend.release_exports([ex["lease"] for ex in exports], wait=False)
            raise
        # The copies have finished: their leases go without a round trip of their own.
        self.client.attend.release_exports(copied, wait=False)
        return out, leases

    def _hold_until_update(self, layer, lease: int, deadline: float) -> None:
        """Layer's keys/values alias an export held under `lease`: its first update (the
        forward concatenating the suffix onto the prefix, into new tensors) retires the lease;
        after `deadline` (the lease's TTL) the server may have reused the memory, so the
        update refuses instead of reading it. The layer's class becomes a subclass doing that
        (copy.deepcopy of the cache copies the class and the hold; the copy's cloned tensors
        are its own, so its update retires nothing)."""
        layer.__dict__["_pion_hold"] = _Hold(lease, deadline, layer.keys.data_ptr(),
                                             weakref.ref(self))
        layer.__class__ = _held_class(type(layer))

    def _release_retired(self) -> None:
        """Releases the leases of zero-copy layers updated since the last request, once the
        device has finished the work that read them (riding with the next command)."""
        if not self._retired:
            return
        _sync(self.device)
        leases, self._retired = self._retired, []
        self.client.attend.release_exports(leases, wait=False)

    def _fill_states(self, cache, states: dict) -> None:
        """Puts the recurrent layers' conv and recurrent states in place (as after a prefill)."""
        for i, arrays in states.items():
            layer = cache.layers[i]
            for s in range(layer.number_of_states):
                conv, rec = arrays[2 * s], arrays[2 * s + 1]
                if conv.numel():
                    conv = conv.to(self.device, self.dtype)[None]
                    layer.lazy_initialization(conv_states=conv, state_idx=s,
                                              conv_kernel_size=conv.shape[-1])
                    layer.conv_states[s].copy_(conv)
                    layer.has_previous_state[s] = True
                if rec.numel():
                    rec = rec.to(self.device, self.dtype)[None]
                    layer.lazy_initialization(recurrent_states=rec, state_idx=s)
                    layer.recurrent_states[s].copy_(rec)
                    layer.has_previous_state[s] = True

    def _layerwise_cache(self, base: str, t: int):
        """A cache whose attention layers arrive in model order from a background thread (the
        first of them in place before it returns); returns (cache, bytes)."""
        torch = _torch()
        order = sorted((i, g, j) for g, idxs in self.plan.groups.items()
                       for j, i in enumerate(idxs))
        side = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        arrivals = _Arrivals({i for i, _, _ in order})

        def fetch(i, g, j):
            if side is None:
                k, v = self._fetch_layer(self._ns(base, g), j)
                return k, v, None
            with torch.cuda.stream(side):
                k, v = self._fetch_layer(self._ns(base, g), j)
                done = torch.cuda.Event()
                done.record(side)
            return k, v, done

        first = order[0]
        arrivals.put(first[0], *fetch(*first))
        cache = _layerwise_cache_type()(self.model.config, t, arrivals)
        cache.arrive(first[0])  # what sizes the masks and positions is there before the forward

        def run():
            try:
                rest = order[1:]
                if side is not None and self.client._shm_channel() is not None and \
                        self.codec in LOSSLESS and self.tp[1] == 1:
                    # Shared memory to the GPU: each namespace's remaining layers in one
                    # pipelined fetch, every layer handed over as its copies are issued.
                    with torch.cuda.stream(side):
                        for g in self.plan.groups:
                            mine = [(i, j) for i, gg, j in rest if gg == g]
                            if mine:
                                self._stream_group_shm(base, g, mine, arrivals)
                    return
                for i, g, j in rest:
                    arrivals.put(i, *fetch(i, g, j))
            except BaseException as e:  # noqa: BLE001 - raised by the update that waits for it
                arrivals.fail(e)
        threading.Thread(target=run, name="pion-layerwise", daemon=True).start()
        nbytes = 0
        for g, idxs in self.plan.groups.items():
            tt, h, d = self._layer_shape(self._ns(base, g))
            nbytes += 2 * len(idxs) * tt * self._tp_share(h)[1] * d * (
                torch.tensor([], dtype=self.dtype).element_size())
        return cache, nbytes

    def _stream_group_shm(self, base: str, group: str, layers, arrivals) -> None:
        """Layers [(model layer i, namespace layer j)] of one group over shared memory, each put
        to `arrivals` ([1, H, T, D] in the model's dtype, with its copy's event)."""
        torch = _torch()
        ns = self._ns(base, group)
        t, h, d = self._layer_shape(ns)
        vi = _wire.parse_map(self.client.execute("V.INFO", ns + "_pk"))
        src = torch_dtype(torch, vi["format"])
        idx = [i for i, _ in layers]

        def hand_over(n, k, v, done):
            arrivals.put(idx[n], k[None], v[None], done)
        got = self.client.kv._fetch_layers_shm(
            torch, self.client._shm_channel(), ns, [j for _, j in layers], t, h, d, src,
            self.dtype, "hnd", self.device, self.model_id, None, on_layer=hand_over)
        if got is None:  # CUDA would not register the mapping: layer by layer
            for i, j in layers:
                if not arrivals.pending(i):
                    continue
                k, v = self._fetch_layer(ns, j)
                done = torch.cuda.Event()
                done.record()
                arrivals.put(i, k, v, done)

    def _tp_share(self, heads: int) -> tuple[int, int]:
        """(first, count) of this rank's K/V heads."""
        from .kvprefix import tp_heads
        return tp_heads(heads, *self.tp)

    def _fetch_layer(self, ns: str, j: int):
        """Layer j of namespace ns as ([1, H, T, D], [1, H, T, D]) tensors in the model's dtype
        on its device (tp_size > 1: this rank's heads)."""
        dev = self.device
        if self.tp[1] > 1:
            _, h, _ = self._layer_shape(ns)
            k, v = self.client.kv.fetch_layer(ns, j, layout="hnd", model=self.model_id,
                                              heads=self._tp_share(h), as_torch=True)
            return (k.to(dev, self.dtype)[None].contiguous(),
                    v.to(dev, self.dtype)[None].contiguous())
        if self.client._shm_channel() is None and self.codec in LOSSLESS:
            return self._fetch_layer_raw(ns, j)
        if dev.type == "cuda":
            k, v = self.client.kv.fetch_layer(ns, j, layout="hnd", model=self.model_id,
                                              device=dev)
        else:
            k, v = self.client.kv.fetch_layer(ns, j, layout="hnd", model=self.model_id,
                                              raw=True, as_torch=True)
        return (k.to(dev, self.dtype)[None].contiguous(), v.to(dev, self.dtype)[None].contiguous())

    def _fetch_layer_raw(self, ns: str, j: int):
        """TCP with a lossless codec: the stored rows (V.FETCH RAW) viewed as a tensor of the
        codec's dtype, moved to the device and laid out there — no host-side decode."""
        torch = _torch()
        t, h, d = self._layer_shape(ns)
        kd, vd = self.client.execute_many([
            ("V.FETCH", ns + sfx, "RANGE", j * t, (j + 1) * t, "RAW", "MODEL", self.model_id)
            for sfx in ("_pk", "_pv")])
        self.client.last_fetch_path = "tcp"
        out = []
        for data in (kd, vd):
            with warnings.catch_warnings():  # read-only reply bytes: copied to the device next
                warnings.simplefilter("ignore")
                x = torch.frombuffer(data, dtype=torch_dtype(torch, self.codec))
            x = x.to(self.device).view(t, h, d).transpose(0, 1)
            out.append(x.to(self.dtype)[None].contiguous())
        return out[0], out[1]


# ---- Stage 2 --------------------------------------------------------------------------------

_ACTIVE: contextvars.ContextVar = contextvars.ContextVar("pion_offload", default=None)


def _offset_layer_class():
    from transformers.cache_utils import DynamicLayer

    class PrefixOffsetLayer(DynamicLayer):
        """A full-attention cache layer whose first `offset` tokens live in Pion: it keeps
        only the tokens after them and reports positions past the prefix."""

        def __init__(self, offset: int):
            super().__init__()
            self.offset = offset

        def get_seq_length(self) -> int:
            return self.offset + super().get_seq_length()

        def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
            return self.get_seq_length() + query_length, 0

    return PrefixOffsetLayer


@dataclass
class SparseAuto:
    """Sparse Stage 2 for decode steps: each offloaded layer's query at one new position attends
    the prefix blocks ATTEND.PREFIX.QUERY_SPARSE_AUTO_FUSED picks (`select` "mean" or "quest";
    `shared`: the query heads of one K/V head choose together) plus the local suffix, densely;
    steps with several query positions (a prompt's suffix) stay exact (QUERY_FUSED).

    `budget` is the share of the prefix's blocks of `block_size` rows attended, the first and
    last included (k_top = ceil(budget · blocks) − 2, at least 0). `dense_layers`: model layer
    indexes kept exact (Quest keeps its first two). `recent`: blocks before the last always
    among those attended (counted in the budget): a decode step's local context. `receipts`: a list to which every sparse
    call appends (model layer index, receipt) — the blocks chosen, the omitted-mass estimate
    and its bound; with `audit` the receipt also has `omitted_mass_exact` (the server scores
    every prefix key once more: costlier than the sparse step it audits — sample it).
    `observe(layer_idx, q, k_suf, v_suf, result)`, when given, sees every sparse call (q [H_q, D],
    k_suf/v_suf [H_kv, S, D] fp32 tensors; result an AttendResult, with its receipt when
    `receipts` is a list) — e.g. to compute the true omitted mass densely."""
    block_size: int = 64
    budget: float = 1 / 8
    select: str = "mean"
    shared: bool = False
    dense_layers: tuple = ()
    recent: int = 0
    receipts: list | None = None
    audit: bool = False
    observe: Any = None

    def k_top(self, prefix_rows: int) -> int:
        blocks = -(-prefix_rows // self.block_size)
        return max(0, int(np.ceil(self.budget * blocks)) - 2)


@dataclass
class _Session:
    sid: str
    layers: dict[int, int]  # model layer index -> slot layer
    window: int = 0
    sparse: SparseAuto | None = None
    prefix_rows: int = 0


def _pion_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                    **kwargs):
    """The "pion" attention: an offloaded layer's queries go to QUERY_FUSED with the local
    (post-prefix) K/V; every other layer runs torch SDPA."""
    sess = _ACTIVE.get()
    slot = None if sess is None else sess[0].layers.get(getattr(module, "layer_idx", -1))
    if slot is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward
        return sdpa_attention_forward(module, query, key, value, attention_mask,
                                      scaling=scaling, dropout=dropout, **kwargs)
    s, client = sess
    torch = _torch()
    if query.shape[0] != 1:
        raise ValueError("Pion attention offload handles batch size 1")
    d = query.shape[-1]
    if scaling is not None and abs(scaling - d ** -0.5) > 1e-6 * d ** -0.5:
        raise NotImplementedError("Pion attention uses the 1/sqrt(head_dim) scale; this layer "
                                  "scales by %r" % scaling)
    q = query[0].float()  # [Hq, M, D]: the last M of the local (post-prefix) positions
    sp = s.sparse
    layer_idx = getattr(module, "layer_idx", -1)
    if sp is not None and q.shape[1] == 1 and layer_idx not in sp.dense_layers:
        k_suf, v_suf = key[0].float(), value[0].float()
        res = client.attend.query_sparse_auto_fused(
            s.sid, slot, q[:, 0], k_suf, v_suf, sp.block_size, sp.k_top(s.prefix_rows),
            window=s.window, select=sp.select, shared=sp.shared,
            recent=min(sp.recent, sp.k_top(s.prefix_rows)),
            receipt="audit" if sp.audit else sp.receipts is not None)
        if sp.receipts is not None:
            sp.receipts.append((layer_idx, res.receipt))
        if sp.observe is not None:
            sp.observe(layer_idx, q[:, 0], k_suf, v_suf, res)
    else:
        res = client.attend.query_fused(s.sid, slot, q, key[0].float(), value[0].float(),
                                        window=s.window)
    out = np.ascontiguousarray(_wire.to_numpy(res.out).reshape(q.shape))
    out = torch.from_numpy(out).to(query.device, query.dtype)
    return out.transpose(0, 1)[None].contiguous(), None  # [1, M, Hq, D]


class PionAttentionOffload:
    """Stage 2 on top of a PionPromptCache: the prefix K/V of the full-attention layers stay
    in Pion (ATTEND.PREFIX slots bound FROM the prefix's namespace: no bytes move) and those
    layers' attention runs there, exact, through QUERY_FUSED — or, with `sparse` (SparseAuto),
    decode steps over a block selection of the prefix. Registers the "pion" attention
    implementation and sets it on the model."""

    def __init__(self, prompt_cache: PionPromptCache, sparse: SparseAuto | None = None):
        from transformers import AttentionInterface
        self.pc = prompt_cache
        AttentionInterface.register("pion", _pion_attention)
        try:  # the layers that stay local get SDPA's masks
            from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
            AttentionMaskInterface.register("pion", sdpa_mask)
        except ImportError:
            pass
        model = prompt_cache.model
        if hasattr(model, "set_attn_implementation"):
            model.set_attn_implementation("pion")
        else:
            model.config._attn_implementation = "pion"
        self.sessions: dict[int, _Session] = {}
        self.sparse = sparse  # read by prepare: a cache keeps the mode it was prepared with

    def prepare(self, prefix_ids, namespace: str | None = None):
        """Makes sure the prefix is stored (prefilling on a miss), binds its full-attention
        layers as slots, and returns a cache whose full-attention layers hold no prefix K/V
        (the other layers are filled as in Stage 1). Use it inside `session(cache)`."""
        from transformers.cache_utils import DynamicCache
        pc = self.pc
        ids = pc._ids(prefix_ids)
        base, pos = pc._identity(ids, namespace)
        pc._release_retired()
        if not pc._complete(base, pos):
            pc.prefill_and_store(ids, base)
        full = pc.plan.groups.get("full", [])
        sid = pc._slot_sid(base, "full")
        # Slots already resident (an earlier request of this prefix) are reused; the others
        # are bound from the namespace inside the server.
        bind_ms = pc.bind(base, "full", pos) if full else 0.0
        # The other layers (sliding-window, recurrent) are filled locally, as in Stage 1.
        cache = DynamicCache(config=pc.model.config)
        pc._fill_attention(cache, base, int(ids.numel()), [g for g in pc.plan.groups
                                                           if g != "full"], pos)
        states = pc._fetch_states(base)
        if states is None:
            raise RuntimeError("the recurrent states of prefix %r are gone from Pion" % base)
        pc._fill_states(cache, states)
        offset_cls = _offset_layer_class()
        for i in full:
            cache.layers[i] = offset_cls(int(ids.numel()))
        self.sessions[id(cache)] = _Session(sid, {i: j for j, i in enumerate(full)},
                                            sparse=self.sparse, prefix_rows=int(ids.numel()))
        pc.last = dict(pc.last, bind_ms=bind_ms, stage=2)
        return cache

    @contextlib.contextmanager
    def session(self, cache):
        """Routes the offloaded layers' attention to Pion while the block runs."""
        s = self.sessions[id(cache)]
        token = _ACTIVE.set((s, self.pc.client))
        try:
            yield cache
        finally:
            _ACTIVE.reset(token)

    def release(self, cache) -> None:
        s = self.sessions.pop(id(cache), None)
        if s is not None:
            self.pc.client.attend.drop(s.sid)


__all__ = ["PionPromptCache", "PionAttentionOffload", "SparseAuto", "model_identity",
           "position_digest", "prefix_digest"]
