#!/usr/bin/python3
"""Fetching what the reader needs (issue 53): one layer of an 8B-shaped prefix (Llama-3-8B:
8 K/V heads of 128, bf16) read whole, by a tensor-parallel rank (HEADS: TP-4, 2 of the 8
heads) and in the reader's codec (AS fp8), over TCP and over the Unix socket's shared memory —
the stored (or transcoded) bytes an engine computes from, received straight into arrays.

One pion-server (--unixsocket) holds a namespace of --layers layers × --tokens tokens. Each
case fetches layers in turn (K and V of one layer per call, distinct layers so no read comes
from a cache warmed by the one before), --reps times, alternating the cases; the table gives
the bytes that crossed per layer, the median time per layer, and both as ratios to the full
bf16 layer fetch on the same transport. The server keeps the rows it shapes as a copy of the
session (--fetch-copies on, the default): AS rows at their first read, HEADS rows at their
second (a slice read once is not kept); the reads after come from the copy. The table gives
the first read of a layer, the second, and the median of the reads after (layers 1.. of each
rep, layer 0 having warmed the client), and the memory the copies took. Goals: TP-4 ≤ 0.3× the bytes and ≤ 0.35× the time;
AS fp8 over TCP ≤ 0.55× the bytes and ≤ 0.6× the time.

    /usr/bin/python3 bench/bench_fetch_shape.py --pion build/pion-server \\
        --out bench/results/fetch-shape-$(date +%F).md
"""
from __future__ import annotations

import argparse
import datetime
import os
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchutil import free_port, report  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "clients",
                                "python"))
import pion  # noqa: E402


