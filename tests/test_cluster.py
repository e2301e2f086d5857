"""Pion as a cluster (issue 30): etcd holds membership, the slot map and leases; unmodified Redis
Cluster clients route.

Every test starts its own etcd (loopback, a temporary data directory, free ports) and its own
nodes (`--cluster etcd://127.0.0.1:PORT`), and stops them all. Skipped only when etcd is not
installed (scripts/install-deps.sh installs etcd-server).

- three nodes: redis-py's RedisCluster stores and fetches 1,000 namespaces across them,
  byte-exact; `redis-cli -c` follows -MOVED; key slots equal redis-py's own CRC16; -CROSSSLOT;
- kill -9 of a node: within the lease TTL + 5 s every saved namespace it held is a HIT on its
  replica, byte-exact; nothing unsaved is a hit anywhere; a namespace dropped meanwhile stays
  dropped when the killed node comes back and rejoins;
- a node joining under load: no request fails (redis-py follows -ASK and -MOVED), every
  namespace is where the counts say;
- etcd down: nodes keep serving their slots; map changes are refused with -CLUSTERDOWN; etcd
  back: they are accepted again;
- etcd restarted (kill -9) under open watches: every node opens its watch again, and a slot-map
  change made after the restart reaches a node that nobody tells, through that watch.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import threading
import time
import urllib.request

import numpy as np
import pytest
import redis
from redis.cluster import RedisCluster, ClusterNode
from redis.crc import key_slot

from pionlib import HOST, _LIVE, _die_with_parent, _stop_process, free_port, wait_for

ETCD = shutil.which("etcd")
pytestmark = pytest.mark.skipif(ETCD is None, reason="etcd is not installed "
                                "(scripts/install-deps.sh installs etcd-server)")

TTL = 3  # --cluster-lease-ttl of the test nodes (seconds)
LAYERS, TOKENS, HEADS, DIM = 1, 64, 1, 8  # a small namespace: 64 rows of 8 fp32 per session


class Etcd:
    """One etcd member on loopback ports, data under `workdir`."""

    def __init__(self, workdir):
        self.workdir = workdir
        self.data = workdir / "etcd-data"
        self.port = 0
        self.proc = None

    def start(self) -> "Etcd":
        if not self.port:
            self.port, self.peer = free_port(), free_port()
        log = open(self.workdir / "etcd.log", "ab")
        url, peer = "http://%s:%d" % (HOST, self.port), "http://%s:%d" % (HOST, self.peer)
        self.proc = subprocess.Popen(
            [ETCD, "--name", "t", "--data-dir", str(self.data), "--listen-client-urls", url,
             "--advertise-client-urls", url, "--listen-peer-urls", peer,
             "--initial-advertise-peer-urls", peer, "--initial-cluster", "t=" + peer,
             "--log-level", "warn"],
            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
            preexec_fn=_die_with_parent)
        log.close()
        _LIVE.add(self.proc)
        wait_for(self.healthy, timeout=15, what="etcd to answer")
        return self

    def healthy(self) -> bool:
        try:
            body = json.dumps({"key": "eA=="}).encode()
            req = urllib.request.Request("http://%s:%d/v3/kv/range" % (HOST, self.port), body)
            with urllib.request.urlopen(req, timeout=1) as r:
                return r.status == 200
        except OSError:
            return False

    def stop(self, sig=signal.SIGTERM) -> None:
        if self.proc is not None:
            _stop_process(self.proc, sig)
            self.proc = None

    @property
    def url(self) -> str:
        return "etcd://%s:%d" % (HOST, self.port)


@pytest.fixture
def etcd(tmp_path):
    e = Etcd(tmp_path).start()
    try:
        yield e
    finally:
        e.stop()


class Cluster:
    def __init__(self, factory, etcd: Etcd):
        self.factory = factory
        self.etcd = etcd
        self.nodes: dict[str, object] = {}

    def add(self, node_id: str, *extra: str):
        srv = self.factory("--workers", "2", "--cluster", self.etcd.url, "--node-id", node_id,
                           "--cluster-lease-ttl", str(TTL), "--replicas", "1", *extra)
        self.nodes[node_id] = srv
        return srv

    def live(self):
        return [s for s in self.nodes.values() if s.alive()]

    def info(self, srv) -> dict[str, str]:
        text = srv.client().execute_command("CLUSTER", "INFO").decode()
        return dict(line.split(":", 1) for line in text.strip().splitlines())

    def settled(self) -> bool:
        live = self.live()
        infos = [self.info(s) for s in live]
        return (all(i["cluster_state"] == "ok" and i["cluster_slots_migrating"] == "0"
                    and i["cluster_known_nodes"] == str(len(live))
                    and int(i["cluster_my_slots"]) > 0 for i in infos)
                and len({i["cluster_current_epoch"] for i in infos}) == 1)

    def wait_settled(self, timeout=30):
        wait_for(self.settled, timeout=timeout, interval=0.1, what="the slot map to settle")

    def client(self, **kw) -> RedisCluster:
        nodes = [ClusterNode(HOST, s.port) for s in self.live()]
        return RedisCluster(startup_nodes=nodes, socket_timeout=20, **kw)

    def owner_of(self, key: str):
        """The live node whose CLUSTER SLOTS says it owns key's slot."""
        slot = key_slot(key.encode())
        for r in self.live()[0].client().execute_command("CLUSTER", "SLOTS"):
            if r[0] <= slot <= r[1]:
                port = r[2][1]
                return next(s for s in self.live() if s.port == port)
        raise AssertionError("no owner for slot %d" % slot)


