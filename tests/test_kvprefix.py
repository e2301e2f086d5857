"""KV.PREFIX.* namespaces: identity manifest and fences, publish-before-visible, committed
frontier and blocks, generations, tenants, and many readers of one prefix."""
from __future__ import annotations

import re
import threading
import time

import numpy as np
import pytest

from pionlib import RespError

L, T, H, D = 4, 200, 2, 64  # layers, tokens (not a multiple of 64), kv heads, head dim
DIM = H * D


def register(r, ns, *extra, layers=L, tokens=T, heads=H, dim=D, fmt="fp16"):
    return r.execute_command("KV.PREFIX.REGISTER", ns, layers, tokens, heads, dim, fmt, *extra)


def fill(r, ns, layers=range(L), tokens=T, seed=0, upto=None):
    rng = np.random.default_rng(seed)
    kv = {}
    for l in layers:
        for part in ("pk", "pv"):
            x = rng.standard_normal((tokens, DIM)).astype(np.float32)
            n = tokens if upto is None else upto
            r.execute_command("V.STOREBATCH", f"{ns}_{part}", l * tokens, x[:n].tobytes())
            kv[(l, part)] = x
    return kv


def info(r, ns):
    flat = r.execute_command("KV.PREFIX.INFO", ns)
    return {flat[i].decode(): flat[i + 1] for i in range(0, len(flat), 2)}


