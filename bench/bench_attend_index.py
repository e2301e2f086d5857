#!/usr/bin/python3
"""The HNSW attention index (ATTEND.*) over RESP and over the 0xCA5E binary protocol, with a
brute-force scan as the baseline in the same run: STORE throughput (tokens/s) on both
protocols, FINALIZE build time and its recall estimate, QUERY latency (k = 32, one query per
request, p50/p99 over loopback: redis-py on RESP, pion.BinaryClient on frames) with the
server's own time per query (ATTEND.INFO query_us), and recall@32 against an exact numpy scan of
the same keys — plus the scan's own latency (numpy, in this process: what finding the top-k
would cost a client without the index).

Run with Debian's python (numpy, redis):
  /usr/bin/python3 bench/bench_attend_index.py --pion build/pion-server [--tokens 131072]
Writes bench/results/attend-index-<date>.md.
"""
from __future__ import annotations

import argparse
import datetime as dt
import os
import platform
import socket
import sys
import time
from pathlib import Path

import numpy as np
import redis

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "bench"))
from benchutil import free_port, report, start_pion  # noqa: E402  (shared by the bench scripts)
sys.path.insert(0, str(REPO / "clients" / "python"))
import pion  # noqa: E402


def index_info(r) -> dict:
    m = r.execute_command("ATTEND.INFO", "bench")
    m = {m[i].decode(): m[i + 1] for i in range(0, len(m), 2)}
    return {"queries": int(m["queries"]), "query_us": float(m["query_us"])}


