#!/usr/bin/env python3
"""Stage 2 on the GPU: Pion's CUDA attention kernels against torch's scaled_dot_product_attention
on the same device, shapes and dtypes, in one run, plus ATTEND.PREFIX.QUERY end to end.

Run on the GPU machine (it has torch) from the repository root, with the binaries of
`make gpu-bundle` (build/devcarry) or of a build:
  python3 bench/bench_attend_gpu.py --bin build/devcarry/bin --out bench/results/x.md

Kernel rows (B = 1, contiguous GQA, the whole prefix visible to the queries):
  pion    pion-gpu-attn-bench: the executor's launch sequence (partials + combine; sparse-auto
          also block scores + block selection), mean per call over replays of a CUDA graph of
          20 calls, timed by CUDA events (the host's launch rate does not count); the mean of
          plain back-to-back calls is reported beside it
  torch   scaled_dot_product_attention(q, k, v, enable_gqa=True) on [1, H, N, D] tensors, timed
          the same two ways; batched rows force the flash backend (SDPBackend.FLASH_ATTENTION)
  stream  a plain streaming read of the same K/V bytes: the bandwidth ceiling
  "TB/s" is K/V bytes read / time (keys × H_kv × D × 2 × dtype size; fp8: × (D + 4) / D, the
  row scales). fp8 rows (Pion's e4m3 slots with a scale per row) run against torch in fp16 at
  the same shape — torch's SDPA has no fp8 K/V — so their "vs torch" is the fp8 goal's measure
  (issue 31: ≥ 1.8× at N = 128K).
Every row carries its ratio to torch: kernel rows torch µs / Pion µs at the same shape;
sparse-auto rows torch's dense SDPA over the same prefix / Pion's sparse-auto; end-to-end rows
torch's SDPA kernel alone at that shape / the whole round trip (the network and the server
included, so far below 1).
End to end: pion-server --attention-backend cuda on loopback, ATTEND.PREFIX.QUERY (M = 1)
measured by pion-fetch-bench (one connection, one request in flight), reply bytes verified.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.functional import scaled_dot_product_attention as sdpa

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "bench"))
from benchutil import free_port, report  # noqa: E402,F401  (shared by the bench scripts)


def pion_kernel(bin_dir: Path, *args, env: dict | None = None) -> dict:
    if not (bin_dir / "pion-gpu-attn-bench").exists() and \
            (bin_dir / "pion-gpu-attn-bench.xz").exists():
        raise SystemExit("%s holds a packed gpu-bundle: run python3 %s first" % (
            bin_dir, bin_dir.parent / "unpack.py"))
    out = subprocess.run([str(bin_dir / "pion-gpu-attn-bench"), *map(str, args)],
                         capture_output=True, text=True, timeout=600,
                         env=None if env is None else {**os.environ, **env})
    if out.returncode != 0:
        raise RuntimeError("pion-gpu-attn-bench %s failed: %s" % (args, out.stderr))
    return json.loads(out.stdout.strip().splitlines()[-1])


def cuda_time_us(fn, iters: int, per_graph: int = 20) -> tuple[float, float]:
    """(µs per call over CUDA graph replays of max(20, per_graph) calls, µs per call back to
    back). A rotating fn reads another K/V set each call: per_graph = its set count, so a
    replay goes round them all."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(5):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(iters):
        fn()
    b.record()
    b.synchronize()
    loop = a.elapsed_time(b) * 1000.0 / iters
    per_graph = max(20, per_graph)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(per_graph):
            fn()
    g.replay()
    torch.cuda.synchronize()
    replays = max(1, iters // per_graph)
    a.record()
    for _ in range(replays):
        g.replay()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) * 1000.0 / (replays * per_graph), loop


