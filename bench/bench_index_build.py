#!/usr/bin/python3
"""ATTEND.FINALIZE's graph build against hnswlib's own build of the same graph (Debian's
python3-hnswlib, the library whose headers Pion builds with), in the same run, on the same
cores, with the same thread count; the calibration that follows Pion's build is reported on
its own.

Like with like: for METRIC ip Pion builds an L2 graph over keys augmented to key_dim + 1
(the extra coordinate sqrt(max‖k‖² − ‖k‖²)), so hnswlib builds `space='l2'` over the same
augmented keys, computed in numpy inside its timed span (Pion's build_ms includes its own
augmentation); METRIC l2 is `space='l2'` over the raw keys, METRIC cos `space='cosine'`. Both
use M, EF_CONSTRUCTION, random seed 100 and T threads: the server runs with
--compute-threads T, hnswlib's add_items with num_threads=T. Keys are attention-like (64
centres of scale 2 plus unit noise), the same array for both. Each repeat measures every
builder (the order rotating), each after waiting for the rest of the machine to go quiet;
medians are reported, with each build's cores used (CPU seconds / wall) and the CPU the rest
of the machine used meanwhile. A graph-quality check follows: recall@32 at EF 128 of every
graph for 200 key-distributed queries against numpy's exact top-32. For reference, hnswlib's
own inner-product space over the raw keys (space='ip', dim key_dim: another graph, not in the
ratios) is built once. Each --baseline [LABEL=]PATH adds another pion-server (another build,
e.g. main's) to the same rotation; a server whose FINALIZE has no calibrate_ms counts its
calibration in build_ms.

Run (Debian's python: numpy, redis, psutil, python3-hnswlib):
  /usr/bin/python3 bench/bench_index_build.py [--pion build/pion-server] [--baseline [LABEL=]PATH]
Writes bench/results/index-build-<date>.md.
"""
from __future__ import annotations

import argparse
import datetime as dt
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import hnswlib
import numpy as np
import psutil
import redis

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "bench"))
from bench_protocol import git_info, machine_info  # noqa: E402
from benchutil import report, start_pion  # noqa: E402

SEED = 100  # Pion's graph seed (store/attn_index.cc)
K, EF_CHECK, N_CHECK = 32, 128, 200


def parse(m) -> dict:
    return {m[i].decode(): m[i + 1] for i in range(0, len(m), 2)}


def lscpu_model() -> str:
    out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    for line in out.splitlines():
        if line.startswith("Model name:"):
            return line.split(":", 1)[1].strip()
    return "unknown"


def busy_seconds() -> float:
    """CPU seconds the whole machine has spent busy since boot."""
    t = psutil.cpu_times()
    return t.user + t.nice + t.system + t.irq + t.softirq + getattr(t, "steal", 0.0)


def wait_idle(max_cores: float, timeout: float) -> float:
    """Waits (up to timeout s) for a second in which the machine is busy for at most max_cores
    (this process and its servers are idle meanwhile); returns the last second's load."""
    end = time.monotonic() + timeout
    while True:
        b0 = busy_seconds()
        time.sleep(1.0)
        load = busy_seconds() - b0
        if load <= max_cores or time.monotonic() > end:
            return load


class Span:
    """Wall time, the CPU seconds of the given processes, and every other process's CPU
    seconds over a with-block."""

    def __init__(self, *procs: psutil.Process):
        self.procs = procs

    def _cpu(self) -> float:
        return sum(sum(p.cpu_times()[:2]) for p in self.procs)

    def __enter__(self):
        self.busy0, self.cpu0, self.t0 = busy_seconds(), self._cpu(), time.perf_counter()
        return self

    def __exit__(self, *exc):
        self.wall = time.perf_counter() - self.t0
        self.cpu = self._cpu() - self.cpu0
        self.other = max(0.0, busy_seconds() - self.busy0 - self.cpu)
        return False


