#!/usr/bin/python3
"""The Python client's fetch forms, each against the fastest form for the same result, on TCP
loopback and on the Unix socket (shared memory), in one run.

Stores one layer (--tokens x --kv-heads x --head-dim in --format, fp16 = 8 MiB by default) as a
KV.PREFIX namespace and times (median of --reps after a warm-up), with a fresh result each call
unless the form takes `into=`:

  stored bytes   v.fetch_raw(decode=False), the same with into=, redis-py's V.FETCH ... RAW
                 (the plain redis client), and Redis GET of the same bytes (the peer)
  float32 rows   v.fetch_raw() (decode here), the same with into=, v.fetch() (decoded by the
                 server)
  a layer's K, V kv.fetch_layer(), kv.fetch_layer(raw=True), and the two rows fetches that
                 give the same arrays ((fetch_raw(K), fetch_raw(V)), (fetch(K), fetch(V)))

Each row's ratio is to the fastest Pion form of its group and transport; the goal is <= 1.3 for
every form. (fetch_layers returns CUDA tensors: bench/bench_shm_gpu.py measures it on a GPU.)

Run:  /usr/bin/python3 bench/bench_client.py        writes bench/results/client-<date>.md
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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bin", default=str(REPO / "build"))
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--format", default="fp16")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=3, help="the whole set, interleaved")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    import pion

    t, h, d = a.tokens, a.kv_heads, a.head_dim
    tmp = Path(tempfile.mkdtemp(prefix="pion-bench-client-"))
    psock, rsock = str(tmp / "pion.sock"), str(tmp / "redis.sock")
    pport, rport = free_port(), free_port()
    pion_proc = start_server([str(Path(a.bin) / "pion-server"), "--port", str(pport), "--dir",
                              str(tmp / "data"), "--unixsocket", psock, "--binary-port", "0",
                              "--metrics-port", "0", "-w", "2"], pport, "pion-server",
                             tmp / "pion.log")
    redis_proc = start_server(["redis-server", "--port", str(rport), "--unixsocket", rsock,
                               "--save", "", "--appendonly", "no"], rport, "redis-server",
                              tmp / "redis.log")
    try:
        rng = np.random.default_rng(0)
        tcp = pion.Client(port=pport, socket_timeout=60)
        uds = pion.Client(unix_socket_path=psock, socket_timeout=60)
        tcp.kv.register("L", 1, t, h, d, a.format)
        tcp.kv.store_layer("L", 0, rng.standard_normal((t, h, d)).astype(np.float32),
                           rng.standard_normal((t, h, d)).astype(np.float32))
        sid = "L_pk"
        stored = bytes(tcp.v.fetch_raw(sid, 0, t, decode=False))
        rows_bytes = t * h * d * 4
        for r in (redis.Redis(port=rport), redis.Redis(unix_socket_path=rsock)):
            r.set("layer", stored)
        peers = {"tcp": redis.Redis(port=rport), "unix": redis.Redis(unix_socket_path=rsock)}
        raw_into = np.empty(len(stored), np.uint8)
        forms = {}
        for name, c in (("tcp", tcp), ("unix", uds)):
            forms[name] = [
                ("bytes", "v.fetch_raw(decode=False)",
                 lambda c=c: c.v.fetch_raw(sid, 0, t, decode=False)),
                ("bytes", "v.fetch_raw(decode=False, into=buf)",
                 lambda c=c: c.v.fetch_raw(sid, 0, t, decode=False, into=raw_into)),
                ("bytes", "redis-py V.FETCH RAW (plain client)",
                 lambda c=c: c.redis.execute_command("V.FETCH", sid, "RANGE", 0, t, "RAW")),
                ("bytes", "Redis GET (peer)", lambda p=peers[name]: p.get("layer")),
                ("rows", "v.fetch_raw()", lambda c=c: c.v.fetch_raw(sid, 0, t)),
                ("rows", "v.fetch_raw(into=buf)", lambda c=c: c.v.fetch_raw(sid, 0, t,
                                                                              into=raw_into)),
                ("rows", "v.fetch()", lambda c=c: c.v.fetch(sid, 0, t)),
                ("layer", "(v.fetch_raw(K), v.fetch_raw(V))",
                 lambda c=c: (c.v.fetch_raw("L_pk", 0, t), c.v.fetch_raw("L_pv", 0, t))),
                ("layer", "(v.fetch(K), v.fetch(V))",
                 lambda c=c: (c.v.fetch("L_pk", 0, t), c.v.fetch("L_pv", 0, t))),
                ("layer", "kv.fetch_layer()", lambda c=c: c.kv.fetch_layer("L", 0)),
                ("layer", "kv.fetch_layer(raw=True)", lambda c=c: c.kv.fetch_layer("L", 0,
                                                                                     raw=True)),
            ]
        times: dict = {}
        for _ in range(a.rounds):
            for name, fs in forms.items():
                for group, label, fn in fs:
                    times.setdefault((name, label), []).append(timed(fn, a.reps))
        best = {k: min(v) for k, v in times.items()}  # the best round of each form
        paths = {"tcp": "TCP loopback", "unix": "Unix socket + shared memory"}
        lines = [
            "# Python client fetch forms (%s)" % dt.date.today().isoformat(), "",
            "- machine: %s" % machine_info(),
            "- commit: %s" % git_info(),
            "- command: `/usr/bin/python3 bench/bench_client.py %s`" % " ".join(sys.argv[1:]),
            "- one layer: %d tokens x %d kv-heads x %d head-dim in %s: %.1f MiB stored, %.1f MiB "
            "as float32 rows; median of %d calls after a warm-up, best of %d interleaved rounds; "
            "a fresh result per call unless into=" % (
                t, h, d, a.format, len(stored) / 2**20, rows_bytes / 2**20, a.reps, a.rounds),
            "- ratio: to the fastest Pion form of the same group on the same transport; "
            "goal <= 1.30", "",
            "| transport | result | form | ms | GB/s | ratio |", "|---|---|---|---|---|---|",
        ]
        worst = 0.0
        twice_rows = {}
        for name, fs in forms.items():
            ref = {}
            for g in ("bytes", "rows", "layer"):
                ref[g] = min(best[(name, lbl)] for grp, lbl, _ in fs
                             if grp == g and "peer" not in lbl and "plain" not in lbl)
            twice_rows[name] = 2 * ref["rows"]
            for group, label, _ in fs:
                s = best[(name, label)]
                nbytes = {"bytes": len(stored), "rows": rows_bytes, "layer": 2 * rows_bytes}[group]
                ratio = s / ref[group]
                pion_form = "peer" not in label and "plain" not in label
                if pion_form:
                    worst = max(worst, ratio)
                lines.append("| %s | %s | %s | %.3f | %.2f | %.2f%s |" % (
                    paths[name], group, label, s * 1e3, nbytes / s / 1e9, ratio,
                    "" if pion_form else " (not a goal)"))
        lines += ["", "Worst ratio of a Pion form: %.2f (goal <= 1.30)." % worst, "",
                  "For comparison, twice the fastest rows form is %s: a layer (K and V both "
                  "held) costs about two rows results, because fresh results of 1 MiB or more "
                  "come from pion._pool's reused blocks (without it glibc returned the second "
                  "freed 16 MiB result to the system and the next pair faulted every page in "
                  "again: 16 ms for a TCP layer)." % ", ".join(
                      "%.3f ms (%s)" % (v * 1e3, paths[k]) for k, v in twice_rows.items())]
        out = a.out or REPO / "bench" / "results" / ("client-%s.md" % dt.date.today().isoformat())
        report(lines, out)
        tcp.close()
        uds.close()
    finally:
        stop(pion_proc)
        stop(redis_proc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