def cpu_model() -> str:
    for line in open("/proc/cpuinfo"):
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pion", default="build/pion-server")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--fetch-copies", default="on", choices=["on", "off"],
                    help="the server's --fetch-copies (off: every read shapes its rows)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    work = tempfile.mkdtemp(prefix="pion-fetch-shape-")
    sock = os.path.join(work, "p.sock")
    port = free_port()
    log = open(os.path.join(work, "server.log"), "w")
    proc = subprocess.Popen([a.pion, "--port", str(port), "--unixsocket", sock, "--dir",
                             os.path.join(work, "data"), "--metrics-port", "0", "--binary-port",
                             "0", "--fetch-copies", a.fetch_copies],
                            stdout=log, stderr=subprocess.STDOUT)
    h, d, t, L = 8, 128, a.tokens, a.layers
    cases = {"full bf16": {}, "TP-4 rank 1 (HEADS 2 2)": {"heads": (2, 2)},
             "AS fp8": {"as_codec": "fp8"}}
    results = {}  # (transport, case) -> (seconds per layer list, bytes per layer)
    try:
        for _ in range(200):
            try:
                c0 = pion.Client(port=port)
                c0.ping()
                break
            except Exception:  # noqa: BLE001 - starting
                time.sleep(0.05)
        rng = np.random.default_rng(53)
        clients = {"tcp": c0, "unix socket (shm)": pion.Client(unix_socket_path=sock)}
        # One namespace per transport, so each transport's first reads shape its copies.
        spaces = {"tcp": "shape", "unix socket (shm)": "shapeu"}
        x = rng.standard_normal((t, h, d)).astype(np.float32)
        for ns in spaces.values():
            c0.kv.register(ns, L, t, h, d, "bf16")
            for layer in range(L):
                c0.kv.store_layer(ns, layer, x, x)
        def extra_of(kw):
            out = [] if "heads" not in kw else ["HEADS", *kw["heads"]]
            return out + ([] if "as_codec" not in kw else ["AS", kw["as_codec"]])

        def fetch_bytes(transport, c, layer, kw):
            """K and V of one layer as the bytes an engine computes from (RAW: no decode)."""
            lo, hi = layer * t, (layer + 1) * t
            ns = spaces[transport]
            if transport == "tcp":
                return c.fetch_many([("V.FETCH", ns + sfx, "RANGE", lo, hi, "RAW",
                                      *extra_of(kw)) for sfx in ("_pk", "_pv")])
            ch = c._shm_channel()
            return c._shm_copy_many(ch, [(ns + sfx, lo, hi) for sfx in ("_pk", "_pv")],
                                    extra=extra_of(kw))

        firsts, seconds = {}, {}
        mem = lambda: int(c0.execute("INFO", "memory")["used_memory_vstore"])  # noqa: E731
        mem_before = mem()
        for transport, c in clients.items():
            for name, kw in cases.items():  # warm: the first call maps segments, etc.
                fetch_bytes(transport, c, 0, kw)
                # ... and the helpers agree with the bytes (what a model would decode)
                c.kv.fetch_layer(spaces[transport], 0, **kw)
        for rep in range(a.reps):
            for transport, c in clients.items():
                names = list(cases) if rep % 2 == 0 else list(reversed(cases))
                for name in names:
                    kw = cases[name]
                    times = results.setdefault((transport, name), [])
                    first = firsts.setdefault((transport, name), [])
                    second = seconds.setdefault((transport, name), [])
                    for layer in range(L):
                        t0 = time.perf_counter()
                        fetch_bytes(transport, c, layer, kw)
                        if layer > 0:
                            (first if rep == 0 else second if rep == 1 else times).append(
                                time.perf_counter() - t0)
        # The bytes that cross per layer (K and V): the reply sizes.
        lo, hi = 0, t
        nbytes = {}
        for name, kw in cases.items():
            extra = [] if "heads" not in kw else ["HEADS", *kw["heads"]]
            extra += [] if "as_codec" not in kw else ["AS", kw["as_codec"]]
            nbytes[name] = 2 * len(c0.execute("V.FETCH", "shape_pk", "RANGE", lo, hi, "RAW",
                                              *extra))
        mem_copies = mem() - mem_before
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    lines = ["# Fetching what the reader needs: TP heads and transcoding on read", "",
             "- date: %s UTC" % datetime.datetime.utcnow().strftime("%Y-%m-%d %H:%M"),
             "- machine: %s, %d cores" % (cpu_model(), os.cpu_count()),
             "- commit: %s; one layer = K and V of %d tokens × %d heads × %d, stored bf16; "
             "%d layers in turn, %d reps; --fetch-copies %s" % (commit, t, h, d, L, a.reps,
                                                                a.fetch_copies),
             "- command: `/usr/bin/python3 bench/bench_fetch_shape.py %s`" % " ".join(sys.argv[1:]),
             "", "| transport | fetch | bytes / layer | ratio | ms / layer, reads after the "
             "second (median) | ratio | first read: ms | ratio | second read: ms | ratio |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for transport in ("tcp", "unix socket (shm)"):
        base_t = statistics.median(results[(transport, "full bf16")])
        base_f = statistics.median(firsts[(transport, "full bf16")])
        base_s = statistics.median(seconds[(transport, "full bf16")])
        for name in cases:
            med = statistics.median(results[(transport, name)])
            fst = statistics.median(firsts[(transport, name)])
            snd = statistics.median(seconds[(transport, name)])
            lines.append("| %s | %s | %d | %.3f | %.2f | %.3f | %.2f | %.3f | %.2f | %.3f |" % (
                transport, name, nbytes[name], nbytes[name] / nbytes["full bf16"], med * 1e3,
                med / base_t, fst * 1e3, fst / base_f, snd * 1e3, snd / base_s))
    prefix_bytes = len(spaces) * L * nbytes["full bf16"]
    lines += ["", "Goals: TP-4 ≤ 0.3× bytes and ≤ 0.35× time (both transports); AS fp8 over TCP "
              "≤ 0.55× bytes and ≤ 0.6× time.", "",
              "Copies kept by the shaped reads (`used_memory_vstore` after the run less before "
              "it): %.1f MiB, %.2f× the prefixes' %.1f MiB (per namespace, one TP-4 rank's heads "
              "and the fp8 transcode of %d layers of K and V)." % (
                  mem_copies / 2**20, mem_copies / prefix_bytes, prefix_bytes / 2**20, L)]
    report(lines, a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