@pytest.fixture
def cluster(pion_factory, etcd):
    return Cluster(pion_factory, etcd)


def rows(seed: int) -> tuple[bytes, bytes]:
    rng = np.random.default_rng(seed)
    k = rng.standard_normal((LAYERS * TOKENS, HEADS * DIM)).astype(np.float32)
    v = rng.standard_normal((LAYERS * TOKENS, HEADS * DIM)).astype(np.float32)
    return k.tobytes(), v.tobytes()


def store_prefix(rc, ns: str, seed: int) -> None:
    k, v = rows(seed)
    assert rc.execute_command("KV.PREFIX.REGISTER", ns, LAYERS, TOKENS, HEADS, DIM, "fp32") == b"OK"
    assert rc.execute_command("V.STOREBATCH", ns + "_pk", 0, k) == LAYERS * TOKENS
    assert rc.execute_command("V.STOREBATCH", ns + "_pv", 0, v) == LAYERS * TOKENS


def check_prefix(rc, ns: str, seed: int) -> None:
    k, v = rows(seed)
    assert rc.execute_command("KV.PREFIX.LOOKUP", ns) == b"HIT", ns
    assert rc.execute_command("V.FETCH", ns + "_pk", "RANGE", 0, LAYERS * TOKENS, "RAW") == k, ns
    assert rc.execute_command("V.FETCH", ns + "_pv", "RANGE", 0, LAYERS * TOKENS, "RAW") == v, ns


def owned_counts(cluster: Cluster, names) -> dict[str, int]:
    """Per node, the namespaces it holds in the slots it owns (CLUSTER COUNTKEYSINSLOT on the
    owner of each slot the names use): every one must be exactly where its slot is served."""
    owner = {}
    for r in cluster.live()[0].client().execute_command("CLUSTER", "SLOTS"):
        for s in range(r[0], r[1] + 1):
            owner[s] = r[2][2].decode()
    out = {nid: 0 for nid, s in cluster.nodes.items() if s.alive()}
    for slot in sorted({key_slot(n.encode()) for n in names}):
        nid = owner[slot]
        out[nid] += cluster.nodes[nid].client().execute_command("CLUSTER", "COUNTKEYSINSLOT", slot)
    return out


def prefix_counts(cluster: Cluster) -> dict[str, int]:
    out = {}
    for nid, s in cluster.nodes.items():
        if s.alive():
            info = s.client().execute_command("KV.PREFIX.INFO")
            out[nid] = dict(zip(info[::2], info[1::2]))[b"prefixes"]
    return out


@pytest.mark.time_limit(150)
def test_three_nodes_route_redis_cluster_clients(cluster):
    for nid in ("n1", "n2", "n3"):
        cluster.add(nid)
    cluster.wait_settled()
    rc = cluster.client()
    n = 1000
    for i in range(n):
        store_prefix(rc, "{doc%d}" % i, i)
    for i in range(n):
        check_prefix(rc, "{doc%d}" % i, i)
    counts = owned_counts(cluster, ["{doc%d}" % i for i in range(n)])
    assert sum(counts.values()) == n, counts
    assert all(c > 200 for c in counts.values()), counts  # spread over all three

    # Key slots are Redis' (redis-py's own CRC16), hash tags included.
    a = cluster.live()[0].client()
    for key in ["foo", "{doc7}_pk", "x{y}z", "{}q", "a{b}{c}", "ü"]:
        assert a.execute_command("CLUSTER", "KEYSLOT", key) == key_slot(key.encode())
    # CLUSTER SLOTS covers every slot once; SHARDS and NODES agree on the owners.
    slots = a.execute_command("CLUSTER", "SLOTS")
    assert sum(r[1] - r[0] + 1 for r in slots) == 16384
    assert len(a.execute_command("CLUSTER", "SHARDS")) == 3
    assert a.execute_command("CLUSTER", "NODES").decode().count("master") == 3

    # redis-cli -c follows -MOVED; without -c the redirection is what it prints.
    ns = next("{doc%d}" % i for i in range(n) if cluster.owner_of("{doc%d}" % i) is not cluster.live()[0])
    first = cluster.live()[0]
    out = subprocess.run(["redis-cli", "-c", "-h", HOST, "-p", str(first.port), "KV.PREFIX.LOOKUP", ns],
                         capture_output=True, text=True, timeout=10).stdout
    assert out.strip() == "HIT", out
    out = subprocess.run(["redis-cli", "-h", HOST, "-p", str(first.port), "KV.PREFIX.LOOKUP", ns],
                         capture_output=True, text=True, timeout=10).stdout
    owner = cluster.owner_of(ns)
    assert out.strip() == "MOVED %d %s:%d" % (key_slot(ns.encode()), HOST, owner.port), out

    # Clear errors: keys of two slots in one command; a namespace whose sessions would land
    # elsewhere; CLUSTER misuse.
    with pytest.raises(redis.ResponseError, match="CROSSSLOT"):
        owner.client().execute_command("ATTEND.PREFIX.STORE", ns, 0, "FROM", "{other}")
    with pytest.raises(redis.ResponseError, match="hash tag"):
        rc.execute_command("KV.PREFIX.REGISTER", "plainname", 1, 64, 1, 8, "fp32")
    with pytest.raises(redis.ResponseError, match="out of range slot"):
        a.execute_command("CLUSTER", "SETSLOT", 16384, "NODE", "n1")
    with pytest.raises(redis.ResponseError, match="Unknown node"):
        a.execute_command("CLUSTER", "SETSLOT", 1, "NODE", "nobody")
    with pytest.raises(redis.ResponseError, match=r"CLUSTER.PUT takes MORE only after FROM"):
        a.execute_command("CLUSTER.PUT", "PREFIX", "default", "{x}", 1, b"file", "MORE")
    rc.close()


