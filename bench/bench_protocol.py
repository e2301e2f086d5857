#!/usr/bin/python3
"""Protocol benchmark: pion-server against redis-server, side by side, in one run.

Starts both servers on free 127.0.0.1 ports, then measures
  (a) PING throughput with redis-benchmark (-t ping -P 16 -c 50 -n 2000000): PING_MBULK and
      PING_INLINE requests/s;
  (b) 4 MiB ECHO round trips with pion-echo-bench (1 and 4 connections): GB/s of payload in
      each direction, requests/s, p50/p99 latency.
Each measurement is repeated --repeats times, alternating which server goes first, and the
median is reported with the ratio pion/redis. CPU seconds used by the server, by the client and
by everything else on the machine are recorded for every run, so a noisy machine is visible in
the result. Writes bench/results/protocol-<YYYY-MM-DD>.md.

Run with Debian's python (it has psutil):  /usr/bin/python3 bench/bench_protocol.py
"""
from __future__ import annotations

import argparse
import datetime as dt
import hashlib
import json
import os
import platform
import resource
import shlex
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "bench"))
from benchutil import free_port  # noqa: E402,F401  (shared by the bench scripts)
GOALS = {"ping": 1.0, "echo": 1.5}  # pion/redis ratios asked for by the issue


# ---- helpers ----------------------------------------------------------------------------------

def wait_ready(proc: subprocess.Popen, port: int, name: str, log: Path, timeout: float = 15.0):
    """Waits until the server answers PING with +PONG."""
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited with status {proc.returncode}:\n{tail(log)}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1.0) as s:
                s.sendall(b"*1\r\n$4\r\nPING\r\n")
                data = s.recv(64)
                if data.startswith(b"+PONG"):
                    return
                last = data
        except OSError as e:
            last = e
        time.sleep(0.05)
    raise RuntimeError(f"{name} not ready on port {port} after {timeout}s ({last!r}):\n{tail(log)}")


def tail(path: Path, n: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""


def start_server(cmd: list[str], port: int, name: str, log: Path) -> subprocess.Popen:
    """Starts a server with its output in `log` and waits until it answers PING."""
    with open(log, "w") as f:
        p = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT)
    wait_ready(p, port, name, log)
    return p


def stop(proc: subprocess.Popen | None):
    if proc is None or proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=5)


def env_with(pairs: list[str]) -> dict:
    """This process's environment plus the KEY=VALUE pairs."""
    env = dict(os.environ)
    for kv in pairs:
        k, _, v = kv.partition("=")
        env[k] = v
    return env


def start_pair(procs: dict, cmds: dict, ports: dict, tmp: Path, envs: dict) -> dict:
    """Starts pion-server and redis-server (cmds/ports/envs by name; logs in tmp) into `procs` —
    filled as they start, so the caller's cleanup stops whatever did — waits until both answer,
    and returns their psutil handles by name."""
    for name in ("pion", "redis"):
        log = tmp / f"{name}.log"
        procs[name] = subprocess.Popen(cmds[name], stdout=open(log, "wb"), stderr=subprocess.STDOUT,
                                       stdin=subprocess.DEVNULL, cwd=tmp, env=envs.get(name))
    for name in procs:
        wait_ready(procs[name], ports[name], name, tmp / f"{name}.log")
    print(f"pion-server pid {procs['pion'].pid} port {ports['pion']}; "
          f"redis-server pid {procs['redis'].pid} port {ports['redis']}", flush=True)
    return {name: psutil.Process(procs[name].pid) for name in procs}


def cmd_output(cmd: list[str]) -> str:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"({e})"