def test_register_fill_lookup_fetch(shared_pion):
    r = shared_pion.client()
    assert register(r, "p1", "MODEL", "llama-3-8b@abc", "POSITION", "rope:500000",
                    "PREFILL_MS", "812.5") == b"OK"
    assert register(r, "p1", "MODEL", "llama-3-8b@abc", "POSITION", "rope:500000") == b"OK"
    assert r.execute_command("KV.PREFIX.LOOKUP", "p1") == b"MISS"
    kv = fill(r, "p1")
    assert r.execute_command("KV.PREFIX.LOOKUP", "p1", "MODEL", "llama-3-8b@abc") == b"HIT"
    # One layer in one round trip, as V.FETCH RANGE on the namespace's session.
    layer2 = np.frombuffer(r.execute_command("V.FETCH", "p1_pv", "RANGE", 2 * T, 3 * T), np.float32)
    np.testing.assert_array_equal(layer2.reshape(T, DIM),
                                  kv[(2, "pv")].astype(np.float16).astype(np.float32))
    i = info(r, "p1")
    assert i["complete"] == 1 and i["committed_frontier"] == T
    assert i["fetches"] == 1 and float(i["saved_prefill_ms"]) == pytest.approx(812.5)
    assert i["cache_generation"] >= 1 and i["publication_generation"] >= 1
    assert i["model"] == b"llama-3-8b@abc" and i["position"] == b"rope:500000"
    chunks = -(-L * T // 64)  # layers are consecutive ids: ceil(800 / 64) chunks per session
    assert i["bytes_ram"] == 2 * chunks * 64 * DIM * 2
    total = r.execute_command("KV.PREFIX.INFO")
    assert total[total.index(b"prefixes") + 1] >= 1


def test_half_written_prefix_is_never_a_hit(shared_pion):
    r = shared_pion.client()
    register(r, "half")
    fill(r, "half", layers=range(L - 1))          # last layer missing entirely
    assert r.execute_command("KV.PREFIX.LOOKUP", "half") == b"MISS"
    fill(r, "half", layers=[L - 1], upto=T - 1)    # last token of the last layer missing
    assert r.execute_command("KV.PREFIX.LOOKUP", "half") == b"MISS"
    assert info(r, "half")["committed_frontier"] == T - 1
    x = np.ones((1, DIM), np.float32)
    r.execute_command("V.STOREBATCH", "half_pk", L * T - 1, x.tobytes())
    assert r.execute_command("KV.PREFIX.LOOKUP", "half") == b"MISS"  # V still missing
    r.execute_command("V.STOREBATCH", "half_pv", L * T - 1, x.tobytes())
    assert r.execute_command("KV.PREFIX.LOOKUP", "half") == b"HIT"


def test_frontier_blocks_and_membership(shared_pion):
    r = shared_pion.client()
    register(r, "blk")
    fill(r, "blk", upto=100)  # tokens 0..99 of every layer
    assert info(r, "blk")["committed_frontier"] == 100
    blocks = r.execute_command("KV.PREFIX.BLOCKS", "blk")
    assert len(blocks) == 4  # 200 tokens = 3 full blocks + 8
    as_maps = [{b[i].decode(): b[i + 1] for i in range(0, len(b), 2)} for b in blocks]
    assert [m["written"] for m in as_maps] == [1, 0, 0, 0]
    assert [m["rows"] for m in as_maps] == [2 * L * 64, 2 * L * 36, 0, 0]
    assert [m["tier"] for m in as_maps] == [b"ram", b"ram", b"none", b"none"]
    assert r.execute_command("KV.PREFIX.MEMBERSHIP", "blk") == [0, 1]
    assert isinstance(r.execute_command("KV.PREFIX.OWNER", "blk"), int)


@pytest.mark.parametrize("field,value", [
    ("model", "other-model"), ("position", "rope:10000"), ("layers", L + 1),
    ("tokens", T * 2), ("heads", H * 2), ("dim", D * 2), ("fmt", "int8")])
def test_identity_mutations_are_refused(shared_pion, field, value):
    """Each manifest field changed alone: REGISTER is a typed MISMATCH and the original bytes
    are untouched; a LOOKUP naming another model or position is a MISS."""
    r = shared_pion.client()
    ns = "id_" + field
    base = dict(layers=L, tokens=T, heads=H, dim=D, fmt="fp16")
    register(r, ns, "MODEL", "m1", "POSITION", "rope:500000", **base)
    fill(r, ns, seed=1)
    extra = {"model": ["MODEL", "m1"], "position": ["POSITION", "rope:500000"]}
    args = dict(base)
    if field in ("model", "position"):
        extra[field] = [field.upper(), value]
    else:
        args[field] = value
    with pytest.raises(Exception, match=r"is registered with model 'm1' layout 4x200x2x64 fp16"):
        register(r, ns, *extra["model"], *extra["position"], **args)
    if field in ("model", "position"):
        assert r.execute_command("KV.PREFIX.LOOKUP", ns, field.upper(), value) == b"MISS"
    assert r.execute_command("KV.PREFIX.LOOKUP", ns, "MODEL", "m1",
                             "POSITION", "rope:500000") == b"HIT"


def test_tenant_never_sees_another_tenants_prefix(pion_factory, tmp_path):
    users = tmp_path / "users.txt"
    users.write_text("alice apw teamA\nbob bpw teamB\n")
    srv = pion_factory("-w", "2", "--users", str(users))
    a = srv.client(username="alice", password="apw")
    b = srv.client(username="bob", password="bpw")
    register(a, "sys-prompt", "MODEL", "m")
    fill(a, "sys-prompt")
    assert a.execute_command("KV.PREFIX.LOOKUP", "sys-prompt", "MODEL", "m") == b"HIT"
    assert b.execute_command("KV.PREFIX.LOOKUP", "sys-prompt", "MODEL", "m") == b"MISS"
    with pytest.raises(Exception, match="no such session 'sys-prompt_pk'"):
        b.execute_command("V.FETCH", "sys-prompt_pk", 0)
    register(b, "sys-prompt", "MODEL", "other")  # same name, other tenant: independent
    assert b.execute_command("KV.PREFIX.LOOKUP", "sys-prompt") == b"MISS"
    assert a.execute_command("KV.PREFIX.LOOKUP", "sys-prompt") == b"HIT"


def test_drop_and_reregister_fences_the_old_generation(shared_pion):
    r = shared_pion.client()
    register(r, "gen", "MODEL", "m")
    fill(r, "gen")
    g1 = info(r, "gen")["cache_generation"]
    assert r.execute_command("KV.PREFIX.LOOKUP", "gen", "GENERATION", g1) == b"HIT"
    assert r.execute_command("KV.PREFIX.DROP", "gen") == 1
    assert r.execute_command("KV.PREFIX.DROP", "gen") == 0
    assert r.execute_command("KV.PREFIX.LOOKUP", "gen") == b"MISS"
    with pytest.raises(Exception, match="no such session 'gen_pk'"):
        r.execute_command("V.FETCH", "gen_pk", 0)
    register(r, "gen", "MODEL", "m")
    g2 = info(r, "gen")["cache_generation"]
    assert g2 > g1
    fill(r, "gen", seed=9)
    with shared_pion.raw() as c:
        err = c.call("KV.PREFIX.LOOKUP", "gen", "GENERATION", g1)
        assert str(err).startswith(f"MISMATCH namespace 'gen' is at generation {g2}, not {g1}")
    assert r.execute_command("KV.PREFIX.LOOKUP", "gen", "GENERATION", g2) == b"HIT"


def test_existing_session_of_another_shape_refuses_register(shared_pion):
    r = shared_pion.client()
    r.execute_command("V.CREATE", "clash_pk", 64, "fp32")
    with shared_pion.raw() as c:
        err = c.call("KV.PREFIX.REGISTER", "clash", L, T, H, D, "fp16")
        assert str(err).startswith("MISMATCH session 'clash_pk' exists with dim 64 format fp32")
    assert r.execute_command("KV.PREFIX.LOOKUP", "clash") == b"MISS"


BAD = [
    (("KV.PREFIX.REGISTER", "x", 0, T, H, D, "fp16"), "ERR n_layers must be in [1, 4096], got 0"),
    (("KV.PREFIX.REGISTER", "x", L, "t", H, D, "fp16"), "ERR n_tokens must be a non-negative integer, got 't'"),
    (("KV.PREFIX.REGISTER", "x", L, T, H, D, "fp9"), "ERR format must be one of fp32|fp16|bf16|int8|turbo4|turbo3|turbo2|fp8|fp8_e5m2|fp8_ds_mla, got 'fp9'"),
    (("KV.PREFIX.REGISTER", "x", L, T, H, D, "fp16", "MODEL"), "ERR option 'MODEL' needs a value"),
    (("KV.PREFIX.REGISTER", "x", L, T, H, D, "fp16", "COLOR", "red"), "ERR unknown option 'COLOR'; expected MODEL, POSITION or PREFILL_MS"),
    (("KV.PREFIX.REGISTER", "x", L, T, H, D, "fp16", "PREFILL_MS", "-1"), "ERR PREFILL_MS must be a non-negative number, got '-1'"),
    (("KV.PREFIX.LOOKUP", "x", "GENERATION", "g"), "ERR GENERATION must be a non-negative integer, got 'g'"),
    (("KV.PREFIX.LOOKUP", "x", "SIZE", "1"), "ERR unknown option 'SIZE'; expected MODEL, POSITION, LAYOUT, GENERATION or EXPLAIN"),
    (("KV.PREFIX.INFO", "nosuch"), "ERR no such prefix namespace 'nosuch'"),
    (("KV.PREFIX.BLOCKS", "nosuch"), "ERR no such prefix namespace 'nosuch'"),
    (("KV.PREFIX.REGISTER", "x", L, T, H, D), "ERR wrong number of arguments for 'kv.prefix.register' command"),
]


@pytest.mark.parametrize("cmd,err", BAD, ids=[str(i) for i in range(len(BAD))])
def test_bad_input(shared_pion, cmd, err):
    with shared_pion.raw() as c:
        assert str(c.call(*cmd)) == err
        assert c.call("PING") == "PONG"


def test_hundred_clients_fetch_one_prefix(shared_pion):
    r = shared_pion.client()
    layers, tokens = 8, 512
    r.execute_command("KV.PREFIX.REGISTER", "hot", layers, tokens, H, D, "bf16", "MODEL", "m")
    rng = np.random.default_rng(4)
    for part in ("pk", "pv"):
        x = rng.standard_normal((layers * tokens, DIM)).astype(np.float32)
        r.execute_command("V.STOREBATCH", f"hot_{part}", 0, x.tobytes())
    want = [r.execute_command("V.FETCH", "hot_pk", "RANGE", l * tokens, (l + 1) * tokens, "RAW")
            for l in range(layers)]
    errors, barrier = [], threading.Barrier(100)

    def client(i):
        try:
            c = shared_pion.client()
            barrier.wait(30)
            assert c.execute_command("KV.PREFIX.LOOKUP", "hot", "MODEL", "m") == b"HIT"
            l = i % layers
            got = c.execute_command("V.FETCH", "hot_pk", "RANGE", l * tokens, (l + 1) * tokens, "RAW")
            if got != want[l]:
                errors.append(f"client {i}: layer {l} differs")
        except Exception as e:  # noqa: BLE001
            errors.append(f"client {i}: {e!r}")

    threads = [threading.Thread(target=client, args=(i,)) for i in range(100)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors[:3]
    assert info(r, "hot")["fetches"] >= 100


def test_kvcache_off(pion_factory):
    srv = pion_factory("--kvcache=off")
    with srv.raw() as c:
        assert str(c.call("KV.PREFIX.LOOKUP", "a")) == "ERR state cache not enabled (use --kvcache)"


def test_fetch_names_model_and_generation_and_is_fenced(shared_pion):
    """A reader can state the identity it expects on every V.FETCH: another model's bytes or a
    dropped generation's are refused, never served."""
    r = shared_pion.client()
    register(r, "fence", "MODEL", "llama@1")
    kv = fill(r, "fence")
    g1 = info(r, "fence")["cache_generation"]
    got = r.execute_command("V.FETCH", "fence_pk", "RANGE", 0, T, "RAW", "MODEL", "llama@1",
                            "GENERATION", g1)
    assert got == kv[(0, "pk")].astype(np.float16).tobytes()
    got = r.execute_command("V.FETCH", "fence_pv", 5, 7, "GENERATION", g1, "MODEL", "llama@1")
    assert len(got) == 2 * DIM * 4
    with shared_pion.raw() as c:
        err = c.call("V.FETCH", "fence_pk", "RANGE", 0, T, "MODEL", "mistral@2")
        assert str(err) == "MISMATCH session 'fence_pk' holds model 'llama@1', not 'mistral@2'"
        r.execute_command("KV.PREFIX.DROP", "fence")
        register(r, "fence", "MODEL", "llama@1")
        fill(r, "fence", seed=5)
        err = c.call("V.FETCH", "fence_pk", "RANGE", 0, T, "RAW", "GENERATION", g1)
        assert str(err).startswith(f"MISMATCH session 'fence_pk' is at generation {g1 + 1}, not {g1}")
        r.execute_command("V.CREATE", "plain", 8, "fp32")
        err = c.call("V.FETCH", "plain", 0, "MODEL", "x")
        assert "applies to KV.PREFIX sessions" in str(err)
        assert c.call("PING") == "PONG"


def test_blocks_saved_is_conservative_after_a_write(pion_factory):
    srv = pion_factory()
    r = srv.client()
    register(r, "sv")
    fill(r, "sv", upto=T - 1)  # not complete: still writable (a published one never changes)
    saved = lambda: {b[b.index(b"saved") + 1] for b in r.execute_command("KV.PREFIX.BLOCKS", "sv")}
    assert saved() == {0}
    assert r.execute_command("KV.PREFIX.SAVE", "sv") == b"OK"
    assert saved() == {1}
    r.execute_command("V.STOREBATCH", "sv_pk", 0, np.ones((1, DIM), np.float32).tobytes())
    assert saved() == {0}  # the disk copy no longer has every current row
    assert r.execute_command("KV.PREFIX.SAVE", "sv") == b"OK"
    assert saved() == {1}


def test_published_prefix_never_changes(shared_pion):
    """Issue 54 §1: a namespace is published once complete; what a reader saw as complete is
    immutable. Writes into its sessions (any V.STOREBATCH form, V.RESTORE, V.DROP) are refused
    with -READONLY naming what to do, and rows outside the manifest's L·T never land."""
    r = shared_pion.client()
    register(r, "pub1", fmt="fp32")
    kv = fill(r, "pub1", upto=T - 1)  # one row short of complete: still writable
    one = np.ones((1, DIM), np.float32)
    assert r.execute_command("V.STOREBATCH", "pub1_pk", 0, one.tobytes()) == 1
    assert r.execute_command("V.STOREBATCH", "pub1_pk", 0, kv[(0, "pk")][:1].tobytes()) == 1
    # Rows beyond n_layers*n_tokens are refused, whichever form names them.
    with pytest.raises(Exception, match=r"row 800 is outside namespace 'pub1'.*\[0, 800\)"):
        r.execute_command("V.STOREBATCH", "pub1_pk", L * T, one.tobytes())
    with pytest.raises(Exception, match="row 800 is outside"):
        r.execute_command("V.STOREBATCH", "pub1_pv", L * T - 1, np.ones((2, DIM), np.float32)
                          .tobytes())
    with pytest.raises(Exception, match="row -1 is outside"):
        r.execute_command("V.STOREBATCH", "pub1_pk", "IDS", np.array([3, -1], np.int64).tobytes(),
                          np.ones((2, DIM), np.float32).tobytes())
    assert info(r, "pub1")["publication_generation"] == 0
    # The last rows complete it: published at once, LOOKUP is a HIT.
    for l in range(L):
        for part in ("pk", "pv"):
            r.execute_command("V.STOREBATCH", f"pub1_{part}", l * T + T - 1,
                              kv[(l, part)][T - 1:].tobytes())
    i = info(r, "pub1")
    assert i["complete"] == 1 and i["publication_generation"] >= 1
    assert r.execute_command("KV.PREFIX.LOOKUP", "pub1") == b"HIT"
    before = r.execute_command("V.FETCH", "pub1_pk", "RANGE", 0, L * T)
    snap = None
    with shared_pion.raw() as c:
        for cmd in (["V.STOREBATCH", "pub1_pk", 0, one.tobytes()],
                    ["V.STOREBATCH", "pub1_pv", T, one.tobytes()],
                    ["V.STOREBATCH", "pub1_pk", "IDS", np.array([5], np.int64).tobytes(),
                     one.tobytes()],
                    ["V.DROP", "pub1_pv"]):
            e = str(c.call(*cmd))
            assert e.startswith("READONLY " + cmd[0] + " ") and "namespace 'pub1' is published" \
                in e and "KV.PREFIX.DROP 'pub1' and KV.PREFIX.REGISTER it again" in e, e
        snap = c.call("V.SNAPSHOT", "pub1_pk")
        e = str(c.call("V.RESTORE", "pub1_pk", snap))
        assert e.startswith("READONLY V.RESTORE of 'pub1_pk'"), e
    assert r.execute_command("V.FETCH", "pub1_pk", "RANGE", 0, L * T) == before
    assert r.execute_command("KV.PREFIX.LOOKUP", "pub1") == b"HIT"
    assert r.execute_command("V.INFO", "pub1_pv")[9] == L * T  # rows: nothing added
    # A new publication: DROP + REGISTER gives a new generation, writable until complete.
    g = info(r, "pub1")["cache_generation"]
    assert r.execute_command("KV.PREFIX.DROP", "pub1") == 1
    register(r, "pub1", fmt="fp32")
    assert info(r, "pub1")["cache_generation"] > g
    assert r.execute_command("V.STOREBATCH", "pub1_pk", 0, one.tobytes()) == 1


def test_python_store_layer_checks_the_manifest(shared_pion):
    """The Python helper checks layer index and array shape against the manifest before
    sending (a head_dim 32 array into a head_dim 64 namespace once overwrote half a layer)."""
    import os
    import sys
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "clients",
                                    "python"))
    import pion
    with pion.Client(port=shared_pion.port) as c:
        c.kv.register("pyl", 4, 256, 4, 64, "fp32")
        good = np.ones((256, 4, 64), np.float32)
        with pytest.raises(ValueError, match=r"do not match namespace 'pyl'.*head_dim 64"):
            c.kv.store_layer("pyl", 1, np.ones((256, 4, 32), np.float32),
                             np.ones((256, 4, 32), np.float32))
        with pytest.raises(ValueError, match="layer 9 is outside namespace 'pyl'"):
            c.kv.store_layer("pyl", 9, good, good)
        with pytest.raises(ValueError, match="tokens \\[200, 456\\) are outside"):
            c.kv.store_layer("pyl", 0, good, good, token_offset=200)
        with pytest.raises(ValueError, match="n_tokens 128 is not"):
            c.kv.store_layer("pyl", 0, good, good, n_tokens=128)
        assert c.kv.info("pyl")["committed_frontier"] == 0  # nothing was sent
        # A client that never registered it reads the manifest (a second client, same check).
        with pion.Client(port=shared_pion.port) as c2:
            with pytest.raises(ValueError, match="head_dim 64"):
                c2.kv.store_layer("pyl", 0, np.ones((256, 4, 32), np.float32),
                                  np.ones((256, 4, 32), np.float32))
        for l in range(4):
            assert c.kv.store_layer("pyl", l, good * l, good * l, layout="nhd") == 256
        assert c.kv.lookup("pyl")
        with pytest.raises(pion.ReadOnlyError, match="namespace 'pyl' is published"):
            c.kv.store_layer("pyl", 0, good, good)
        k, _ = c.kv.fetch_layer("pyl", 3)
        assert np.array_equal(k, good * 3)