def kill_and_wait_served(cluster: Cluster, victim, check, what: str, meanwhile=None) -> float:
    """kill -9 of `victim` (then `meanwhile()`, before its lease expires), then waits (lease TTL
    + 5 s at most) until `check(rc)` passes on a fresh RedisCluster client; returns the seconds
    it took."""
    victim.stop(signal.SIGKILL)
    t0 = time.monotonic()
    if meanwhile is not None:
        meanwhile()

    def served():
        try:
            c = cluster.client()
            try:
                check(c)
            finally:
                c.close()
            return True
        except (redis.RedisError, AssertionError, OSError):
            return False

    wait_for(served, timeout=TTL + 5, interval=0.2, what=what)
    return time.monotonic() - t0


@pytest.mark.time_limit(150)
def test_kill_fails_over_saved_prefixes_to_the_replica(cluster):
    for nid in ("n1", "n2", "n3"):
        cluster.add(nid)
    cluster.wait_settled()
    rc = cluster.client()
    saved = ["{s%d}" % i for i in range(90)]
    unsaved = ["{u%d}" % i for i in range(30)]
    for i, ns in enumerate(saved):
        store_prefix(rc, ns, i)
        assert rc.execute_command("KV.PREFIX.SAVE", ns) == b"OK"
    for i, ns in enumerate(unsaved):
        store_prefix(rc, ns, 1000 + i)
    victim = cluster.nodes["n2"]
    held = [ns for ns in saved if cluster.owner_of(ns) is victim]
    held_unsaved = [ns for ns in unsaved if cluster.owner_of(ns) is victim]
    assert len(held) > 10 and held_unsaved, (len(held), held_unsaved)
    rc.close()

    failover_s = kill_and_wait_served(
        cluster, victim, lambda c: [check_prefix(c, ns, saved.index(ns)) for ns in held],
        "the victim's saved prefixes on its replica")
    rc = cluster.client()
    for ns in held_unsaved:  # never saved: nowhere a hit
        assert rc.execute_command("KV.PREFIX.LOOKUP", ns) == b"MISS", ns
    for ns in saved:
        check_prefix(rc, ns, saved.index(ns))
    # Dropped while the victim is away: its old copy must not come back.
    gone = held[0]
    assert rc.execute_command("KV.PREFIX.DROP", gone) == 1
    rc.close()

    victim.start()  # same --dir: its stale files are there
    cluster.wait_settled()
    rc = cluster.client()
    assert int(cluster.info(victim)["cluster_my_slots"]) > 0  # it rejoined and took a share
    assert rc.execute_command("KV.PREFIX.LOOKUP", gone) == b"MISS"
    for ns in saved:
        if ns != gone:
            check_prefix(rc, ns, saved.index(ns))
    for ns in held_unsaved:
        assert rc.execute_command("KV.PREFIX.LOOKUP", ns) == b"MISS", ns
    rc.close()
    print("fail-over after kill -9: %.2f s (lease TTL %d s)" % (failover_s, TTL))


def join_n3_under_load(cluster: Cluster, step) -> list:
    """Runs `step(rc, i, created)` (one write and a read back; it returns what it created) in a
    loop on a RedisCluster client while node n3 joins and the map settles. Returns what was
    created; fails with the first error any step met."""
    done = threading.Event()
    errors: list[str] = []
    created: list = []

    def load():
        rc = cluster.client()
        i = 0
        try:
            while not done.is_set():
                try:
                    created.append(step(rc, i, created))
                except Exception as e:  # noqa: BLE001 - any failure is the finding
                    errors.append("step %d: %r" % (i, e))
                    return
                i += 1
        finally:
            rc.close()

    t = threading.Thread(target=load)
    t.start()
    time.sleep(1.0)
    cluster.add("n3")
    try:
        cluster.wait_settled(timeout=60)
        time.sleep(0.5)
    finally:
        done.set()
        t.join(timeout=30)
    assert not errors, errors[:3]
    return created


@pytest.mark.time_limit(150)
def test_node_joining_under_load_fails_no_request(cluster):
    cluster.add("n1")
    cluster.add("n2")
    cluster.wait_settled()

    def step(rc, i, created):
        ns = "{j%d}" % i
        store_prefix(rc, ns, i)
        if i % 3 == 0:
            assert rc.execute_command("KV.PREFIX.SAVE", ns) == b"OK"
        j = (created + [i])[(i * 7919) % (len(created) + 1)]  # an earlier one reads back
        check_prefix(rc, "{j%d}" % j, j)
        return i

    created = join_n3_under_load(cluster, step)
    assert len(created) > 50, len(created)
    counts = owned_counts(cluster, ["{j%d}" % i for i in created])
    assert sum(counts.values()) == len(created), (counts, len(created))
    assert counts["n3"] > 0, counts
    rc = cluster.client()
    for i in created:
        check_prefix(rc, "{j%d}" % i, i)
    rc.close()