def machine_info() -> dict:
    model = "unknown"
    flags = ""
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name") and model == "unknown":
                model = line.split(":", 1)[1].strip()
            if line.startswith("flags") and not flags:
                flags = line
    mem_kib = 0
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                mem_kib = int(line.split()[1])
    os_name = platform.system()
    try:
        for line in Path("/etc/os-release").read_text().splitlines():
            if line.startswith("PRETTY_NAME="):
                os_name = line.split("=", 1)[1].strip('"')
    except OSError:
        pass
    return {
        "nproc": os.cpu_count(),
        "cpu": model,
        "hypervisor": " hypervisor" in flags,
        "memory": f"{mem_kib / 1024 / 1024:.1f} GiB",
        "kernel": platform.release(),
        "os": os_name,
    }


def git_info() -> str:
    rev = cmd_output(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"])
    dirty = cmd_output(["git", "-C", str(REPO), "status", "--porcelain", "--", "src"])
    return rev + (" (src/ has uncommitted changes)" if dirty else "")


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()[:16]


class CpuMeter:
    """CPU seconds of the server process, of our waited-for children (the client), and of
    everything else on the machine, between start() and stop()."""

    def __init__(self, server: psutil.Process):
        self.server = server

    @staticmethod
    def _busy() -> float:
        t = psutil.cpu_times()
        return t.user + t.nice + t.system + t.irq + t.softirq + getattr(t, "steal", 0.0)

    def start(self):
        c = self.server.cpu_times()
        self.s0 = c.user + c.system
        ru = resource.getrusage(resource.RUSAGE_CHILDREN)
        self.c0 = ru.ru_utime + ru.ru_stime
        self.b0 = self._busy()
        self.t0 = time.monotonic()

    def stop(self) -> dict:
        c = self.server.cpu_times()
        ru = resource.getrusage(resource.RUSAGE_CHILDREN)
        wall = time.monotonic() - self.t0
        server = c.user + c.system - self.s0
        client = ru.ru_utime + ru.ru_stime - self.c0
        busy = self._busy() - self.b0
        # CPU time is reported in ticks; clamp the remainder at 0.
        other = max(0.0, busy - server - client)
        return {"wall_s": wall, "server_cpu": server / wall, "client_cpu": client / wall,
                "other_cpu": other / wall}


# ---- the measurements ---------------------------------------------------------------------------

def wait_quiet(max_background: float, timeout: float) -> float:
    """Waits (up to timeout seconds) until the machine's CPU use, sampled over 0.5 s while both
    servers are idle, is at most max_background cores. Returns the last sample."""
    deadline = time.monotonic() + timeout
    while True:
        b0, t0 = CpuMeter._busy(), time.monotonic()
        time.sleep(0.5)
        busy = (CpuMeter._busy() - b0) / (time.monotonic() - t0)
        if busy <= max_background or time.monotonic() >= deadline:
            return busy
        time.sleep(1.0)


def run_redis_benchmark(rb: str, port: int, a) -> dict:
    cmd = [rb, "-h", "127.0.0.1", "-p", str(port), "-t", "ping", "-P", "16", "-c", "50",
           "-n", str(a.ping_requests), "-q", "--csv"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if p.returncode != 0:
        raise RuntimeError(f"redis-benchmark failed ({p.returncode}): {p.stderr.strip()}")
    out = {}
    for line in p.stdout.splitlines():
        cols = [c.strip('"') for c in line.strip().split(",")]
        if len(cols) >= 2 and cols[0] in ("PING_INLINE", "PING_MBULK"):
            out[cols[0]] = float(cols[1])
            if len(cols) >= 7:
                out[cols[0] + "_p50_ms"] = float(cols[4])
                out[cols[0] + "_p99_ms"] = float(cols[6])
    if "PING_MBULK" not in out:
        raise RuntimeError(f"no PING_MBULK row in redis-benchmark output:\n{p.stdout}")
    return out


def run_echo(echo: Path, port: int, conns: int, a) -> dict:
    cmd = [str(echo), "--host", "127.0.0.1", "--port", str(port), "--size", str(a.echo_size),
           "--connections", str(conns), "--seconds", str(a.echo_seconds),
           "--warmup", str(a.echo_warmup), "--pipeline", "1"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=a.echo_seconds * 4 + 120)
    if p.returncode != 0:
        raise RuntimeError(f"pion-echo-bench failed ({p.returncode}): {p.stderr.strip()}")
    return json.loads(p.stdout)


def median(xs):
    return statistics.median(xs) if xs else float("nan")


def nz(v):
    return float("nan") if v is None else v


def ratio(p, r):
    return p / r if r else float("nan")


# ---- main ---------------------------------------------------------------------------------------

def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pion", default="build/pion-server", help="pion-server binary")
    ap.add_argument("--echo-bench", default=None,
                    help="pion-echo-bench binary (default: next to --pion)")
    ap.add_argument("--redis-server", default="/usr/bin/redis-server")
    ap.add_argument("--redis-benchmark", default="/usr/bin/redis-benchmark")
    ap.add_argument("--repeats", type=int, default=3, help="runs per measurement (median)")
    ap.add_argument("--quick", action="store_true",
                    help="1 repeat, 200k PINGs, 3 s ECHO, 1 connection; writes *-quick.md")
    ap.add_argument("--ping-requests", type=int, default=2_000_000)
    ap.add_argument("--echo-size", type=int, default=4 * 1024 * 1024)
    ap.add_argument("--echo-seconds", type=float, default=10.0)
    ap.add_argument("--echo-warmup", type=float, default=1.0)
    ap.add_argument("--echo-connections", default="1,4", help="comma-separated list")
    ap.add_argument("--workers", type=int, default=2, help="pion-server -w")
    ap.add_argument("--pion-env", action="append", default=[], metavar="KEY=VALUE",
                    help="extra environment for pion-server (repeatable; recorded in the result)")
    ap.add_argument("--max-background", type=float, default=0.3,
                    help="before each run, wait until other CPU use is at most this many cores")
    ap.add_argument("--wait-idle", type=float, default=60.0,
                    help="longest wait (s) for --max-background before running anyway")
    ap.add_argument("--clean-threshold", type=float, default=0.25,
                    help="runs with more other CPU use (cores) than this are left out of the "
                         "medians when the server has any run below it")
    ap.add_argument("--out", default=None, help="result file (default bench/results/protocol-<date>.md)")
    a = ap.parse_args()
    if a.quick:
        a.repeats = 1
        a.ping_requests = min(a.ping_requests, 200_000)
        a.echo_seconds = min(a.echo_seconds, 3.0)
        a.echo_warmup = min(a.echo_warmup, 0.5)
        a.echo_connections = "1"
    conns_list = [int(c) for c in a.echo_connections.split(",") if c]

    pion = Path(a.pion).resolve()
    echo = Path(a.echo_bench).resolve() if a.echo_bench else pion.parent / "pion-echo-bench"
    if not pion.exists():
        sys.exit(f"pion-server not found at {pion} (cmake --build build --target pion-server)")
    if not echo.exists():
        sys.exit(f"pion-echo-bench not found at {echo} "
                 f"(cmake --build {pion.parent} --target pion-echo-bench)")
    for tool in (a.redis_server, a.redis_benchmark):
        if not shutil.which(tool):
            sys.exit(f"{tool} not found (apt-get install redis-server redis-tools)")

    started = dt.datetime.now()
    command_line = " ".join(shlex.quote(x) for x in [sys.executable] + sys.argv)
    tmp = Path(tempfile.mkdtemp(prefix="pion-bench-"))
    p1, p2 = free_port(), free_port()
    while p2 == p1:
        p2 = free_port()
    pion_cmd = [str(pion), "-w", str(a.workers), "--port", str(p1), "--metrics-port", "0", "--binary-port", "0"]
    redis_cmd = [a.redis_server, "--port", str(p2), "--save", "", "--appendonly", "no",
                 "--proto-max-bulk-len", "1gb", "--client-query-buffer-limit", "2gb",
                 "--bind", "127.0.0.1", "--dir", str(tmp)]
    procs: dict[str, subprocess.Popen] = {}
    runs: list[dict] = []  # one row per measurement run
    load_before = os.getloadavg()
    try:
        ports = {"pion": p1, "redis": p2}
        ps = start_pair(procs, {"pion": pion_cmd, "redis": redis_cmd}, ports, tmp,
                        {"pion": env_with(a.pion_env)})

        def order(rep):
            return ["pion", "redis"] if rep % 2 == 0 else ["redis", "pion"]

        def check_alive():
            for name, p in procs.items():
                if p.poll() is not None:
                    raise RuntimeError(f"{name} died ({p.returncode}):\n{tail(tmp / (name + '.log'))}")

        # (a) PING via redis-benchmark.
        for rep in range(a.repeats):
            for srv in order(rep):
                bg = wait_quiet(a.max_background, a.wait_idle)
                meter = CpuMeter(ps[srv])
                meter.start()
                res = run_redis_benchmark(a.redis_benchmark, ports[srv], a)
                cpu = meter.stop()
                check_alive()
                for test in ("PING_MBULK", "PING_INLINE"):
                    if test in res:
                        runs.append({"test": test, "server": srv, "rep": rep, "value": res[test],
                                     "unit": "req/s", "p50_ms": res.get(test + "_p50_ms"),
                                     "p99_ms": res.get(test + "_p99_ms"), "background_before": bg,
                                     **cpu})
                print(f"  ping rep {rep} {srv:5s}: MBULK {res['PING_MBULK']:>10.0f} req/s  "
                      f"INLINE {res.get('PING_INLINE', float('nan')):>10.0f} req/s  "
                      f"(server {cpu['server_cpu']:.2f} cores, client {cpu['client_cpu']:.2f}, "
                      f"other {cpu['other_cpu']:.2f}; idle wait {bg:.2f})", flush=True)
                time.sleep(0.5)

        # (b) ECHO round trips via pion-echo-bench.
        for conns in conns_list:
            test = f"ECHO_{a.echo_size >> 20}MiB_c{conns}" if a.echo_size >= 1 << 20 \
                else f"ECHO_{a.echo_size}B_c{conns}"
            for rep in range(a.repeats):
                for srv in order(rep):
                    bg = wait_quiet(a.max_background, a.wait_idle)
                    meter = CpuMeter(ps[srv])
                    meter.start()
                    res = run_echo(echo, ports[srv], conns, a)
                    cpu = meter.stop()
                    check_alive()
                    runs.append({"test": test, "server": srv, "rep": rep, "value": res["gb_per_s"],
                                 "unit": "GB/s", "req_per_s": res["req_per_s"],
                                 "requests": res["requests"], "p50_ms": res["p50_us"] / 1000,
                                 "p99_ms": res["p99_us"] / 1000,
                                 "background_before": bg, **cpu})
                    print(f"  {test} rep {rep} {srv:5s}: {res['gb_per_s']:.3f} GB/s "
                          f"{res['req_per_s']:.1f} req/s p50 {res['p50_us'] / 1000:.1f} ms "
                          f"p99 {res['p99_us'] / 1000:.1f} ms  (server {cpu['server_cpu']:.2f} "
                          f"cores, client {cpu['client_cpu']:.2f}, other {cpu['other_cpu']:.2f}; "
                          f"idle wait {bg:.2f})",
                          flush=True)
                    time.sleep(0.5)
    finally:
        for p in procs.values():
            stop(p)
    load_after = os.getloadavg()
    finished = dt.datetime.now()

    # ---- summarise --------------------------------------------------------------------------
    tests = list(dict.fromkeys(r["test"] for r in runs))
    summary = []
    for t in tests:
        row = {"test": t, "unit": next(r["unit"] for r in runs if r["test"] == t)}
        for srv in ("pion", "redis"):
            all_rs = [r for r in runs if r["test"] == t and r["server"] == srv]
            # Medians over the undisturbed runs (little other CPU use) when there are any.
            rs = [r for r in all_rs if r["other_cpu"] <= a.clean_threshold] or all_rs
            row[srv + "_used"] = f"{len(rs)}/{len(all_rs)}"
            row[srv + "_all"] = median([r["value"] for r in all_rs])
            row[srv] = median([r["value"] for r in rs])
            row[srv + "_p50_ms"] = median([r["p50_ms"] for r in rs if r.get("p50_ms") is not None])
            row[srv + "_p99_ms"] = median([r["p99_ms"] for r in rs if r.get("p99_ms") is not None])
            row[srv + "_cpu"] = median([r["server_cpu"] for r in rs])
            row[srv + "_other"] = median([r["other_cpu"] for r in rs])
            if rs and "req_per_s" in rs[0]:
                row[srv + "_rps"] = median([r["req_per_s"] for r in rs])
            # Server CPU time per request: efficiency that does not depend on whether the
            # (shared-CPU) client or the server is the bottleneck.
            row[srv + "_us_per_req"] = median([r["server_cpu"] * 1e6 / r.get("req_per_s", r["value"])
                                               for r in rs if r.get("req_per_s", r["value"])])
        row["ratio"] = ratio(row["pion"], row["redis"])
        row["ratio_all"] = ratio(row["pion_all"], row["redis_all"])
        goal = GOALS["ping"] if t == "PING_MBULK" else GOALS["echo"] if t.startswith("ECHO") else None
        row["goal"] = goal
        summary.append(row)

    def fmt(v, unit):
        return f"{v:,.0f}" if unit == "req/s" else f"{v:.3f}"

    print()
    hdr = (f"{'test':18s} {'unit':6s} {'pion':>12s} {'redis':>12s} {'pion/redis':>10s} "
           f"{'runs':>9s} {'all-runs':>8s}  goal")
    print(hdr)
    print("-" * len(hdr))
    for s in summary:
        goal = "" if s["goal"] is None else \
            f">= {s['goal']:.1f} {'met' if s['ratio'] >= s['goal'] else 'MISSED'}"
        print(f"{s['test']:18s} {s['unit']:6s} {fmt(s['pion'], s['unit']):>12s} "
              f"{fmt(s['redis'], s['unit']):>12s} {s['ratio']:>10.2f} "
              f"{s['pion_used'] + ',' + s['redis_used']:>9s} {s['ratio_all']:>8.2f}  {goal}")

    # ---- result file ------------------------------------------------------------------------
    m = machine_info()
    out = Path(a.out) if a.out else REPO / "bench" / "results" / (
        f"protocol-{started:%Y-%m-%d}{'-quick' if a.quick else ''}.md")
    out.parent.mkdir(parents=True, exist_ok=True)
    L = []
    L.append(f"# Protocol benchmark: pion-server vs redis-server ({started:%Y-%m-%d})\n")
    L.append("## Run\n")
    L.append(f"- Command: `{command_line}` (cwd `{os.getcwd()}`)")
    L.append(f"- Date: {started:%Y-%m-%d %H:%M:%S} to {finished:%H:%M:%S} (local time)")
    L.append(f"- Machine: {m['nproc']} CPUs ({m['cpu']}{', virtual machine' if m['hypervisor'] else ''}), "
             f"{m['memory']} memory, kernel {m['kernel']}, {m['os']}")
    L.append(f"- Load average (1/5/15 min): before {load_before[0]:.2f}/{load_before[1]:.2f}/"
             f"{load_before[2]:.2f}, after {load_after[0]:.2f}/{load_after[1]:.2f}/{load_after[2]:.2f}")
    L.append(f"- pion-server: `{pion}` --version `{cmd_output([str(pion), '--version'])}`, "
             f"sha256 {sha256(pion)}…, git {git_info()}")
    L.append(f"- redis-server: `{cmd_output([a.redis_server, '--version'])}`")
    L.append(f"- redis-benchmark: `{cmd_output([a.redis_benchmark, '--version'])}`")
    L.append(f"- pion command: `{' '.join(shlex.quote(x) for x in [*a.pion_env, *pion_cmd])}`")
    L.append(f"- redis command: `{' '.join(shlex.quote(x) for x in redis_cmd)}`")
    L.append(f"- PING: `redis-benchmark -h 127.0.0.1 -p PORT -t ping -P 16 -c 50 -n {a.ping_requests} -q --csv`")
    L.append(f"- ECHO: `pion-echo-bench --host 127.0.0.1 --port PORT --size {a.echo_size} "
             f"--connections C --seconds {a.echo_seconds:g} --warmup {a.echo_warmup:g} --pipeline 1`, "
             f"C in {conns_list}")
    L.append(f"- Repeats: {a.repeats} per measurement, server order alternating; medians below. "
             f"Before each run the script waited (up to {a.wait_idle:g} s) for other CPU use "
             f"≤ {a.max_background:g} cores (`idle wait` column: what it measured last).")
    L.append("- Servers, client and any other load share the same CPUs; `cpu` columns are CPU cores "
             "busy on average during the run (server process; everything else on the machine "
             "except server and client = `other`); `cpu µs/req` is server CPU time per request, "
             "which compares the servers' efficiency even where the client is the bottleneck.\n")

    L.append("## Summary (medians)\n")
    L.append(f"Medians over the runs with other CPU use ≤ {a.clean_threshold:g} cores (`runs used`: "
             "pion, redis; all runs when none qualifies). `all-runs` is the ratio of the medians "
             "over every run.\n")
    L.append("| test | unit | pion | redis | pion/redis | goal | runs used | all-runs pion | "
             "all-runs redis | all-runs ratio |")
    L.append("|---|---|---:|---:|---:|---|---|---:|---:|---:|")
    for s in summary:
        goal = "" if s["goal"] is None else \
            f"≥ {s['goal']:.1f}: {'met' if s['ratio'] >= s['goal'] else '**missed**'}"
        L.append(f"| {s['test']} | {s['unit']} | {fmt(s['pion'], s['unit'])} | "
                 f"{fmt(s['redis'], s['unit'])} | {s['ratio']:.2f} | {goal} | "
                 f"{s['pion_used']}, {s['redis_used']} | {fmt(s['pion_all'], s['unit'])} | "
                 f"{fmt(s['redis_all'], s['unit'])} | {s['ratio_all']:.2f} |")
    L.append("")
    L.append("| test | pion p50 ms | redis p50 ms | pion p99 ms | redis p99 ms | pion req/s | "
             "redis req/s | pion server cpu | redis server cpu | pion cpu µs/req | "
             "redis cpu µs/req |")
    L.append("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for s in summary:
        L.append(f"| {s['test']} | {s['pion_p50_ms']:.2f} | {s['redis_p50_ms']:.2f} | "
                 f"{s['pion_p99_ms']:.2f} | {s['redis_p99_ms']:.2f} | "
                 f"{s.get('pion_rps', s['pion']):,.1f} | {s.get('redis_rps', s['redis']):,.1f} | "
                 f"{s['pion_cpu']:.2f} | {s['redis_cpu']:.2f} | {s['pion_us_per_req']:.2f} | "
                 f"{s['redis_us_per_req']:.2f} |")
    L.append("")
    L.append("## Raw runs\n")
    L.append("| test | rep | server | value | unit | p50 ms | p99 ms | wall s | server cpu | "
             "client cpu | other cpu | idle wait |")
    L.append("|---|---:|---|---:|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in runs:
        L.append(f"| {r['test']} | {r['rep']} | {r['server']} | {fmt(r['value'], r['unit'])} | "
                 f"{r['unit']} | {nz(r.get('p50_ms')):.2f} | {nz(r.get('p99_ms')):.2f} | {r['wall_s']:.1f} | "
                 f"{r['server_cpu']:.2f} | {r['client_cpu']:.2f} | {r['other_cpu']:.2f} | "
                 f"{r['background_before']:.2f} |")
    L.append("")
    out.write_text("\n".join(L) + "\n")
    print(f"\nwrote {out}")
    shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
