"""The residency engine under pressure: ATTEND.PREFIX.QUERY latency by the tier its slot was in.

Attention slots whose total is twice the fastest tier's budget are queried in a skewed (Zipf)
order. Each query is classed by where its slot was just before it — GPU, host memory, disk —
and its latency compared in the same run with

  * the all-resident case: the same queries with every slot in the fastest tier;
  * the raw transfer of the same bytes: a read of a file of the slot's size on the same file
    system (from the page cache, as the server's spill reads are, and after dropping it from
    the cache), and on a GPU a host-to-device copy (pageable and pinned, torch).

Backends: `--backend cpu` (the 2-core box: host <-> disk, --maxmemory = half the slots) and
`--backend cuda` (the GPU machine: --gpu-memory = half the slots, --maxmemory = a quarter of them,
so a quarter are on disk only).

    /usr/bin/python3 bench/bench_residency.py --bin build                 # cpu, here
    python3 bench/bench_residency.py --bin build/devcarry/bin --backend cuda   # on the H200

Writes bench/results/residency-<backend>-<date>.md (or --out).
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import redis

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchutil import report, start_pion  # noqa: E402

REPO = Path(__file__).resolve().parent.parent


def p50(xs):
    return statistics.median(xs) if xs else float("nan")


def zipf_order(n_slots, n_queries, s, rng):
    ranks = np.arange(1, n_slots + 1, dtype=np.float64)
    p = ranks ** -s
    p /= p.sum()
    perm = rng.permutation(n_slots)  # which slot is hot is random
    return [int(perm[i]) for i in rng.choice(n_slots, size=n_queries, p=p)]


def tier_of(r, sid):
    m = r.execute_command("ATTEND.PREFIX.INFO", sid)[0]
    d = {m[i]: m[i + 1] for i in range(0, len(m), 2)}
    return d[b"tier"].decode()


def store_slots(r, n, h, rows, d, rng):
    for i in range(n):
        k = rng.standard_normal((h, rows, d)).astype(np.float32)
        v = rng.standard_normal((h, rows, d)).astype(np.float32)
        assert r.execute_command("ATTEND.PREFIX.STORE", f"s{i}", 0, h, rows, d, k.tobytes(),
                                 v.tobytes()) == b"OK"


def query(r, sid, h, d, q):
    t0 = time.perf_counter()
    r.execute_command("ATTEND.PREFIX.QUERY", sid, 0, h, d, 0, q)
    return time.perf_counter() - t0


def residency_info(r):
    return {k: v for k, v in r.info("residency").items()}


def raw_disk_read(directory: Path, nbytes: int, rounds: int = 5):
    """(page-cache read s, cold read s) of a file of nbytes on the same file system."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "raw-read.bin"
    with open(path, "wb") as f:
        f.write(os.urandom(nbytes))
        f.flush()
        os.fsync(f.fileno())
    warm, cold = [], []
    fd = os.open(path, os.O_RDONLY)
    try:
        buf = bytearray(nbytes)
        for _ in range(rounds):
            os.preadv(fd, [buf], 0)  # into the cache
            t0 = time.perf_counter()
            os.preadv(fd, [buf], 0)
            warm.append(time.perf_counter() - t0)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            t0 = time.perf_counter()
            os.preadv(fd, [buf], 0)
            cold.append(time.perf_counter() - t0)
    finally:
        os.close(fd)
        path.unlink()
    return p50(warm), p50(cold)