@pytest.mark.time_limit(120)
def test_etcd_down_keeps_serving_and_refuses_map_changes(cluster, etcd):
    for nid in ("n1", "n2", "n3"):
        cluster.add(nid)
    cluster.wait_settled()
    rc = cluster.client()
    for i in range(60):
        store_prefix(rc, "{e%d}" % i, i)
    etcd.stop(signal.SIGKILL)
    a = cluster.nodes["n1"]
    wait_for(lambda: cluster.info(a)["cluster_etcd"] == "down", timeout=10, what="etcd noticed down")
    # Serving goes on: reads, writes, saves (replication is node to node).
    for i in range(60):
        check_prefix(rc, "{e%d}" % i, i)
    store_prefix(rc, "{late}", 77)
    assert rc.execute_command("KV.PREFIX.SAVE", "{late}") == b"OK"
    # Map changes are refused, saying why.
    slot = key_slot(b"{late}")
    other = next(n for n in ("n1", "n2", "n3") if cluster.owner_of("{late}") is not cluster.nodes[n])
    with pytest.raises(redis.ResponseError, match=r"CLUSTERDOWN etcd at .* the slot map"):
        a.client().execute_command("CLUSTER", "SETSLOT", slot, "NODE", other)
    # CLUSTER INFO stays `key:value` lines while the error names host:port and its causes
    # (issue 51): redis-py's own parser (split on every ':') reads it, on a node and through
    # RedisCluster, and the error is there, on one line, without a ':'.
    parsed = a.client().cluster("INFO")
    assert parsed["cluster_etcd"] == "down", parsed
    err = parsed["cluster_etcd_last_error"]
    assert err.startswith("etcd at %s#%d " % (HOST, etcd.port)) and "unreachable" in err, err
    assert ":" not in err and "\n" not in err and "\r" not in err, err
    for info in rc.cluster_info(target_nodes=RedisCluster.ALL_NODES).values():
        assert info["cluster_etcd"] == "down" and info["cluster_etcd_last_error"], info
    # Nor can a node join: it does not start, and says why.
    with pytest.raises(RuntimeError, match=r"cannot join the cluster: etcd at .* unreachable"):
        cluster.factory("--cluster", cluster.etcd.url, "--node-id", "late")
    time.sleep(TTL + 1)  # past the lease TTL: nobody lost its slots while etcd was away
    for i in range(60):
        check_prefix(rc, "{e%d}" % i, i)

    etcd.start()
    wait_for(lambda: all(cluster.info(s)["cluster_etcd"] == "up" for s in cluster.live()),
             timeout=15, what="etcd up again")
    assert a.client().execute_command("CLUSTER", "SETSLOT", slot, "NODE", other) == b"OK"
    wait_for(lambda: cluster.owner_of("{late}") is cluster.nodes[other], timeout=15,
             what="the slot to move")
    rc.close()
    rc = cluster.client()
    check_prefix(rc, "{late}", 77)
    for i in range(60):
        check_prefix(rc, "{e%d}" % i, i)
    rc.close()


@pytest.mark.time_limit(120)
def test_watch_reopens_after_an_etcd_restart(cluster, etcd):
    """kill -9 of etcd and a restart while every node watches /pion/pion/: each node's watch
    breaks and opens again once etcd is back (its log says so, with etcd's revision), and a
    slot-map change made after the restart reaches n3 — which no node tells: the change is
    n1's, the slot goes to n2 — through the reopened watch: n3's log names the map's PUT that
    its watch delivered (the keeper's 500 ms re-read would update the map without it)."""
    for nid in ("n1", "n2"):
        cluster.add(nid)
    n3 = cluster.add("n3", "--loglevel", "debug")
    cluster.wait_settled()
    n1 = cluster.nodes["n1"]
    opened = "cluster: watch on /pion/pion/ open at etcd %s:%d" % (HOST, etcd.port)
    wait_for(lambda: all(s.log_text().count(opened) == 1 for s in cluster.live()), timeout=10,
             what="every node's watch to open")
    rc = cluster.client()
    for i in range(30):
        store_prefix(rc, "{w%d}" % i, i)
        assert rc.execute_command("KV.PREFIX.SAVE", "{w%d}" % i) == b"OK"

    etcd.stop(signal.SIGKILL)
    wait_for(lambda: all(cluster.info(s)["cluster_etcd"] == "down" for s in cluster.live()),
             timeout=10, what="etcd noticed down")
    etcd.start()
    wait_for(lambda: all(s.log_text().count(opened) == 2 for s in cluster.live()), timeout=15,
             what="every node's watch to open again")
    wait_for(lambda: all(cluster.info(s)["cluster_etcd"] == "up" for s in cluster.live()),
             timeout=15, what="etcd up again")
    assert "cluster: watch on /pion/pion/ ended: etcd at" in n3.log_text()

    slot = next(key_slot(("{w%d}" % i).encode()) for i in range(30)
                if cluster.owner_of("{w%d}" % i) is n1)
    mark = len(n3.log_text())
    assert n1.client().execute_command("CLUSTER", "SETSLOT", slot, "NODE", "n2") == b"OK"
    wait_for(lambda: "PUT /pion/pion/slots" in n3.log_text()[mark:], timeout=10,
             what="n3's watch to deliver the new map")

    def n3_routes_to_n2() -> bool:
        for r in n3.client().execute_command("CLUSTER", "SLOTS"):
            if r[0] <= slot <= r[1]:
                return r[2][2] == b"n2"
        return False

    wait_for(n3_routes_to_n2, timeout=10, what="n3 to route the slot to n2")
    cluster.wait_settled()
    rc.close()
    rc = cluster.client()
    for i in range(30):
        check_prefix(rc, "{w%d}" % i, i)
    rc.close()