def _explain(r, ns, *opts):
    flat = r.execute_command("KV.PREFIX.LOOKUP", ns, *opts, "EXPLAIN")
    return {flat[i].decode(): (flat[i + 1].decode() if isinstance(flat[i + 1], bytes)
                               else flat[i + 1]) for i in range(0, len(flat), 2)}


def test_lookup_explain_says_why(shared_pion):
    """Issue 54 §4: KV.PREFIX.LOOKUP ... EXPLAIN answers why a lookup missed, as a map."""
    r = shared_pion.client()
    e = _explain(r, "ex-nope")
    assert e["result"] == "MISS" and e["reason"] == "not_registered", e
    assert "no namespace 'ex-nope'" in e["detail"]
    register(r, "ex1", "MODEL", "llama@a", "POSITION", "rope:1")
    fill(r, "ex1", layers=range(2), upto=T)   # layers 0, 1 complete: 2 and 3 not
    fill(r, "ex1", layers=range(2, L), upto=130)
    e = _explain(r, "ex1")
    assert e["result"] == "MISS" and e["reason"] == "incomplete", e
    assert e["committed_frontier"] == 130 and e["n_tokens"] == T, e
    assert "written up to token 130 of 200" in e["detail"]
    e = _explain(r, "ex1", "MODEL", "llama@b")
    assert (e["result"], e["reason"], e["expected"], e["held"]) == \
        ("MISS", "model_differs", "llama@b", "llama@a"), e
    e = _explain(r, "ex1", "POSITION", "rope:2")
    assert (e["reason"], e["expected"], e["held"]) == ("position_differs", "rope:2", "rope:1")
    g = info(r, "ex1")["cache_generation"]
    e = _explain(r, "ex1", "GENERATION", g + 7)
    assert (e["result"], e["reason"], e["expected"], e["held"]) == \
        ("MISMATCH", "generation_differs", str(g + 7), str(g)), e
    fill(r, "ex1", layers=range(2, L), upto=T)
    e = _explain(r, "ex1", "MODEL", "llama@a", "GENERATION", g)
    assert (e["result"], e["reason"], e["committed_frontier"]) == ("HIT", "", T), e
    # Without EXPLAIN the answers stay as they were.
    assert r.execute_command("KV.PREFIX.LOOKUP", "ex1") == b"HIT"
    with pytest.raises(Exception, match="MISMATCH"):
        r.execute_command("KV.PREFIX.LOOKUP", "ex1", "GENERATION", g + 7)
    register(r, "ex-lost")
    r.execute_command("V.DROP", "ex-lost_pv")
    assert _explain(r, "ex-lost")["reason"] == "sessions_lost"


