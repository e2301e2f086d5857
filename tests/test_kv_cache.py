"""KV.STORE / KV.FETCH / KV.INFO / KV.EVICT: tensors cached under embeddings, fetched by the
nearest embedding (cosine, computed here with numpy for the expected entry), with the MODEL
fence, TTL, THRESHOLD, per-tenant capacity and LRU eviction, and the EVICT forms."""
from __future__ import annotations

import time

import numpy as np
import pytest

from pionlib import RespError


def f32(a) -> bytes:
    return np.ascontiguousarray(a, dtype="<f4").tobytes()


def as_map(flat) -> dict:
    items = list(flat.items()) if isinstance(flat, dict) else \
        [(flat[i], flat[i + 1]) for i in range(0, len(flat), 2)]
    return {(k.decode() if isinstance(k, bytes) else k): v for k, v in items}


def fetch(r, q, *extra):
    got = r.execute_command("KV.FETCH", f32(q), *extra)
    if got is None:
        return None
    m = as_map(got)
    return {"id": int(m["id"]), "similarity": float(m["similarity"]), "model": m["model"],
            "tensor": m["tensor"]}


def info(r) -> dict:
    return {k: int(v) for k, v in as_map(r.execute_command("KV.INFO")).items()}


def err(srv, *args) -> str:
    with srv.raw() as c:
        got = c.call(*args)
    assert isinstance(got, RespError), "expected an error, got %r" % (got,)
    return str(got)


def test_fetch_returns_the_nearest_entry_by_cosine(pion):
    r = pion.client()
    rng = np.random.default_rng(1)
    keys = rng.standard_normal((50, 32)).astype(np.float32)
    ids = [int(r.execute_command("KV.STORE", f32(k), b"tensor-%d" % i)) for i, k in enumerate(keys)]
    assert len(set(ids)) == 50
    unit = keys / np.linalg.norm(keys, axis=1, keepdims=True)
    for _ in range(10):
        q = keys[rng.integers(50)] + 0.05 * rng.standard_normal(32).astype(np.float32)
        sims = unit @ (q / np.linalg.norm(q))
        best = int(np.argmax(sims))
        got = fetch(r, q, "THRESHOLD", 0.5)
        assert got["id"] == ids[best] and got["tensor"] == b"tensor-%d" % best
        assert abs(got["similarity"] - sims[best]) < 1e-5
    # Below the threshold (default 0.95): nil.
    far = rng.standard_normal(32).astype(np.float32)
    assert fetch(r, far) is None
    assert fetch(r, far, "THRESHOLD", -1)["id"] in ids
    # Another dimension never matches.
    assert fetch(r, np.ones(16, np.float32), "THRESHOLD", -1) is None
    st = info(r)
    assert st["entries"] == 50 and st["hits"] == 11 and st["misses"] == 2
    assert st["blob_bytes"] == sum(len(b"tensor-%d" % i) for i in range(50))


def test_model_is_an_identity_fence(pion):
    r = pion.client()
    k = np.ones(8, np.float32)
    a = int(r.execute_command("KV.STORE", f32(k), b"llama", "MODEL", "llama-3-8b"))
    b = int(r.execute_command("KV.STORE", f32(k), b"qwen", "MODEL", "qwen-2-7b"))
    assert fetch(r, k, "MODEL", "llama-3-8b")["id"] == a
    assert fetch(r, k, "MODEL", "qwen-2-7b")["tensor"] == b"qwen"
    assert fetch(r, k, "MODEL", "mistral") is None
    assert fetch(r, k) is None  # no MODEL: only entries stored without one
    c = int(r.execute_command("KV.STORE", f32(k), b"plain"))
    assert fetch(r, k)["id"] == c and fetch(r, k, "MODEL", "qwen-2-7b")["id"] == b


def test_ttl_expiry_and_evict_expired(pion):
    r = pion.client()
    k = np.ones(4, np.float32)
    short = int(r.execute_command("KV.STORE", f32(k), b"short", "TTL", 1))
    assert fetch(r, k)["id"] == short
    time.sleep(1.2)
    assert fetch(r, k) is None  # expired: never served
    long = int(r.execute_command("KV.STORE", f32(k * 2), b"long", "TTL", 3600))
    assert fetch(r, k)["id"] == long
    assert r.execute_command("KV.EVICT", "EXPIRED") == 1
    assert info(r)["entries"] == 1 and info(r)["expired"] == 1