@pytest.mark.time_limit(120)
def test_pion_cluster_client_typed_helpers_and_shared_memory(cluster, tmp_path):
    import sys
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parent.parent
                           / "clients" / "python"))
    import pion
    socks = {}
    for nid in ("n1", "n2", "n3"):
        path = str(tmp_path / ("%s.sock" % nid))
        srv = cluster.add(nid, "--unixsocket", path)
        socks["%s:%d" % (HOST, srv.port)] = path
    cluster.wait_settled()
    assert pion.key_slot("{doc7}_pk") == key_slot(b"{doc7}_pk")
    cc = pion.ClusterClient([(HOST, cluster.nodes["n1"].port)], unix_sockets=socks)
    tcp = pion.ClusterClient([(HOST, cluster.nodes["n2"].port)])
    rng = np.random.default_rng(5)
    used = set()
    for i in range(30):
        ns = "{py%d}" % i
        k = rng.standard_normal((TOKENS, HEADS, DIM)).astype(np.float32)
        v = rng.standard_normal((TOKENS, HEADS, DIM)).astype(np.float32)
        cc.kv.register(ns, 1, TOKENS, HEADS, DIM, "fp32")
        cc.kv.store_layer(ns, 0, k, v, n_tokens=TOKENS)
        assert tcp.kv.lookup(ns)
        for c, path in ((cc, "shm"), (tcp, "tcp")):
            k2, v2 = c.kv.fetch_layer(ns, 0)
            assert np.array_equal(k2, k) and np.array_equal(v2, v), ns
            assert c.node_for(ns).last_fetch_path == path
        used.add(cc.node_for(ns).redis.connection_pool.connection_kwargs.get("path"))
        assert cc.execute("KV.PREFIX.LOOKUP", ns) == b"HIT"
    assert len(used) == 3, used  # the namespaces went to all three nodes, each by its socket
    cc.close()
    tcp.close()


# ------------------------------------------------------------------------------------------
# The other families with saved objects: STATE slots, SSM.PREFIX sessions, ATTEND.PREFIX slots,
# sealed V.COMMIT snapshots — copied to the replica on save, served by it after a fail-over,
# moved with their slot on a join.
# ------------------------------------------------------------------------------------------

ST_BYTES, AT_N, AT_D, V_ROWS, V_DIM = 256, 16, 32, 100, 8


def blob(seed: int, n: int) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


def f32s(seed: int, *shape) -> bytes:
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32).tobytes()


def store_family_objects(rc, tag: str, seed: int, save: bool, change: bool = True,
                         vsession: bool = True) -> dict:
    """One object of each family under hash tag `tag` (without `vsession`, no V session and so
    no sealed snapshot); saved when `save` (then, with `change`, changed after the save: only the
    saved content may be served after a fail-over). Returns what a reader must get back."""
    st, ssm, at, vs = tag + "st", tag + "ssm", tag + "at", tag + "v"
    assert rc.execute_command("STATE.ALLOC", st, ST_BYTES) == b"OK"
    assert rc.execute_command("STATE.WRITE", st, 0, blob(seed, ST_BYTES)) == b"OK"
    for layer in (0, 1):
        assert rc.execute_command("SSM.PREFIX.STORE", ssm, layer, blob(seed + layer, 96)) == b"OK"
    q, answers = f32s(seed + 2, 1, AT_D), []
    for layer in (0, 1):  # two layers: a session moves as one, its layers together
        k, v = f32s(seed + layer, 1, AT_N, AT_D), f32s(seed + 1 + layer, 1, AT_N, AT_D)
        assert rc.execute_command("ATTEND.PREFIX.STORE", at, layer, 1, AT_N, AT_D, k, v) == b"OK"
        answers.append(rc.execute_command("ATTEND.PREFIX.QUERY", at, layer, 1, AT_D, 0, q))
    want = {"tag": tag, "seed": seed, "q": q, "answers": answers, "snap": None}
    if vsession:
        assert rc.execute_command("V.CREATE", vs, V_DIM, "fp32") == b"OK"
        assert rc.execute_command("V.STOREBATCH", vs, 0, f32s(seed, V_ROWS, V_DIM)) == V_ROWS
        want["snap"] = rc.execute_command("V.SNAPSHOT", vs)
        want["rows"] = rc.execute_command("V.FETCH", vs, "RANGE", 0, V_ROWS, "RAW")
    if not save:
        return want
    assert rc.execute_command("STATE.SAVE", st) == b"OK"
    assert rc.execute_command("SSM.PREFIX.SAVE", ssm) == b"OK"
    assert rc.execute_command("ATTEND.PREFIX.SAVE", at) == b"OK"
    if vsession:
        assert rc.execute_command("V.COMMIT", vs, want["snap"]) == b"OK"
        # A second sealed snapshot of the session, equal to the first.
        want["snap2"] = rc.execute_command("V.SNAPSHOT", vs)
        assert rc.execute_command("V.COMMIT", vs, want["snap2"]) == b"OK"
    if not change:
        return want
    # Changes after the saves: never on a replica.
    assert rc.execute_command("STATE.WRITE", st, 0, b"\xff" * 16) == b"OK"
    assert rc.execute_command("SSM.PREFIX.STORE", ssm, 0, b"later") == b"OK"
    k2 = f32s(seed + 9, 1, AT_N, AT_D)
    assert rc.execute_command("ATTEND.PREFIX.STORE", at, 0, 1, AT_N, AT_D, k2, v) == b"OK"
    return want


def check_objects(rc, want: dict) -> None:
    """What store_family_objects stored, byte-exact: as saved when it was changed after its save
    (only the saved content may be served after a fail-over), else as it is."""
    tag, seed = want["tag"], want["seed"]
    assert rc.execute_command("STATE.READ", tag + "st", 0, ST_BYTES) == blob(seed, ST_BYTES), tag
    for layer in (0, 1):
        got = rc.execute_command("SSM.PREFIX.FETCH", tag + "ssm", layer)
        assert got == blob(seed + layer, 96), (tag, layer)
    for layer in (0, 1):
        got = rc.execute_command("ATTEND.PREFIX.QUERY", tag + "at", layer, 1, AT_D, 0, want["q"])
        assert got == want["answers"][layer], (tag, layer)
    for snap in ("snap", "snap2"):
        if want.get(snap) is not None:
            assert rc.execute_command("V.RESTORE", tag + "v", want[snap]) == b"OK"
            got = rc.execute_command("V.FETCH", tag + "v", "RANGE", 0, V_ROWS, "RAW")
            assert got == want["rows"], (tag, snap)