def test_lookup_hit_rate_metrics_per_tenant(pion_factory, tmp_path):
    """pion_prefix_lookups_total{tenant, result}: a hit rate per tenant is one PromQL ratio."""
    users = tmp_path / "users.txt"
    users.write_text("alice apw tenant-a\nbob bpw tenant-b\nroot rootpw default\n")
    srv = pion_factory("--workers", "2", "--users", str(users))
    a = srv.client(username="alice", password="apw")
    b = srv.client(username="bob", password="bpw")
    register(a, "m1")
    fill(a, "m1")
    for _ in range(3):
        assert a.execute_command("KV.PREFIX.LOOKUP", "m1") == b"HIT"
    assert a.execute_command("KV.PREFIX.LOOKUP", "m1", "MODEL", "x") == b"MISS"
    assert b.execute_command("KV.PREFIX.LOOKUP", "m1") == b"MISS"  # tenant-b has none
    with pytest.raises(Exception):
        a.execute_command("KV.PREFIX.LOOKUP", "m1", "GENERATION", 999)
    a.execute_command("KV.PREFIX.LOOKUP", "m1", "EXPLAIN")  # counted like any lookup
    text = srv.metrics_text()
    assert "# TYPE pion_prefix_lookups_total counter" in text

    def count(tenant, result):
        m = re.search(r'^pion_prefix_lookups_total\{tenant="%s",result="%s"\} (\d+)$'
                      % (tenant, result), text, re.M)
        return int(m.group(1)) if m else 0
    assert (count("tenant-a", "hit"), count("tenant-a", "miss"),
            count("tenant-a", "mismatch")) == (4, 1, 1)
    assert (count("tenant-b", "hit"), count("tenant-b", "miss")) == (0, 1)
    assert re.search(r'^pion_prefix_lookups_total\{tenant="default",result="hit"\} 0$', text,
                     re.M)


