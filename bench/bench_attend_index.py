#!/usr/bin/python3
"""The HNSW attention index (ATTEND.*) over RESP, with a brute-force scan as the baseline in the
same run: STORE throughput (tokens/s), FINALIZE build time and its recall estimate, QUERY latency
(k = 32, one query per request, p50/p99 over loopback with redis-py) and recall@32 against an
exact numpy scan of the same keys — plus the scan's own latency (numpy, in this process: what
attending over a retrieved top-k would cost without the index).

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
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import redis

REPO = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
    port = free_port()
    work = Path(tempfile.mkdtemp(prefix="pion-index-bench-"))
    srv = subprocess.Popen([a.pion, "--port", str(port), "--dir", str(work / "data"),
                            "--metrics-port", "0"], stdout=open(work / "server.log", "w"),
                           stderr=subprocess.STDOUT)
    try:
        r = redis.Redis(port=port, socket_timeout=600)
        for _ in range(100):
            try:
                r.ping()
                break
            except redis.ConnectionError:
                time.sleep(0.05)
        rng = np.random.default_rng(1)
        # Attention-like keys: clustered (heads attend to structure), values random.
        centers = 2 * rng.standard_normal((64, d)).astype(np.float32)
        keys = (rng.standard_normal((n, d)).astype(np.float32) + centers[rng.integers(0, 64, n)])
        values = rng.standard_normal((n, d)).astype(np.float32)
        r.execute_command("ATTEND.CREATE", "bench", d, d)
        batch = 8192
        t0 = time.perf_counter()
        for i in range(0, n, batch):
            r.execute_command("ATTEND.STORE", "bench", keys[i:i + batch].tobytes(),
                              values[i:i + batch].tobytes())
        store_s = time.perf_counter() - t0
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
                lat, ids = [], []
                extra = ["EF", ef] if ef else []
                for i in range(len(q)):
                    t = time.perf_counter()
                    rep = r.execute_command("ATTEND.QUERY", "bench", k, q[i].tobytes(), *extra)
                    lat.append((time.perf_counter() - t) * 1e6)
                    m = {rep[j].decode(): rep[j + 1] for j in range(0, len(rep), 2)}
                    ids.append(np.frombuffer(m["ids"], "<u4"))
                recall = np.mean([len(set(ids[i]) & set(exact[i])) / k for i in range(len(q))])
                rows.append((name, ef or 320, pct(lat, 50), pct(lat, 99), recall, scan_us))
                print(rows[-1], flush=True)
    finally:
        srv.terminate()
        srv.wait(timeout=10)
    lines = [
        "# ATTEND.* HNSW index over RESP, with a brute-force scan (%s)" % dt.date.today(),
        "",
        "Command: `/usr/bin/python3 bench/bench_attend_index.py --pion build/pion-server "
        "--tokens %d` (%s, %d cores). One session, key_dim = value_dim = %d, clustered keys, "
        "default parameters (METRIC ip, M 16, EF_CONSTRUCTION 200, query EF 320), k = %d. "
        "Latency is one query per request over loopback through redis-py (its client overhead "
        "included); the brute-force scan is numpy's exact top-k of one query over the same keys in "
        "this process (keys @ q, then argpartition)." % (
            n, platform.processor() or platform.machine(), os.cpu_count(), d, k),
        "",
        "| stage | result |",
        "|---|---|",
        "| ATTEND.STORE (RESP, batches of 8192 tokens) | %.2f M tokens/s (%.2f s for %d tokens) |"
        % (n / store_s / 1e6, store_s, n),
        "| ATTEND.FINALIZE | %.1f s (server build_ms %.0f), recall estimate %.3f |" % (
            build_s, float(fin["build_ms"]), float(fin["recall_estimate"])),
        "",
        "| queries | EF | QUERY p50 µs | p99 µs | recall@%d | brute-force scan µs per query |" % k,
        "|---|---|---|---|---|---|",
    ]
    for name, ef, p50, p99, recall, scan in rows:
        lines.append("| %s | %d | %.0f | %.0f | %.3f | %.0f |" % (name, ef, p50, p99, recall,
                                                                  scan))
    text = "\n".join(lines) + "\n"
    print(text)
    out = Path(a.out) if a.out else REPO / "bench" / "results" / (
        "attend-index-%s.md" % dt.date.today())
    out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