def check_nothing_unsaved(rc, tag: str) -> None:
    with pytest.raises(redis.ResponseError, match="no such state slot"):
        rc.execute_command("STATE.READ", tag + "st", 0, 1)
    assert rc.execute_command("SSM.PREFIX.FETCH", tag + "ssm", 0) is None
    assert rc.execute_command("ATTEND.PREFIX.LOOKUP", tag + "at", 0) == b"MISS"
    with pytest.raises(redis.ResponseError, match="no such session|no snapshot"):
        rc.execute_command("V.RESTORE", tag + "v", 1)


@pytest.mark.time_limit(150)
def test_kill_fails_over_every_saved_family_to_the_replica(cluster):
    for nid in ("n1", "n2", "n3"):
        cluster.add(nid)
    cluster.wait_settled()
    rc = cluster.client()
    saved = [store_family_objects(rc, "{fs%d}" % i, 10 * i, True) for i in range(24)]
    unsaved = ["{fu%d}" % i for i in range(12)]
    for i, tag in enumerate(unsaved):
        store_family_objects(rc, tag, 5000 + i, False)
    victim = cluster.nodes["n2"]
    held = [w for w in saved if cluster.owner_of(w["tag"]) is victim]
    held_unsaved = [t for t in unsaved if cluster.owner_of(t) is victim]
    assert len(held) >= 3 and held_unsaved, (len(held), held_unsaved)
    # A dropped saved object is dropped on the replica too.
    gone = held[0]["tag"]
    assert rc.execute_command("STATE.FREE", gone + "st") == 1
    assert rc.execute_command("SSM.PREFIX.DROP", gone + "ssm") == b"OK"
    assert rc.execute_command("ATTEND.PREFIX.DROP", gone + "at") == 2
    assert rc.execute_command("V.DROP", gone + "v") == 1
    rc.close()

    # An object whose owner's replica is the victim: saved there, but not acknowledged.
    slots = cluster.nodes["n1"].client().execute_command("CLUSTER", "SLOTS")
    backed = next(w for w in saved if any(
        r[0] <= key_slot(w["tag"].encode()) <= r[1] and len(r) > 3 and r[3][1] == victim.port
        for r in slots))
    owner = cluster.owner_of(backed["tag"]).client()

    def save_without_replica():
        tag, err = backed["tag"], r"IOERR saved on this node, but its copy to replica 'n2'"
        k = f32s(1, 1, AT_N, AT_D)
        for write, save in (
                (["STATE.WRITE", tag + "st", 0, b"\xee" * 16], ["STATE.SAVE", tag + "st"]),
                (["SSM.PREFIX.STORE", tag + "ssm", 0, b"later"], ["SSM.PREFIX.SAVE", tag + "ssm"]),
                (["ATTEND.PREFIX.STORE", tag + "at", 0, 1, AT_N, AT_D, k, k],
                 ["ATTEND.PREFIX.SAVE", tag + "at"])):
            assert owner.execute_command(*write) == b"OK"
            with pytest.raises(redis.ResponseError, match=err):
                owner.execute_command(*save)
        snap = owner.execute_command("V.SNAPSHOT", tag + "v")
        with pytest.raises(redis.ResponseError, match=err):
            owner.execute_command("V.COMMIT", tag + "v", snap)

    failover_s = kill_and_wait_served(cluster, victim,
                                      lambda c: [check_objects(c, w) for w in held[1:]],
                                      "the victim's saved objects on its replica",
                                      meanwhile=save_without_replica)
    owner.close()
    rc = cluster.client()
    for tag in held_unsaved + [gone]:  # never saved, or dropped: nowhere served
        check_nothing_unsaved(rc, tag)
    for w in saved:  # the others' owners still serve what was written after the saves
        if w not in held:
            got = rc.execute_command("STATE.READ", w["tag"] + "st", 0, 16)
            assert got == (b"\xee" if w is backed else b"\xff") * 16
            assert rc.execute_command("SSM.PREFIX.FETCH", w["tag"] + "ssm", 0) == b"later"
    # Dropped while the victim is away: its old copies must not come back with it.
    away = held[1]["tag"]
    assert rc.execute_command("STATE.FREE", away + "st") == 1
    assert rc.execute_command("SSM.PREFIX.DROP", away + "ssm") == b"OK"
    assert rc.execute_command("ATTEND.PREFIX.DROP", away + "at") == 2
    assert rc.execute_command("V.DROP", away + "v") == 1
    rc.close()

    victim.start()  # same --dir: its stale files are there
    cluster.wait_settled()
    rc = cluster.client()
    assert int(cluster.info(victim)["cluster_my_slots"]) > 0  # it rejoined and took a share
    for tag in held_unsaved + [gone, away]:
        check_nothing_unsaved(rc, tag)
    for w in held[2:]:
        check_objects(rc, w)
    rc.close()
    print("fail-over of STATE/SSM/ATTENTION/VSNAP after kill -9: %.2f s (lease TTL %d s)"
          % (failover_s, TTL))