FORMATS_53 = ["fp32", "fp16", "bf16", "int8", "fp8", "fp8_e5m2", "turbo4"]


def _pion():
    import os
    import sys
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "clients",
                                    "python"))
    import pion
    return pion


def _decode(fmt, dim, data, n):
    codecs = _pion().codecs
    return codecs.decode(fmt, dim, codecs.default_block(fmt), data, n)


@pytest.mark.parametrize("fmt", FORMATS_53)
def test_fetch_heads_reads_a_tp_ranks_share(shared_pion, fmt):
    """Issue 53 §1: V.FETCH ... HEADS <first> <count> gives those K/V heads of a layer, exactly
    the values of the full rows, in a quarter of the bytes for a TP-4 reader of 8 heads."""
    r = shared_pion.client()
    L_, T_, H_, D_ = 2, 100, 8, 128
    ns = "tp-" + fmt
    r.execute_command("KV.PREFIX.REGISTER", ns, L_, T_, H_, D_, fmt)
    rng = np.random.default_rng(53)
    for part in ("pk", "pv"):
        r.execute_command("V.STOREBATCH", f"{ns}_{part}", 0,
                          rng.standard_normal((L_ * T_, H_ * D_)).astype(np.float32).tobytes())
    lo, hi = T_, 2 * T_  # layer 1
    full = np.frombuffer(r.execute_command("V.FETCH", ns + "_pk", "RANGE", lo, hi), np.float32)
    full = full.reshape(T_, H_, D_)
    full_raw = r.execute_command("V.FETCH", ns + "_pk", "RANGE", lo, hi, "RAW")
    for rank in range(4):
        first, count = _pion().tp_heads(H_, rank, 4)
        got = np.frombuffer(r.execute_command("V.FETCH", ns + "_pk", "RANGE", lo, hi, "HEADS",
                                              first, count), np.float32)
        assert np.array_equal(got.reshape(T_, count, D_), full[:, first:first + count])
        raw = r.execute_command("V.FETCH", ns + "_pk", "RANGE", lo, hi, "RAW", "HEADS", first,
                                count)
        assert len(raw) <= len(full_raw) // 4 + 4 * T_, (len(raw), len(full_raw))
        dec = _decode(fmt, count * D_, raw, T_).reshape(T_, count, D_)
        assert np.array_equal(dec, full[:, first:first + count]), fmt
    # Ids too, and HEADS with the identity options in any order.
    got = np.frombuffer(r.execute_command("V.FETCH", ns + "_pv", T_ + 3, T_ + 1, "HEADS", 7, 1,
                                          "GENERATION", info(r, ns)["cache_generation"]),
                        np.float32)
    fullv = np.frombuffer(r.execute_command("V.FETCH", ns + "_pv", T_ + 3, T_ + 1), np.float32)
    assert np.array_equal(got.reshape(2, D_), fullv.reshape(2, H_, D_)[:, 7])