class CpuTrace:
    """A process's CPU seconds sampled every 10 ms on a thread over a with-block, to split the
    span by time: at(t) interpolates."""

    def __init__(self, proc: psutil.Process):
        self.proc, self.samples, self.stop = proc, [], threading.Event()

    def _sample(self):
        self.samples.append((time.perf_counter(), sum(self.proc.cpu_times()[:2])))

    def _run(self):
        while not self.stop.wait(0.01):
            self._sample()

    def __enter__(self):
        self._sample()
        self.thread = threading.Thread(target=self._run)
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join()
        self._sample()
        return False

    def at(self, t: float) -> float:
        ts, cs = zip(*self.samples)
        return float(np.interp(t, ts, cs))


def keys_for(rng, n, d) -> np.ndarray:
    centers = 2 * rng.standard_normal((64, d)).astype(np.float32)
    return rng.standard_normal((n, d)).astype(np.float32) + centers[rng.integers(0, 64, n)]


def augment(keys: np.ndarray) -> np.ndarray:
    """Pion's inner-product reduction: [k, sqrt(max‖k‖² − ‖k‖²)] (norms in float64)."""
    k64 = keys.astype(np.float64)
    nn = np.einsum("ij,ij->i", k64, k64)
    extra = np.sqrt(np.maximum(0.0, nn.max() - nn)).astype(np.float32)
    return np.hstack([keys, extra[:, None]])


def hnswlib_build(keys, metric, m, efc, threads, raw_ip=False):
    n, d = keys.shape
    if metric == "ip" and not raw_ip:
        data = augment(keys)
        index = hnswlib.Index(space="l2", dim=d + 1)
    else:
        data = keys
        index = hnswlib.Index(space={"ip": "ip", "l2": "l2", "cos": "cosine"}[metric], dim=d)
    index.init_index(max_elements=n, M=m, ef_construction=efc, random_seed=SEED)
    index.add_items(data, np.arange(n), num_threads=threads)
    return index


def recall(got, truth) -> float:
    return float(np.mean([len(set(g) & set(t)) / len(t) for g, t in zip(got, truth)]))


