#!/usr/bin/env python3
"""Writes the seed corpus of command_fuzz (fuzz/corpus/command/): valid command vectors of
every family, in the fuzzer's input format (command_fuzz.cc's header comment):

  flags byte, then per command: 0xF0 + length + name, the argument count, and per argument
  a tag byte (4: raw bytes, 5: fp32 blob of an exact length, 6: blob shaped by the command's
  integers, 7: a key name or a scalar of an earlier reply) and its payload; the command's key
  argument is one byte, an index into kKeys.

Commands are written by name, so the seeds keep their meaning when the table changes.
Files named regress-* beside them are inputs the fuzzer found, kept as they are."""
import pathlib
import struct

OUT = pathlib.Path(__file__).resolve().parent / "corpus" / "command"

# kKeys in command_fuzz.cc, as far as the seeds use them.
KEYS = ["a", "b", "{t}a", "{t}b", "t", "a_pk", "a_pv"]
KEYED = ("STATE.", "V.", "SSM.", "KV.PREFIX.", "ATTEND.")
NOT_KEYED = {"STATE.INFO"}

# Connection flags.
DEFAULT, ALICE, CAROL, NOAUTH = 0, 1, 2, 3
RESP3, PIPELINE, TCP = 4, 8, 16


class K:
    """A key name (kKeys index)."""
    def __init__(self, i):
        self.i = i


class F32:
    """An fp32 blob of `n` bytes."""
    def __init__(self, n, seed=1):
        self.n, self.seed = n, seed


class Shaped:
    """A blob of (product of the command's earlier integers picked by `mask`, bit 0 = the
    latest) x width x mult bytes; kind 0 fp32, 1 fp16, 2 int32, 3 int64; int values lie in
    [0, (seed & 63) + 1)."""
    def __init__(self, mask, kind=0, mult=1, seed=1):
        self.mask, self.kind, self.mult, self.seed = mask, kind, mult, seed


class Recent:
    """The i-th latest scalar of earlier replies (0: the latest)."""
    def __init__(self, i):
        self.i = i


def command(name, *args, conn=0):
    """One command; conn=1 sends it on the input's second connection."""
    keyed = name.startswith(KEYED) and name not in NOT_KEYED
    assert len(args) < 16
    out = bytes([0xF0, len(name)]) + name.encode() + bytes([len(args) | conn << 7])
    for pos, a in enumerate(args, start=1):
        if isinstance(a, K) and pos == 1 and keyed:
            out += bytes([a.i])
        elif isinstance(a, K):
            out += bytes([7, 2 * a.i])
        elif isinstance(a, Recent):
            out += bytes([7, 2 * a.i + 1])
        elif isinstance(a, F32):
            out += bytes([5]) + struct.pack("<H", a.n) + bytes([a.seed])
        elif isinstance(a, Shaped):
            out += bytes([6, a.mask, a.kind | (a.mult - 1) << 2, a.seed])
        else:
            raw = a if isinstance(a, bytes) else str(a).encode()
            assert len(raw) < 256
            out += bytes([4, len(raw)]) + raw
    return out


def seed(flags, *commands):
    return bytes([flags]) + b"".join(commands)