def raw_h2d(nbytes: int, rounds: int = 10):
    """(pageable s, pinned s) of a host-to-device copy of nbytes, or (nan, nan) without torch."""
    try:
        import torch
        if not torch.cuda.is_available():
            return float("nan"), float("nan")
    except ImportError:
        return float("nan"), float("nan")
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    out = []
    for pinned in (False, True):
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)
        host.fill_(1)
        times = []
        for _ in range(rounds):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            dev.copy_(host, non_blocking=False)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        out.append(p50(times[2:]))
    return out[0], out[1]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bin", default=str(REPO / "build"), help="directory with pion-server")
    ap.add_argument("--backend", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--slots", type=int, default=32)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--rows", type=int, default=None, help="tokens per slot")
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--queries", type=int, default=600)
    ap.add_argument("--zipf", type=float, default=1.1)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    rows = a.rows or (1024 if a.backend == "cpu" else 16384)
    slot = 2 * a.heads * rows * a.d * 4
    total = slot * a.slots
    rng = np.random.default_rng(2026)
    order = zipf_order(a.slots, a.queries, a.zipf, rng)
    q = rng.standard_normal((a.heads, a.d)).astype(np.float32).tobytes()
    binary = str(Path(a.bin) / "pion-server")
    common = ["-w", "2", "--attention-backend", a.backend, "--binary-port", "0"]

    # 1. Every slot in the fastest tier.
    budget = ["--maxmemory", str(total * 2)]
    if a.backend == "cuda":
        budget += ["--gpu-memory", str(total * 2)]
    proc, port, work = start_pion(binary, common + budget)
    try:
        r = redis.Redis(port=port, socket_timeout=120)
        store_slots(r, a.slots, a.heads, rows, a.d, np.random.default_rng(1))
        for sid in range(a.slots):
            query(r, f"s{sid}", a.heads, a.d, q)  # warm: summaries, caches, rates
        resident = []
        for sid in order:  # the same commands as run 2: the tier asked, then the query
            tier_of(r, f"s{sid}")
            resident.append(query(r, f"s{sid}", a.heads, a.d, q))
    finally:
        proc.kill()
        proc.wait()

    # 2. Twice the fastest tier's budget.
    if a.backend == "cpu":
        budget = ["--maxmemory", str(total // 2)]
    else:
        # A slot with a GPU copy needs no host copy (the engine drops the clean one), so the
        # two tiers hold 3/4 of the slots and the rest are on disk only.
        budget = ["--gpu-memory", str(total // 2), "--maxmemory", str(total // 4)]
    proc, port, work = start_pion(binary, common + budget)
    try:
        r = redis.Redis(port=port, socket_timeout=120)
        store_slots(r, a.slots, a.heads, rows, a.d, np.random.default_rng(1))
        for sid in range(a.slots):
            query(r, f"s{sid}", a.heads, a.d, q)
        before = residency_info(r)
        by_tier: dict[str, list[float]] = {"gpu": [], "host": [], "disk": []}
        for sid in order:
            t = tier_of(r, f"s{sid}")
            by_tier[t].append(query(r, f"s{sid}", a.heads, a.d, q))
        after = residency_info(r)
        disk_dir = work / "data" / "rawread"
        warm, cold = raw_disk_read(disk_dir, slot)
    finally:
        proc.kill()
        proc.wait()
    h2d_pageable, h2d_pinned = raw_h2d(slot) if a.backend == "cuda" else (float("nan"),) * 2

    def delta(k):
        return int(after.get(k, 0)) - int(before.get(k, 0))

    base = p50(resident)
    ms = lambda s: "%.3f" % (s * 1e3)  # noqa: E731
    fastest = "gpu" if a.backend == "cuda" else "host"
    lines = [
        "# Residency: query latency by the tier the slot was in (%s)" % a.backend, "",
        "- date: %s; machine: %s, %d cores; %s" % (
            datetime.date.today().isoformat(), platform.processor() or platform.machine(),
            os.cpu_count(), os.environ.get("PION_COMMIT") or subprocess.run(
                ["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True,
                text=True).stdout.strip()),
        "- command: `%s`" % " ".join(["python3", "bench/bench_residency.py"] + sys.argv[1:]),
        "- %d slots of %.1f MiB (H=%d N=%d D=%d fp32, K and V), %.0f MiB in all; %d queries "
        "(M = 1 dense, RESP over loopback), Zipf s=%.2f; budgets for run 2: %s" % (
            a.slots, slot / 2**20, a.heads, rows, a.d, total / 2**20, a.queries, a.zipf,
            " ".join(budget)),
        "- moves during the measured queries: promotions disk->host %d, host->gpu %d; "
        "demotions host->disk %d (spill writes), drops host %d, gpu %d; backend reads %d" % (
            delta("residency_promotions_disk_host"), delta("residency_promotions_host_gpu"),
            delta("residency_demotions_host_disk"), delta("residency_drops_host"),
            delta("residency_drops_gpu"), delta("residency_backend_reads")),
        "",
        "| case | queries | p50 ms | vs all-%s | reference |" % fastest,
        "|---|---|---|---|---|",
        "| all slots in %s | %d | %s | 1.00 | |" % (fastest, len(resident), ms(base)),
    ]
    for t in ("gpu", "host", "disk"):
        xs = by_tier[t]
        if not xs:
            continue
        ref = ""
        if t == fastest:
            ref = "goal <= 1.2x all-%s" % fastest
        elif t == "host":  # cuda: a promotion host -> GPU
            ref = "raw H2D of %.0f MiB: pageable %s ms, pinned %s ms; (p50 - all-gpu) / pinned = " \
                  "%.2f (goal <= 1.5)" % (slot / 2**20, ms(h2d_pageable), ms(h2d_pinned),
                                          (p50(xs) - base) / h2d_pinned)
        else:  # disk -> host (-> GPU)
            extra = h2d_pinned if a.backend == "cuda" else 0.0
            raw = warm + extra
            ref = "raw read of %.0f MiB: page cache %s ms, cold %s ms%s; (p50 - all) / raw = " \
                  "%.2f (goal <= 1.5)" % (slot / 2**20, ms(warm), ms(cold),
                                          " (+ pinned H2D %s)" % ms(extra) if extra else "",
                                          (p50(xs) - base) / raw)
        lines.append("| slot in %s | %d | %s | %.2f | %s |" % (t, len(xs), ms(p50(xs)),
                                                            p50(xs) / base, ref))
    out = a.out or REPO / "bench" / "results" / ("residency-%s-%s.md" % (
        a.backend, datetime.date.today().isoformat()))
    report(lines, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