def test_fetch_as_transcodes_like_the_target_encoder(shared_pion):
    """Issue 53 §2: V.FETCH ... AS <codec> sends the rows in the reader's codec, exactly as that
    codec's own encoder stores the stored values (lossless where it holds them)."""
    r = shared_pion.client()
    T_, H_, D_ = 96, 4, 64
    rng = np.random.default_rng(54)
    x = rng.standard_normal((T_, H_ * D_)).astype(np.float32)
    for src in ("bf16", "fp16", "fp8", "int8", "turbo3"):
        ns = "as-" + src
        r.execute_command("KV.PREFIX.REGISTER", ns, 1, T_, H_, D_, src)
        for part in ("pk", "pv"):
            r.execute_command("V.STOREBATCH", f"{ns}_{part}", 0, x.tobytes())
        decoded = np.frombuffer(r.execute_command("V.FETCH", ns + "_pk", "RANGE", 0, T_),
                                np.float32)
        for dst in ("fp16", "bf16", "fp8", "int8", "fp32"):
            got = r.execute_command("V.FETCH", ns + "_pk", "RANGE", 0, T_, "AS", dst)
            ref = "ref-%s-%s" % (src, dst)  # the target's own encoder, over the stored values
            r.execute_command("V.CREATE", ref, H_ * D_, dst)
            r.execute_command("V.STOREBATCH", ref, 0, decoded.tobytes())
            assert got == r.execute_command("V.FETCH", ref, "RANGE", 0, T_, "RAW"), (src, dst)
            # With HEADS: the target encoder over those heads' values.
            got = r.execute_command("V.FETCH", ns + "_pk", "RANGE", 0, T_, "HEADS", 1, 2, "AS",
                                    dst)
            ref2 = ref + "-h"
            r.execute_command("V.CREATE", ref2, 2 * D_, dst)
            r.execute_command("V.STOREBATCH", ref2, 0, np.ascontiguousarray(
                decoded.reshape(T_, H_, D_)[:, 1:3]).tobytes())
            assert got == r.execute_command("V.FETCH", ref2, "RANGE", 0, T_, "RAW"), (src, dst)
        # Lossless where the target holds the source: bf16/fp16/fp8 as fp32 are the values.
        if src in ("bf16", "fp16", "fp8"):
            assert np.array_equal(np.frombuffer(r.execute_command(
                "V.FETCH", ns + "_pk", "RANGE", 0, T_, "AS", "fp32"), np.float32), decoded)
        # The stored codec: the stored bytes.
        assert r.execute_command("V.FETCH", ns + "_pk", "RANGE", 0, T_, "AS", src) == \
            r.execute_command("V.FETCH", ns + "_pk", "RANGE", 0, T_, "RAW")
    fp8 = r.execute_command("V.FETCH", "as-bf16_pk", "RANGE", 0, T_, "AS", "fp8")
    bf16 = r.execute_command("V.FETCH", "as-bf16_pk", "RANGE", 0, T_, "RAW")
    assert len(fp8) <= 0.55 * len(bf16)


def test_fetch_heads_and_as_errors(shared_pion):
    r = shared_pion.client()
    r.execute_command("KV.PREFIX.REGISTER", "he", 1, 64, 8, 64, "turbo4")
    for part in ("pk", "pv"):
        r.execute_command("V.STOREBATCH", "he_" + part, 0, np.ones((64, 512), np.float32).tobytes())
    r.execute_command("V.CREATE", "plainv", 8, "fp32")
    r.execute_command("V.STOREBATCH", "plainv", 0, np.ones((2, 8), np.float32).tobytes())
    cases = [
        (("V.FETCH", "plainv", "RANGE", 0, 2, "HEADS", 0, 1),
         "ERR HEADS applies to KV.PREFIX sessions"),
        (("V.FETCH", "he_pk", "RANGE", 0, 64, "HEADS", 6, 3),
         "ERR HEADS 6 3 is not inside the namespace's 8 K/V heads"),
        (("V.FETCH", "he_pk", "RANGE", 0, 64, "HEADS", 0, 0),
         "ERR HEADS 0 0 is not inside"),
        (("V.FETCH", "he_pk", "RANGE", 0, 64, "RAW", "HEADS", 1, 1),
         "ERR RAW columns [64, 128) of a turbo4 row split its blocks of 128 values"),
        (("V.FETCH", "he_pk", "RANGE", 0, 64, "AS", "fp9"),
         "ERR AS must name a codec, one of"),
        (("V.FETCH", "he_pk", "RANGE", 0, 64, "HEADS", 1, 1, "AS", "turbo4"),
         "ERR AS turbo4 cannot hold rows of 64 values"),
        (("V.FETCH", "he_pk", "RANGE", 0, 64, "HEADS", "x", 1), "ERR HEADS first must be"),
    ]
    with shared_pion.raw() as c:
        for cmd, want in cases:
            got = str(c.call(*cmd))
            assert got.startswith(want), (cmd, got)
    # Decoded, the split block is no problem; and AS of the whole row fits turbo's blocks.
    assert len(r.execute_command("V.FETCH", "he_pk", "RANGE", 0, 64, "HEADS", 1, 1)) == 64 * 64 * 4
    assert r.execute_command("V.FETCH", "he_pk", "RANGE", 0, 64, "HEADS", 2, 2, "AS", "turbo4")


