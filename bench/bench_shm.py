#!/usr/bin/python3
"""Same-host layer fetch: how fast a client on this machine gets one K/V layer into its own
memory, by path, in one run.

Starts pion-server with --unixsocket and redis-server with a unix socket. Stores one layer
(--tokens x --kv-heads x --head-dim, fp16: 8 MiB by default) as a V-store session in pion and
the same RAW bytes as a redis key, then times (median of --reps, after a warm-up), each ending
with the bytes in a fresh numpy array of the client:
  pion_tcp_raw     redis-py V.FETCH RANGE … RAW over TCP loopback
  pion_unix_raw    the same over the Unix socket
  pion_shm         the Python client's shared-memory path (pion.Client on the Unix socket,
                   v.fetch_raw): V.FETCH … SHM, copy from the read-only mapping, SHM.RELEASE
  memcpy           numpy's copy of the same bytes into a fresh array (the ceiling)
  redis_unix_get   redis-py GET of the same bytes over redis's Unix socket (the peer)
Prints GB/s per path and ratios to the peer; writes bench/results/shm-<date>.md.

Run:  /usr/bin/python3 bench/bench_shm.py
"""
from __future__ import annotations

import argparse
import datetime as dt
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import redis

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "clients" / "python"))
from bench_protocol import free_port, git_info, machine_info, start_server, stop  # noqa: E402
from benchutil import report  # noqa: E402

REPO = Path(__file__).resolve().parent.parent


