"""A client of a Pion cluster (issue 30): routes every command by its key's hash slot, as Redis
Cluster clients do, to one `pion.Client` per node — so the typed helpers (c.v, c.kv, c.attend,
c.ssm, c.state) and, for nodes on this host, the shared-memory path work across nodes.

    import pion
    cc = pion.ClusterClient([("127.0.0.1", 7001)],
                            unix_sockets={"127.0.0.1:7001": "/tmp/pion-1.sock"})  # optional
    cc.kv.register("{doc9}", 32, 4096, 8, 128, "fp16")   # hash tags keep a namespace together
    cc.kv.store_layer("{doc9}", 0, k, v)
    k0, v0 = cc.kv.fetch_layer("{doc9}", 0)             # shared memory when that node is local

Routing: the slot map comes from CLUSTER SLOTS of any reachable node; -MOVED updates it and
the command goes to the node named; -ASK (a slot whose keys are moving) is followed exactly by
execute() (ASKING then the command on one connection) and waited out by the typed helpers,
which retry for up to `ask_wait` seconds (a key in flight arrives within milliseconds; the
move of a slot's keys ends soon after); -TRYAGAIN and -CLUSTERDOWN are retried likewise. A node
that cannot be reached makes the client re-read the map from the others (fail-over).
"""
from __future__ import annotations

import threading
import time

import redis

from . import errors
from .client import Client

SLOTS = 16384


def _crc16(data: bytes) -> int:
    crc = 0
    for b in data:
        crc ^= b << 8
        for _ in range(8):
            crc = ((crc << 1) ^ 0x1021) & 0xFFFF if crc & 0x8000 else (crc << 1) & 0xFFFF
    return crc


def key_slot(key) -> int:
    """Redis Cluster's slot of a key: CRC16 of its {hash tag} (when non-empty) or of itself."""
    k = key.encode() if isinstance(key, str) else bytes(key)
    start = k.find(b"{")
    if start >= 0:
        end = k.find(b"}", start + 1)
        if end > start + 1:
            k = k[start + 1:end]
    return _crc16(k) % SLOTS


class _Redirect(Exception):
    pass


class _Routed:
    """A family (v, kv, attend, ssm, state) whose methods route by their first argument."""

    def __init__(self, cluster: "ClusterClient", family: str):
        self._cluster, self._family = cluster, family

    def __getattr__(self, method):
        def call(key, *args, **kwargs):
            return self._cluster._route(key, lambda c: getattr(getattr(c, self._family), method)(
                key, *args, **kwargs))
        call.__name__ = method
        return call


class ClusterClient:
    """Args:
      startup_nodes: (host, port) pairs; any one reachable node is enough.
      unix_sockets: {"host:port": socket path} for nodes on this host started with
        --unixsocket: their client uses it (and shared memory for raw range fetches).
      ask_wait: seconds the typed helpers keep retrying a slot whose keys are moving.
      **client_kwargs: passed to each node's pion.Client (password, socket_timeout, ...).
    """

    def __init__(self, startup_nodes, unix_sockets: dict | None = None, ask_wait: float = 5.0,
                 **client_kwargs):
        self._startup = [(h, int(p)) for h, p in startup_nodes]
        self._unix = dict(unix_sockets or {})
        self._kwargs = client_kwargs
        self._ask_wait = ask_wait
        self._lock = threading.Lock()
        self._clients: dict[str, Client] = {}
        self._slots: list[str | None] = [None] * SLOTS
        self.refresh()
        self.state = _Routed(self, "state")
        self.v = _Routed(self, "v")
        self.kv = _Routed(self, "kv")
        self.attend = _Routed(self, "attend")
        self.ssm = _Routed(self, "ssm")

    # --- topology -------------------------------------------------------------------------
    def node(self, addr: str) -> Client:
        """The pion.Client of the node at "host:port"."""
        with self._lock:
            c = self._clients.get(addr)
            if c is None:
                host, port = addr.rsplit(":", 1)
                if addr in self._unix:
                    c = Client(unix_socket_path=self._unix[addr], **self._kwargs)
                else:
                    c = Client(host=host, port=int(port), **self._kwargs)
                self._clients[addr] = c
            return c

    def refresh(self) -> None:
        """Reads the slot map (CLUSTER SLOTS) from the first node that answers."""
        candidates = [a for a in dict.fromkeys(
            ["%s:%d" % hp for hp in self._startup] + [a for a in self._slots if a])]
        last = None
        for addr in candidates:
            try:
                reply = self.node(addr).execute("CLUSTER", "SLOTS")
            except errors.PionError as e:
                last = e
                continue
            slots: list[str | None] = [None] * SLOTS
            for r in reply:
                host = r[2][0].decode() if isinstance(r[2][0], bytes) else r[2][0]
                owner = "%s:%d" % (host, r[2][1])
                for s in range(int(r[0]), int(r[1]) + 1):
                    slots[s] = owner
            self._slots = slots
            return
        raise errors.PionConnectionError("no cluster node answered CLUSTER SLOTS: %s" % last)

    def node_for(self, key) -> Client:
        addr = self._slots[key_slot(key)]
        if addr is None:
            self.refresh()
            addr = self._slots[key_slot(key)]
            if addr is None:
                raise errors.PionError("CLUSTERDOWN slot %d is not served" % key_slot(key))
        return self.node(addr)

    # --- commands -------------------------------------------------------------------------
    def _route(self, key, fn, asking_fn=None):
        deadline = time.monotonic() + self._ask_wait
        while True:
            client = self.node_for(key)
            try:
                return fn(client)
            except errors.PionConnectionError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
                try:
                    self.refresh()
                except errors.PionConnectionError:
                    pass
            except errors.PionError as e:
                text = str(e)
                word = text.split(" ", 1)[0]
                if word == "MOVED":
                    _, slot, addr = text.split()[:3]
                    self._slots[int(slot)] = addr
                    continue
                if word == "ASK" and asking_fn is not None:
                    # The old owner may send it on to the new one (a key that is nowhere yet).
                    for _hop in range(4):
                        try:
                            return asking_fn(self.node(text.split()[2]))
                        except errors.PionError as again:
                            text = str(again)
                            if text.split(" ", 1)[0] != "ASK":
                                raise
                    raise
                if word in ("ASK", "TRYAGAIN", "CLUSTERDOWN") and time.monotonic() < deadline:
                    time.sleep(0.02)
                    if word == "CLUSTERDOWN":
                        self.refresh()
                    continue
                raise

    def execute(self, *args):
        """One command, routed by its first argument (the key of every Pion command that has
        one); -ASK is followed with ASKING on the same connection."""
        def asking(c: Client):
            pipe = c.redis.pipeline(transaction=False)
            pipe.execute_command("ASKING")
            pipe.execute_command(*args)
            try:
                return pipe.execute()[1]
            except redis.RedisError as e:
                raise errors.from_redis(e) from e
        return self._route(args[1], lambda c: c.execute(*args), asking)

    def close(self) -> None:
        for c in self._clients.values():
            c.close()
