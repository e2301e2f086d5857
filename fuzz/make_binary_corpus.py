#!/usr/bin/env python3
"""Writes the seed corpus of binary_frame_fuzz (fuzz/corpus/binary/): one valid frame per
command, pipelined frames, and malformed ones. Each file starts with the fuzzer's three
config bytes (limits and read pattern), then the stream."""
import pathlib
import struct

OUT = pathlib.Path(__file__).resolve().parent / "corpus" / "binary"
H = struct.Struct("<HBBHHQQ")


def frame(cmd, payload=b"", rid=1, magic=0xCA5E, version=1, flags=0, status=0, length=None):
    n = len(payload) if length is None else length
    return H.pack(magic, version, cmd, flags, status, rid, n) + payload


def s(x: bytes) -> bytes:
    return struct.pack("<H", len(x)) + x


CFG = b"\x07\x01\x01"  # max blob 28673, big payloads from 528 bytes, authenticated
keys = bytes(range(256)) * 4  # 1024 bytes: 16 rows of dim 16
seeds = {
    "layer_store": frame(0x01, s(b"sid") + struct.pack("<I", 3) + b"state" * 200),
    "layer_fetch": frame(0x02, s(b"sid") + struct.pack("<I", 3)),
    "layer_drop": frame(0x05, s(b"sid") + struct.pack("<q", -1)),
    "ping": frame(0x03) + frame(0x03, b"hello", rid=2),
    "auth": frame(0x04, s(b"") + s(b"secret")),
    "attend_create": frame(0x20, s(b"a") + struct.pack("<IIIIB", 16, 16, 0, 0, 0)),
    "attend_store": frame(0x21, s(b"a") + struct.pack("<qQ", -1, 1024) + keys + keys),
    "attend_finalize": frame(0x22, s(b"a")),
    "attend_query": frame(0x23, s(b"a") + struct.pack("<IIB", 4, 0, 1) + keys[:64]),
    "attend_info": frame(0x24, s(b"")) + frame(0x25, s(b"a"), rid=9),
    "bad_magic": frame(0x03, magic=0xBEEF),
    "bad_version": frame(0x03, version=7),
    "unknown_command": frame(0x7F, b"junk") + frame(0x03, rid=2),
    "flags_set": frame(0x03, flags=1) + frame(0x03, rid=2),
    "truncated_field": frame(0x22, b"\x09\x00ab"),
    "trailing_bytes": frame(0x22, s(b"a") + b"extra"),
    "oversized": frame(0x01, b"", length=1 << 40),
    "short_header": H.pack(0xCA5E, 1, 3, 0, 0, 1, 0)[:10],
}

OUT.mkdir(parents=True, exist_ok=True)
for name, data in seeds.items():
    (OUT / name).write_bytes(CFG + data)
print("wrote %d seeds to %s" % (len(seeds), OUT))