@pytest.mark.time_limit(150)
def test_node_joining_moves_every_family_with_no_failed_read(cluster):
    cluster.add("n1")
    cluster.add("n2")
    cluster.wait_settled()
    # Sealed snapshots first (a live V session is not moved: only what V.COMMIT sealed is).
    rc = cluster.client()
    sealed = [store_family_objects(rc, "{ms%d}" % i, 3 * i, True, change=False)
              for i in range(40)]
    rc.close()

    def step(rc, i, created):
        want = store_family_objects(rc, "{m%d}" % i, 7 * i, i % 3 == 0, change=False,
                                    vsession=False)
        w = (created + [want])[(i * 7919) % (len(created) + 1)]  # an earlier one reads back
        check_objects(rc, w)
        s = sealed[i % len(sealed)]  # and a sealed snapshot, wherever it is now
        assert rc.execute_command("V.RESTORE", s["tag"] + "v", s["snap" + "2" * (i % 2)]) == b"OK"
        return want

    created = join_n3_under_load(cluster, step)
    assert len(created) > 20, len(created)
    n3 = cluster.nodes["n3"]
    on_n3 = [w for w in created if cluster.owner_of(w["tag"]) is n3]
    assert on_n3, "no object landed in n3's slots"
    state = dict(zip(*[iter(n3.client().execute_command("STATE.INFO"))] * 2))
    assert state[b"slots"] >= len(on_n3), (state, len(on_n3))
    moved = sum(int(cluster.info(cluster.nodes[n])["cluster_moved_out"]) for n in ("n1", "n2"))
    assert moved >= 4 * len(on_n3) // 2, (moved, len(on_n3))  # each family's objects moved
    rc = cluster.client()
    for w in created:
        check_objects(rc, w)
    for w in sealed:
        check_objects(rc, w)
    assert any(cluster.owner_of(w["tag"]) is n3 for w in sealed)
    rc.close()
    print("join under load: %d tags of STATE/SSM/ATTENTION written (and 40 V sessions with 2 sealed snapshots each), %d in n3's slots, %d objects moved"
          % (len(created), len(on_n3), moved))


def owner_and_replicas(cluster: Cluster, key: str):
    """The node that owns key's slot and the nodes listed as its replicas (CLUSTER SLOTS)."""
    slot = key_slot(key.encode())
    for r in cluster.live()[0].client().execute_command("CLUSTER", "SLOTS"):
        if r[0] <= slot <= r[1]:
            by_id = {nid: s for nid, s in cluster.nodes.items()}
            return by_id[r[2][2].decode()], [by_id[x[2].decode()] for x in r[3:]]
    raise AssertionError("no owner for slot %d" % slot)


@pytest.mark.time_limit(150)
def test_reads_during_a_move_to_a_replica_holder_never_go_back_in_time(cluster):
    """Issue 51: a slot moves to the node that holds its replica copies (CLUSTER SETSLOT here;
    the leader's rebalance after a fail-over does the same). The copies are of the last save;
    the objects were rewritten since. Until a key's current bytes arrive from the old owner,
    the new owner must not serve its copy: every read during the move is the last acknowledged
    write — a namespace's K and V of one version, an attention session's two layers too."""
    for nid in ("n1", "n2", "n3"):
        cluster.add(nid)
    cluster.wait_settled()
    tag = "{mv51}"
    owner, replicas = owner_and_replicas(cluster, tag)
    target = replicas[0]
    target_id = next(n for n, s in cluster.nodes.items() if s is target)
    names = ["%s%d" % (tag, i) for i in range(200)]
    sessions = ["%sat%d" % (tag, i) for i in range(30)]
    q = f32s(7, 1, AT_D)
    rc = cluster.client()

    def store_session(sid, seed):
        answers = []
        for layer in (0, 1):
            k, v = f32s(seed + layer, 1, AT_N, AT_D), f32s(seed + 2 + layer, 1, AT_N, AT_D)
            assert rc.execute_command("ATTEND.PREFIX.STORE", sid, layer, 1, AT_N, AT_D, k,
                                      v) == b"OK"
            answers.append(rc.execute_command("ATTEND.PREFIX.QUERY", sid, layer, 1, AT_D, 0, q))
        return tuple(answers)

    # The namespaces are written but for their last row: not complete, so not published
    # (a published namespace never changes) — rewritten in place, they change under readers.
    n = LAYERS * TOKENS - 1
    row_bytes = HEADS * DIM * 4

    def partial(seed):
        k, v = rows(seed)
        return k[:n * row_bytes], v[:n * row_bytes]

    v1, v2 = {}, {}
    for i, ns in enumerate(names):  # v1, saved: the replica holds it
        k, v = partial(i)
        assert rc.execute_command("KV.PREFIX.REGISTER", ns, LAYERS, TOKENS, HEADS, DIM,
                                  "fp32") == b"OK"
        assert rc.execute_command("V.STOREBATCH", ns + "_pk", 0, k) == n
        assert rc.execute_command("V.STOREBATCH", ns + "_pv", 0, v) == n
        assert rc.execute_command("KV.PREFIX.SAVE", ns) == b"OK"
        v1[ns] = (k, v)
    for i, sid in enumerate(sessions):
        v1[sid] = store_session(sid, 100 * i)
        assert rc.execute_command("ATTEND.PREFIX.SAVE", sid) == b"OK"
    for i, ns in enumerate(names):  # v2, acknowledged but not saved: only the owner has it
        k, v = partial(10_000 + i)
        assert rc.execute_command("V.STOREBATCH", ns + "_pk", 0, k) == n
        assert rc.execute_command("V.STOREBATCH", ns + "_pv", 0, v) == n
        v2[ns] = (k, v)
    for i, sid in enumerate(sessions):
        v2[sid] = store_session(sid, 100_000 + 100 * i)
    rc.close()

    done = threading.Event()
    findings: list[str] = []
    reads = [0]

    def read(c, key):
        if key in v2 and key.startswith(tag + "at"):
            return tuple(c.execute_command("ATTEND.PREFIX.QUERY", key, layer, 1, AT_D, 0, q)
                         for layer in (0, 1))
        return tuple(c.execute_command("V.FETCH", key + part, "RANGE", 0, n, "RAW")
                     for part in ("_pk", "_pv"))

    def reader(seed):
        c = cluster.client()
        rnd = np.random.default_rng(seed)
        keys = names + sessions
        try:
            while not done.is_set():
                key = keys[int(rnd.integers(len(keys)))]
                got = read(c, key)
                reads[0] += 1
                if got != v2[key]:
                    old, new = v1[key], v2[key]
                    kind = ("the saved version before the last writes" if got == old else
                            "parts of different versions" if all(
                                g in (o, n) for g, o, n in zip(got, old, new))
                            else "bytes of neither version")
                    findings.append("%s: %s" % (key, kind))
        except Exception as e:  # noqa: BLE001 - a failed read is a finding too
            findings.append("read failed: %r" % e)
        finally:
            c.close()

    threads = [threading.Thread(target=reader, args=(s,)) for s in range(3)]
    for t in threads:
        t.start()
    try:
        time.sleep(0.5)
        slot = key_slot(tag.encode())
        assert owner.client().execute_command("CLUSTER", "SETSLOT", slot, "NODE",
                                              target_id) == b"OK"
        wait_for(lambda: all(cluster.info(s)["cluster_slots_migrating"] == "0"
                             for s in cluster.live()), timeout=60, interval=0.05,
                 what="the move to end")
        time.sleep(0.3)
    finally:
        done.set()
        for t in threads:
            t.join(timeout=30)
    assert cluster.owner_of(tag) is target
    assert reads[0] > 100, reads[0]
    assert not findings, (len(findings), findings[:5])
    rc = cluster.client()
    for key in names + sessions:  # all of it arrived, and the target serves it
        assert read(rc, key) == v2[key], key
    rc.close()