A, B, TA, TB, T, A_PK, A_PV = (K(i) for i in range(7))
C = command
# ATTEND.PREFIX slot: H=2 K/V heads, N=16 rows, D=32.
slot = C("ATTEND.PREFIX.STORE", A, 0, 2, 16, 32, Shaped(7), Shaped(7, seed=2))
seeds = {
    "server": seed(DEFAULT, C("PING"), C("ECHO", "hello"), C("COMMAND", "COUNT"),
                   C("COMMAND", "LIST"), C("COMMAND", "DOCS", "state.alloc"),
                   C("COMMAND", "INFO", "ping", "nosuch")),
    "info_resp3": seed(DEFAULT | RESP3, C("INFO", "everything"), C("INFO", "memory", "residency"),
                       C("COMMAND")),
    "client": seed(DEFAULT, C("CLIENT", "ID"), C("CLIENT", "SETNAME", "fuzz"),
                   C("CLIENT", "GETNAME"), C("CLIENT", "INFO"), C("CLIENT", "LIST"),
                   C("CLIENT", "KILL", "SKIPME", "yes")),
    "client_kill_self": seed(PIPELINE, C("CLIENT", "KILL", "USER", "default", "SKIPME", "no"),
                             C("PING")),
    "config": seed(DEFAULT, C("CONFIG", "GET", "max*"),
                   C("CONFIG", "SET", "slowlog-log-slower-than", 0, "maxmemory", "1mb"),
                   C("STATE.ALLOC", A, 2000000), C("SLOWLOG", "GET", 2), C("SLOWLOG", "LEN"),
                   C("SLOWLOG", "RESET"), C("CONFIG", "RESETSTAT")),
    "config_requirepass": seed(DEFAULT, C("CONFIG", "SET", "requirepass", "x"), C("AUTH", "x"),
                               C("CONFIG", "SET", "requirepass", "")),
    "auth_tenants": seed(NOAUTH, C("STATE.ALLOC", A, 8), C("AUTH", "alice", "wrong"),
                         C("HELLO", 3, "AUTH", "alice", "pw1", "SETNAME", "x"),
                         C("STATE.ALLOC", A, 8), C("AUTH", "carol", "pw2"), C("STATE.READ", A, 0, 8),
                         C("CONFIG", "GET", "*")),
    "quit_pipelined": seed(PIPELINE, C("STATE.ALLOC", A, 16), C("QUIT"), C("STATE.FREE", A)),
    "state": seed(DEFAULT, C("STATE.ALLOC", A, 16), C("STATE.WRITE", A, 4, "hello"),
                  C("STATE.READ", A, 4, 5), C("STATE.WRITE", A, 14, "hello"),
                  C("STATE.ALLOC", A, 16, "DEADLINE", 1000), C("STATE.INFO"), C("STATE.SAVE", A),
                  C("STATE.READ", A, 0, 16, "DEADLINE", 50), C("STATE.FREE", A)),
    "state_tcp_tags": seed(ALICE | TCP, C("STATE.ALLOC", TA, 64), C("STATE.ALLOC", TB, 64),
                           C("STATE.WRITE", TB, 0, b"\x00" * 64), C("STATE.SAVE", TA),
                           C("STATE.INFO")),
    "vstore_fp16": seed(DEFAULT, C("V.CREATE", A, 8, "fp16"), C("V.STOREBATCH", A, 0, F32(8 * 4 * 10)),
                        C("V.FETCH", A, "RANGE", 0, 10, "RAW"), C("V.FETCH", A, 1, 2, 3),
                        C("V.INFO", A), C("V.INFO")),
    **{"vstore_codecs_%d" % part: seed(CAROL, *[c for i, fmt in enumerate(formats) for c in (
        C("V.CREATE", K(i % 2), 128, fmt), C("V.STOREBATCH", K(i % 2), 0, F32(128 * 4 * 3, seed=i + 1)),
        C("V.FETCH", K(i % 2), "RANGE", 0, 3, "RAW"), C("V.FETCH", K(i % 2), 2, 0),
        C("V.DROP", K(i % 2)))])
       for part, formats in enumerate([["fp32", "bf16", "int8", "fp8"], ["turbo4", "turbo3", "turbo2"]])},
    "vstore_blocks": seed(DEFAULT, C("V.CREATE", A, 64, "turbo4", "BLOCK", 32),
                          C("V.STOREBATCH", A, 0, F32(64 * 4 * 5)), C("V.FETCH", A, "RANGE", 0, 5, "RAW"),
                          C("V.CREATE", B, 64, "int8", "BLOCK", 16), C("V.INFO", B)),
    "vstore_ids": seed(DEFAULT, C("V.CREATE", A, 4, "fp32"),
                       C("V.STOREBATCH", A, "IDS", Shaped(0, kind=3, mult=4, seed=15), F32(4 * 4 * 4)),
                       C("V.FETCH", A, "RANGE", 0, 16)),
    "vstore_snapshot": seed(DEFAULT, C("V.CREATE", A, 4, "int8"), C("V.STOREBATCH", A, 0, F32(64)),
                            C("V.SNAPSHOT", A), C("V.STOREBATCH", A, 0, F32(64, seed=9)),
                            C("V.RESTORE", A, Recent(1)), C("V.SNAPSHOT", A),
                            C("V.COMMIT", A, Recent(0)), C("V.FETCH", A, "RANGE", 0, 4, "RAW")),
    "vstore_shm": seed(DEFAULT, C("SHM.ATTACH"), C("V.CREATE", A, 4, "fp32"),
                       C("V.STOREBATCH", A, 0, F32(256)), C("V.FETCH", A, "RANGE", 0, 16, "SHM"),
                       C("SHM.INFO"), C("SHM.RESERVE", 4096),
                       C("V.STOREBATCH", A, 16, "SHM", Recent(3)), C("SHM.RELEASE", 1)),
    "ssm": seed(DEFAULT, C("SSM.PREFIX.STORE", A, 0, b"state" * 40), C("SSM.PREFIX.STORE", A, 3, "x"),
                C("SSM.PREFIX.FETCH", A, 0), C("SSM.PREFIX.INFO", A), C("SSM.PREFIX.SAVE", A),
                C("SSM.PREFIX.FETCH", A, 3, "DEADLINE", 100), C("SSM.PREFIX.DROP", A, 0),
                C("SSM.PREFIX.DROP", A)),
    "kvprefix": seed(DEFAULT, C("KV.PREFIX.REGISTER", A, 1, 30, 2, 32, "fp32", "MODEL", "m1"),
                     C("V.STOREBATCH", A_PK, 0, F32(30 * 64 * 4)),
                     C("V.STOREBATCH", A_PV, 0, F32(30 * 64 * 4, seed=3)),
                     C("KV.PREFIX.LOOKUP", A, "MODEL", "m1"), C("KV.PREFIX.BLOCKS", A),
                     C("KV.PREFIX.MEMBERSHIP", A), C("KV.PREFIX.OWNER", A), C("KV.PREFIX.INFO", A),
                     C("KV.PREFIX.SAVE", A), C("KV.PREFIX.WARM", A, "DEADLINE", 1000),
                     C("ATTEND.PREFIX.STORE", B, 0, "FROM", A, "MODEL", "m1"),
                     C("ATTEND.PREFIX.INFO", B), C("KV.PREFIX.DROP", A), C("KV.PREFIX.LOOKUP", A)),
    "kvprefix_fp16_position": seed(DEFAULT, C("KV.PREFIX.REGISTER", T, 2, 64, 1, 64, "fp16",
                                              "POSITION", "d1", "PREFILL_MS", 5),
                                   C("KV.PREFIX.LOOKUP", T, "POSITION", "d1", "GENERATION", 1),
                                   C("KV.PREFIX.INFO")),
    "attend_prefix_dense": seed(DEFAULT, slot, C("ATTEND.PREFIX.LOOKUP", A, 0),
                                C("ATTEND.PREFIX.QUERY", A, 0, 2, 32, 0, Shaped(6), "RECEIPT"),
                                C("ATTEND.PREFIX.QUERY", A, 0, 4, 32, 0, Shaped(6, mult=4)),
                                C("ATTEND.PREFIX.QUERY", A, 0, 2, 32, 4, Shaped(6), 8, "QPOS", 12),
                                C("ATTEND.PREFIX.INFO", A)),
    "attend_prefix_sparse": seed(DEFAULT, slot,
                                 C("ATTEND.PREFIX.QUERY_SPARSE", A, 0, 2, 32, 4, Shaped(6),
                                   Shaped(5, kind=2, seed=15), Shaped(4, kind=2, seed=4), "RECEIPT"),
                                 C("ATTEND.PREFIX.QUERY_SPARSE_AUTO", A, 0, 4, 32, 4, 1, 2, Shaped(24),
                                   Shaped(16, kind=2, seed=1), "SELECT", "quest", "SHARED",
                                   "RECEIPT", "ALLOW", "APPROX")),
    "attend_prefix_fused": seed(DEFAULT, slot,
                                C("ATTEND.PREFIX.QUERY_FUSED", A, 0, 2, 32, 3, 2, Shaped(12),
                                  Shaped(7), Shaped(7, seed=5), Shaped(8, kind=2, seed=1)),
                                C("ATTEND.PREFIX.QUERY_SPARSE_AUTO_FUSED", A, 0, 2, 32, 4, 1, 2, 3,
                                  Shaped(1 << 5 | 1 << 4), Shaped(19), Shaped(19, seed=6), Shaped(32, kind=2, seed=1),
                                  "RECEIPT")),
    "attend_prefix_save": seed(DEFAULT, slot, C("ATTEND.PREFIX.SAVE", A, 0), C("ATTEND.PREFIX.SAVE", A),
                               C("ATTEND.PREFIX.EXPORT", A, 0, "PACKED"), C("ATTEND.PREFIX.DROP", A, 0),
                               C("ATTEND.PREFIX.DROP", A)),
    "attend_index": seed(DEFAULT, C("ATTEND.CREATE", A, 8, 8, "M", 8, "EF_CONSTRUCTION", 32),
                         C("ATTEND.STORE", A, F32(32 * 8 * 4), F32(32 * 8 * 4, seed=2)),
                         C("ATTEND.STORE", A, F32(8 * 8 * 4, seed=3), F32(8 * 8 * 4, seed=4), 100),
                         C("ATTEND.FINALIZE", A),
                         C("ATTEND.QUERY", A, 4, F32(2 * 8 * 4, seed=5), "EF", 16, "ATTEND"),
                         C("ATTEND.INFO", A), C("ATTEND.INFO"), C("ATTEND.DROP", A)),
    "attend_index_metrics": seed(ALICE, C("ATTEND.CREATE", A, 4, 2, "METRIC", "cos"),
                                 C("ATTEND.CREATE", B, 4, 2, "METRIC", "l2"),
                                 C("ATTEND.STORE", A, F32(64 * 4 * 4), F32(64 * 2 * 4)),
                                 C("ATTEND.QUERY", A, 4, F32(16)), C("ATTEND.FINALIZE", A),
                                 C("ATTEND.QUERY", A, 100, F32(16))),
    "kv_cache": seed(DEFAULT, C("KV.STORE", F32(64), F32(256, seed=2), "MODEL", "m1", "TTL", 10),
                     C("KV.STORE", F32(64, seed=3), F32(16), "MODEL", "m2"),
                     C("KV.FETCH", F32(64), "MODEL", "m1", "THRESHOLD", 0.5), C("KV.INFO"),
                     C("KV.EVICT", Recent(0)), C("KV.EVICT", "EXPIRED"), C("KV.EVICT", "ALL")),
    # A host tier of 64 KiB: stores demote least recently used objects to disk, reads park
    # while they come back.
    "residency_state": seed(DEFAULT, C("CONFIG", "SET", "maxmemory", "64kb"),
                            C("STATE.ALLOC", A, 30000), C("STATE.WRITE", A, 0, "first"),
                            C("STATE.ALLOC", B, 30000), C("STATE.ALLOC", TA, 30000),
                            C("STATE.READ", A, 0, 5), C("STATE.READ", B, 0, 5, "DEADLINE", 1),
                            C("STATE.SAVE", B), C("INFO", "residency")),
    "residency_ssm_vstore": seed(DEFAULT, C("CONFIG", "SET", "maxmemory", "96kb"),
                                 C("SSM.PREFIX.STORE", A, 0, F32(40000)),
                                 C("SSM.PREFIX.STORE", A, 1, F32(40000, seed=2)),
                                 C("V.CREATE", B, 128, "fp16"), C("V.STOREBATCH", B, 0, F32(128 * 4 * 64)),
                                 C("V.STOREBATCH", B, 64, F32(128 * 4 * 64, seed=3)),
                                 C("SSM.PREFIX.FETCH", A, 0), C("V.FETCH", B, "RANGE", 0, 128, "RAW"),
                                 C("V.SNAPSHOT", B), C("V.COMMIT", B, Recent(0)),
                                 C("SSM.PREFIX.INFO", A), C("V.INFO", B)),
    "residency_attend": seed(PIPELINE, C("CONFIG", "SET", "maxmemory", "48kb", "attention-memory", "40kb"),
                             C("ATTEND.PREFIX.STORE", A, 0, 2, 64, 32, Shaped(7), Shaped(7)),
                             C("ATTEND.PREFIX.STORE", A, 1, 2, 64, 32, Shaped(7), Shaped(7)),
                             C("ATTEND.PREFIX.QUERY", A, 0, 2, 32, 0, Shaped(6), "RECEIPT"),
                             C("ATTEND.PREFIX.SAVE", A),
                             C("ATTEND.PREFIX.QUERY", A, 1, 4, 32, 0, Shaped(6), "DEADLINE", 5),
                             C("ATTEND.PREFIX.INFO", A)),
    # Two connections: one drops or kills while the other's commands are in flight.
    "two_connections": seed(PIPELINE, C("STATE.ALLOC", A, 4096), C("V.CREATE", B, 8, "fp16"),
                            C("STATE.READ", A, 0, 16, conn=1), C("STATE.FREE", A),
                            C("V.STOREBATCH", B, 0, F32(32 * 64), conn=1), C("V.SNAPSHOT", B),
                            C("V.DROP", B, conn=1), C("V.RESTORE", B, 1), C("CLIENT", "LIST", conn=1),
                            C("CLIENT", "KILL", "SKIPME", "yes"), C("PING", conn=1)),
    "two_connections_shm": seed(DEFAULT, C("V.CREATE", A, 16, "fp32"), C("V.STOREBATCH", A, 0, F32(64 * 64)),
                                C("V.FETCH", A, "RANGE", 0, 64, "SHM", conn=1), C("V.DROP", A),
                                C("SHM.INFO", conn=1), C("V.FETCH", A, "RANGE", 0, 4, conn=1),
                                C("QUIT", conn=1), C("SHM.INFO")),
    "errors": seed(DEFAULT, C("STATE.READ", B, 0, 1), C("V.FETCH", B, "RANGE", 5, 1),
                   C("ATTEND.PREFIX.QUERY", B, 0, 2, 8, 0, F32(3)), C("NOSUCH.COMMAND", "x\r\ny"),
                   C("STATE.ALLOC", A, -1), C("V.CREATE", A, 0, "fp9"), C("ATTEND.CREATE", A, 0, 0)),
    "deadline_approx": seed(DEFAULT, slot,
                            C("ATTEND.PREFIX.QUERY", A, 0, 2, 32, 0, Shaped(6), "DEADLINE", 1, "ALLOW",
                              "APPROX"),
                            C("STATE.ALLOC", A, 8, "DEADLINE", 0), C("SSM.PREFIX.FETCH", A, 0, "DEADLINE", "x")),
}

OUT.mkdir(parents=True, exist_ok=True)
for name, data in seeds.items():
    (OUT / name).write_bytes(data)
print("wrote %d seeds to %s" % (len(seeds), OUT))