def test_python_fetch_layer_heads_and_as_codec(pion_factory, tmp_path):
    """kv.fetch_layer(heads=tp_heads(...), as_codec=...) over TCP and shared memory."""
    pion = _pion()
    path = str(tmp_path / "p.sock")
    if len(path) > 100:
        pytest.skip("tmp path too long for a Unix socket")
    srv = pion_factory("--unixsocket", path)
    L_, T_, H_, D_ = 2, 130, 8, 64
    rng = np.random.default_rng(55)
    k = rng.standard_normal((T_, H_, D_)).astype(np.float32)
    with pion.Client(port=srv.port) as tcp, pion.Client(unix_socket_path=path) as local:
        tcp.kv.register("pyh", L_, T_, H_, D_, "bf16")
        for layer in range(L_):
            tcp.kv.store_layer("pyh", layer, k * (layer + 1), k)
        fk, fv = tcp.kv.fetch_layer("pyh", 1)
        for c, path_name in ((tcp, "tcp"), (local, "shm")):
            for rank in range(4):
                first, count = pion.tp_heads(H_, rank, 4)
                hk, hv = c.kv.fetch_layer("pyh", 1, heads=(first, count))
                assert c.last_fetch_path == path_name
                assert np.array_equal(hk, fk[:, first:first + count])
                assert np.array_equal(hv, fv[:, first:first + count])
            qk, _ = c.kv.fetch_layer("pyh", 1, as_codec="fp8", layout="hnd", heads=(2, 2))
            want = pion.codecs.decode("fp8", 2 * D_, 0, tcp.execute(
                "V.FETCH", "pyh_pk", "RANGE", T_, 2 * T_, "HEADS", 2, 2, "AS", "fp8"), T_)
            assert np.array_equal(qk, want.reshape(T_, 2, D_).transpose(1, 0, 2))
    assert pion.tp_heads(8, 3, 4) == (6, 2) and pion.tp_heads(2, 5, 8) == (1, 1)
    with pytest.raises(ValueError):
        pion.tp_heads(6, 0, 4)


def test_shm_heads_reply_names_the_rows_parts(pion_factory, tmp_path):
    """V.FETCH ... HEADS ... SHM in the stored encoding leases the stored rows themselves and
    names the byte ranges of each row the reader copies (row_stride, row_parts: fp8 has two,
    its row scale and its columns): nothing gathered on the server, and what the reader
    copies is byte for byte the RAW HEADS reply over TCP, in fp16, fp8 and int8 (whole blocks),
    across chunk boundaries. AS still answers one gathered piece. (With --fetch-copies off:
    with copies on, a read that can keep its shaped rows does, below.)"""
    pion = _pion()
    path = str(tmp_path / "h.sock")
    if len(path) > 100:
        pytest.skip("tmp path too long for a Unix socket")
    srv = pion_factory("--unixsocket", path, "--fetch-copies", "off")
    T_, H_, D_ = 1500, 8, 64  # > one chunk of rows
    rng = np.random.default_rng(57)
    with pion.Client(port=srv.port) as tcp, pion.Client(unix_socket_path=path) as local:
        ch = local._shm_channel()
        for fmt, parts in (("fp16", 1), ("fp8", 2), ("int8", 1)):
            ns = "sh" + fmt
            tcp.kv.register(ns, 2, T_, H_, D_, fmt)
            for layer in range(2):
                x = rng.standard_normal((T_, H_, D_)).astype(np.float32)
                tcp.kv.store_layer(ns, layer, x, -x)
            vi = tcp.execute("V.INFO", ns + "_pk")
            vi = dict(zip(vi[::2], vi[1::2])) if isinstance(vi, list) else vi
            stride = int(vi.get(b"row_bytes", vi.get("row_bytes")))
            for first, count in ((0, 2), (2, 2), (6, 2), (3, 1)):
                want = tcp.execute("V.FETCH", ns + "_pk", "RANGE", T_, 2 * T_, "RAW", "HEADS",
                                   first, count)
                lease, pieces, row_bytes, nbytes = ch.fetch_range(
                    ns + "_pk", T_, 2 * T_, extra=["HEADS", first, count])
                try:
                    assert pieces.row_parts is not None and len(pieces.row_parts) == parts
                    assert nbytes == len(want) == T_ * row_bytes
                    assert sum(n for _, _, n in pieces) == T_ * pieces.row_stride
                    assert pieces.row_stride == stride
                    out = np.empty(nbytes, np.uint8)
                    assert ch.read_into(pieces, out) == nbytes
                    assert out.tobytes() == want, (fmt, first, count)
                    with pytest.raises(ValueError):
                        ch.views(pieces)
                finally:
                    ch.release(lease)
            lease, pieces, _, nbytes = ch.fetch_range(ns + "_pk", 0, T_,
                                                      extra=["HEADS", 2, 2, "AS", "fp16"])
            ch.release(lease)
            assert pieces.row_parts is None and len(pieces) == 1 and nbytes == T_ * 2 * D_ * 2


