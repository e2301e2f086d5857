#!/usr/bin/python3
"""Layer fetch benchmark: pion V.FETCH RANGE of one K/V-prefix layer against redis GET of the
same bytes, side by side, in one run.

Starts pion-server and redis-server on free 127.0.0.1 ports. Loads pion with one prefix
namespace (KV.PREFIX.REGISTER <ns> 32 4096 8 128 fp16, then V.STOREBATCH of every layer of K
and V from random fp32 rows), and redis with one key per layer holding that layer's RAW bytes
as pion returns them (V.FETCH ... RAW), so both servers serve identical bytes; checks that once
per layer. Then measures, with pion-fetch-bench and 1 and 4 connections:
  pion_raw   V.FETCH <ns>_pk RANGE l*T (l+1)*T RAW  (stored fp16, 8 MiB per layer)
  pion_fp32  V.FETCH <ns>_pk RANGE l*T (l+1)*T      (decoded to fp32, 16 MiB per layer)
  redis_get  GET vfetch:layer:<l>                    (the same 8 MiB as pion_raw)
cycling the layers l. Each measurement is repeated --repeats times, alternating the order of the
three, and the medians are reported with the ratios pion/redis in layers/s. Server CPU time
per request is recorded for every run. Writes bench/results/vfetch-<YYYY-MM-DD>.md.

Run with Debian's python (it has numpy, redis, psutil):  /usr/bin/python3 bench/bench_vfetch.py
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import psutil
import redis

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_protocol import (CpuMeter, cmd_output, env_with, free_port, git_info,  # noqa: E402
                            machine_info, median, ratio, sha256, start_pair, stop, tail,
                            wait_quiet)

REPO = Path(__file__).resolve().parent.parent
# pion/redis ratios of layers/s asked for by the issue (fp32 sends twice the bytes of a layer).
GOALS = {"pion_raw": 2.0, "pion_fp32": 1.0}
TESTS = ("pion_raw", "pion_fp32", "redis_get")
SERVER_OF = {"pion_raw": "pion", "pion_fp32": "pion", "redis_get": "redis"}
CODEC_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2}


def resp(*words) -> bytes:
    out = [b"*%d\r\n" % len(words)]
    for w in words:
        w = w if isinstance(w, bytes) else str(w).encode()
        out.append(b"$%d\r\n%s\r\n" % (len(w), w))
    return b"".join(out)


class WindowMeter:
    """CPU seconds of the server, of the client process and of everything else on the machine,
    between the client's "# measure start" and "# measure end" marks (so the probe and the
    warm-up are not counted). Like bench_protocol.CpuMeter, but the client is sampled with
    psutil since it is still running when the window closes."""

    def __init__(self, server: psutil.Process, client: psutil.Process):
        self.server, self.client = server, client

    def _sample(self):
        s, c, t = self.server.cpu_times(), self.client.cpu_times(), psutil.cpu_times()
        return (s.user + s.system, c.user + c.system, CpuMeter._busy(), t.irq + t.softirq,
                time.monotonic())

    def start(self):
        self.s0 = self._sample()

    def stop(self) -> dict:
        s1 = self._sample()
        server, client, busy, irq, wall = (b - a for a, b in zip(self.s0, s1))
        # Interrupt time is not charged to any process; on loopback it is mostly the network
        # stack's work for this very traffic (softirq), so it is reported apart from `other`.
        other = max(0.0, busy - server - client - irq)
        return {"wall_s": wall, "server_cpu": server / wall, "client_cpu": client / wall,
                "irq_cpu": irq / wall, "other_cpu": other / wall, "server_cpu_s": server}


def run_fetch(fb: Path, server: psutil.Process, port: int, cmd_file: Path, verify: list[Path],
              conns: int, a) -> tuple[dict, dict, list[str]]:
    cmd = [str(fb), "--host", "127.0.0.1", "--port", str(port), "--command-file", str(cmd_file),
           "--connections", str(conns), "--seconds", str(a.seconds), "--warmup", str(a.warmup),
           "--pipeline", "1", "--verify-every", str(a.verify_every)]
    for v in verify:
        cmd += ["--verify-file", str(v)]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    meter = WindowMeter(server, psutil.Process(p.pid))
    cpu, errs = None, []
    try:
        for line in p.stderr:  # the marks arrive while the client runs
            if line.startswith("# measure start"):
                meter.start()
            elif line.startswith("# measure end"):
                cpu = meter.stop()
            else:
                errs.append(line.rstrip())
        out = p.stdout.read()
        rc = p.wait(timeout=a.seconds * 4 + 180)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    if rc != 0 or cpu is None:
        raise RuntimeError(f"pion-fetch-bench failed ({rc}): {' '.join(errs)}")
    return json.loads(out), cpu, cmd


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pion", default="build/pion-server", help="pion-server binary")
    ap.add_argument("--fetch-bench", default=None,
                    help="pion-fetch-bench binary (default: next to --pion)")
    ap.add_argument("--redis-server", default="/usr/bin/redis-server")
    ap.add_argument("--repeats", type=int, default=3, help="runs per measurement (median)")
    ap.add_argument("--quick", action="store_true",
                    help="1 repeat, 3 s runs, 1 connection; writes *-quick.md")
    ap.add_argument("--seconds", type=float, default=10.0, help="measured time per run")
    ap.add_argument("--warmup", type=float, default=1.0, help="unmeasured time before it")
    ap.add_argument("--connections", default="1,4", help="comma-separated list")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--format", default="fp16", choices=sorted(CODEC_BYTES),
                    help="namespace codec (RAW bytes are checked against numpy for these)")
    ap.add_argument("--no-values", action="store_true",
                    help="store only K (<ns>_pk), not V; the prefix is then incomplete")
    ap.add_argument("--redis-keys", type=int, default=None,
                    help="layers stored in redis and cycled by GET (default: all, so both "
                         "servers cycle the same working set)")
    ap.add_argument("--verify-every", type=int, default=64,
                    help="pion-fetch-bench --verify-every (hash check of replies)")
    ap.add_argument("--seed", type=int, default=1974)
    ap.add_argument("--workers", type=int, default=2, help="pion-server -w")
    ap.add_argument("--pion-env", action="append", default=[], metavar="KEY=VALUE",
                    help="extra environment for pion-server (repeatable; recorded in the result)")
    ap.add_argument("--redis-env", action="append", default=[], metavar="KEY=VALUE",
                    help="extra environment for redis-server (repeatable; recorded), e.g. "
                         "MALLOC_CONF=dirty_decay_ms:-1")
    ap.add_argument("--max-background", type=float, default=0.3,
                    help="before each run, wait until other CPU use is at most this many cores")
    ap.add_argument("--wait-idle", type=float, default=60.0,
                    help="longest wait (s) for --max-background before running anyway")
    ap.add_argument("--clean-threshold", type=float, default=0.25,
                    help="runs with more other CPU use (cores) than this are left out of the "
                         "medians when the test has any run below it")
    ap.add_argument("--note", action="append", default=[],
                    help="a line for the result file's Run section (repeatable), e.g. which "
                         "commit the binary was built from")
    ap.add_argument("--out", default=None, help="result file (default bench/results/vfetch-<date>.md)")
    a = ap.parse_args()
    if a.quick:
        a.repeats = 1
        a.seconds = min(a.seconds, 3.0)
        a.warmup = min(a.warmup, 0.5)
        a.connections = "1"
    conns_list = [int(c) for c in a.connections.split(",") if c]
    redis_keys = a.layers if a.redis_keys is None else max(1, min(a.redis_keys, a.layers))

    pion = Path(a.pion).resolve()
    fb = Path(a.fetch_bench).resolve() if a.fetch_bench else pion.parent / "pion-fetch-bench"
    if not pion.exists():
        sys.exit(f"pion-server not found at {pion} (cmake --build build --target pion-server)")
    if not fb.exists():
        sys.exit(f"pion-fetch-bench not found at {fb} "
                 f"(cmake --build {pion.parent} --target pion-fetch-bench)")
    if not shutil.which(a.redis_server):
        sys.exit(f"{a.redis_server} not found (apt-get install redis-server)")

    T, dim = a.tokens, a.kv_heads * a.head_dim
    raw_bytes = T * dim * CODEC_BYTES[a.format]
    fp32_bytes = T * dim * 4
    ns = "bench"

    started = dt.datetime.now()
    command_line = " ".join(shlex.quote(x) for x in [sys.executable] + sys.argv)
    tmp = Path(tempfile.mkdtemp(prefix="pion-vfetch-"))
    p1, p2 = free_port(), free_port()
    while p2 == p1:
        p2 = free_port()
    # Run a copy, so that a rebuild of build/pion-server during the run (other work on the
    # tree) neither changes the server under test nor the checksum recorded for it.
    pion_src = pion
    pion_stat = pion_src.stat()
    pion = tmp / "pion-server"
    shutil.copy2(pion_src, pion)
    pion_info = (f"`{pion_src}` (copied to the temp dir for the run; built "
                 f"{dt.datetime.fromtimestamp(pion_stat.st_mtime):%Y-%m-%d %H:%M:%S}) --version "
                 f"`{cmd_output([str(pion), '--version'])}`, sha256 {sha256(pion)}…, "
                 f"git at start {git_info()}")
    (tmp / "pion-data").mkdir()
    (tmp / "redis-data").mkdir()
    pion_cmd = [str(pion), "-w", str(a.workers), "--port", str(p1), "--metrics-port", "0", "--binary-port", "0",
                "--dir", str(tmp / "pion-data")]
    redis_cmd = [a.redis_server, "--port", str(p2), "--save", "", "--appendonly", "no",
                 "--proto-max-bulk-len", "1gb", "--client-query-buffer-limit", "2gb",
                 "--bind", "127.0.0.1", "--dir", str(tmp / "redis-data")]
    procs: dict[str, subprocess.Popen] = {}
    runs: list[dict] = []
    load_notes: list[str] = []
    client_cmds: dict[str, list[str]] = {}
    load_before = os.getloadavg()
    try:
        ports = {"pion": p1, "redis": p2}
        ps = start_pair(procs, {"pion": pion_cmd, "redis": redis_cmd}, ports, tmp,
                        {"pion": env_with(a.pion_env), "redis": env_with(a.redis_env)})

        def check_alive():
            for name, p in procs.items():
                if p.poll() is not None:
                    raise RuntimeError(f"{name} died ({p.returncode}):\n{tail(tmp / (name + '.log'))}")

        # ---- load ----------------------------------------------------------------------------
        t0 = time.monotonic()
        pc = redis.Redis(host="127.0.0.1", port=p1, socket_timeout=300)
        rc = redis.Redis(host="127.0.0.1", port=p2, socket_timeout=300)
        r = pc.execute_command("KV.PREFIX.REGISTER", ns, a.layers, T, a.kv_heads, a.head_dim,
                               a.format)
        if r not in (b"OK", "OK", True):
            raise RuntimeError(f"KV.PREFIX.REGISTER: {r!r}")
        rng = np.random.default_rng(a.seed)
        dtype = {"fp32": "<f4", "fp16": "<f2"}.get(a.format)
        cmd_raw, cmd_fp32, cmd_get = [], [], []
        layer_files = []
        for sess in ("pk",) if a.no_values else ("pk", "pv"):
            for layer in range(a.layers):
                rows = rng.standard_normal((T, dim), dtype=np.float32)
                n = pc.execute_command("V.STOREBATCH", f"{ns}_{sess}", layer * T, rows.tobytes())
                if n != T:
                    raise RuntimeError(f"V.STOREBATCH {sess} layer {layer}: {n!r}")
                if sess != "pk":
                    continue
                lo, hi = layer * T, (layer + 1) * T
                raw = pc.execute_command("V.FETCH", f"{ns}_pk", "RANGE", lo, hi, "RAW")
                if len(raw) != raw_bytes:
                    raise RuntimeError(f"RAW layer {layer}: {len(raw)} bytes, expected {raw_bytes}")
                if dtype is not None:
                    want = rows.astype(dtype).tobytes()
                elif a.format == "bf16":  # round to nearest even, as numpy has no bfloat16
                    u = rows.view(np.uint32).astype(np.uint64)
                    want = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype("<u2").tobytes()
                if raw != want:
                    raise RuntimeError(f"RAW layer {layer} differs from numpy's {a.format} encoding")
                if layer in (0, a.layers - 1):  # the decoded path, checked on two layers
                    f32 = pc.execute_command("V.FETCH", f"{ns}_pk", "RANGE", lo, hi)
                    dec = np.frombuffer(want, dtype=dtype).astype(np.float32) if dtype else \
                        (np.frombuffer(want, dtype="<u2").astype(np.uint32) << 16).view(np.float32)
                    if f32 != dec.tobytes():
                        raise RuntimeError(f"fp32 layer {layer} differs from numpy's decode")
                path = tmp / f"layer{layer}.raw"
                path.write_bytes(raw)
                layer_files.append(path)
                cmd_raw.append(resp("V.FETCH", f"{ns}_pk", "RANGE", lo, hi, "RAW"))
                cmd_fp32.append(resp("V.FETCH", f"{ns}_pk", "RANGE", lo, hi))
                if layer < redis_keys:
                    key = f"vfetch:layer:{layer}"
                    rc.set(key, raw)
                    if rc.get(key) != raw:
                        raise RuntimeError(f"redis GET {key} differs from pion RAW layer {layer}")
                    cmd_get.append(resp("GET", key))
        lookup = pc.execute_command("KV.PREFIX.LOOKUP", ns)
        load_s = time.monotonic() - t0
        pinfo = pc.execute_command("V.INFO", f"{ns}_pk")
        pinfo = dict(zip(pinfo[::2], pinfo[1::2])) if isinstance(pinfo, list) else pinfo
        rmem = rc.info("memory")
        load_notes.append(
            f"Loaded in {load_s:.1f} s: {a.layers} layers of K{'' if a.no_values else ' and V'} "
            f"({T} rows × {dim} fp32 values per layer, random normal, seed {a.seed}); "
            f"KV.PREFIX.LOOKUP → `{lookup!r}`; V.INFO {ns}_pk: "
            + ", ".join(f"{k.decode() if isinstance(k, bytes) else k}="
                        f"{v.decode() if isinstance(v, bytes) else v}" for k, v in pinfo.items()))
        load_notes.append(
            f"Checked: every layer's RAW bytes equal numpy's {a.format} encoding of the stored "
            f"rows and redis GET returns them unchanged; the fp32 replies of layers 0 and "
            f"{a.layers - 1} equal numpy's decode of them. Server memory after loading: pion RSS "
            f"{ps['pion'].memory_info().rss / 2**20:.0f} MiB, redis RSS "
            f"{ps['redis'].memory_info().rss / 2**20:.0f} MiB (used_memory "
            f"{rmem['used_memory'] / 2**20:.0f} MiB, {redis_keys} keys of {raw_bytes} bytes).")
        print("\n".join(load_notes), flush=True)
        pc.close()
        rc.close()
        files = {"pion_raw": tmp / "pion_raw.resp", "pion_fp32": tmp / "pion_fp32.resp",
                 "redis_get": tmp / "redis_get.resp"}
        files["pion_raw"].write_bytes(b"".join(cmd_raw))
        files["pion_fp32"].write_bytes(b"".join(cmd_fp32))
        files["redis_get"].write_bytes(b"".join(cmd_get))
        verify = {"pion_raw": layer_files, "pion_fp32": [], "redis_get": layer_files[:redis_keys]}
        expect = {"pion_raw": raw_bytes, "pion_fp32": fp32_bytes, "redis_get": raw_bytes}

        # ---- measure --------------------------------------------------------------------------
        for conns in conns_list:
            for rep in range(a.repeats):
                order = list(TESTS) if rep % 2 == 0 else list(reversed(TESTS))
                for test in order:
                    srv = SERVER_OF[test]
                    bg = wait_quiet(a.max_background, a.wait_idle)
                    res, cpu, ccmd = run_fetch(fb, ps[srv], ports[srv], files[test],
                                               verify[test], conns, a)
                    check_alive()
                    client_cmds[test] = ccmd
                    if res["reply_bytes_min"] != expect[test] or res["reply_bytes_max"] != expect[test]:
                        raise RuntimeError(f"{test}: replies of {res['reply_bytes_min']}.."
                                           f"{res['reply_bytes_max']} bytes, expected {expect[test]}")
                    rps = res["req_per_s"]
                    runs.append({"test": test, "conns": conns, "server": srv, "rep": rep,
                                 "gb_per_s": res["gb_per_s"], "layers_per_s": rps,
                                 "requests": res["requests"], "p50_ms": res["p50_us"] / 1000,
                                 "p99_ms": res["p99_us"] / 1000, "verified": res["verified"],
                                 "us_per_req": (cpu["server_cpu_s"] * 1e6 / res["requests"]
                                                if res["requests"] else float("nan")),
                                 "background_before": bg, **cpu})
                    print(f"  c{conns} rep {rep} {test:9s}: {res['gb_per_s']:.3f} GB/s "
                          f"{rps:7.1f} layers/s p50 {res['p50_us'] / 1000:.2f} ms "
                          f"p99 {res['p99_us'] / 1000:.2f} ms  server {cpu['server_cpu']:.2f} "
                          f"cores = {runs[-1]['us_per_req']:.0f} µs/req, client "
                          f"{cpu['client_cpu']:.2f}, irq {cpu['irq_cpu']:.2f}, other {cpu['other_cpu']:.2f}; "
                          f"idle wait {bg:.2f}",
                          flush=True)
                    time.sleep(0.5)
    finally:
        for p in procs.values():
            stop(p)
        for f in tmp.glob("*.raw"):  # 8 MiB each; the logs stay until the end
            f.unlink()
    load_after = os.getloadavg()
    finished = dt.datetime.now()

    # ---- summarise ------------------------------------------------------------------------------
    summary = {}
    for conns in conns_list:
        for test in TESTS:
            all_rs = [r for r in runs if r["test"] == test and r["conns"] == conns]
            rs = [r for r in all_rs if r["other_cpu"] <= a.clean_threshold] or all_rs
            s = {"used": f"{len(rs)}/{len(all_rs)}",
                 "layers_all": median([r["layers_per_s"] for r in all_rs])}
            for k in ("gb_per_s", "layers_per_s", "p50_ms", "p99_ms", "server_cpu", "client_cpu",
                      "irq_cpu", "other_cpu", "us_per_req"):
                s[k] = median([r[k] for r in rs])
            summary[(test, conns)] = s

    print()
    hdr = (f"{'test':10s} {'conns':>5s} {'GB/s':>7s} {'layers/s':>9s} {'p50 ms':>7s} {'p99 ms':>7s} "
           f"{'cpu µs/req':>10s} {'runs':>5s}  {'vs redis (layers/s)':s}")
    print(hdr)
    print("-" * len(hdr))
    for conns in conns_list:
        red = summary[("redis_get", conns)]
        for test in TESTS:
            s = summary[(test, conns)]
            note = ""
            if test in GOALS:
                rt = ratio(s["layers_per_s"], red["layers_per_s"])
                note = f"{rt:.2f} (goal >= {GOALS[test]:.1f} {'met' if rt >= GOALS[test] else 'MISSED'})"
            print(f"{test:10s} {conns:>5d} {s['gb_per_s']:>7.3f} {s['layers_per_s']:>9.1f} "
                  f"{s['p50_ms']:>7.2f} {s['p99_ms']:>7.2f} {s['us_per_req']:>10.0f} "
                  f"{s['used']:>5s}  {note}")

    # ---- result file ----------------------------------------------------------------------------
    m = machine_info()
    out = Path(a.out) if a.out else REPO / "bench" / "results" / (
        f"vfetch-{started:%Y-%m-%d}{'-quick' if a.quick else ''}.md")
    out.parent.mkdir(parents=True, exist_ok=True)

    def client_line(test):
        c = client_cmds.get(test)
        if not c:
            return "(not run)"
        c = [Path(x).name if x.startswith(str(tmp)) else x for x in c]
        c[0] = "pion-fetch-bench"
        for i, x in enumerate(c):
            if c[i - 1] == "--port":
                c[i] = "PORT"
            if c[i - 1] == "--connections":
                c[i] = "C"
        out_c, seen = [], False  # list the verify files once, abbreviated
        for i, x in enumerate(c):
            if x == "--verify-file" or (i and c[i - 1] == "--verify-file"):
                if not seen:
                    out_c.append("--verify-file layer0.raw ...")
                    seen = True
                continue
            out_c.append(x)
        return "`" + " ".join(out_c) + "`"

    L = []
    L.append(f"# Layer fetch benchmark: pion V.FETCH RANGE vs redis GET ({started:%Y-%m-%d})\n")
    L.append("## Run\n")
    L.append(f"- Command: `{command_line}` (cwd `{os.getcwd()}`)")
    L.append(f"- Date: {started:%Y-%m-%d %H:%M:%S} to {finished:%H:%M:%S} (local time)")
    L.append(f"- Machine: {m['nproc']} CPUs ({m['cpu']}{', virtual machine' if m['hypervisor'] else ''}), "
             f"{m['memory']} memory, kernel {m['kernel']}, {m['os']}")
    L.append(f"- Load average (1/5/15 min): before {load_before[0]:.2f}/{load_before[1]:.2f}/"
             f"{load_before[2]:.2f}, after {load_after[0]:.2f}/{load_after[1]:.2f}/{load_after[2]:.2f}")
    L.append(f"- pion-server: {pion_info}")
    for note in a.note:
        L.append(f"- Note: {note}")
    L.append(f"- pion-fetch-bench: `{fb}`, sha256 {sha256(fb)}…")
    L.append(f"- redis-server: `{cmd_output([a.redis_server, '--version'])}`")
    L.append(f"- Python {sys.version.split()[0]}, numpy {np.__version__}, redis-py "
             f"{redis.__version__}, psutil {psutil.__version__}")
    L.append(f"- pion command: `{' '.join(shlex.quote(x) for x in [*a.pion_env, *pion_cmd])}`"
             " (`<tmp>/pion-server` is the copy)")
    L.append(f"- redis command: `{' '.join(shlex.quote(x) for x in [*a.redis_env, *redis_cmd])}`")
    L.append(f"- Prefix: `KV.PREFIX.REGISTER {ns} {a.layers} {T} {a.kv_heads} {a.head_dim} {a.format}`; "
             f"one layer = {T} rows × {dim} values = {raw_bytes} bytes RAW, {fp32_bytes} bytes fp32")
    for note in load_notes:
        L.append(f"- {note}")
    L.append(f"- pion_raw: {client_line('pion_raw')}, command file: `V.FETCH {ns}_pk RANGE l*{T} "
             f"(l+1)*{T} RAW` for l = 0..{a.layers - 1}")
    L.append(f"- pion_fp32: {client_line('pion_fp32')}, the same without `RAW`")
    L.append(f"- redis_get: {client_line('redis_get')}, command file: `GET vfetch:layer:<l>` for "
             f"l = 0..{redis_keys - 1}")
    L.append("- Each connection sends the requests of its command file in turn (connection c "
             "starts at layer c), one in flight, and reads each reply whole; `--verify-file` "
             "compares the first reply of each layer byte for byte with the layer's RAW bytes "
             "(pion_raw and redis_get), and every reply's hash is checked against the first on "
             f"each connection's first reply and every {a.verify_every}th after it.")
    L.append(f"- Connections: {conns_list}. Repeats: {a.repeats} per measurement, order "
             f"{' → '.join(TESTS)} on even repeats and reversed on odd ones; {a.seconds:g} s "
             f"measured after {a.warmup:g} s warm-up. Before each run the script waited (up to "
             f"{a.wait_idle:g} s) for other CPU use ≤ {a.max_background:g} cores.")
    L.append("- GB/s = 10^9 bytes of reply payload per second; a layer is one request. "
             "`cpu` columns are CPU cores busy on average during the run (server process; "
             "client; interrupt time (`irq`: irq + softirq, charged to no process, mostly the "
             "loopback network stack working for this traffic); everything else = `other`), sampled over the measured window only (between the "
             "client's `# measure start` and `# measure end` marks); `cpu µs/req` is server CPU "
             "time in that window per request completed in it.\n")

    L.append("## Summary (medians)\n")
    L.append(f"Medians over the runs with other CPU use ≤ {a.clean_threshold:g} cores (`runs used`; "
             "all runs when none qualifies). Ratios are pion/redis in layers/s (requests/s); "
             "`GB/s ratio` compares payload bytes (fp32 replies are twice as large).\n")
    L.append("| test | conns | GB/s | layers/s | p50 ms | p99 ms | server cpu | client cpu | "
             "irq cpu | cpu µs/req | pion/redis layers/s | GB/s ratio | goal | runs used |")
    L.append("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|")
    for conns in conns_list:
        red = summary[("redis_get", conns)]
        for test in TESTS:
            s = summary[(test, conns)]
            rt = ratio(s["layers_per_s"], red["layers_per_s"]) if test in GOALS else None
            gr = ratio(s["gb_per_s"], red["gb_per_s"]) if test in GOALS else None
            goal = "" if test not in GOALS else \
                f"≥ {GOALS[test]:.1f}: {'met' if rt >= GOALS[test] else '**missed**'}"
            L.append(f"| {test} | {conns} | {s['gb_per_s']:.3f} | {s['layers_per_s']:.1f} | "
                     f"{s['p50_ms']:.2f} | {s['p99_ms']:.2f} | {s['server_cpu']:.2f} | "
                     f"{s['client_cpu']:.2f} | {s['irq_cpu']:.2f} | {s['us_per_req']:.0f} | "
                     f"{'' if rt is None else f'**{rt:.2f}**'} | {'' if gr is None else f'{gr:.2f}'} | "
                     f"{goal} | {s['used']} |")
    L.append("")
    L.append("## Raw runs\n")
    L.append("| conns | rep | test | GB/s | layers/s | requests | p50 ms | p99 ms | wall s | "
             "server cpu | cpu µs/req | client cpu | irq cpu | other cpu | idle wait | verified |")
    L.append("|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in runs:
        L.append(f"| {r['conns']} | {r['rep']} | {r['test']} | {r['gb_per_s']:.3f} | "
                 f"{r['layers_per_s']:.1f} | {r['requests']} | {r['p50_ms']:.2f} | "
                 f"{r['p99_ms']:.2f} | {r['wall_s']:.1f} | {r['server_cpu']:.2f} | "
                 f"{r['us_per_req']:.0f} | {r['client_cpu']:.2f} | {r['irq_cpu']:.2f} | "
                 f"{r['other_cpu']:.2f} | "
                 f"{r['background_before']:.2f} | {r['verified']} |")
    L.append("")
    out.write_text("\n".join(L) + "\n")
    print(f"\nwrote {out}")
    shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