def mla_rows(seed: int) -> bytes:
    return np.random.default_rng(seed).standard_normal((2 * 64, 192)).astype(np.float32).tobytes()


@pytest.mark.time_limit(150)
def test_mla_namespaces_and_slots_fail_over_and_keep_their_layout(cluster):
    """Issue 52: an MLA namespace ({ns}_pl, one latent row per token) and an MLA attention slot
    bound from it are saved objects like any: after kill -9 of their owner the replica serves
    them byte-exact, still an MLA layout (a per-head LOOKUP misses, its `_pk` is refused), and
    the slot answers QUERY_MLA as before; when the node rejoins, the slots that move to it
    bring them along the same."""
    for nid in ("n1", "n2", "n3"):
        cluster.add(nid)
    cluster.wait_settled()
    rc = cluster.client()
    names = ["{m%d}" % i for i in range(24)]
    q = np.random.default_rng(7).standard_normal((4, 192)).astype(np.float32).tobytes()
    before = {}
    for i, ns in enumerate(names):
        assert rc.execute_command("KV.PREFIX.REGISTER", ns, 2, 64, "MLA", 128, 64,
                                  "fp8_ds_mla") == b"OK"
        assert rc.execute_command("V.STOREBATCH", ns + "_pl", 0, mla_rows(i)) == 128
        assert rc.execute_command("KV.PREFIX.SAVE", ns) == b"OK"
        slot = ns + ":attn"
        assert rc.execute_command("ATTEND.PREFIX.STORE", slot, 1, "FROM", ns) == b"OK"
        assert rc.execute_command("ATTEND.PREFIX.SAVE", slot) == b"OK"
        before[ns] = (rc.execute_command("V.FETCH", ns + "_pl", "RANGE", 0, 128, "RAW"),
                      rc.execute_command("ATTEND.PREFIX.QUERY_MLA", slot, 1, 4, 128, 64, "0.125",
                                         q))
    victim = cluster.nodes["n3"]
    held = [ns for ns in names if cluster.owner_of(ns) is victim]
    assert held, "n3 owns none of the names"
    rc.close()

    def check(c, names=held):
        for ns in names:
            raw, out = before[ns]
            assert c.execute_command("KV.PREFIX.LOOKUP", ns, "LAYOUT", "mla") == b"HIT", ns
            assert c.execute_command("KV.PREFIX.LOOKUP", ns) == b"MISS", ns
            assert c.execute_command("V.FETCH", ns + "_pl", "RANGE", 0, 128, "RAW") == raw, ns
            assert c.execute_command("ATTEND.PREFIX.QUERY_MLA", ns + ":attn", 1, 4, 128, 64,
                                     "0.125", q) == out, ns

    kill_and_wait_served(cluster, victim, check, "the victim's MLA objects on its replica")
    rc = cluster.client()
    check(rc, names)
    with pytest.raises(redis.ResponseError, match="a per-head reader cannot read an MLA"):
        rc.execute_command("V.FETCH", held[0] + "_pk", "RANGE", 0, 1)
    rc.close()
    # The victim rejoins and takes a share again: slots move to it, their MLA objects with them.
    victim.start()
    cluster.wait_settled()
    assert int(cluster.info(victim)["cluster_my_slots"]) > 0
    moved = [ns for ns in names if cluster.owner_of(ns) is victim]
    assert moved, "no name moved back"
    rc = cluster.client()
    check(rc, names)
    rc.close()
