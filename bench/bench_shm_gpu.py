#!/usr/bin/env python3
"""Same-host layer fetch into GPU memory (run on the GPU machine): one 64 MiB fp16 K/V layer
(32K tokens x 8 heads x 128) from pion-server to a CUDA tensor, by path, in one run:
  shm_pinned_bounce        V.FETCH ... SHM, copy from the mapping into a pinned host buffer,
                           then cudaMemcpyAsync to the GPU (the Python client's device= path)
  shm_hostregister_direct  the mapping itself registered with cudaHostRegister (read-only
                           flag), DMA from it to the GPU piece by piece, no host copy
  tcp_raw_pageable         V.FETCH ... RAW over TCP (redis-py), pageable host memory -> GPU
Each path's GPU bytes are compared with the RAW reply. Also checks kv.fetch_layer(device="cuda").

The GPU machine has no Debian packages: build here, then carry the server, its shared libraries
and redis-py (pure Python) in build/devcarry (see bench/README.md), and run from the repo root:
    python3 bench/bench_shm_gpu.py     (env PION_DEVCARRY=build/devcarry by default)
"""
import os, subprocess, sys, time, socket
CARRY = os.environ.get("PION_DEVCARRY", "build/devcarry")
sys.path.insert(0, CARRY + "/py"); sys.path.insert(0, "clients/python")
import numpy as np, torch, pion
env = dict(os.environ, LD_LIBRARY_PATH=CARRY + "/lib")
sock = "/tmp/pion-gpu.sock"
BIN = CARRY + "/bin/pion-server" if os.path.exists(CARRY + "/bin/pion-server") else CARRY + "/pion-server"
srv = subprocess.Popen([BIN, "--port", "19740", "--metrics-port", "0", "--binary-port", "0", "--dir", "/tmp/pd",
                        "--unixsocket", sock, "--shm-segment-size", "1gb", "--proto-max-bulk-len", "4gb"], env=env)
for _ in range(100):
    try: socket.create_connection(("127.0.0.1", 19740)).close(); break
    except OSError: time.sleep(0.1)
print(torch.__version__, torch.cuda.get_device_name(0), flush=True)
T, H, D = 32768, 8, 128
rows = np.random.default_rng(0).standard_normal((T, H * D)).astype(np.float32)
c = pion.Client(unix_socket_path=sock); tcp = pion.Client(port=19740, shm=False)
c.v.create("L", H * D, "fp16"); c.v.store_batch("L", 0, rows)
nbytes = T * H * D * 2
def med(f, n=15):
    f(); ts = []
    for _ in range(n):
        torch.cuda.synchronize(); t0 = time.perf_counter(); f(); torch.cuda.synchronize(); ts.append(time.perf_counter() - t0)
    return sorted(ts)[len(ts) // 2]
pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
gpu = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
def a():  # SHM -> pinned bounce buffer -> GPU
    c.v.fetch_raw("L", 0, T, decode=False, into=pinned.numpy()); gpu.copy_(pinned, non_blocking=True)
ch = c._shm_channel(); cudart = torch.cuda.cudart(); registered = set()
def b():  # SHM lease, cudaHostRegister the mapping (once per segment), DMA straight from it
    lease, pieces, _, _ = ch.fetch_range("L", 0, T); pos = 0
    for s, o, n in pieces:
        if s not in registered:
            registered.add(s); print("register", s, ch.cuda_register(s), flush=True)
        src = torch.from_numpy(np.frombuffer(ch.maps[s], np.uint8, n, o))
        gpu[pos:pos + n].copy_(src, non_blocking=True); pos += n
    torch.cuda.synchronize(); ch.release(lease)
def t():  # TCP RAW -> numpy -> GPU (pageable)
    g = torch.from_numpy(np.frombuffer(tcp.execute("V.FETCH", "L", "RANGE", 0, T, "RAW"), np.uint8).copy())
    gpu.copy_(g)
ref = np.frombuffer(tcp.execute("V.FETCH", "L", "RANGE", 0, T, "RAW"), np.uint8)
for name, f in (("shm_pinned_bounce", a), ("shm_hostregister_direct", b), ("tcp_raw_pageable", t)):
    dt = med(f); ok = np.array_equal(gpu.cpu().numpy(), ref)
    print(f"{name}: {dt*1e3:.2f} ms {nbytes/dt/1e9:.2f} GB/s bytes_equal={ok}", flush=True)
for fmt in ("fp16", "bf16", "fp32", "int8"):
    for layout in ("nhd", "hnd"):
        ns = "ns_%s_%s" % (fmt, layout)
        c.kv.register(ns, 1, 4096, 8, 128, fmt)
        kk = rows[:4096].reshape(4096, 8, 128)
        c.kv.store_layer(ns, 0, kk, kk[::-1].copy())
        k, v = c.kv.fetch_layer(ns, 0, device="cuda", layout=layout)
        kc, vc = tcp.kv.fetch_layer(ns, 0, layout=layout)
        print(f"fetch_layer {fmt} {layout} device=cuda: {k.device} path={c.last_fetch_path} "
              f"equal_to_tcp={np.array_equal(k.cpu().numpy(), kc) and np.array_equal(v.cpu().numpy(), vc)}",
              flush=True)
c.kv.register("big", 1, T, H, D, "fp16")
c.kv.store_layer("big", 0, rows.reshape(T, H, D), rows.reshape(T, H, D))
dt = med(lambda: c.kv.fetch_layer("big", 0, device="cuda"), 9)
print(f"fetch_layer fp16 32K tokens (K+V {2 * nbytes / 2**20:.0f} MiB) device=cuda: {dt*1e3:.2f} ms "
      f"{2 * nbytes / dt / 1e9:.2f} GB/s path={c.last_fetch_path}", flush=True)
# A whole prefix: 32 layers x 32K tokens x 8 heads x 128, bf16, K+V = 4 GiB, into CUDA tensors of
# the stored dtype in the model's [H, T, D] layout (kv.fetch_layers: pipelined SHM fetch, DMA from
# the registered mapping), against torch's pinned host->GPU copy of the same bytes.
L = 32
c.kv.register("prefix", L, T, H, D, "bf16")
for j in range(L):
    for sfx in ("_pk", "_pv"):
        c.v.store_batch("prefix" + sfx, j * T, rows)
total = 2 * L * T * H * D * 2
dt = med(lambda: c.kv.fetch_layers("prefix", device="cuda"), 3)
print(f"fetch_layers bf16 {L} layers x {T} tokens (K+V {total / 2**30:.1f} GiB) device=cuda: "
      f"{dt*1e3:.1f} ms {total / dt / 1e9:.1f} GB/s path={c.last_fetch_path}", flush=True)
kv = c.kv.fetch_layers("prefix", [0, L - 1], device="cuda")
want = torch.from_numpy(rows).to(torch.bfloat16).view(T, H, D).transpose(0, 1)
print("fetch_layers equals the stored rows:", all(torch.equal(x.cpu(), want) for p in kv for x in p),
      flush=True)
del kv
pin = torch.empty(total, dtype=torch.uint8, pin_memory=True); gpu4 = torch.empty(total, dtype=torch.uint8, device="cuda")
dp = med(lambda: gpu4.copy_(pin, non_blocking=True), 3)
print(f"torch pinned host->GPU copy of {total / 2**30:.1f} GiB: {dp*1e3:.1f} ms {total / dp / 1e9:.1f} GB/s; "
      f"shm path / pinned = {dp / dt * 100:.0f} %", flush=True)
c.close()
srv.terminate(); srv.wait()
