#!/usr/bin/env python3
"""Sparse-auto against dense on one server: ATTEND.PREFIX.QUERY_SPARSE_AUTO per query head and
with SHARED (the query heads of a K/V head choose one block set), next to the dense QUERY over
the same slot, all in one run.

  /usr/bin/python3 bench/bench_sparse_auto.py --server build/pion-server [--backend cpu|cuda]
      [--n 65536 --hq 32 --hkv 8 --d 128 --block 64 --k-top 62] [--out bench/results/x.md]

Each form's time is the server's own compute time from its RECEIPT (`micros`: the executor, no
network), the median of --reps queries after one warm-up. Every sparse reply is checked against
a float64 numpy reference over the rows its receipt says were chosen (max rel err shown).
"""
from __future__ import annotations

import argparse
import datetime as dt
import os
import platform
import sys
from pathlib import Path

import numpy as np
import redis

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchutil import report, start_pion  # noqa: E402


def receipt(reply) -> tuple[bytes, dict]:
    out, rc = reply
    fields = {rc[i].decode(): rc[i + 1] for i in range(0, len(rc), 2)}
    return out, fields


def reference(q, k, v, hm, blocks, b, n):
    """Each head h attends the rows of its chosen blocks (all visible: the query is at N)."""
    hq, d = q.shape
    out = np.zeros((hq, d))
    for h in range(hq):
        rows = np.concatenate([np.arange(x * b, min((x + 1) * b, n)) for x in blocks[h]])
        kk = k[hm[h], rows].astype(np.float64)
        s = kk @ q[h].astype(np.float64) / np.sqrt(d)
        p = np.exp(s - s.max())
        out[h] = (p / p.sum()) @ v[hm[h], rows].astype(np.float64)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--server", default="build/pion-server")
    ap.add_argument("--backend", default="cpu")
    ap.add_argument("--n", type=int, default=65536)
    ap.add_argument("--hq", type=int, default=32)
    ap.add_argument("--hkv", type=int, default=8)
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--block", type=int, default=64)
    ap.add_argument("--k-top", type=int, default=62)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--out", default=None, help="markdown results file")
    a = ap.parse_args()
    srv, port, _ = start_pion(Path(a.server).resolve(),
                              ["--binary-port", "0", "--attention-backend", a.backend],
                              "pion-sparse-bench-")
    try:
        r = redis.Redis(port=port)
        rng = np.random.default_rng(1)
        n, d, hq, hkv, b = a.n, a.d, a.hq, a.hkv, a.block
        k = rng.standard_normal((hkv, n, d), dtype=np.float32)
        v = rng.standard_normal((hkv, n, d), dtype=np.float32)
        q = rng.standard_normal((hq, d), dtype=np.float32) * 2
        hm = (np.arange(hq) // (hq // hkv)).astype(np.int32)
        assert r.execute_command("ATTEND.PREFIX.STORE", "bench", 0, hkv, n, d, k.tobytes(),
                                 v.tobytes()) == b"OK"

        def timed(name, *args):
            micros, last = [], None
            for i in range(a.reps + 1):
                last = receipt(r.execute_command(*args, "RECEIPT"))
                if i:
                    micros.append(float(last[1]["micros"]))
            return {"form": name, "us": float(np.median(micros)), "reply": last}

        dense = timed("dense", "ATTEND.PREFIX.QUERY", "bench", 0, hq, d, 0, q.tobytes())
        rows = [dense]
        for name, tail in (("sparse-auto, per head", []), ("sparse-auto, SHARED", ["SHARED"])):
            res = timed(name, "ATTEND.PREFIX.QUERY_SPARSE_AUTO", "bench", 0, hq, d, b, a.k_top,
                        hkv, q.tobytes(), hm.tobytes(), *tail)
            out, rc = res["reply"]
            blocks = [[int(x) for x in h] for h in rc["blocks"]]
            ref = reference(q, k, v, hm, blocks, b, n)
            got = np.frombuffer(out, "<f4").reshape(hq, d)
            res["err"] = float(np.max(np.abs(got - ref) / (1 + np.abs(ref))))
            assert res["err"] < 1e-4, (name, res["err"])
            res["rows"] = int(rc["rows_attended"])
            rows.append(res)
        for x in rows:
            print(x["form"], round(x["us"], 1), flush=True)
    finally:
        srv.terminate()
        srv.wait(timeout=10)

    lines = [
        "# Sparse-auto vs dense, %s backend (%s)" % (a.backend, dt.date.today()),
        "",
        "Command: `/usr/bin/python3 bench/bench_sparse_auto.py --server %s --backend %s --n %d "
        "--hq %d --hkv %d --d %d --block %d --k-top %d`" % (
            a.server, a.backend, n, hq, hkv, d, b, a.k_top),
        "",
        "Machine: %s, %d cores, %s. fp32 slot, one query per head at position N (M = 1); "
        "server compute µs = the receipt's `micros`, median of %d." % (
            platform.processor() or platform.machine(), os.cpu_count(), platform.platform(),
            a.reps),
        "",
        "| form | server compute µs | dense / form | rows attended (receipt: Σ over query "
        "heads) | max rel err vs numpy |",
        "|---|---|---|---|---|",
    ]
    for x in rows:
        lines.append("| %s | %.0f | %.2f× | %s | %s |" % (
            x["form"], x["us"], rows[0]["us"] / x["us"], x.get("rows", hq * n),
            "%.1e" % x["err"] if "err" in x else "—"))
    report(lines, a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