def rotate_sets(set_bytes: float) -> int:
    """Distinct K/V sets a rotated row reads in turn: at least 8, and together at least 4× the
    L2 (so no call finds the bytes of the call before it there), within 12 GB."""
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    want = max(8, -(-4 * l2 // int(set_bytes)))
    return int(max(8, min(want, 12e9 // set_bytes)))


def torch_attend(dtype: str, hq: int, hkv: int, m: int, n: int,
                 d: int, flash: bool, sets: int = 1) -> tuple[tuple[float, float], str]:
    """torch SDPA at this shape: f32 in fp32, bf16 in bf16, f16 (and f8, which torch has no
    kernel for: its peer) in fp16. ((µs graph, µs launches), backend). sets > 1: the calls
    read that many distinct K/V copies in turn. fp32 runs on its fastest backend here: the
    default (math), or memory-efficient SDPA (K/V expanded for GQA where it needs them)."""
    t = {"f32": torch.float32, "bf16": torch.bfloat16}.get(dtype, torch.float16)
    g = torch.Generator(device="cuda").manual_seed(1)
    q = torch.randn(1, hq, m, d, dtype=t, device="cuda", generator=g)
    k0 = torch.randn(1, hkv, n, d, dtype=t, device="cuda", generator=g)
    v0 = torch.randn(1, hkv, n, d, dtype=t, device="cuda", generator=g)
    kv = [(k0, v0)] + [(k0.clone(), v0.clone()) for _ in range(sets - 1)]
    byts = 2 * hkv * n * d * q.element_size()
    iters = 30 if byts > 1e9 else 100 if byts > 1e8 else 400
    turn = [0]

    def rotating(call, pairs):
        def fn():
            k, v = pairs[turn[0] % len(pairs)]
            turn[0] += 1
            return call(k, v)
        return fn

    def gqa(k, v):
        return sdpa(q, k, v, enable_gqa=True)

    if flash:
        try:
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                return cuda_time_us(rotating(gqa, kv), iters, sets), "flash, gqa"
        except RuntimeError:
            expanded = [(k.repeat_interleave(hq // hkv, dim=1),
                         v.repeat_interleave(hq // hkv, dim=1)) for k, v in kv]
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                return cuda_time_us(rotating(lambda k, v: sdpa(q, k, v), expanded), iters,
                                    sets), "flash, K/V expanded"
    best = (cuda_time_us(rotating(gqa, kv), iters, sets), "default, gqa")
    if dtype == "f32":
        # torch's fp32 backends at this shape (H100, torch 2.11, M = 1, N = 32K: default/gqa
        # 1608 µs, memory-efficient on expanded K/V 3058 µs, math on expanded K/V 850 µs; no
        # fused kernel takes GQA in fp32): the fastest of them is the peer.
        expanded = None
        for how, backend, use_gqa in (("memory-efficient, gqa", SDPBackend.EFFICIENT_ATTENTION,
                                       True),
                                      ("memory-efficient, K/V expanded",
                                       SDPBackend.EFFICIENT_ATTENTION, False),
                                      ("math, K/V expanded", SDPBackend.MATH, False)):
            try:
                if use_gqa:
                    pairs, call = kv, gqa
                else:
                    if expanded is None:  # within 24 GB: at 128K a pair is 4 GB, far past L2
                        per_pair = 2 * hq * n * d * q.element_size()
                        m_sets = max(min(2, len(kv)), min(len(kv), int(24e9 // per_pair)))
                        expanded = [(k.repeat_interleave(hq // hkv, dim=1),
                                     v.repeat_interleave(hq // hkv, dim=1))
                                    for k, v in kv[:m_sets]]
                    pairs, call = expanded, (lambda k, v: sdpa(q, k, v))
                with sdpa_kernel(backend):
                    got = cuda_time_us(rotating(call, pairs), iters, sets)
                if got[0] < best[0][0]:
                    best = (got, how)
            except RuntimeError as e:  # named in the table: why the backend did not run
                print("torch fp32 %s: %s" % (how, str(e).splitlines()[0][:160]), flush=True)
                continue
    return best


def resp(*args) -> bytes:
    out = [b"*%d\r\n" % len(args)]
    for a in args:
        b = a if isinstance(a, bytes) else str(a).encode()
        out.append(b"$%d\r\n%s\r\n" % (len(b), b))
    return b"".join(out)


def call(port: int, payload: bytes) -> bytes:
    """One request on a fresh connection; returns the whole RESP reply (simple or bulk)."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(payload)
        data = b""
        while True:
            chunk = s.recv(1 << 20)
            if not chunk:
                return data
            data += chunk
            if b"\r\n" in data:
                head = data[:data.index(b"\r\n")]
                if head[:1] != b"$" or len(data) >= len(head) + 4 + int(head[1:]):
                    return data


def e2e(bin_dir: Path, backend: str, seconds: float, extra: list[str]) -> dict:
    port = free_port()
    work = Path(tempfile.mkdtemp(prefix="pion-gpu-bench-"))
    env = dict(os.environ)
    srv = subprocess.Popen([str(bin_dir / "pion-server"), "--port", str(port), "--dir",
                            str(work / "data"), "--metrics-port", "0", "--binary-port", "0",
                            "--attention-backend",
                            backend, *extra], stdout=open(work / "server.log", "w"),
                           stderr=subprocess.STDOUT, env=env)
    try:
        for _ in range(200):
            try:
                if call(port, resp("PING")).startswith(b"+PONG"):
                    break
            except OSError:
                time.sleep(0.05)
        rng = np.random.default_rng(7)
        h, n, d = 8, 2048, 128
        k = rng.standard_normal((h, n, d), dtype=np.float32)
        v = rng.standard_normal((h, n, d), dtype=np.float32)
        q = rng.standard_normal((h, d), dtype=np.float32)
        assert call(port, resp("ATTEND.PREFIX.STORE", "bench", 0, h, n, d, k.tobytes(),
                               v.tobytes())).startswith(b"+OK")
        query = resp("ATTEND.PREFIX.QUERY", "bench", 0, h, d, 0, q.tobytes())
        reply = call(port, query)
        body = reply[reply.index(b"\r\n") + 2:-2]
        got = np.frombuffer(body, "<f4").reshape(h, d)
        s = np.einsum("hnd,hd->hn", k.astype(np.float64), q) / np.sqrt(d)
        p = np.exp(s - s.max(1, keepdims=True))
        ref = np.einsum("hn,hnd->hd", p / p.sum(1, keepdims=True), v)
        err = float(np.max(np.abs(got - ref) / (1 + np.abs(ref))))
        assert err <= 1e-4, "QUERY reply differs from the reference: %g" % err
        # The server's own compute time for one query (receipt "micros": the executor, GPU
        # transfers and kernels included), median of 200.
        micros = []
        for _ in range(200):
            rep = call(port, resp("ATTEND.PREFIX.QUERY", "bench", 0, h, d, 0, q.tobytes(),
                                  "RECEIPT"))
            i = rep.index(b"micros")
            tail = rep[i:].split(b"\r\n")
            micros.append(float(tail[2]))
        cmd_file, verify = work / "query.resp", work / "reply.bin"
        cmd_file.write_bytes(query)
        verify.write_bytes(body)
        out = subprocess.run([str(bin_dir / "pion-fetch-bench"), "--host", "127.0.0.1", "--port",
                              str(port), "--command-file", str(cmd_file), "--verify-file",
                              str(verify), "--connections", "1", "--pipeline", "1", "--seconds",
                              str(seconds), "--warmup", "1"], capture_output=True, text=True,
                             timeout=seconds * 4 + 60)
        if out.returncode != 0:
            raise RuntimeError("pion-fetch-bench: " + out.stderr)
        r = json.loads(out.stdout)
        r["max_rel_err"] = err
        r["compute_us"] = float(np.median(micros))
        return r
    finally:
        srv.terminate()
        srv.wait(timeout=10)


DECODE_N = (1024, 2048, 8192, 32768, 131072)


def decode_goal(rows: list) -> list:
    """The issue-31 decode goal per dtype and d: Pion at least as fast as torch at every N of
    DECODE_N, and from N = 32K at least 95 % of the streaming read of the same bytes."""
    out = ["", "Decode goal (GQA 32/8, M = 1; fp8 against torch fp16): Pion ≥ torch at every N, "
           "and ≥ 95 % of the stream's TB/s from N = 32K — on the rotated figures (distinct K/V "
           "sets in turn, as a model's decode step reads its layers); the same-K/V repeat beside.",
           "", "| dtype | d | slowest vs torch (N) | lowest share of stream, N ≥ 32K (N) | met "
           "| same K/V: slowest vs torch, lowest share from 32K "
           "| calls apart: slowest vs torch, lowest share from 32K |",
           "|---|---|---|---|---|---|---|"]
    for dd in (128, 64):
        for dty in ("f16", "bf16", "f8"):
            rs = [r for r in rows if r["case"] == "decode" and r["dtype"] == dty and r["d"] == dd]
            if not rs:
                continue
            slow = min(rs, key=lambda r: r["speedup_rot"])
            long = [r for r in rs if r["n"] >= 32768]
            low = min(long, key=lambda r: r["pion_rot_tbps"] / r["stream_rot_tbps"])
            share = low["pion_rot_tbps"] / low["stream_rot_tbps"]
            met = slow["speedup_rot"] >= 1.0 and share >= 0.95
            same = "%.2f×, %.0f %%" % (min(r["speedup"] for r in rs),
                                       100 * min(r["pion_tbps"] / r["stream_tbps"] for r in long))
            # The same with the calls apart (no overlap between one call and the next).
            ap = [r for r in rs if r["pion_apart_us"]]
            apart = "—"
            if ap:
                a_slow = min(r["torch_us"] / r["pion_apart_us"] for r in ap)
                a_share = min((r["pion_us"] / r["pion_apart_us"]) * r["pion_tbps"] /
                              r["stream_tbps"] for r in ap if r["n"] >= 32768)
                apart = "%.2f×, %.0f %%" % (a_slow, 100 * a_share)
            out.append("| %s | %d | %.2f× (%d) | %.0f %% (%d) | %s | %s | %s |" % (
                dty, dd, slow["speedup_rot"], slow["n"], 100 * share, low["n"],
                "yes" if met else "no", same, apart))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bin", default="build", help="directory with pion-server, "
                    "pion-gpu-attn-bench and pion-fetch-bench")
    ap.add_argument("--out", default=None, help="markdown results file")
    ap.add_argument("--seconds", type=float, default=5.0, help="end-to-end measured time")
    ap.add_argument("--sections", default="decode,compare,batched,sparse,e2e",
                    help="comma-separated subset of decode, compare (the decode's other paths "
                    "and the batched SIMT rows), batched, sparse, e2e (default: all)")
    ap.add_argument("--decode-shapes", default=None,
                    help="the decode grid's dtype/d pairs to run, comma-separated (e.g. f8/64; "
                    "default: f16, bf16, f8 at d 128 and 64, and fp32)")
    a = ap.parse_args()
    sections = set(a.sections.split(","))
    unknown = sections - {"decode", "compare", "batched", "sparse", "e2e"}
    if unknown:
        ap.error("unknown sections: %s" % ", ".join(sorted(unknown)))
    bin_dir = Path(a.bin).resolve()
    hq, hkv, d = 32, 8, 128
    rows = []

    torch_dense = {}  # (dtype, hq, hkv, m, n) -> torch µs (graph)

    def kernel_row(label, dtype, m, n, flash=False, env=None, dd=d):
        p = pion_kernel(bin_dir, "dense", dtype, hq, hkv, m, n, dd, env=env)
        (tu, tu_loop), how = torch_attend(dtype, hq, hkv, m, n, dd, flash)
        torch_dense[(dtype, hq, hkv, m, n, dd)] = tu
        torch_dtype = dtype if dtype in ("f32", "bf16") else "f16"
        torch_bytes = 2 * hkv * n * dd * (4 if torch_dtype == "f32" else 2)
        st = pion_kernel(bin_dir, "stream", int(p["bytes"]))
        # As a model's decode step reads them: distinct K/V sets in turn (the headline).
        sets = rotate_sets(p["bytes"])
        pr = pion_kernel(bin_dir, "dense", dtype, hq, hkv, m, n, dd,
                         env={**(env or {}), "PION_BENCH_ROTATE": str(sets)})
        (tr, tr_loop), how_r = torch_attend(dtype, hq, hkv, m, n, dd, flash, sets=rotate_sets(
            torch_bytes))
        torch.cuda.empty_cache()  # torch's copies go back before the next subprocess allocates
        sr = pion_kernel(bin_dir, "stream", int(p["bytes"]), sets)
        # M = 1 decodes again with calls apart: no overlap of one call's launches with the next's
        # (kernels::cuda::SetOverlapCalls off) — what one call alone costs.
        apart = (pion_kernel(bin_dir, "dense", dtype, hq, hkv, m, n, dd,
                             env={**(env or {}), "PION_BENCH_OVERLAP": "0"})["us"]
                 if m == 1 else None)
        rows.append({"case": label, "dtype": dtype, "m": m, "n": n, "d": dd, "sets": sets,
                     "pion_rot_us": pr["us"], "pion_rot_tbps": pr["bytes"] / pr["us"] / 1e6,
                     "torch_rot_us": tr, "torch_rot_tbps": torch_bytes / tr / 1e6,
                     "torch_rot_how": how_r, "stream_rot_tbps": sr["gbps"] / 1e3,
                     "stream_form": sr["best_form"], "speedup_rot": tr / pr["us"],
                     "pion_us": p["us"],
                     "pion_loop_us": p["us_launches"], "pion_apart_us": apart,
                     "pion_tbps": p["bytes"] / p["us"] / 1e6, "path": p["path"],
                     "torch_us": tu, "torch_loop_us": tu_loop, "torch_dtype": torch_dtype,
                     "torch_tbps": torch_bytes / tu / 1e6, "torch_how": how,
                     "stream_tbps": st["gbps"] / 1e3, "speedup": tu / p["us"]})
        print(rows[-1], flush=True)

    # The launch floor: an empty kernel, and two (a split-K pass and its combine are two).
    floor = [pion_kernel(bin_dir, "empty", k, 128)["us"] for k in (1, 2)]
    # The decode goal's grid (issue 31): fp16, bf16 and fp8 (against torch fp16), d 128 and 64,
    # N 1K .. 128K.
    shapes = None if a.decode_shapes is None else set(a.decode_shapes.split(","))
    if "decode" in sections:
        for dd in (128, 64):
            for dty in ("f16", "bf16", "f8"):
                if shapes is not None and "%s/%d" % (dty, dd) not in shapes:
                    continue
                for n in DECODE_N:
                    kernel_row("decode", dty, 1, n, dd=dd)
        for n in (2048, 32768, 131072) if shapes is None or "f32/128" in shapes else ():
            kernel_row("decode", "f32", 1, n)
    if "compare" in sections:
        # For comparison: the M = 1 decodes on the per-warp-ring tensor-core decode instead of
        # the streaming decode, the streaming decode's 64-key tiles where it takes 128, and the
        # bf16 and fp8 decodes on the SIMT kernel.
        old = {"PION_BENCH_STREAM": "0"}
        for dty, dd, n in (("f16", 128, 8192), ("f16", 128, 32768), ("f16", 128, 131072),
                           ("f16", 64, 32768), ("f8", 128, 131072), ("f8", 64, 131072)):
            kernel_row("decode, tensor-core decode", dty, 1, n, env=old, dd=dd)
        for dty, dd, n in (("f16", 64, 32768), ("f16", 64, 131072), ("f8", 128, 131072),
                           ("f8", 64, 131072)):
            kernel_row("decode, 64-key tiles", dty, 1, n, env={"PION_BENCH_STREAM_TILE": "64"},
                       dd=dd)
        kernel_row("decode, SIMT", "bf16", 1, 131072, env={"PION_BENCH_BF16TC": "0"})
        kernel_row("decode, SIMT", "f8", 1, 131072, env={"PION_BENCH_F8TC": "0"})
    if "batched" in sections:
        # Prefill (M = 512) and a short chunk (M = 16: 64 query rows a K/V head, the smallest
        # batched shape) over a 32K prefix; bf16 and fp8 on the eight-group tensor-core kernel
        # (the default: kernels::cuda::LowpBatched) and on their SIMT kernel.
        for m in (512, 16):
            for dty in ("f16", "bf16", "f8"):
                kernel_row("batched", dty, m, 32768, flash=True)
        if "compare" in sections:
            simt = {"PION_BENCH_LOWP_BATCHED": "0"}
            kernel_row("batched, SIMT", "bf16", 512, 32768, flash=True, env=simt)
            kernel_row("batched, SIMT", "f8", 512, 32768, flash=True, env=simt)
    # Sparse-auto at N = 64K with a 4K-token budget (block 64, 62 + first + last blocks) against
    # dense over the same prefix.
    sparse = []
    for sdt, shq, shkv, shared in (("f16", hq, hkv, False), ("f16", hq, hkv, True),
                                   ("f16", hkv, hkv, False), ("f8", hq, hkv, False),
                                   ("f8", hq, hkv, True)) if "sparse" in sections else ():
        # SHARED: the one-launch kernel the server uses (fused, fp16), with the four launches
        # beside.
        fused = shared and sdt == "f16"
        mode = ["fused"] if fused else ["shared"] if shared else []
        dn = pion_kernel(bin_dir, "dense", sdt, shq, shkv, 1, 65536, d)
        # As a model's decode step reads them: distinct K/V (and block summaries) in turn — the
        # headline; the same K/V call after call (L2 holds part of it) beside.
        sets = rotate_sets(dn["bytes"])
        rot = {"PION_BENCH_ROTATE": str(sets)}
        sa = pion_kernel(bin_dir, "sparse_auto", sdt, shq, shkv, 65536, d, 64, 62, *mode)
        sa_r = pion_kernel(bin_dir, "sparse_auto", sdt, shq, shkv, 65536, d, 64, 62, *mode,
                           env=rot)
        dn_r = pion_kernel(bin_dir, "dense", sdt, shq, shkv, 1, 65536, d, env=rot)
        (tdn, _), _ = torch_attend(sdt, shq, shkv, 1, 65536, d, False)
        (tdn_r, _), _ = torch_attend(sdt, shq, shkv, 1, 65536, d, False, sets=sets)
        torch.cuda.empty_cache()
        # Dense reads H_kv·N rows; sparse H_q·budget, or H_kv·budget when each K/V head's
        # query heads share their blocks: the best possible ratio.
        variants = [("SHARED, four launches" if shared else "per head", sa_r["us"], sa["us"],
                     sa_r["us_launches"], sa.get("path", ""))]
        if fused:
            variants.insert(0, ("SHARED, one launch", sa_r["fused_us"], sa["fused_us"],
                                sa_r["fused_us_launches"],
                                "a cluster of %d a head" % sa["fused_cluster"]))
        for label, us, us_same, loop_us, path in variants:
            sparse.append({"dtype": sdt, "hq": shq, "hkv": shkv, "selection": label,
                           "sets": sets, "sparse_us": us, "sparse_us_same": us_same,
                           "sparse_loop_us": loop_us, "dense_loop_us": dn_r["us_launches"],
                           "dense_us": dn_r["us"], "dense_us_same": dn["us"],
                           "budget": sa["budget"], "speedup": dn_r["us"] / us,
                           "speedup_same": dn["us"] / us_same, "path": path,
                           "torch_dense_us": tdn_r, "torch_dense_us_same": tdn,
                           "vs_torch": tdn_r / us,
                           "bound": shkv * 65536 / ((shkv if shared else shq) * sa["budget"])})
            print(sparse[-1], flush=True)
    e2e_rows = []
    # The server's defaults, then without shard polling (--poll-us 0: a request forwarded to
    # the owning shard, and its reply, wait for scheduler wake-ups), then the CPU backend.
    for label, backend, extra in (("cuda", "cuda", []), ("cuda, --poll-us 0", "cuda",
                                                          ["--poll-us", "0"]),
                                  ("cpu", "cpu", [])) if "e2e" in sections else ():
        r = e2e(bin_dir, backend, a.seconds, extra)
        e2e_rows.append((label, r))
        print(label, {k: r[k] for k in ("p50_us", "p99_us", "req_per_s", "max_rel_err",
                                        "compute_us")},
              flush=True)

    e2e_torch_us = torch_attend("f32", 8, 8, 1, 2048, d, False)[0][0] if e2e_rows else 0.0
    dev = torch.cuda.get_device_name()
    lines = [
        "# Stage 2 on the GPU: CUDA kernels vs torch SDPA (%s, %s)" % (dev, dt.date.today()),
        "",
        "Command (on the GPU machine, from the repository root):",
        "`python3 bench/bench_attend_gpu.py --bin build/devcarry/bin%s` (binaries from "
        "`make gpu-bundle`, unpacked by `python3 build/devcarry/unpack.py`). torch %s, CUDA %s, host %s (%d cores)." % (
            "" if a.sections == ap.get_default("sections") else " --sections " + a.sections,
            torch.__version__, torch.version.cuda, platform.processor() or platform.machine(),
            os.cpu_count()),
        "",
        "## Kernels: B=1, H_q=32, H_kv=8, D=128 (and 64 where the D column says), the whole "
        "prefix visible",
        "",
        "µs = per call, from replays of a CUDA graph of 20 calls (both sides; the host's launch "
        "rate does not count). `launches` = the same calls issued back to back from the host. "
        "Pion's back-to-back calls overlap (programmatic dependent launch: a decode's first tiles "
        "stream while the call before it drains and merges; kernels::cuda::SetOverlapCalls); "
        "`calls apart` = the same graph with that off — what one call alone costs, as when a copy "
        "separates the calls (the server uploads each query). "
        "TB/s = K/V bytes read / time. `stream` = a plain streaming read of the same bytes in "
        "the same run. N=2K fits in L2 (50 MB), so its TB/s is above HBM for both. The launch "
        "floor in the same run: an empty kernel %.2f µs, two empty kernels %.2f µs." % (
            floor[0], floor[1]),
        "",
        "fp8 rows: Pion's fp8 slots (e4m3 bytes + an f32 scale per row) against torch fp16 at "
        "the same shape (torch's SDPA takes no fp8 K/V); the fp8 goal is ≥ 1.8× torch fp16 at "
        "N = 128K decode.",
        "",
        "Rotated (the headline): each call reads the next of `sets` distinct copies of the K/V "
        "(at least 8, together at least 4× the L2), as a model's decode step reads layer after "
        "layer; torch and the stream rotate the same way. `same K/V`: every call reads one set "
        "(part of it may still sit in L2 from the call before). The stream is the best of three "
        "plain reads (gpu_stream.cu: evict-first 16-byte loads; four or eight non-coherent loads "
        "in flight a thread), `form` the best one. fp32 rows: torch on its fastest fp32 backend.",
        "",
        "| case | dtype (Pion / torch) | D | M | N | sets | Pion µs | Pion TB/s | torch µs "
        "| torch TB/s | stream TB/s (form) | Pion vs torch | same K/V: Pion µs, torch µs, stream "
        "TB/s, Pion vs torch | Pion µs, launches | torch µs, launches "
        "| Pion µs, calls apart | Pion path | torch backend |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            "| %s | %s / %s | %d | %d | %d | %d | %.1f | %.2f | %.1f | %.2f | %.2f (%d) | %.2f× "
            "| %.1f, %.1f, %.2f, %.2f× | %.1f | %.1f | %s | %s | %s |" % (
                r["case"], r["dtype"], r["torch_dtype"], r["d"], r["m"], r["n"], r["sets"],
                r["pion_rot_us"], r["pion_rot_tbps"], r["torch_rot_us"], r["torch_rot_tbps"],
                r["stream_rot_tbps"], r["stream_form"], r["speedup_rot"], r["pion_us"],
                r["torch_us"], r["stream_tbps"], r["speedup"], r["pion_loop_us"],
                r["torch_loop_us"],
                "—" if r["pion_apart_us"] is None else "%.1f" % r["pion_apart_us"], r["path"],
                r["torch_rot_how"]))
    lines += decode_goal(rows)
    goal = [r for r in rows if r["dtype"] == "f8" and r["case"] == "decode" and r["n"] == 131072
            and r["d"] == 128]
    if goal:
        lines += ["", "fp8 goal (decode, N = 128K, vs torch fp16, rotated): %.2f× (goal ≥ 1.8×: "
                  "%s; same K/V %.2f×)." % (
                      goal[0]["speedup_rot"], "met" if goal[0]["speedup_rot"] >= 1.8 else
                      "not met", goal[0]["speedup"])]
    if sparse:
        lines += [
            "",
            "## Sparse-auto: N=64K, D=128, budget %d keys per query head (block 64, K_top 62)"
            % sparse[0]["budget"],
            "",
            "Per query head (the default), each head picks its own blocks, so sparse reads H_q × "
            "budget rows where dense reads H_kv × N: with H_q/H_kv = 4 the read volume — and the "
            "best possible ratio — is 4×. With `SHARED` the query heads of a K/V head choose one "
            "set together (H_kv × budget rows: 16×), as with one query head per K/V head. The "
            "server runs SHARED (without a suffix) as one launch — thread-block clusters per K/V "
            "head score, select, attend and merge (sparse_fused.cu); the four launches it replaced "
            "are timed beside it.",
            "",
            "`vs torch`: torch's dense SDPA over the same prefix (fp16; fp32 for none here) / "
            "Pion's sparse-auto. Headline columns: %d distinct K/V sets (with their block "
            "summaries) read in turn, together ≥ 4× the L2, as a model's decode step reads its "
            "layers; `same K/V`: one set call after call (L2 holds part of it)." % sparse[0]["sets"],
            "",
            "| dtype | H_q | H_kv | selection | sparse-auto µs (one launch, or scores + select + "
            "attend + combine) | dense µs | dense / sparse | read-volume bound | torch dense µs "
            "| vs torch | same K/V: sparse / dense µs, ratio | attend path "
            "| sparse / dense µs, launches |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in sparse:
            lines.append("| %s | %d | %d | %s | %.1f | %.1f | %.2f× | %.0f× | %.1f | %.2f× "
                         "| %.1f / %.1f, %.2f× | %s | %.1f / %.1f |" % (
                             r["dtype"], r["hq"], r["hkv"], r["selection"], r["sparse_us"],
                             r["dense_us"], r["speedup"], r["bound"], r["torch_dense_us"],
                             r["vs_torch"], r["sparse_us_same"], r["dense_us_same"],
                             r["speedup_same"], r["path"], r["sparse_loop_us"],
                             r["dense_loop_us"]))
    if e2e_rows:
        lines += [
            "",
            "## End to end: ATTEND.PREFIX.QUERY M=1, H=8, N=2048, D=128 (fp32 slot), loopback",
            "",
            "One connection, one request in flight, %.0f s; reply checked against float64 numpy "
            "(max rel err shown) and verified byte for byte by pion-fetch-bench." % a.seconds,
            "",
            "`vs torch`: torch's SDPA kernel alone at this shape (fp32, %.1f µs) / the round trip's "
            "p50." % e2e_torch_us,
            "",
            "| backend, flags | p50 µs | p99 µs | queries/s | server compute µs (receipt, median) "
            "| max rel err | vs torch |",
            "|---|---|---|---|---|---|---|",
        ]
        for backend, r in e2e_rows:
            lines.append("| %s | %.0f | %.0f | %.0f | %.0f | %.1e | %.3f× |" % (
                backend, r["p50_us"], r["p99_us"], r["req_per_s"], r["compute_us"], r["max_rel_err"],
                e2e_torch_us / r["p50_us"]))
    report(lines, a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
