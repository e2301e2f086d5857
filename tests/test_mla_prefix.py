"""MLA namespaces (issue 52, Stage 1): KV.PREFIX.REGISTER ... MLA <kv_lora_rank> <rope_dim>.

A DeepSeek V2/V3 layer caches one latent row per token — kv_lora_rank compressed values then
rope_dim RoPE key values, shared by every head — in one session `<ns>_pl`. The layout is part of
the namespace's identity: a per-head reader's lookup misses it and its reads are refused with a
specific error (and the other way round). Codecs: fp16, bf16, Pion's fp8 and DeepSeek-V3.2's
fp8_ds_mla (656 bytes a token), checked here against an independent numpy reading of the
layout. RAW and shared-memory fetches, save/restore and residency are the V-store's, verified
here for latent sessions."""
from __future__ import annotations

import os
import signal
import sys

import numpy as np
import pytest

from pionlib import RespError

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "clients",
                                "python"))
import pion  # noqa: E402
from pion import codecs  # noqa: E402

L, T, R, P = 3, 200, 512, 64  # layers, tokens (not a multiple of 64), kv_lora_rank, rope_dim
DK = R + P


def register(r, ns, fmt="bf16", *extra, layers=L, tokens=T, rank=R, rope=P):
    return r.execute_command("KV.PREFIX.REGISTER", ns, layers, tokens, "MLA", rank, rope, fmt,
                             *extra)


def latents(seed, rows=L * T, dk=DK):
    rng = np.random.default_rng(seed)
    c = rng.standard_normal((rows, dk)).astype(np.float32)
    c[:, R:] *= 3.0  # RoPE values at another scale than the compressed ones
    return c


def fill(r, ns, c):
    assert r.execute_command("V.STOREBATCH", ns + "_pl", 0, c.tobytes()) == c.shape[0]


def info(r, ns):
    flat = r.execute_command("KV.PREFIX.INFO", ns)
    return {flat[i].decode(): flat[i + 1] for i in range(0, len(flat), 2)}


def explain(r, ns, *args):
    flat = r.execute_command("KV.PREFIX.LOOKUP", ns, *args, "EXPLAIN")
    return {flat[i].decode(): flat[i + 1] for i in range(0, len(flat), 2)}


def restart(srv):
    srv.stop(signal.SIGTERM)
    return srv.start()


# ---- an independent reading of DeepSeek-V3.2's fp8 latent row (src/store/codec/README.md) ----

def e4m3_values() -> np.ndarray:
    """float64 [256]: every e4m3fn byte's value (bias 7, 3 mantissa bits, 0x7F/0xFF NaN)."""
    out = np.empty(256)
    for b in range(256):
        e, m = (b >> 3) & 15, b & 7
        v = m / 8 * 2.0 ** -6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7)
        out[b] = np.nan if (b & 0x7F) == 0x7F else (-v if b & 0x80 else v)
    return out


def ds_mla_read(row: bytes):
    """One 656-byte row: (the 512 compressed values, their 4 scales, the 64 RoPE values)."""
    assert len(row) == 656
    q = np.frombuffer(row[:512], np.uint8)
    scales = np.frombuffer(row[512:528], "<f4").astype(np.float64)
    rope = (np.frombuffer(row[528:], "<u2").astype(np.uint32) << 16).view(np.float32)
    return e4m3_values()[q] * np.repeat(scales, 128), scales, rope.astype(np.float64)


def bf16_rne(x: np.ndarray) -> np.ndarray:
    u = x.astype(np.float32).view(np.uint32).astype(np.uint64)
    return (((u + 0x7FFF + ((u >> 16) & 1)) >> 16) << 16).astype(np.uint32).view(np.float32)


# ---- the layout and its identity ----------------------------------------------------------------

