"""Deadline admission: how well the attention cost model estimates a query before it runs.

A real pion-server (CPU backend by default) holds slots of the shapes users run (GQA 32/8,
head dim 128) in each K/V dtype at a few prefix lengths, each a distinct layer so no query
reads another's bytes from cache. Every ATTEND.PREFIX form runs --reps times with RECEIPT, and
each receipt's `estimate_us` (what the server expected, from rates it measured) is compared
with its `micros` (what the computation took): the ratio's p50 and p95 (and p5), per form and
dtype. The issue's contract: a query that takes T is never refused with a deadline >= 1.5·T,
so estimate / actual must stay under 1.5.

Then the ALLOW APPROX trade: for each dense decode row, a deadline of half the exact step —
the exact answer (refused without ALLOW APPROX), the sparse answer's time, its estimate, and
whether sparse really came sooner (it is used only when estimated so).

    /usr/bin/python3 bench/bench_deadline.py --pion build/pion-server --out \\
        bench/results/deadline-$(date +%F).md
"""
from __future__ import annotations

import argparse
import datetime
import os
import socket
import subprocess
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchutil import cpu_model, report, start_pion  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "clients",
                                "python"))
import pion  # noqa: E402


def store_slot(c, layer, k, v, dt):
    """A slot of k/v [H][N][D] stored as dtype dt: ("bench", layer), or for fp8 ("bench<layer>",
    0) bound from an fp8 KV.PREFIX namespace (the server's own encoder). Returns (sid, layer)."""
    hkv, n, d = k.shape
    if dt == "fp32":
        blobs = (k.tobytes(), v.tobytes())
    elif dt == "fp16":
        blobs = (k.astype(np.float16).tobytes(), v.astype(np.float16).tobytes())
    elif dt == "bf16":
        blobs = tuple((x.view(np.uint32) >> 16).astype(np.uint16).tobytes() for x in (k, v))
    else:
        ns = "bench-ns%d" % layer
        c.execute("KV.PREFIX.REGISTER", ns, 1, n, hkv, d, dt)
        for part, x in (("pk", k), ("pv", v)):
            c.execute("V.STOREBATCH", ns + "_" + part, 0,
                      np.ascontiguousarray(x.transpose(1, 0, 2)).tobytes())
        c.execute("ATTEND.PREFIX.STORE", "bench%d" % layer, 0, "FROM", ns)
        c.execute("KV.PREFIX.DROP", ns)
        return "bench%d" % layer, 0
    c.execute("ATTEND.PREFIX.STORE", "bench", layer, hkv, n, d, *blobs, "DTYPE", dt)
    return "bench", layer