def loopback_gbps(total: int = 1 << 30, chunk: int = 8 << 20) -> float:
    """Python-to-Python TCP over loopback (sendall / recv_into): the ceiling of a client of
    this interpreter pushing bytes, measured in the same run."""
    import threading
    lsn = socket.socket()
    lsn.bind(("127.0.0.1", 0))
    lsn.listen(1)

    def sink():
        c, _ = lsn.accept()
        buf = memoryview(bytearray(chunk))
        got = 0
        while got < total:
            got += c.recv_into(buf)
        c.sendall(b"x")
        c.close()

    t = threading.Thread(target=sink)
    t.start()
    s = socket.create_connection(("127.0.0.1", lsn.getsockname()[1]))
    data = bytes(chunk)
    t0 = time.perf_counter()
    for _ in range(total // chunk):
        s.sendall(data)
    s.recv(1)
    dt = time.perf_counter() - t0
    t.join()
    s.close()
    lsn.close()
    return total / dt / 1e9


def pct(xs, p):
    return float(np.percentile(np.asarray(xs), p))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pion", default=str(REPO / "build" / "pion-server"))
    ap.add_argument("--tokens", type=int, default=131072)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--queries", type=int, default=300)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    n, d, k = a.tokens, a.dim, 32
    bport = free_port()
    srv, port, _ = start_pion(a.pion, ["--binary-port", str(bport)], "pion-index-bench-")
    try:
        r = redis.Redis(port=port, socket_timeout=600)
        rng = np.random.default_rng(1)
        # Attention-like keys: clustered (heads attend to structure), values random.
        centers = 2 * rng.standard_normal((64, d)).astype(np.float32)
        keys = (rng.standard_normal((n, d)).astype(np.float32) + centers[rng.integers(0, 64, n)])
        values = rng.standard_normal((n, d)).astype(np.float32)
        b = pion.BinaryClient(port=bport, timeout=600)
        batch = 8192
        # An untimed STORE first (the server's memory is faulted in once, then reused by the
        # allocator), then RESP into a scratch session, then frames into the indexed one.
        b.attend_create("warm", d, d)
        for i in range(0, n, batch):
            b.attend_store("warm", keys[i:i + batch], values[i:i + batch])
        b.attend_drop("warm")
        r.execute_command("ATTEND.CREATE", "resp", d, d)
        t0 = time.perf_counter()
        for i in range(0, n, batch):
            r.execute_command("ATTEND.STORE", "resp", keys[i:i + batch].tobytes(),
                              values[i:i + batch].tobytes())
        store_s = time.perf_counter() - t0
        r.execute_command("ATTEND.DROP", "resp")
        loop_gbps = loopback_gbps()
        b.attend_create("bench", d, d)
        t0 = time.perf_counter()
        for i in range(0, n, batch):
            b.attend_store("bench", keys[i:i + batch], values[i:i + batch])
        bstore_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        fin = r.execute_command("ATTEND.FINALIZE", "bench")
        build_s = time.perf_counter() - t0
        fin = {fin[i].decode(): fin[i + 1] for i in range(0, len(fin), 2)}
        # Queries: stored keys plus noise (key-distributed) and shifted ones.
        qs = {
            "key-distributed": keys[rng.integers(0, n, a.queries)] +
            0.3 * rng.standard_normal((a.queries, d)).astype(np.float32),
            "shifted": (1.5 * keys[rng.integers(0, n, a.queries)] +
                        0.5 * rng.standard_normal((a.queries, d)) + 0.3).astype(np.float32),
        }
        rows = []
        for name, q in qs.items():
            scores = q.astype(np.float32) @ keys.T
            exact = np.argpartition(-scores, k, axis=1)[:, :k]  # the exact top-k sets
            # The baseline's latency: one query scanned on its own (matvec + top-k), as a
            # client without the index would per decode step.
            t = time.perf_counter()
            for i in range(20):
                np.argpartition(-(keys @ q[i]), k)[:k]
            scan_us = (time.perf_counter() - t) * 1e6 / 20
            for ef in (64, None):
                lat, blat, ids = [], [], []
                extra = ["EF", ef] if ef else []
                before = index_info(r)
                for i in range(len(q)):
                    t = time.perf_counter()
                    rep = r.execute_command("ATTEND.QUERY", "bench", k, q[i].tobytes(), *extra)
                    lat.append((time.perf_counter() - t) * 1e6)
                    m = {rep[j].decode(): rep[j + 1] for j in range(0, len(rep), 2)}
                    ids.append(np.frombuffer(m["ids"], "<u4"))
                for i in range(len(q)):
                    t = time.perf_counter()
                    hit = b.attend_query("bench", k, q[i], ef=ef or 0)
                    blat.append((time.perf_counter() - t) * 1e6)
                    assert hit["ids"][0].tolist() == ids[i].tolist()  # same answer on both
                after = index_info(r)
                server_us = (after["query_us"] * after["queries"] - before["query_us"] *
                             before["queries"]) / (after["queries"] - before["queries"])
                recall = np.mean([len(set(ids[i]) & set(exact[i])) / k for i in range(len(q))])
                rows.append((name, ef or 320, pct(lat, 50), pct(lat, 99), pct(blat, 50),
                             pct(blat, 99), server_us, recall, scan_us))
                print(rows[-1], flush=True)
    finally:
        srv.terminate()
        srv.wait(timeout=10)
    lines = [
        "# ATTEND.* HNSW index over RESP and the binary protocol, with a brute-force scan (%s)"
        % dt.date.today(),
        "",
        "Command: `/usr/bin/python3 bench/bench_attend_index.py --pion build/pion-server "
        "--tokens %d` (%s, %d cores). One session, key_dim = value_dim = %d, clustered keys, "
        "default parameters (METRIC ip, M 16, EF_CONSTRUCTION 200, query EF 320), k = %d. "
        "Latency is one query per request over loopback, client overhead included (redis-py on "
        "RESP, pion.BinaryClient on the binary port); `server µs` is the server's own time per "
        "query (the search on a compute worker, ATTEND.INFO query_us, both protocols); the brute-force scan is numpy's exact top-k of one query over the same keys in "
        "this process (keys @ q, then argpartition)." % (
            n, platform.processor() or platform.machine(), os.cpu_count(), d, k),
        "",
        "| stage | result |",
        "|---|---|",
        "| ATTEND.STORE over RESP (batches of 8192 tokens, %d KiB per token) | %.2f M tokens/s "
        "(%.2f s for %d tokens, %.2f GB/s) |" % (2 * d * 4 // 1024, n / store_s / 1e6, store_s, n,
                                               n * 8 * d / store_s / 1e9),
        "| ATTEND.STORE over the binary protocol (same batches) | %.2f M tokens/s (%.2f s, "
        "%.2f GB/s) |" % (n / bstore_s / 1e6, bstore_s, n * 8 * d / bstore_s / 1e9),
        "| loopback TCP ceiling (Python to Python, 8 MiB sends, same run) | %.2f GB/s |"
        % loop_gbps,
        "| ATTEND.FINALIZE | %.1f s (server build_ms %.0f), recall estimate %.3f |" % (
            build_s, float(fin["build_ms"]), float(fin["recall_estimate"])),
        "",
        "| queries | EF | RESP p50 µs | RESP p99 µs | binary p50 µs | binary p99 µs | server µs "
        "| recall@%d | brute-force scan µs per query |" % k,
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, ef, p50, p99, bp50, bp99, server, recall, scan in rows:
        lines.append("| %s | %d | %.0f | %.0f | %.0f | %.0f | %.0f | %.3f | %.0f |" % (
            name, ef, p50, p99, bp50, bp99, server, recall, scan))
    report(lines, a.out or REPO / "bench" / "results" / ("attend-index-%s.md" % dt.date.today()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