def test_capacity_lru_and_evict_forms(pion_factory):
    srv = pion_factory("--kv-cache-capacity", "3")
    r = srv.client()
    eye = np.eye(8, dtype=np.float32)
    ids = [int(r.execute_command("KV.STORE", f32(eye[i]), b"e%d" % i)) for i in range(3)]
    assert fetch(r, eye[0])["id"] == ids[0]  # e0 is now the most recently used
    ids.append(int(r.execute_command("KV.STORE", f32(eye[3]), b"e3")))  # evicts e1
    assert fetch(r, eye[1]) is None
    assert [fetch(r, eye[i]) is not None for i in (0, 2, 3)] == [True, True, True]
    st = info(r)
    assert st["entries"] == 3 and st["capacity"] == 3 and st["evictions"] == 1
    assert r.execute_command("KV.EVICT", ids[2]) == 1
    assert r.execute_command("KV.EVICT", ids[2]) == 0
    assert r.execute_command("KV.EVICT", "ALL") == 2
    assert info(r)["entries"] == 0
    assert r.config_get("kv-cache-capacity")["kv-cache-capacity"] == "3"
    r.config_set("kv-cache-capacity", "5")
    assert info(r)["capacity"] == 5


def test_tenants_do_not_share_entries(pion_factory, tmp_path):
    users = tmp_path / "users.txt"
    users.write_text("alice pa tenant_a\nbob pb tenant_b\n")
    srv = pion_factory("--users", str(users))
    a = srv.client(username="alice", password="pa")
    b = srv.client(username="bob", password="pb")
    k = np.ones(4, np.float32)
    a.execute_command("KV.STORE", f32(k), b"secret")
    assert fetch(b, k) is None and info(b)["entries"] == 0
    assert fetch(a, k)["tensor"] == b"secret"


def test_errors(pion):
    cases = [
        (("KV.STORE", b"abc", b"t"), "ERR key_embedding must be 1 to 65536 fp32 values (a non-zero multiple of 4 bytes), got 3 bytes"),
        (("KV.STORE", f32(np.zeros(4)), b"t"), "ERR key_embedding must be a finite, non-zero vector (cosine needs a direction)"),
        (("KV.STORE", f32(np.ones(4)), b"t", "TTL", 0), "ERR TTL must be an integer number of seconds in [1, 315360000], got 0"),
        (("KV.STORE", f32(np.ones(4)), b"t", "TTL"), "ERR option 'TTL' needs a value"),
        (("KV.STORE", f32(np.ones(4)), b"t", "FOO", 1), "ERR unknown option 'FOO'; expected MODEL or TTL"),
        (("KV.FETCH", b""), "ERR query_embedding must be 1 to 65536 fp32 values (a non-zero multiple of 4 bytes), got 0 bytes"),
        (("KV.FETCH", f32(np.ones(4)), "THRESHOLD", 2), "ERR THRESHOLD must be a cosine in [-1, 1], got '2'"),
        (("KV.FETCH", f32(np.ones(4)), "BAR", 1), "ERR unknown option 'BAR'; expected MODEL or THRESHOLD"),
        (("KV.EVICT", "x"), "ERR KV.EVICT takes an entry id (a positive integer), ALL or EXPIRED, got 'x'"),
    ]
    for args, want in cases:
        assert err(pion, *args) == want, (args, err(pion, *args))
    assert pion.client().ping()


def test_memory_budget_evicts_lru_then_oom(pion_factory):
    srv = pion_factory("-w", "1", "--maxmemory", "1mb")
    r = srv.client()
    k = np.ones(4, np.float32)
    blob = b"x" * (300 << 10)
    first = int(r.execute_command("KV.STORE", f32(k), blob))
    for i in range(4):  # 300 KiB each under 1 MiB: the oldest go
        r.execute_command("KV.STORE", f32(k + i), blob)
    assert info(r)["entries"] <= 3 and info(r)["evictions"] >= 2
    assert r.execute_command("KV.EVICT", first) == 0
    with pytest.raises(Exception) as e:
        r.execute_command("KV.STORE", f32(k), b"y" * (2 << 20))
    assert "OOM" in str(e.value)
    assert r.ping()
