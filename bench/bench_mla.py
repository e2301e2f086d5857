#!/usr/bin/python3
"""MLA (issue 52) on the CPU: ATTEND.PREFIX.QUERY_MLA end to end over loopback, with numpy
computing the same absorbed attention in the same run as the peer.

Starts pion-server (--compute-threads = the machine's cores), binds an MLA slot FROM an MLA
namespace per storage (bf16, and DeepSeek-V3.2's fp8_ds_mla) of DeepSeek's shape (kv_lora_rank
512 + rope_dim 64), checks one reply against a float64 numpy reference (|err| <= 2e-5·(1+|ref|)),
then times, one request in flight on one connection:
  pion      QUERY_MLA (dense: M = 1 decode, M = 2 MTP) and QUERY_MLA_SPARSE (2048 rows a token,
            DeepSeek-V3.2's top-k), H_q = 128: p50 / p90 of the round trip and of the receipt's
            `micros` (the computation in the server)
  numpy     the same computation in this process, float32 (BLAS matmuls) over the latents
            already decoded to float32 in its memory — what a client with the latents at hand
            would pay; alternated with pion call by call, so both see the same machine load
Reports the medians and the ratio pion / numpy; writes bench/results/mla-cpu-<date>.md.

    /usr/bin/python3 bench/bench_mla.py [--bin build] [--seconds 3] [--tokens 4096,32768]
"""
from __future__ import annotations

import argparse
import datetime as dt
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import redis

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_protocol import free_port, git_info, machine_info, start_server, stop  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "clients" / "python"))
from pion import codecs  # noqa: E402

R, P, HQ = 512, 64, 128
DK = R + P
SCALE = 1.0 / np.sqrt(192.0)


def numpy_mla(q, c, lists=None):
    """The peer: float32 absorbed attention, q [H, M, DK] over c [N, DK] (rows visible to all)."""
    h, m, _ = q.shape
    out = np.empty((h, m, R), np.float32)
    for i in range(m):
        rows = c if lists is None else c[lists[i]]
        s = (q[:, i, :] @ rows.T) * np.float32(SCALE)
        s -= s.max(axis=1, keepdims=True)
        np.exp(s, out=s)
        s /= s.sum(axis=1, keepdims=True)
        out[:, i, :] = s @ rows[:, :R]
    return out


def reference(q, c, lists=None):
    q, c = q.astype(np.float64), c.astype(np.float64)
    out = np.empty((q.shape[0], q.shape[1], R))
    for i in range(q.shape[1]):
        rows = c if lists is None else c[lists[i]]
        s = SCALE * (q[:, i, :] @ rows.T)
        w = np.exp(s - s.max(axis=1, keepdims=True))
        out[:, i, :] = (w @ rows[:, :R]) / w.sum(axis=1, keepdims=True)
    return out