class PionBuilder:
    def __init__(self, name: str, binary: str, threads: int):
        self.name = name
        self.proc, port, _ = start_pion(binary, ["--binary-port", "0", "--compute-threads",
                                                 str(threads)], "pion-index-build-")
        self.ps = psutil.Process(self.proc.pid)
        self.r = redis.Redis(port=port, socket_timeout=3600)

    def load(self, sid, keys, a):
        n, d = keys.shape
        self.r.execute_command("ATTEND.CREATE", sid, d, 1, "M", a.m, "EF_CONSTRUCTION",
                               a.ef_construction, "METRIC", a.metric)
        for i in range(0, n, 8192):
            b = min(n, i + 8192)
            self.r.execute_command("ATTEND.STORE", sid, keys[i:b].tobytes(),
                                   np.zeros((b - i, 1), np.float32).tobytes())

    def build(self, sid) -> dict:
        with Span(self.ps) as s, CpuTrace(self.ps) as trace:
            t0 = time.perf_counter()
            fin = parse(self.r.execute_command("ATTEND.FINALIZE", sid))
            t2 = time.perf_counter()
        build = float(fin["build_ms"])
        cal = float(fin["calibrate_ms"]) if "calibrate_ms" in fin else None
        t1 = t0 + build / 1e3 if cal is not None else t2  # the server's build ends here
        return dict(build=build, calibrate=cal, wall=s.wall * 1e3, cores=s.cpu / s.wall,
                    other=s.other / s.wall, estimate=float(fin["recall_estimate"]),
                    build_cpu=trace.at(t1) - trace.at(t0),
                    calibrate_cpu=None if cal is None else trace.at(t2) - trace.at(t1))

    def query(self, sid, qs) -> np.ndarray:
        got = parse(self.r.execute_command("ATTEND.QUERY", sid, K, qs.tobytes(), "EF", EF_CHECK))
        return np.frombuffer(got["ids"], np.uint32).reshape(len(qs), K)

    def close(self):
        self.proc.terminate()
        self.proc.wait(timeout=30)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pion", default=str(REPO / "build" / "pion-server"))
    ap.add_argument("--baseline", action="append", default=[], metavar="[LABEL=]PATH",
                    help="another pion-server to measure alongside (repeatable)")
    ap.add_argument("--sizes", default="50000x128,10000x128", help="rows x key_dim, comma-separated")
    ap.add_argument("--metric", default="ip", choices=["ip", "l2", "cos"])
    ap.add_argument("--m", type=int, default=16)
    ap.add_argument("--ef-construction", type=int, default=200)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--max-background", type=float, default=0.3,
                    help="before each build, wait for the rest of the machine to use at most "
                    "this many cores (for up to --wait-idle s)")
    ap.add_argument("--wait-idle", type=float, default=60)
    ap.add_argument("--no-raw-ip", action="store_true", help="skip hnswlib's space='ip' reference")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    sizes = [tuple(int(x) for x in s.split("x")) for s in a.sizes.split(",")]
    pions = [PionBuilder("Pion", a.pion, a.threads)]
    for i, spec in enumerate(a.baseline):
        label, _, path = spec.rpartition("=")
        pions.append(PionBuilder("Pion " + (label or "baseline %d" % (i + 1)), path, a.threads))
    me = psutil.Process()
    table, raw = [], []
    try:
        for n, d in sizes:
            rng = np.random.default_rng(n + d)
            keys = keys_for(rng, n, d)
            sid = "build-%dx%d" % (n, d)
            for p in pions:
                p.load(sid, keys, a)
            runs = {p.name: [] for p in pions}
            runs["hnswlib"] = []
            who = [p.name for p in pions] + ["hnswlib"]
            index = None
            for rep in range(a.repeats):
                for name in who[rep % len(who):] + who[:rep % len(who)]:
                    idle = wait_idle(a.max_background, a.wait_idle)
                    if name == "hnswlib":
                        index = None  # its previous graph goes first (kept for the check)
                        with Span(me) as s:
                            index = hnswlib_build(keys, a.metric, a.m, a.ef_construction,
                                                  a.threads)
                        run = dict(build=s.wall * 1e3, calibrate=None, wall=s.wall * 1e3,
                                   cores=s.cpu / s.wall, other=s.other / s.wall, estimate=None,
                                   build_cpu=s.cpu, calibrate_cpu=None)
                    else:
                        run = next(p for p in pions if p.name == name).build(sid)
                    runs[name].append(run)
                    raw.append("%dx%d rep %d %s: build %.0f ms (%.1f CPU s)%s, %.2f cores, others "
                               "%.2f cores (%.2f before)" % (
                                   n, d, rep, name, run["build"], run["build_cpu"],
                                   "" if run["calibrate"] is None else
                                   ", calibrate %.0f ms (%.1f CPU s), FINALIZE %.0f ms" % (
                                       run["calibrate"], run["calibrate_cpu"], run["wall"]),
                                   run["cores"], run["other"], idle))
                    print(raw[-1], flush=True)
            # Graph quality: the same queries on every graph at the same beam.
            qs = (keys[rng.integers(0, n, N_CHECK)] +
                  0.3 * rng.standard_normal((N_CHECK, d))).astype(np.float32)
            k64, q64 = keys.astype(np.float64), qs.astype(np.float64)
            if a.metric == "l2":
                ref = 2 * q64 @ k64.T - (k64 ** 2).sum(1)[None]
            elif a.metric == "cos":
                ref = (q64 @ k64.T) / np.linalg.norm(k64, axis=1)[None]
            else:
                ref = q64 @ k64.T
            truth = np.argsort(-ref, axis=1)[:, :K]
            quality = {p.name: recall(p.query(sid, qs), truth) for p in pions}
            index.set_ef(EF_CHECK)
            lq = np.hstack([qs, np.zeros((N_CHECK, 1), np.float32)]) if a.metric == "ip" else qs
            quality["hnswlib"] = recall(index.knn_query(lq, k=K)[0], truth)
            index = None
            ref_ms = None
            if a.metric == "ip" and not a.no_raw_ip:
                wait_idle(a.max_background, a.wait_idle)
                t0 = time.perf_counter()
                hnswlib_build(keys, "ip", a.m, a.ef_construction, a.threads, raw_ip=True)
                ref_ms = (time.perf_counter() - t0) * 1e3
                raw.append("%dx%d hnswlib space='ip' on the raw keys (another graph): %.0f ms"
                           % (n, d, ref_ms))
                print(raw[-1], flush=True)
            for p in pions:
                p.r.execute_command("ATTEND.DROP", sid)
            lib = statistics.median(x["build"] for x in runs["hnswlib"])
            lib_min = min(x["build"] for x in runs["hnswlib"])
            lib_cpu = statistics.median(x["build_cpu"] for x in runs["hnswlib"])
            for name in who:
                rs = runs[name]

                def med(key):
                    vals = [x[key] for x in rs if x[key] is not None]
                    return statistics.median(vals) if vals else None

                def ms(v, fmt="%.0f"):
                    return "—" if v is None else fmt % v

                build_min = min(x["build"] for x in rs)
                table.append(
                    "| %d × %d | %s | %.0f (%.0f) | %.1f | %s | %s | %.0f | %.2f (%.2f) | %.2f | %.2f "
                    "| %.2f | %.3f | %s |" % (
                        n, d, name, med("build"), build_min, med("build_cpu"),
                        ms(med("calibrate")), ms(med("calibrate_cpu"), "%.1f"), med("wall"),
                        med("build") / lib, build_min / lib_min, med("build_cpu") / lib_cpu,
                        med("wall") / lib, max(x["other"] for x in rs), quality[name],
                        ms(med("estimate"), "%.3f")))
            if ref_ms is not None:
                table.append("| %d × %d | hnswlib space='ip', raw keys (another graph, one run) "
                             "| %.0f | | — | — | %.0f | %.2f | | %.2f | | | |" % (
                                 n, d, ref_ms, ref_ms, ref_ms / lib, ref_ms / lib))
    finally:
        for p in pions:
            p.close()
    lines = [
        "# ATTEND.FINALIZE's graph build against hnswlib's own build (%s)" % dt.date.today(),
        "",
        "- machine: %s (lscpu: %s)" % (machine_info(), lscpu_model()),
        "- commit: %s" % git_info(),
        "- command: `/usr/bin/python3 bench/bench_index_build.py %s`" % " ".join(sys.argv[1:]),
        "- hnswlib: Debian python3-hnswlib %s; Pion builds with libhnswlib-dev's headers of the "
        "same version" % subprocess.run(["dpkg-query", "-W", "-f", "${Version}",
                                        "python3-hnswlib"], capture_output=True,
                                       text=True).stdout,
        "- METRIC %s, M %d, EF_CONSTRUCTION %d, %d threads each (pion-server --compute-threads "
        "%d; add_items num_threads=%d), medians of %d repeats (order rotating, each after up to "
        "%.0f s waiting for the rest of the machine to use at most %.1f cores)%s" % (
            a.metric, a.m, a.ef_construction, a.threads, a.threads, a.threads, a.repeats,
            a.wait_idle, a.max_background,
            "; hnswlib builds space='l2' over the same keys augmented to key_dim + 1 (the graph "
            "Pion builds for ip), the augmentation timed" if a.metric == "ip" else ""),
        "- build = FINALIZE's build_ms (Pion: key preparation and inserts) or the Python call "
        "(hnswlib), median (min) wall ms; calibrate = FINALIZE's calibrate_ms; CPU s = the "
        "building process's CPU seconds over that span (Pion's split at build_ms; sampled every "
        "10 ms): the measure a busy machine disturbs least; FINALIZE = the client's wall time "
        "for the command; ratios are over hnswlib's median build (wall, min over min, CPU); "
        "others = cores the rest of the machine used meanwhile (the worst run); recall@%d at EF "
        "%d of %d key-distributed queries against numpy's exact top-%d; recall estimate = "
        "FINALIZE's" % (K, EF_CHECK, N_CHECK, K),
        "",
        "| rows × dim | builder | build ms | build CPU s | calibrate ms | calibrate CPU s | "
        "FINALIZE ms | build ÷ hnswlib (min ÷ min) | build CPU ÷ hnswlib | FINALIZE ÷ hnswlib "
        "| others (cores) | recall@32 EF 128 | recall estimate |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ] + table + ["", "Runs:", ""] + ["- " + x for x in raw]
    report(lines, a.out or REPO / "bench" / "results" / ("index-build-%s.md" % dt.date.today()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
