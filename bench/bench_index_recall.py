#!/usr/bin/python3
"""ATTEND.QUERY recall@32 and latency on hard keys, at the default settings and with EXACT,
against numpy's exact scan of the same keys in the same run.

Keys (--rows x --dim, inner product): isotropic Gaussian; clustered (64 centres of scale 3 plus
unit noise); Gaussian with 4 channels of 12x magnitude (as real K have). Queries are independent
Gaussians — out of distribution for the keys, as attention queries are. For each: FINALIZE time
and the plan the calibration chose (an exact scan, or a beam), then per form the mean and the
worst recall@32 over --queries queries, p50/p99 latency over loopback (redis-py, one query per
request) and the receipt; numpy's top-32 scan in this process is the peer.

Run:  /usr/bin/python3 bench/bench_index_recall.py      writes bench/results/index-recall-<date>.md
"""
from __future__ import annotations

import argparse
import datetime as dt
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import redis

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "bench"))
from bench_protocol import git_info, machine_info  # noqa: E402
from benchutil import report, start_pion  # noqa: E402


def parse(m):
    return {m[i].decode(): m[i + 1] for i in range(0, len(m), 2)}


def keysets(rng, n, d):
    iso = rng.standard_normal((n, d)).astype(np.float32)
    clus = rng.standard_normal((n, d)).astype(np.float32)
    clus += (3 * rng.standard_normal((64, d)).astype(np.float32))[rng.integers(0, 64, n)]
    outl = rng.standard_normal((n, d)).astype(np.float32)
    outl[:, :4] *= 12
    return {"isotropic": iso, "clustered": clus, "outlier channels": outl}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bin", default=str(REPO / "build"))
    ap.add_argument("--rows", type=int, default=20000)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--queries", type=int, default=200)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    n, d, k = a.rows, a.dim, 32
    rng = np.random.default_rng(2026)
    proc, port, _work = start_pion(str(Path(a.bin) / "pion-server"), ["--binary-port", "0"])
    lines = [
        "# ATTEND.QUERY recall on hard keys (%s)" % dt.date.today().isoformat(), "",
        "- machine: %s" % machine_info(),
        "- commit: %s" % git_info(),
        "- command: `/usr/bin/python3 bench/bench_index_recall.py %s`" % " ".join(sys.argv[1:]),
        "- %d keys of dim %d, METRIC ip, defaults (M 16, EF_CONSTRUCTION 200); %d Gaussian "
        "queries, k = 32, one per request over loopback (redis-py); recall@32 against numpy's "
        "exact top-32 (float64)" % (n, d, a.queries), "",
        "| keys | FINALIZE s | form | receipt (exact, ef, recall estimate) | recall@32 mean | "
        "worst | p50 ms | p99 ms |", "|---|---|---|---|---|---|---|---|",
    ]
    try:
        r = redis.Redis(port=port, socket_timeout=300)
        for name, keys in keysets(rng, n, d).items():
            sid = "idx-" + name.replace(" ", "-")
            r.execute_command("ATTEND.CREATE", sid, d, 4, "METRIC", "ip")
            r.execute_command("ATTEND.STORE", sid, keys.tobytes(),
                              np.zeros((n, 4), np.float32).tobytes())
            t0 = time.perf_counter()
            r.execute_command("ATTEND.FINALIZE", sid)
            build = time.perf_counter() - t0
            qs = rng.standard_normal((a.queries, d)).astype(np.float32)
            k64 = keys.astype(np.float64)
            truth = [set(np.argsort(-(k64 @ q.astype(np.float64)))[:k]) for q in qs]
            for form, extra in (("default", []), ("EXACT", ["EXACT"]), ("EF 1280", ["EF", 1280])):
                rec, ts, m = [], [], {}
                for i, q in enumerate(qs):
                    t1 = time.perf_counter()
                    m = parse(r.execute_command("ATTEND.QUERY", sid, k, q.tobytes(), *extra))
                    ts.append(time.perf_counter() - t1)
                    rec.append(len(set(np.frombuffer(m["ids"], np.uint32)) & truth[i]) / k)
                lines.append("| %s | %.2f | %s | %s, %s, %.3f | %.3f | %.3f | %.3f | %.3f |" % (
                    name, build, form, int(m["exact"]), int(m["ef"]),
                    float(m["recall_estimate"]), np.mean(rec), np.min(rec),
                    np.percentile(ts, 50) * 1e3, np.percentile(ts, 99) * 1e3))
            ts = []
            for q in qs:
                t1 = time.perf_counter()
                np.argpartition(-(keys @ q), k)[:k]
                ts.append(time.perf_counter() - t1)
            lines.append("| %s | | numpy scan in-process (peer) | exact | 1.000 | 1.000 | %.3f "
                         "| %.3f |" % (name, np.percentile(ts, 50) * 1e3,
                                       np.percentile(ts, 99) * 1e3))
            r.execute_command("ATTEND.DROP", sid)
    finally:
        proc.kill()
        proc.wait()
    out = a.out or REPO / "bench" / "results" / ("index-recall-%s.md" % dt.date.today().isoformat())
    report(lines, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