def _wait_for(pred, what, timeout=5.0):
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def test_shm_heads_is_shaped_once_then_leased_whole(pion_factory, tmp_path):
    """With --fetch-copies on (the default) a HEADS read of rows read once before shapes the
    rank's columns and keeps them as a copy of the session (the first read of a range keeps
    nothing: a slice read once is not worth a copy); later reads of that range — SHM and TCP —
    are served from it: one contiguous row per output row (no row_parts), the bytes of the RAW
    HEADS reply, and no new memory. CONFIG SET fetch-copies off: a new shape keeps nothing and
    answers the strided form."""
    pion = _pion()
    path = str(tmp_path / "c.sock")
    if len(path) > 100:
        pytest.skip("tmp path too long for a Unix socket")
    srv = pion_factory("--unixsocket", path)
    T_, H_, D_ = 1500, 8, 64
    rng = np.random.default_rng(58)
    mem = lambda: int(srv.info("memory")["used_memory_vstore"])  # noqa: E731
    with pion.Client(port=srv.port) as tcp, pion.Client(unix_socket_path=path) as local:
        assert tcp.execute("CONFIG", "GET", "fetch-copies")[1] in (b"on", "on")
        ch = local._shm_channel()
        for fmt in ("fp16", "fp8"):
            ns = "cp" + fmt
            tcp.kv.register(ns, 1, T_, H_, D_, fmt)
            x = rng.standard_normal((T_, H_, D_)).astype(np.float32)
            tcp.kv.store_layer(ns, 0, x, -x)
            # The reference, read while copies are off (it keeps nothing).
            tcp.execute("CONFIG", "SET", "fetch-copies", "off")
            before = mem()
            want = tcp.execute("V.FETCH", ns + "_pk", "RANGE", 0, T_, "RAW", "HEADS", 2, 2)
            assert mem() == before
            tcp.execute("CONFIG", "SET", "fetch-copies", "on")
            for i in range(4):
                lease, pieces, row_bytes, nbytes = ch.fetch_range(ns + "_pk", 0, T_,
                                                                  extra=["HEADS", 2, 2])
                try:
                    # The first read: the stored rows, strided; then whole rows.
                    assert (pieces.row_parts is not None) == (i == 0), (fmt, i)
                    assert nbytes == len(want) == T_ * row_bytes
                    out = np.empty(nbytes, np.uint8)
                    assert ch.read_into(pieces, out) == nbytes
                    assert out.tobytes() == want, (fmt, i)
                finally:
                    ch.release(lease)
                if i == 0:
                    time.sleep(0.2)
                    assert mem() == before  # read once: nothing kept
                if i == 1:  # asked again: the rank's rows, kept once this read shaped them
                    _wait_for(lambda: mem() - before >= len(want), "the copy was not kept")
                    grown = mem()
            assert mem() == grown  # the later reads came from the copy
            assert tcp.execute("V.FETCH", ns + "_pk", "RANGE", 0, T_, "RAW", "HEADS", 2,
                               2) == want
            assert mem() == grown
        assert tcp.execute("CONFIG", "SET", "fetch-copies", "off") in (b"OK", "OK", True)
        want = tcp.execute("V.FETCH", "cpfp16_pk", "RANGE", 0, T_, "RAW", "HEADS", 4, 2)
        before = mem()
        lease, pieces, _, nbytes = ch.fetch_range("cpfp16_pk", 0, T_, extra=["HEADS", 4, 2])
        try:
            assert pieces.row_parts is not None
            out = np.empty(nbytes, np.uint8)
            ch.read_into(pieces, out)
            assert out.tobytes() == want
        finally:
            ch.release(lease)
        time.sleep(0.2)
        assert mem() == before
        with pytest.raises(Exception, match="on or off"):
            tcp.execute("CONFIG", "SET", "fetch-copies", "maybe")


def test_fetch_as_is_transcoded_once_and_follows_writes(shared_pion):
    """AS keeps a transcoded copy of the rows it served (a prefix read many times in the
    reader's codec is transcoded once): the next read of them is the same bytes, served from
    it; a write to the session makes the copy go, and AS follows the new rows."""
    r = shared_pion.client()
    rng = np.random.default_rng(56)
    r.execute_command("V.CREATE", "asc", 256, "bf16")
    x = rng.standard_normal((4096, 256)).astype(np.float32)
    r.execute_command("V.STOREBATCH", "asc", 0, x.tobytes())
    mem = lambda: int(shared_pion.info("memory")["used_memory_vstore"])  # noqa: E731
    before = mem()
    first = r.execute_command("V.FETCH", "asc", "RANGE", 0, 4096, "AS", "fp8")
    # The copy: 4096 fp8 rows, adopted on the session's shard after the reply went out.
    _wait_for(lambda: mem() - before >= 4096 * (4 + 256), "the transcoded copy was not kept")
    assert r.execute_command("V.FETCH", "asc", "RANGE", 0, 4096, "AS", "fp8") == first
    assert r.execute_command("V.FETCH", "asc", "RANGE", 64, 128, "AS", "fp8") == \
        first[64 * 260:128 * 260]
    y = rng.standard_normal((1, 256)).astype(np.float32)
    r.execute_command("V.STOREBATCH", "asc", 70, y.tobytes())
    after = r.execute_command("V.FETCH", "asc", "RANGE", 0, 4096, "AS", "fp8")
    assert after[:70 * 260] == first[:70 * 260] and after[70 * 260:71 * 260] != first[70 * 260:
                                                                                      71 * 260]
    ref = "asc-ref"
    r.execute_command("V.CREATE", ref, 256, "fp8")
    r.execute_command("V.STOREBATCH", ref, 0, r.execute_command("V.FETCH", "asc", "RANGE", 0,
                                                                  4096))
    assert after == r.execute_command("V.FETCH", ref, "RANGE", 0, 4096, "RAW")