def timed(fn, reps):
    fn()
    fn()
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def bench_prefix(a, pport: int, psock: str, layer: np.ndarray) -> dict:
    """A whole prefix: --prefix-layers layers of --prefix-tokens tokens, K and V (fp16), fetched
    into one preallocated array of the client: per-layer RAW replies over TCP and over the Unix
    socket, the shared-memory path of the Python client (one leased range per session, copied
    out of the mapping), and a memcpy of the same bytes. Returns {"bytes", "rows": [(name, s)]}."""
    import pion
    L, T = a.prefix_layers, a.prefix_tokens
    dim = a.kv_heads * a.head_dim
    c = pion.Client(unix_socket_path=psock, socket_timeout=600)
    c.kv.register("prefix", L, T, a.kv_heads, a.head_dim, "fp16")
    rows = np.resize(layer, (T, dim))  # one layer's rows, repeated to T tokens
    for j in range(L):
        for sfx in ("_pk", "_pv"):
            c.v.store_batch("prefix" + sfx, j * T, rows)
    row_bytes = dim * 2
    per = T * row_bytes
    total = 2 * L * per
    dst = np.empty(total, np.uint8)
    dst[:] = 0  # fault the pages in once: every path writes into the same resident array
    tcp = redis.Redis(port=pport)
    unix = redis.Redis(unix_socket_path=psock)

    def sockets(client):
        def run():
            pipe_pos = 0
            for j in range(L):
                for sfx in ("_pk", "_pv"):
                    b = client.execute_command("V.FETCH", "prefix" + sfx, "RANGE", j * T,
                                               (j + 1) * T, "RAW")
                    dst[pipe_pos:pipe_pos + per] = np.frombuffer(b, np.uint8)
                    pipe_pos += per
        return run

    def shm():
        half = L * per
        c.v.fetch_raw("prefix_pk", 0, L * T, decode=False, into=dst[:half])
        c.v.fetch_raw("prefix_pv", 0, L * T, decode=False, into=dst[half:])

    shm()
    want = tcp.execute_command("V.FETCH", "prefix_pv", "RANGE", (L - 1) * T, L * T, "RAW")
    assert c.last_fetch_path == "shm" and dst[-per:].tobytes() == want  # byte for byte
    src = np.empty(total, np.uint8)
    src[:] = 1

    def memcpy():
        dst[:] = src

    out = []
    for name, fn in (("pion_tcp_raw", sockets(tcp)), ("pion_unix_raw", sockets(unix)),
                     ("pion_shm", shm), ("memcpy", memcpy)):
        out.append((name, timed(fn, a.prefix_reps)))
    c.close()
    return {"bytes": total, "rows": out}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pion", default="build/pion-server")
    ap.add_argument("--redis-server", default="/usr/bin/redis-server")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--prefix-layers", type=int, default=32,
                    help="whole-prefix case: layers (0 skips it)")
    ap.add_argument("--prefix-tokens", type=int, default=8192,
                    help="whole-prefix case: tokens per layer (32768 = a 4 GiB 8B-model prefix)")
    ap.add_argument("--prefix-reps", type=int, default=3)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="pion-bench-shm-"))
    psock, rsock = str(tmp / "pion.sock"), str(tmp / "redis.sock")
    pport, rport = free_port(), free_port()
    procs = []
    rows = []
    prefix = None
    try:
        p = start_server([a.pion, "--port", str(pport), "--metrics-port", "0", "--binary-port", "0", "--dir",
                          str(tmp / "d"), "--unixsocket", psock], pport, "pion", tmp / "pion.log")
        procs.append(p)
        rp = start_server([a.redis_server, "--port", str(rport), "--bind", "127.0.0.1",
                           "--unixsocket", rsock, "--save", "", "--appendonly", "no"], rport,
                          "redis", tmp / "redis.log")
        procs.append(rp)

        dim = a.kv_heads * a.head_dim
        layer = np.random.default_rng(1).standard_normal((a.tokens, dim)).astype(np.float32)
        tcp = redis.Redis(port=pport)
        unix = redis.Redis(unix_socket_path=psock)
        tcp.execute_command("V.CREATE", "layer", dim, "fp16")
        tcp.execute_command("V.STOREBATCH", "layer", 0, layer.tobytes())
        raw = tcp.execute_command("V.FETCH", "layer", "RANGE", 0, a.tokens, "RAW")
        nbytes = len(raw)
        rr = redis.Redis(unix_socket_path=rsock)
        rr.set("layer", raw)

        def fetch(client):
            def run():
                b = client.execute_command("V.FETCH", "layer", "RANGE", 0, a.tokens, "RAW")
                np.frombuffer(b, np.uint8).copy()
            return run

        import pion
        c = pion.Client(unix_socket_path=psock)

        def shm():  # the Python client's path: V.FETCH … SHM, copy out, SHM.RELEASE
            return c.v.fetch_raw("layer", 0, a.tokens, decode=False,
                                 into=np.empty(nbytes, np.uint8))

        assert shm().tobytes() == raw and c.last_fetch_path == "shm"  # byte for byte

        def rget():
            np.frombuffer(rr.get("layer"), np.uint8).copy()

        src = np.frombuffer(raw, np.uint8)
        resident = np.zeros(nbytes, np.uint8)  # e.g. an engine's pinned staging buffer

        def memcpy():  # the machine's copy of the same bytes into a fresh array (the ceiling)
            out = np.empty(nbytes, np.uint8)
            out[:] = src

        def shm_resident():
            c.v.fetch_raw("layer", 0, a.tokens, decode=False, into=resident)

        def memcpy_resident():
            resident[:] = src

        for name, fn in (("pion_tcp_raw", fetch(tcp)), ("pion_unix_raw", fetch(unix)),
                         ("pion_shm", shm), ("redis_unix_get", rget), ("memcpy", memcpy),
                         ("pion_shm into a resident buffer", shm_resident),
                         ("memcpy into a resident buffer", memcpy_resident)):
            t = timed(fn, a.reps)
            rows.append((name, t))
        c.close()
        if a.prefix_layers:
            prefix = bench_prefix(a, pport, psock, layer)
    finally:
        for p in procs:
            stop(p)
    peer = dict(rows)["redis_unix_get"]
    today = dt.date.today().isoformat()
    m = machine_info()
    lines = [f"# Same-host layer fetch — {today}", "",
             f"Command: `/usr/bin/python3 bench/bench_shm.py --prefix-tokens {a.prefix_tokens} "
             f"--prefix-reps {a.prefix_reps}`  ",
             f"Commit: {git_info()}  ",
             f"Machine: {m.get('cpu')}, {m.get('nproc')} cores, {m.get('memory')}, {m.get('os')}  ",
             f"One layer: {a.tokens} tokens x {a.kv_heads} heads x {a.head_dim} fp16 = "
             f"{nbytes / 2**20:.1f} MiB; median of {a.reps} fetches into a fresh numpy array "
             "(redis-py client, one connection), and into one resident buffer (`into=`; the "
             "memcpy rows are the same copies between the process's own arrays).", "",
             "| path | ms | GB/s | vs redis GET over its Unix socket |", "|---|---:|---:|---:|"]
    mc = dict(rows)["memcpy"]
    mcr = dict(rows)["memcpy into a resident buffer"]
    lines[-2] = "| path | ms | GB/s | vs redis GET over its Unix socket | of memcpy |"
    lines[-1] = "|---|---:|---:|---:|---:|"
    for name, t in rows:
        base = mcr if "resident" in name else mc
        lines.append(f"| {name} | {t * 1e3:.2f} | {nbytes / t / 1e9:.2f} | {peer / t:.2f}× "
                     f"| {base / t * 100:.0f} % |")
    if prefix:
        pb, pm = prefix["bytes"], dict(prefix["rows"])["memcpy"]
        lines += ["", f"Whole prefix: {a.prefix_layers} layers x {a.prefix_tokens} tokens x "
                  f"{a.kv_heads} heads x {a.head_dim} fp16, K and V = {pb / 2**30:.2f} GiB, into "
                  f"one resident array; median of {a.prefix_reps} (per-layer RAW replies over "
                  "the sockets; the shared-memory path of the Python client, one leased range "
                  "per session).", "",
                  "| path | ms | GB/s | of memcpy |", "|---|---:|---:|---:|"]
        for name, t in prefix["rows"]:
            lines.append(f"| {name} | {t * 1e3:.1f} | {pb / t / 1e9:.2f} | {pm / t * 100:.0f} % |")
    report(lines, a.out or REPO / "bench" / "results" / f"shm-{today}.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
