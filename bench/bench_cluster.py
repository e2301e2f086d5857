#!/usr/bin/python3
"""A Pion cluster on this machine: aggregate fetch throughput of 1, 2 and 3 nodes (loopback),
with each node's CPU so that the machine's core count is visible, and the fail-over time after
a kill -9 (p50 over --kills kills).

One etcd (temporary data directory, loopback ports) and N pion-server nodes (`-w 1` each,
--cluster); --namespaces KV.PREFIX namespaces {bN} of one layer (--tokens x --kv-heads x
--head-dim fp16: 512 KiB per session by default), saved. Throughput: --clients processes, each
a redis-py RedisCluster (unmodified) fetching `V.FETCH {bN}_pk RANGE 0 T RAW` of random
namespaces for --seconds; reported as fetches/s and GB/s over all nodes, with the CPU seconds
per second of each node and of the clients. Fail-over: three nodes, --cluster-lease-ttl
--ttl; each round kills one node (in turn), times until every saved namespace it owned is a HIT
with the right bytes through a fresh RedisCluster, then restarts it and waits for the map to
settle. Kill -9 loop (--loop-rounds): the same kills, restarts and rebalances while a writer
publishes new versions of namespaces (KV.PREFIX.DROP, REGISTER, K, V: a published namespace
never changes) and saves some, and readers (INFO's generation, then K and V at it) check every
read against the writer's ledger: never older than the last acknowledged publication (its save
after a kill), never K and V of different versions (the rebalance after each restart moves
slots to nodes that hold replica copies of them — issue 51).

Run:  /usr/bin/python3 bench/bench_cluster.py      writes bench/results/cluster-<date>.md
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import logging
import multiprocessing as mp
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np
import psutil
from redis.cluster import ClusterNode, RedisCluster
from redis.crc import key_slot

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_protocol import git_info, machine_info  # noqa: E402
from benchutil import free_port, report  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
HOST = "127.0.0.1"
# The kill -9 loop: namespaces (tokens x 1 x dim fp16), and one write in SAVE_EVERY is saved.
LOOP_NS, LOOP_TOKENS, LOOP_DIM, LOOP_SAVE_EVERY = 200, 128, 128, 4


class Etcd:
    def __init__(self, work: Path):
        self.work, self.port, self.peer = work, free_port(), free_port()
        url, peer = "http://%s:%d" % (HOST, self.port), "http://%s:%d" % (HOST, self.peer)
        self.proc = subprocess.Popen(
            [shutil.which("etcd"), "--name", "b", "--data-dir", str(work / "etcd"),
             "--listen-client-urls", url, "--advertise-client-urls", url,
             "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
             "--initial-cluster", "b=" + peer, "--log-level", "warn"],
            stdout=open(work / "etcd.log", "w"), stderr=subprocess.STDOUT)
        for _ in range(300):
            try:
                req = urllib.request.Request(url + "/v3/kv/range", json.dumps({"key": "eA=="}).encode())
                with urllib.request.urlopen(req, timeout=1):
                    return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError("etcd did not start: " + (work / "etcd.log").read_text()[-2000:])

    def stop(self):
        self.proc.terminate()
        self.proc.wait(timeout=10)


class Node:
    def __init__(self, binary, work: Path, etcd: Etcd, node_id: str, ttl: int):
        self.binary, self.work, self.etcd, self.id, self.ttl = binary, work, etcd, node_id, ttl
        self.proc = None
        self.port = 0

    def start(self):
        self.port = free_port()
        d = self.work / self.id
        d.mkdir(exist_ok=True)
        self.proc = subprocess.Popen(
            [str(self.binary), "--port", str(self.port), "--binary-port", "0", "--metrics-port",
             "0", "--dir", str(d / "data"), "-w", "1", "--cluster",
             "etcd://%s:%d" % (HOST, self.etcd.port), "--node-id", self.id,
             "--cluster-lease-ttl", str(self.ttl)],
            stdout=open(d / "server.log", "a"), stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            try:
                import redis
                if redis.Redis(port=self.port, socket_timeout=1).ping():
                    return self
            except Exception:  # noqa: BLE001 - not up yet
                time.sleep(0.05)
        raise RuntimeError("node %s did not start" % self.id)

    def kill(self):
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=10)
        self.proc = None

    def stop(self):
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(timeout=15)
            self.proc = None

    def cluster_info(self) -> dict:
        import redis
        text = redis.Redis(port=self.port, socket_timeout=5).execute_command("CLUSTER", "INFO")
        return dict(line.split(":", 1) for line in text.decode().strip().splitlines())


def settled(nodes) -> bool:
    try:
        infos = [n.cluster_info() for n in nodes]
    except Exception:  # noqa: BLE001
        return False
    return (all(i["cluster_state"] == "ok" and i["cluster_slots_migrating"] == "0"
                and i["cluster_known_nodes"] == str(len(nodes)) and int(i["cluster_my_slots"]) > 0
                for i in infos) and len({i["cluster_current_epoch"] for i in infos}) == 1)


def wait(pred, timeout, what):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.05)
    raise RuntimeError("timed out waiting for " + what)


def client(nodes) -> RedisCluster:
    return RedisCluster(startup_nodes=[ClusterNode(HOST, n.port) for n in nodes], socket_timeout=20)


def rows_of(i: int, rows: int, dim: int) -> np.ndarray:
    return np.random.default_rng(i).standard_normal((rows, dim)).astype(np.float32)


def populate(nodes, n_ns, tokens, heads, dim):
    rc = client(nodes)
    for i in range(n_ns):
        ns = "{b%d}" % i
        rc.execute_command("KV.PREFIX.REGISTER", ns, 1, tokens, heads, dim, "fp16")
        blob = rows_of(i, tokens, heads * dim).tobytes()
        rc.execute_command("V.STOREBATCH", ns + "_pk", 0, blob)
        rc.execute_command("V.STOREBATCH", ns + "_pv", 0, blob)
        rc.execute_command("KV.PREFIX.SAVE", ns)
    rc.close()


def fetch_worker(ports, n_ns, tokens, seconds, out):
    rc = RedisCluster(startup_nodes=[ClusterNode(HOST, p) for p in ports], socket_timeout=20)
    rnd = random.Random()
    n = nbytes = 0
    t_end = time.monotonic() + seconds
    while time.monotonic() < t_end:
        ns = "{b%d}" % rnd.randrange(n_ns)
        nbytes += len(rc.execute_command("V.FETCH", ns + "_pk", "RANGE", 0, tokens, "RAW"))
        n += 1
    rc.close()
    out.put((n, nbytes))


def throughput(binary, work, n_nodes, args) -> dict:
    etcd = Etcd(work)
    nodes = []
    try:
        for i in range(n_nodes):
            nodes.append(Node(binary, work, etcd, "n%d" % (i + 1), args.ttl).start())
        wait(lambda: settled(nodes), 60, "the map to settle")
        populate(nodes, args.namespaces, args.tokens, args.kv_heads, args.head_dim)
        # Warm: every namespace opened (first use reads its chunk index).
        rc = client(nodes)
        for i in range(args.namespaces):
            rc.execute_command("KV.PREFIX.LOOKUP", "{b%d}" % i)
        rc.close()
        procs = [psutil.Process(n.proc.pid) for n in nodes]
        cpu0 = [sum(p.cpu_times()[:2]) for p in procs]
        busy0 = psutil.cpu_times()
        me0 = psutil.Process().cpu_times()
        me0 = me0.children_user + me0.children_system
        q = mp.Queue()
        workers = [mp.Process(target=fetch_worker, args=([n.port for n in nodes], args.namespaces,
                                                          args.tokens, args.seconds, q))
                   for _ in range(args.clients)]
        t0 = time.monotonic()
        for w in workers:
            w.start()
        results = [q.get(timeout=args.seconds + 60) for _ in workers]
        for w in workers:
            w.join()
        elapsed = time.monotonic() - t0
        cpu = [(sum(p.cpu_times()[:2]) - c) / elapsed for p, c in zip(procs, cpu0)]
        busy1 = psutil.cpu_times()
        machine = ((sum(busy1) - busy1.idle - busy1.iowait) -
                   (sum(busy0) - busy0.idle - busy0.iowait)) / elapsed
        me1 = psutil.Process().cpu_times()
        clients_cpu = (me1.children_user + me1.children_system - me0) / elapsed
        fetches = sum(r[0] for r in results)
        nbytes = sum(r[1] for r in results)
        return {"nodes": n_nodes, "fetches_s": fetches / elapsed, "gb_s": nbytes / elapsed / 1e9,
                "node_cpu": cpu, "clients_cpu": clients_cpu, "machine_cpu": machine,
                "elapsed": elapsed}
    finally:
        for n in nodes:
            n.stop()
        etcd.stop()


def failover(binary, work, args) -> list[float]:
    etcd = Etcd(work)
    nodes = []
    times = []
    try:
        for i in range(3):
            nodes.append(Node(binary, work, etcd, "f%d" % (i + 1), args.ttl).start())
        wait(lambda: settled(nodes), 60, "the map to settle")
        n_ns = 60
        populate(nodes, n_ns, 64, 1, 64)
        for k in range(args.kills):
            victim = nodes[k % 3]
            slots = client(nodes).cluster_slots()
            owned = []
            for (lo, hi), v in slots.items():
                if v["primary"][1] == victim.port:
                    owned += [i for i in range(n_ns) if lo <= key_slot(b"{b%d}" % i) <= hi]
            victim.kill()
            t0 = time.monotonic()
            others = [n for n in nodes if n is not victim]

            def all_hit():
                try:
                    rc = client(others)
                    try:
                        for i in owned:
                            ns = "{b%d}" % i
                            if rc.execute_command("KV.PREFIX.LOOKUP", ns) != b"HIT":
                                return False
                            got = rc.execute_command("V.FETCH", ns + "_pk", "RANGE", 0, 64, "RAW")
                            if got != rows_of(i, 64, 64).astype(np.float16).tobytes():
                                raise RuntimeError("wrong bytes for " + ns)
                    finally:
                        rc.close()
                    return True
                except RuntimeError:
                    raise
                except Exception:  # noqa: BLE001 - not yet
                    return False

            wait(all_hit, args.ttl + 30, "fail-over")
            times.append(time.monotonic() - t0)
            victim.start()
            wait(lambda: settled(nodes), 60, "the map to settle after the restart")
        return times
    finally:
        for n in nodes:
            n.stop()
        etcd.stop()


def kill_loop(binary, work, args) -> dict:
    """Kills, restarts and rebalances, as failover() does, under writes, saves and reads (see
    the module comment). Returns the counts."""
    etcd = Etcd(work)
    nodes = []
    n_ns, tokens, dim = LOOP_NS, LOOP_TOKENS, LOOP_DIM
    names = ["{k%d}" % i for i in range(n_ns)]
    # A published namespace never changes (issue 54 §1): the writer publishes each new version
    # as a prefix does, by KV.PREFIX.DROP, REGISTER (a higher cache generation) and the K and V
    # writes that complete it. ABSENT stands for "no complete namespace" (dropped, or registered
    # and not yet complete: a LOOKUP MISS). The ledger, per namespace (its lock: a read never
    # overlaps its writes):
    #  - cur: the versions a read may return: the last acknowledged publication; after its owner
    #    was killed, what may have survived there (durable);
    #  - durable: what a fail-over may leave: the last acknowledged save, ABSENT once a DROP was
    #    acknowledged (the drop reaches the replicas before it is answered), and whatever a
    #    request cut off may have done (a save or drop sent but not answered);
    #  - hist: every version written (to name an older one that comes back).
    ABSENT = -1
    cur = {ns: {0} for ns in names}
    durable = {ns: {0} for ns in names}
    hist = {ns: [0] for ns in names}
    locks = {ns: threading.Lock() for ns in names}
    counts = {"writes": 0, "saves": 0, "refused": 0, "reads": 0, "failed_reads": 0,
              "misses": 0, "older": 0, "mixed": 0, "unknown": 0, "rounds": 0, "lost": 0}
    counts_mu = threading.Lock()
    done = threading.Event()

    def bump(what: str) -> None:
        with counts_mu:
            counts[what] += 1

    def blobs(ns: str, version: int) -> tuple[bytes, bytes]:
        seed = names.index(ns) * 1_000_000 + version
        return (rows_of(2 * seed, tokens, dim).tobytes(),
                rows_of(2 * seed + 1, tokens, dim).tobytes())

    def raw(blob: bytes) -> bytes:
        return np.frombuffer(blob, np.float32).astype(np.float16).tobytes()

    def version_of(ns: str, got: bytes, part: int, among) -> int | None:
        for x in among:
            if x != ABSENT and raw(blobs(ns, x)[part]) == got:
                return x
        return None

    def fresh(rc):
        # A new client after a failure: redis-py 4.3's RedisCluster cannot re-read the map
        # through a node it did not know at first (it deep-copies itself, lock included).
        try:
            if rc is not None:
                rc.close()
        except Exception:  # noqa: BLE001
            pass
        while True:
            try:
                return client([n for n in nodes if n.proc is not None])
            except Exception:  # noqa: BLE001 - the map is changing
                time.sleep(0.1)

    def publish(rc, ns: str, version: int) -> None:
        k, v = blobs(ns, version)
        rc.execute_command("KV.PREFIX.REGISTER", ns, 1, tokens, 1, dim, "fp16")
        rc.execute_command("V.STOREBATCH", ns + "_pk", 0, k)
        rc.execute_command("V.STOREBATCH", ns + "_pv", 0, v)

    def writer():
        rc = fresh(None)
        rnd = random.Random(1)
        versions = {ns: 0 for ns in names}
        while not done.is_set():
            ns = rnd.choice(names)
            versions[ns] += 1
            v_ = versions[ns]
            failed = False
            with locks[ns]:
                hist[ns].append(v_)
                stage = "drop"
                try:
                    rc.execute_command("KV.PREFIX.DROP", ns)
                    durable[ns] = {ABSENT}
                    stage = "publish"
                    publish(rc, ns, v_)
                    cur[ns] = {v_}
                    bump("writes")
                except Exception:  # noqa: BLE001 - a fail-over in progress: cut off
                    if stage == "drop":  # the drop may or may not have happened
                        durable[ns].add(ABSENT)
                    cur[ns] |= {v_, ABSENT}
                    failed = True
                if not failed and rnd.random() < 1 / LOOP_SAVE_EVERY:
                    try:
                        if rc.execute_command("KV.PREFIX.SAVE", ns) == b"OK":
                            durable[ns] = {v_}
                            bump("saves")
                    except Exception:  # noqa: BLE001 - not acknowledged: it may be durable
                        durable[ns].add(v_)
                        bump("refused")
                        failed = True
            if failed:
                rc = fresh(rc)

    def read(rc, ns: str):
        """The namespace's complete publication as (version-bytes K, V), or None when there is
        none (a MISS). K and V are read at the generation INFO named: never two publications."""
        try:
            info = rc.execute_command("KV.PREFIX.INFO", ns)
        except Exception as e:  # noqa: BLE001
            if "no such prefix namespace" in str(e):
                return None
            raise
        if isinstance(info, list):
            info = dict(zip(info[::2], info[1::2]))
        if int(info[b"complete"]) == 0:
            return None
        g = int(info[b"cache_generation"])
        k = rc.execute_command("V.FETCH", ns + "_pk", "RANGE", 0, tokens, "RAW", "GENERATION", g)
        v = rc.execute_command("V.FETCH", ns + "_pv", "RANGE", 0, tokens, "RAW", "GENERATION", g)
        return k, v

    def reader(seed):
        rc = fresh(None)
        rnd = random.Random(seed)
        while not done.is_set():
            ns = rnd.choice(names)
            with locks[ns]:  # what the ledger allows, as of the read
                allowed = set(cur[ns])
                older = [x for x in hist[ns] if x not in allowed]
                try:
                    got = read(rc, ns)
                    ok = True
                except Exception:  # noqa: BLE001 - a fail-over in progress (or a generation
                    ok = False     # that moved between INFO and FETCH: never, under the lock)
            if not ok:
                bump("failed_reads")
                rc = fresh(rc)
                continue
            bump("reads")
            if got is None:
                bump("misses")
                if ABSENT not in allowed:
                    bump("older")  # a published version that vanished: an older state
                continue
            k, v = got
            vk, vv = version_of(ns, k, 0, allowed), version_of(ns, v, 1, allowed)
            if vk is not None and vk == vv:
                continue
            if vk is not None and vv is not None:
                bump("mixed")
            elif version_of(ns, k, 0, older) is not None or version_of(ns, v, 1, older) is not None:
                bump("older")  # a version the ledger had moved past: back in time
            else:
                bump("unknown")

    def owned_by(victim) -> list:
        rc = client([n for n in nodes if n is not victim])
        slots = rc.cluster_slots()
        rc.close()
        out = []
        for (lo, hi), where in slots.items():
            if where["primary"][1] == victim.port:
                out += [ns for ns in names if lo <= key_slot(ns.encode()) <= hi]
        return out

    try:
        for i in range(3):
            nodes.append(Node(binary, work, etcd, "k%d" % (i + 1), args.ttl).start())
        wait(lambda: settled(nodes), 60, "the map to settle")
        rc = client(nodes)
        for ns in names:
            publish(rc, ns, 0)
            rc.execute_command("KV.PREFIX.SAVE", ns)
        rc.close()
        threads = [threading.Thread(target=writer, daemon=True)] + [
            threading.Thread(target=reader, args=(s,), daemon=True) for s in range(2)]
        for t in threads:
            t.start()
        try:
            for r in range(args.loop_rounds):
                time.sleep(args.loop_dwell)  # the workload on a settled map
                victim = nodes[r % 3]
                held = owned_by(victim)
                victim.kill()
                for ns in held:  # unsaved writes die with their owner: its saves remain
                    with locks[ns]:
                        cur[ns] = set(durable[ns])
                others = [n for n in nodes if n is not victim]
                wait(lambda: settled(others), args.ttl + 30, "fail-over")
                victim.start()  # then the rebalance moves slots back to it
                wait(lambda: settled(nodes), 60, "the map to settle after the restart")
                bump("rounds")
        finally:
            done.set()
            for t in threads:
                t.join(timeout=60)
        # Last: every namespace reads back as the ledger allows — nothing acknowledged lost.
        rc = client(nodes)
        for ns in names:
            got = read(rc, ns)
            if got is None:
                if ABSENT not in cur[ns]:
                    counts["lost"] += 1
            elif version_of(ns, got[0], 0, cur[ns]) is None:
                counts["lost"] += 1
        rc.close()
        return counts
    finally:
        for n in nodes:
            n.stop()
        etcd.stop()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bin", default=str(REPO / "build"))
    ap.add_argument("--namespaces", type=int, default=200)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--seconds", type=float, default=8.0)
    ap.add_argument("--ttl", type=int, default=3)
    ap.add_argument("--kills", type=int, default=10)
    ap.add_argument("--loop-rounds", type=int, default=20)
    ap.add_argument("--loop-dwell", type=float, default=2.0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    # RedisCluster logs every redirection and refused connection it handles; the fail-over
    # rounds expect thousands of them.
    logging.getLogger("redis.cluster").setLevel(logging.CRITICAL)
    binary = Path(args.bin) / "pion-server"
    out = args.out or str(REPO / "bench" / "results" / ("cluster-%s.md" % dt.date.today()))
    rows = []
    for n in (1, 2, 3):
        with tempfile.TemporaryDirectory(prefix="pion-bench-cluster-") as d:
            r = throughput(binary, Path(d), n, args)
            rows.append(r)
            print("%d node(s): %.0f fetches/s, %.2f GB/s, node CPU %s, clients %.2f" % (
                n, r["fetches_s"], r["gb_s"], ["%.2f" % c for c in r["node_cpu"]], r["clients_cpu"]))
    with tempfile.TemporaryDirectory(prefix="pion-bench-failover-") as d:
        times = failover(binary, Path(d), args)
    print("fail-over: p50 %.2f s, min %.2f, max %.2f over %d kills" % (
        statistics.median(times), min(times), max(times), len(times)))
    with tempfile.TemporaryDirectory(prefix="pion-bench-killloop-") as d:
        loop = kill_loop(binary, Path(d), args)
    print("kill -9 loop: %s" % loop)
    m = machine_info()
    size = args.tokens * args.kv_heads * args.head_dim * 2
    lines = [
        "# Pion cluster: fetch throughput by node count, fail-over time",
        "",
        "- command: `/usr/bin/python3 bench/bench_cluster.py %s`" % " ".join(sys.argv[1:]),
        "- date: %s" % dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "- commit: %s" % git_info(),
        "- machine: %s" % json.dumps(m),
        "- etcd %s on loopback; nodes `-w 1`, `--cluster-lease-ttl %d`; clients: %d processes of "
        "redis-py %s RedisCluster" % (
            subprocess.run(["etcd", "--version"], capture_output=True, text=True).stdout.split()[2],
            args.ttl, args.clients, __import__("redis").__version__),
        "- fetch: `V.FETCH {bN}_pk RANGE 0 %d RAW` = %d KiB (fp16, %d x %d x %d) of %d saved "
        "namespaces, random, %.0f s" % (args.tokens, size // 1024, args.tokens, args.kv_heads,
                                      args.head_dim, args.namespaces, args.seconds),
        "",
        "| nodes | fetches/s | GB/s | CPU of each node (cores) | CPU of the clients (cores) | "
        "whole machine busy (cores) |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append("| %d | %.0f | %.2f | %s | %.2f | %.2f |" % (
            r["nodes"], r["fetches_s"], r["gb_s"], ", ".join("%.2f" % c for c in r["node_cpu"]),
            r["clients_cpu"], r["machine_cpu"]))
    lines += [
        "",
        "The machine has %s cores: nodes and clients share them, so the aggregate is bounded by "
        "the cores, not by the node count (the per-node CPU column shows where they went)." % m["nproc"],
        "",
        "## Fail-over after kill -9 (three nodes, lease TTL %d s)" % args.ttl,
        "",
        "From the kill until every saved namespace the killed node owned is a HIT with the right "
        "bytes on its replica (a fresh RedisCluster per check), %d kills, each node in turn, "
        "restarted and settled between kills:" % len(times),
        "",
        "| p50 | min | max | all (s) |",
        "|---|---|---|---|",
        "| %.2f s | %.2f s | %.2f s | %s |" % (statistics.median(times), min(times), max(times),
                                              ", ".join("%.2f" % t for t in times)),
        "",
        "The floor is the lease TTL (etcd expires the lease, checking about every 500 ms), then "
        "the leader's and the replica's watches fire at once; plus the client's own retry pacing.",
        "",
        "## Kill -9 loop under writes, saves and reads",
        "",
        "Three nodes, %d namespaces (%d x 1 x %d fp16); %d rounds: %.0f s of load, kill -9 of "
        "a node (in turn), fail-over, restart, rebalance (slots move back to the restarted node, "
        "which holds replica copies of them); one writer publishes new versions of namespaces "
        "(KV.PREFIX.DROP, REGISTER, K, V) and saves one in %d, two readers (KV.PREFIX.INFO's "
        "cache_generation, then K and V fetched at it) check every read against its ledger (a "
        "read may return the last acknowledged publication — after its owner was killed, its "
        "last acknowledged save, or nothing if it was dropped since — never an older version, "
        "never K and V of two):" % (
            LOOP_NS, LOOP_TOKENS, LOOP_DIM, loop["rounds"], args.loop_dwell, LOOP_SAVE_EVERY),
        "",
        "| rounds | acknowledged publications | acknowledged saves | saves or writes refused or cut "
        "off | reads | of them misses (no complete namespace) | failed reads (during fail-over) | reads older than the last acknowledged "
        "write (its save after a kill) | K and V of different versions | bytes of no version | "
        "acknowledged saves lost |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
        "| %d | %d | %d | %d | %d | %d | %d | %d | %d | %d | %d |" % (
            loop["rounds"], loop["writes"], loop["saves"], loop["refused"], loop["reads"],
            loop["misses"], loop["failed_reads"], loop["older"], loop["mixed"], loop["unknown"], loop["lost"]),
    ]
    report(lines, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