def test_register_store_lookup_fetch_and_info(shared_pion):
    r = shared_pion.client()
    assert register(r, "m1", "bf16", "MODEL", "dsv3", "POSITION", "yarn:40") == b"OK"
    assert register(r, "m1", "bf16", "MODEL", "dsv3", "POSITION", "yarn:40") == b"OK"  # same
    i = info(r, "m1")
    assert i["layout"] == b"mla" and i["kv_lora_rank"] == R and i["rope_dim"] == P
    assert i["kv_heads"] == 1 and i["head_dim"] == DK and i["format"] == b"bf16"
    v = r.execute_command("V.INFO", "m1_pl")
    v = {v[j].decode(): v[j + 1] for j in range(0, len(v), 2)}
    assert v["dim"] == DK and v["row_bytes"] == 2 * DK
    assert r.execute_command("KV.PREFIX.LOOKUP", "m1", "LAYOUT", "mla") == b"MISS"  # empty
    c = latents(1)
    fill(r, "m1", c)
    assert r.execute_command("KV.PREFIX.LOOKUP", "m1", "MODEL", "dsv3", "LAYOUT", "mla") == b"HIT"
    i = info(r, "m1")
    assert i["complete"] == 1 and i["committed_frontier"] == T and i["publication_generation"] > 0
    chunks = -(-L * T // 64)
    assert i["bytes_ram"] == chunks * 64 * DK * 2  # one session, not two
    blocks = r.execute_command("KV.PREFIX.BLOCKS", "m1")
    assert all(b[b.index(b"written") + 1] == 1 for b in blocks)
    assert blocks[0][blocks[0].index(b"rows") + 1] == L * 64  # latent rows: one per token+layer
    # A layer is one RANGE of the latent session; bf16 is exact on bf16 values.
    got = np.frombuffer(r.execute_command("V.FETCH", "m1_pl", "RANGE", T, 2 * T), np.float32)
    np.testing.assert_array_equal(got.reshape(T, DK), bf16_rne(c[T:2 * T]))
    # Published: immutable like every namespace.
    with pytest.raises(Exception, match="namespace 'm1' is published"):
        r.execute_command("V.STOREBATCH", "m1_pl", 0, c[:1].tobytes())


def test_layout_is_part_of_the_identity(shared_pion):
    r = shared_pion.client()
    register(r, "lay", "fp16")
    fill(r, "lay", latents(2))
    # A per-head reader (no LAYOUT: every reader before MLA) never gets a hit.
    assert r.execute_command("KV.PREFIX.LOOKUP", "lay") == b"MISS"
    assert r.execute_command("KV.PREFIX.LOOKUP", "lay", "LAYOUT", "heads") == b"MISS"
    e = explain(r, "lay")
    assert e["result"] == b"MISS" and e["reason"] == b"layout_differs"
    assert e["expected"] == b"heads" and e["held"] == b"mla"
    assert b"kv_lora_rank 512 + rope_dim 64" in e["detail"] and b"LAYOUT mla" in e["detail"]
    # Its reads and writes of K/V sessions: a specific error, never another layout's bytes.
    with shared_pion.raw() as raw:
        for cmd in (("V.FETCH", "lay_pk", "RANGE", 0, 10), ("V.FETCH", "lay_pv", 0, "RAW"),
                    ("V.STOREBATCH", "lay_pk", 0, np.zeros(DK, np.float32).tobytes())):
            assert raw.call(*cmd) == RespError(
                "MISMATCH namespace 'lay' holds MLA latents (kv_lora_rank 512 + rope_dim 64 per "
                "token, one session 'lay_pl'), so '%s' is not one of its sessions: a per-head "
                "reader cannot read an MLA namespace (read its latent rows from 'lay_pl')"
                % cmd[1]), cmd
        # Registering the name with a per-head layout: refused, naming both.
        assert raw.call("KV.PREFIX.REGISTER", "lay", L, T, 1, DK, "fp16") == RespError(
            "MISMATCH namespace 'lay' is registered with model '' layout 3x200xMLA(512+64) fp16 "
            "position '', not model '' layout 3x200x1x576 fp16 position ''; KV.PREFIX.DROP it "
            "first")
    # HEADS has no meaning on latents.
    with pytest.raises(Exception, match="HEADS applies to per-head namespaces"):
        r.execute_command("V.FETCH", "lay_pl", "RANGE", 0, 10, "HEADS", 0, 1)
    # The other way round: a per-head namespace is no MLA reader's.
    r.execute_command("KV.PREFIX.REGISTER", "ph", 1, 64, 1, DK, "fp16")
    for part in ("pk", "pv"):
        r.execute_command("V.STOREBATCH", f"ph_{part}", 0,
                          np.ones((64, DK), np.float32).tobytes())
    assert r.execute_command("KV.PREFIX.LOOKUP", "ph") == b"HIT"
    assert r.execute_command("KV.PREFIX.LOOKUP", "ph", "LAYOUT", "mla") == b"MISS"
    assert explain(r, "ph", "LAYOUT", "mla")["reason"] == b"layout_differs"
    with pytest.raises(Exception, match="an MLA reader cannot read a per-head namespace"):
        r.execute_command("V.FETCH", "ph_pl", "RANGE", 0, 1)


@pytest.mark.parametrize("cmd,error", [
    (("KV.PREFIX.REGISTER", "e", 1, 64, "MLA", 512, 64, "int8"),
     "ERR an MLA namespace stores its latents as fp32, fp16, bf16, fp8 or fp8_ds_mla, got 'int8'"),
    (("KV.PREFIX.REGISTER", "e", 1, 64, "MLA", 512, 32, "fp8_ds_mla"),
     "ERR fp8_ds_mla holds kv_lora_rank (a multiple of 128) + 64 RoPE values, got kv_lora_rank "
     "512 rope_dim 32"),
    (("KV.PREFIX.REGISTER", "e", 1, 64, "MLA", 500, 64, "fp8_ds_mla"),
     "ERR fp8_ds_mla holds kv_lora_rank (a multiple of 128) + 64 RoPE values, got kv_lora_rank "
     "500 rope_dim 64"),
    (("KV.PREFIX.REGISTER", "e", 1, 64, 1, 576, "fp8_ds_mla"),
     "ERR fp8_ds_mla is the MLA latent layout: register the namespace with MLA <kv_lora_rank> "
     "<rope_dim> (kv_heads/head_dim namespaces hold per-head K/V)"),
    (("KV.PREFIX.REGISTER", "e", 1, 64, "MLA", 0, 64, "bf16"),
     "ERR kv_lora_rank must be in [1, 4096], got 0"),
    (("KV.PREFIX.REGISTER", "e", 1, 64, "MLA", 512, 2000, "bf16"),
     "ERR rope_dim must be in [0, 1024], got 2000"),
    (("KV.PREFIX.REGISTER", "e", 1, 64, "MLA", 512, 64),
     "ERR syntax: KV.PREFIX.REGISTER <ns> <n_layers> <n_tokens> MLA <kv_lora_rank> <rope_dim> "
     "<format> [MODEL <id>] [POSITION <digest>] [PREFILL_MS <ms>]"),
    (("KV.PREFIX.LOOKUP", "e", "LAYOUT", "latent"), "ERR LAYOUT must be heads or mla, got 'latent'"),
    (("V.CREATE", "v", 512, "fp8_ds_mla"),
     "ERR fp8_ds_mla rows are kv_lora_rank + 64 RoPE values, kv_lora_rank a positive multiple of "
     "128 (DeepSeek: 512 + 64 = 576), got dim 512"),
])
def test_errors(shared_pion, cmd, error):
    with shared_pion.raw() as c:
        assert c.call(*cmd) == RespError(error)


# ---- codecs -------------------------------------------------------------------------------------

def test_fp8_ds_mla_is_656_bytes_a_token_and_dequantizes_within_its_bound(shared_pion):
    r = shared_pion.client()
    register(r, "ds", "fp8_ds_mla")
    c = latents(3)
    c[5, 7] = 0.0
    c[6, :128] = 0.0   # a group of zeros: scale 0, decodes to zeros
    c[7, 200] = 1e4    # one large value costs only its own group's precision
    fill(r, "ds", c)
    v = r.execute_command("V.INFO", "ds_pl")
    v = {v[j].decode(): v[j + 1] for j in range(0, len(v), 2)}
    assert v["row_bytes"] == 656 and v["block"] == 128 and v["format"] == b"fp8_ds_mla"
    raw = r.execute_command("V.FETCH", "ds_pl", "RANGE", 0, L * T, "RAW")
    assert len(raw) == 656 * L * T
    server = np.frombuffer(r.execute_command("V.FETCH", "ds_pl", "RANGE", 0, L * T),
                           np.float32).reshape(L * T, DK)
    # The client's decoder (pion.codecs, from the README) reproduces the server's bit for bit.
    np.testing.assert_array_equal(codecs.decode("fp8_ds_mla", DK, 128, raw), server)
    err = norm = 0.0
    for t in range(L * T):
        vals, scales, rope = ds_mla_read(raw[t * 656:(t + 1) * 656])
        x = c[t].astype(np.float64)
        groups = x[:R].reshape(4, 128)
        np.testing.assert_array_equal(scales, (np.abs(groups).max(axis=1).astype(np.float32)
                                               / np.float32(448)).astype(np.float64))
        # e4m3: 3 mantissa bits (relative error <= 2^-4) above 2^-6·scale, subnormal steps of
        # 2^-9·scale below (error <= 2^-10·scale); f32 rounding of the product on top.
        bound = np.maximum(np.abs(x[:R]) * 2.0 ** -4, np.repeat(scales, 128) * 2.0 ** -10)
        assert np.all(np.abs(vals - x[:R]) <= bound * (1 + 1e-6) + 1e-30), t
        np.testing.assert_array_equal(np.asarray(server[t, :R], np.float64), vals.astype(np.float32))
        np.testing.assert_array_equal(rope.astype(np.float32), bf16_rne(c[t, R:]))
        if t != 7:
            err += float(((vals - x[:R]) ** 2).sum())
            norm += float((x[:R] ** 2).sum())
    assert np.all(server[6, :128] == 0)
    assert server[7, 200] == pytest.approx(1e4, rel=1e-6)
    rel = err / norm
    assert 3e-4 <= rel <= 1.5e-3, rel  # stored e4m3: not more, not less


@pytest.mark.parametrize("fmt,bound,floor", [("fp16", 2.4e-7, 2e-8), ("bf16", 1.53e-5, 1.3e-6),
                                             ("fp8", 1.5e-3, 3e-4), ("fp32", 0, 0)])
def test_other_latent_codecs_round_trip(shared_pion, fmt, bound, floor):
    r = shared_pion.client()
    ns = "rt_" + fmt
    register(r, ns, fmt)
    c = latents(4)
    fill(r, ns, c)
    raw = r.execute_command("V.FETCH", ns + "_pl", "RANGE", 0, L * T, "RAW")
    assert len(raw) == L * T * codecs.row_bytes(fmt, DK)
    got = codecs.decode(fmt, DK, 0, raw)
    rel = float(((got.astype(np.float64) - c) ** 2).sum() / (c.astype(np.float64) ** 2).sum())
    assert floor <= rel <= bound, rel
    client = pion.Client("127.0.0.1", shared_pion.port)
    np.testing.assert_array_equal(client.kv.fetch_latents(ns, 1), got[T:2 * T])
    rows = client.kv.fetch_latents(ns, 1, decode=False)
    assert rows.shape == (T, codecs.row_bytes(fmt, DK)) and rows.tobytes() == raw[
        T * rows.shape[1]:2 * T * rows.shape[1]]


def test_python_client_mla_namespace(shared_pion):
    c = pion.Client("127.0.0.1", shared_pion.port)
    c.kv.register_mla("pyml", 2, 100, 256, 64, "fp8_ds_mla", model="dsv2-lite")
    x = latents(5, rows=100, dk=320)
    for layer in range(2):
        assert c.kv.store_latents("pyml", layer, x) == 100
    assert c.kv.lookup("pyml", model="dsv2-lite", layout="mla")
    assert not c.kv.lookup("pyml", model="dsv2-lite")
    assert c.kv.lookup("pyml", explain=True)["reason"] == "layout_differs"
    got = c.kv.fetch_latents("pyml", 1)
    assert got.shape == (100, 320)
    q, scales, rope = codecs.ds_mla_parts(c.kv.fetch_latents("pyml", 1, decode=False).tobytes(),
                                          320)
    assert q.shape == (100, 256) and scales.shape == (100, 2) and rope.shape == (100, 64)
    with pytest.raises(ValueError, match="do not match MLA namespace"):
        c.kv.store_latents("pyml", 0, x[:, :300])
    with pytest.raises(pion.MismatchError, match="a per-head reader cannot read"):
        c.kv.fetch_layer("pyml", 0)


# ---- generic over sessions: shared memory, save/restore, residency --------------------------------

def test_shm_fetch_of_latents_equals_raw(pion_factory, tmp_path):
    sock = str(tmp_path / "pion.sock")
    srv = pion_factory("--workers", "2", "--unixsocket", sock)
    r = srv.client()
    register(r, "shm", "fp8_ds_mla")
    c = latents(6)
    fill(r, "shm", c)
    raw = r.execute_command("V.FETCH", "shm_pl", "RANGE", T, 2 * T, "RAW")
    client = pion.Client(unix_socket_path=sock)
    rows = client.kv.fetch_latents("shm", 1, decode=False)
    assert client.last_fetch_path == "shm"
    assert rows.tobytes() == raw
    np.testing.assert_array_equal(client.kv.fetch_latents("shm", 1),
                                  codecs.decode("fp8_ds_mla", DK, 128, raw))


@pytest.mark.parametrize("fmt", ["bf16", "fp8_ds_mla"])
def test_saved_mla_namespace_survives_restart(pion_factory, fmt):
    srv = pion_factory("-w", "2")
    r = srv.client()
    register(r, "sv", fmt, "MODEL", "dsv3")
    fill(r, "sv", latents(7))
    want = r.execute_command("V.FETCH", "sv_pl", "RANGE", 0, L * T, "RAW")
    assert r.execute_command("KV.PREFIX.SAVE", "sv") == b"OK"
    restart(srv)
    r = srv.client()
    i = info(r, "sv")
    assert i["resident"] == 0 and i["layout"] == b"mla" and i["kv_lora_rank"] == R
    assert i["rope_dim"] == P and i["format"] == fmt.encode() and i["complete"] == 1
    assert r.execute_command("KV.PREFIX.LOOKUP", "sv", "MODEL", "dsv3") == b"MISS"  # per-head
    assert info(r, "sv")["resident"] == 0  # a per-head reader's miss opens nothing
    assert r.execute_command("KV.PREFIX.LOOKUP", "sv", "MODEL", "dsv3", "LAYOUT", "mla") == b"HIT"
    assert r.execute_command("V.FETCH", "sv_pl", "RANGE", 0, L * T, "RAW") == want
    with pytest.raises(Exception, match="a per-head reader cannot read an MLA namespace"):
        r.execute_command("V.FETCH", "sv_pk", "RANGE", 0, 1)
    # Same identity after restart: idempotent; the per-head layout: refused.
    assert register(r, "sv", fmt, "MODEL", "dsv3") == b"OK"
    with pytest.raises(Exception, match="MISMATCH|is registered with"):
        r.execute_command("KV.PREFIX.REGISTER", "sv", L, T, 1, DK, fmt if fmt != "fp8_ds_mla"
                          else "fp16", "MODEL", "dsv3")


def test_memory_pressure_moves_latents_to_disk_and_back(pion_factory):
    per_ns = -(-L * T // 64) * 64 * 656  # chunks of fp8_ds_mla rows
    budget = int(per_ns * 2.5)
    srv = pion_factory("-w", "1", "--maxmemory", str(budget))
    r = srv.client()
    want = {}
    for i, ns in enumerate(("a", "b", "c", "d")):
        register(r, ns, "fp8_ds_mla")
        fill(r, ns, latents(10 + i))
        want[ns] = r.execute_command("V.FETCH", ns + "_pl", "RANGE", 0, L * T, "RAW")
    assert int(srv.info("residency")["residency_demotions_host_disk"]) >= 1
    assert int(srv.info("memory")["used_memory"]) <= budget
    for ns in want:
        assert r.execute_command("KV.PREFIX.LOOKUP", ns, "LAYOUT", "mla") == b"HIT"
        assert r.execute_command("V.FETCH", ns + "_pl", "RANGE", 0, L * T, "RAW") == want[ns]
    assert int(srv.info("persistence")["evictions"]) == 0
    assert r.execute_command("KV.PREFIX.DROP", "a") == 1
    with pytest.raises(Exception, match="no such session"):
        r.execute_command("V.INFO", "a_pl")