def pct(xs, p):
    return float(np.percentile(np.asarray(xs), p)) if xs else float("nan")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pion", default="build/pion-server")
    ap.add_argument("--backend", default="cpu")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--lengths", default="4096,16384,32768")
    ap.add_argument("--dtypes", default="fp32,fp16,bf16,fp8")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    proc, port, work = start_pion(a.pion, ["--attention-backend", a.backend, "--binary-port",
                                           "0"])
    hq, hkv, d = 32, 8, 128
    lengths = [int(x) for x in a.lengths.split(",")]
    dtypes = a.dtypes.split(",")
    rng = np.random.default_rng(2026)
    rows = []  # (form, dtype, n, [ratios], [micros])
    approx = []
    try:
        c = pion.Client(port=port, socket_timeout=120)
        layer = 0
        slots = {}
        for dt in dtypes:
            for n in lengths:
                k = rng.standard_normal((hkv, n, d)).astype(np.float32)
                v = rng.standard_normal((hkv, n, d)).astype(np.float32)
                slots[(dt, n)] = store_slot(c, layer, k, v, dt)
                layer += 1
        hm = np.repeat(np.arange(hkv, dtype=np.int32), hq // hkv)
        q1 = rng.standard_normal((hq, d)).astype(np.float32)
        q16 = rng.standard_normal((hq, 16, d)).astype(np.float32)
        s_suf = 16
        ks = rng.standard_normal((hkv, s_suf, d)).astype(np.float32)
        forms = {
            "dense m1": lambda sl, n: ("ATTEND.PREFIX.QUERY", *sl, hq, d, 0, q1.tobytes()),
            "dense m16": lambda sl, n: ("ATTEND.PREFIX.QUERY", *sl, hq, d, 0,
                                        q16.tobytes()),
            "fused m16": lambda sl, n: ("ATTEND.PREFIX.QUERY_FUSED", *sl, hq, d, s_suf,
                                       hkv, q16.tobytes(), ks.tobytes(), ks.tobytes(),
                                       hm.tobytes()),
            "sparse_auto 1/8 shared": lambda sl, n: (
                "ATTEND.PREFIX.QUERY_SPARSE_AUTO", *sl, hq, d, 64, max(1, n // 64 // 8),
                hkv, q1.tobytes(), hm.tobytes(), "SHARED"),
        }
        for name, make in forms.items():
            for dt in dtypes:
                ratios, micros = [], []
                for n in lengths:
                    sl = slots[(dt, n)]
                    for rep in range(a.reps + 2):
                        _, rc = c.execute(*make(sl, n), "RECEIPT")
                        r = pion.parse_receipt(rc)
                        if rep < 2:  # the first runs of a kind measure it
                            continue
                        if r["estimate_us"] > 0:
                            ratios.append(r["estimate_us"] / r["micros"])
                        micros.append(r["micros"])
                rows.append((name, dt, ratios, micros))
        # ALLOW APPROX at half the exact decode step.
        for dt in dtypes:
            n = lengths[-1]
            q = ("ATTEND.PREFIX.QUERY", *slots[(dt, n)], hq, d, 0, q1.tobytes())
            exact = [pion.parse_receipt(c.execute(*q, "RECEIPT")[1])["micros"] for _ in range(5)]
            t_exact = float(np.median(exact))
            deadline = max(1, int(t_exact / 2000))
            try:
                _, rc = c.execute(*q, "RECEIPT", "DEADLINE", deadline, "ALLOW", "APPROX")
                r = pion.parse_receipt(rc)
                approx.append((dt, n, t_exact, deadline, r["form"], r["micros"],
                               r["estimate_us"], r.get("omitted_mass_estimate", 0.0)))
            except pion.DeadlineError as e:
                approx.append((dt, n, t_exact, deadline, "refused", 0.0, 0.0, str(e)[:60]))
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    lines = [
        "# Deadline admission: estimate / actual of the attention cost model",
        "",
        "- date: %s UTC" % datetime.datetime.utcnow().strftime("%Y-%m-%d %H:%M"),
        "- machine: %s, %d cores, %s" % (cpu_model(), os.cpu_count(), socket.gethostname()),
        "- commit: %s; backend %s; GQA %d/%d, d %d; prefix lengths %s; %d reps per length" % (
            commit, a.backend, hq, hkv, d, a.lengths, a.reps),
        "- command: `/usr/bin/python3 bench/bench_deadline.py %s`" % " ".join(sys.argv[1:]),
        "",
        "Estimate / actual (`estimate_us / micros` of each receipt; the refusal contract needs it "
        "below 1.5):",
        "",
        "| form | dtype | p5 | p50 | p95 | max | actual p50 (µs) | queries |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    worst = 0.0
    for name, dt, ratios, micros in rows:
        worst = max(worst, max(ratios) if ratios else 0)
        lines.append("| %s | %s | %.2f | %.2f | %.2f | %.2f | %.0f | %d |" % (
            name, dt, pct(ratios, 5), pct(ratios, 50), pct(ratios, 95),
            max(ratios) if ratios else float("nan"), pct(micros, 50), len(ratios)))
    lines += ["", "Largest estimate / actual over every query: %.2f" % worst, "",
              "ALLOW APPROX with a deadline of half the exact decode step (N = %d):" % lengths[-1],
              "", "| dtype | exact (µs) | deadline (ms) | answer | its time (µs) | its estimate "
              "(µs) | omitted mass (est.) |", "|---|---:|---:|---|---:|---:|---:|"]
    for dt, n, t_exact, deadline, form, micros, est, om in approx:
        lines.append("| %s | %.0f | %d | %s | %.0f | %.0f | %s |" % (
            dt, t_exact, deadline, form, micros, est,
            ("%.3f" % om) if isinstance(om, float) else om))
    report(lines, a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