def stats(xs):
    xs = sorted(xs)
    return xs[len(xs) // 2], xs[int(len(xs) * 0.9)]


def timed(fn, seconds, min_runs=5):
    lat, end = [], time.perf_counter() + seconds
    while time.perf_counter() < end or len(lat) < min_runs:
        t0 = time.perf_counter()
        fn()
        lat.append((time.perf_counter() - t0) * 1e6)
    return lat


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", default=str(REPO / "build"))
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--tokens", default="4096,32768")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    ns_tokens = [int(x) for x in a.tokens.split(",")]
    tmp = Path(tempfile.mkdtemp(prefix="bench_mla_"))
    port = free_port()
    import os
    threads = os.cpu_count() or 1
    srv = start_server([str(Path(a.bin) / "pion-server"), "--port", str(port), "--binary-port",
                        "0", "--metrics-port", "0", "--dir", str(tmp / "data"),
                        "--compute-threads", str(threads)], port, "pion", tmp / "pion.log")
    rows = []
    try:
        r = redis.Redis(port=port)
        rng = np.random.default_rng(0)
        for n in ns_tokens:
            c = rng.standard_normal((n, DK)).astype(np.float32)
            for fmt in ("bf16", "fp8_ds_mla"):
                ns = f"b{n}{fmt}"
                r.execute_command("KV.PREFIX.REGISTER", ns, 1, n, "MLA", R, P, fmt)
                r.execute_command("V.STOREBATCH", ns + "_pl", 0, c.tobytes())
                r.execute_command("ATTEND.PREFIX.STORE", ns, 0, "FROM", ns)
                stored = codecs.decode(fmt, DK, 0, r.execute_command(
                    "V.FETCH", ns + "_pl", "RANGE", 0, n, "RAW"))
                forms = [("decode M=1", 1, None), ("MTP M=2", 2, None)]
                if n >= 4096:
                    forms.append(("sparse 2048/token", 1,
                                  [np.sort(rng.choice(n, 2048, replace=False))]))
                for name, m, lists in forms:
                    q = rng.standard_normal((HQ, m, DK)).astype(np.float32)
                    if lists is None:
                        cmd = ("ATTEND.PREFIX.QUERY_MLA", ns, 0, HQ, R, P, repr(SCALE),
                               q.tobytes(), "RECEIPT")
                    else:
                        idx = np.array(lists, np.int32)
                        cmd = ("ATTEND.PREFIX.QUERY_MLA_SPARSE", ns, 0, HQ, R, P, repr(SCALE),
                               idx.shape[1], q.tobytes(), idx.tobytes(),
                               np.array([idx.shape[1]], np.int32).tobytes(), "RECEIPT")
                    reply, _ = r.execute_command(*cmd)
                    got = np.frombuffer(reply, "<f4")[:HQ * m * R].reshape(HQ, m, R)
                    want = reference(q, stored, lists)
                    err = float(np.max(np.abs(got - want) / (1 + np.abs(want))))
                    assert err <= 2e-5, (n, fmt, name, err)
                    micros = []

                    def call():
                        _, rc = r.execute_command(*cmd)
                        micros.append(float(rc[rc.index(b"micros") + 1]))

                    # Alternated call by call, so both see the machine's load alike.
                    lat, peer = [], []
                    end = time.perf_counter() + 2 * a.seconds
                    while time.perf_counter() < end or len(lat) < 5:
                        lat += timed(call, 0, min_runs=1)
                        peer += timed(lambda: numpy_mla(q, stored, lists), 0, min_runs=1)
                    row = {"n": n, "fmt": fmt, "form": name, "pion": stats(lat),
                           "server": stats(micros), "numpy": stats(peer), "err": err,
                           "runs": len(lat)}
                    rows.append(row)
                    print("N=%-6d %-10s %-18s pion p50 %9.0f us (server %9.0f)  numpy p50 "
                          "%9.0f us  pion/numpy %.2f  max rel err %.1e" % (
                              n, fmt, name, row["pion"][0], row["server"][0], row["numpy"][0],
                              row["pion"][0] / row["numpy"][0], err), flush=True)
    finally:
        stop(srv)
    mi = machine_info()
    out = Path(a.out) if a.out else REPO / "bench" / "results" / (
        "mla-cpu-%s.md" % dt.date.today().isoformat())
    lines = [
        "# MLA on the CPU: ATTEND.PREFIX.QUERY_MLA end to end (issue 52)",
        "",
        "`/usr/bin/python3 bench/bench_mla.py %s` — %s; %s cores (%s, %s), %s compute threads; "
        "one connection, one request in flight, H_q = %d, kv_lora_rank %d + rope_dim %d, scale "
        "1/sqrt(192); pion and numpy alternated call by call for %.0f s each per case." % (" ".join(sys.argv[1:]), git_info(), mi["nproc"],
                                            mi["cpu"], mi["memory"], threads, HQ, R, P,
                                            a.seconds),
        "",
        "pion: round trip over loopback (redis-py), and `micros` from the receipt (the "
        "computation in the server). numpy: the same float32 computation in the client's "
        "process over latents already decoded in its memory (BLAS), the peer of the same run. "
        "Every reply checked against float64 (max relative error shown).",
        "",
        "| N | storage | form | pion p50 (p90) µs | server p50 µs | numpy p50 (p90) µs | "
        "pion / numpy | max err |",
        "|---:|---|---|---:|---:|---:|---:|---:|",
    ]
    for x in rows:
        lines.append("| %d | %s | %s | %.0f (%.0f) | %.0f | %.0f (%.0f) | %.2f | %.1e |" % (
            x["n"], x["fmt"], x["form"], x["pion"][0], x["pion"][1], x["server"][0],
            x["numpy"][0], x["numpy"][1], x["pion"][0] / x["numpy"][0], x["err"]))
    out.write_text("\n".join(lines) + "\n")
    print("wrote", out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
