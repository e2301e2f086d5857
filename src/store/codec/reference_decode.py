#!/usr/bin/env python3
"""Reference decoder for Pion's RAW value rows (V.FETCH ... RAW), written from README.md alone.

It uses nothing from the C++ code: the layouts, the sign-vector generator and the centroid
tables are transcribed from src/store/codec/README.md. codec_test runs it on rows encoded by the
server's codec and requires the same float32 bits as RowCodec::Decode.

Library use:
    rows = decode(fmt, dim, block, data, n_rows)   # -> np.ndarray float32 [n_rows, dim]
Command line (used by the test):
    reference_decode.py FORMAT DIM BLOCK N_ROWS IN.bin OUT.bin   # OUT: float32 little-endian
"""
import sys

import numpy as np

# ---- README "Centroid tables": float32 bit patterns, index 0 .. 2^B - 1 ------------------------
CENTROID_BITS = {
    2: [0xBFC1555D, 0xBEE7D2C9, 0x3EE7D2C9, 0x3FC1555D],
    3: [0xC009B97A, 0xBFAC0538, 0xBF418990, 0xBE7AF9F8,
        0x3E7AF9F8, 0x3F418990, 0x3FAC0538, 0x4009B97A],
    4: [0xC02EE2BF, 0xC0046AC7, 0xBFCF1C25, 0xBFA0CC2F,
        0xBF713D39, 0xBF28215E, 0xBEC6AE44, 0xBE0379FD,
        0x3E0379FD, 0x3EC6AE44, 0x3F28215E, 0x3F713D39,
        0x3FA0CC2F, 0x3FCF1C25, 0x40046AC7, 0x402EE2BF],
}
TURBO_BITS = {"turbo4": 4, "turbo3": 3, "turbo2": 2}

# ---- README "Rotation sign vectors" --------------------------------------------------------------
SIGN_SEED_1 = 0x50494F4E00000001
SIGN_SEED_2 = 0x50494F4E00000002
MASK64 = (1 << 64) - 1


def splitmix64(seed, count):
    state = seed
    out = []
    for _ in range(count):
        state = (state + 0x9E3779B97F4A7C15) & MASK64
        z = state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
        out.append(z ^ (z >> 31))
    return out


def sign_vector(seed, n):
    """float32 array of +1/-1: sign i is bit (i % 64) of the (i // 64)-th SplitMix64 output."""
    words = splitmix64(seed, (n + 63) // 64)
    bits = [(words[i // 64] >> (i % 64)) & 1 for i in range(n)]
    return np.where(np.array(bits, dtype=np.uint8) == 1, np.float32(-1), np.float32(1)).astype(
        np.float32)


def fp16_to_f32(u16):
    """IEEE binary16 bits -> float32 (exact; NaN payloads kept)."""
    return np.asarray(u16, dtype="<u2").view(np.float16).astype(np.float32)


def fwht(v):
    """In-place-order Walsh-Hadamard butterflies on the last axis (length n = 2^k), float32:
    for h = 1, 2, 4, ..., n/2: for every i with i & h == 0: (v[i], v[i+h]) <- (v[i]+v[i+h], v[i]-v[i+h])."""
    n = v.shape[-1]
    h = 1
    while h < n:
        w = v.reshape(v.shape[:-1] + (n // (2 * h), 2, h))
        a = w[..., 0, :]
        b = w[..., 1, :]
        v = np.stack((a + b, a - b), axis=-2).reshape(v.shape)
        h *= 2
    return v


def unpack_indices(packed, bits, n):
    """packed: uint8 [..., n*bits/8] -> uint8 [..., n]; LSB-first bit stream, index i at bit i*bits."""
    stream = np.unpackbits(packed, axis=-1, bitorder="little")  # bit k of the stream at [..., k]
    stream = stream.reshape(packed.shape[:-1] + (n, bits)).astype(np.uint8)
    weights = (1 << np.arange(bits)).astype(np.uint8)
    return (stream * weights).sum(axis=-1).astype(np.uint8)


def decode(fmt, dim, block, data, n_rows):
    fmt = fmt.lower()
    raw = np.frombuffer(data, dtype=np.uint8)
    if fmt == "fp32":
        return raw.view("<f4").astype(np.float32).reshape(n_rows, dim)
    if fmt == "fp16":
        return fp16_to_f32(raw.view("<u2")).reshape(n_rows, dim)
    if fmt == "bf16":
        return (raw.view("<u2").astype(np.uint32) << 16).view(np.float32).reshape(n_rows, dim)
    if fmt == "int8":
        out = np.empty((n_rows, dim), dtype=np.float32)
        row_bytes = dim + 2 * ((dim + 31) // 32)
        rows = raw.reshape(n_rows, row_bytes)
        pos = 0
        for start in range(0, dim, 32):
            length = min(32, dim - start)
            scale = fp16_to_f32(rows[:, pos:pos + 2].copy().view("<u2"))  # [n_rows, 1]
            q = rows[:, pos + 2:pos + 2 + length].view(np.int8).astype(np.float32)
            out[:, start:start + length] = q * scale
            pos += 2 + length
        return out
    if fmt in TURBO_BITS:
        bits = TURBO_BITS[fmt]
        n = block
        n_blocks = dim // n
        block_bytes = 2 + n * bits // 8
        blocks = raw.reshape(n_rows * n_blocks, block_bytes)
        stored = fp16_to_f32(blocks[:, 0:2].copy().view("<u2"))  # [blocks, 1]
        k = stored * np.float32(1.0 / n)  # exact: n is a power of two
        idx = unpack_indices(blocks[:, 2:], bits, n)
        table = np.array(CENTROID_BITS[bits], dtype=np.uint32).view(np.float32)
        v = table[idx] * sign_vector(SIGN_SEED_2, n)  # D2 (sign flips are exact)
        v = fwht(v)  # H
        x = (v * k) * sign_vector(SIGN_SEED_1, n)  # scale, then D1
        return x.astype(np.float32).reshape(n_rows, dim)
    raise ValueError("unknown format " + fmt)


def main(argv):
    if len(argv) != 7:
        sys.exit(__doc__)
    fmt, dim, block, n_rows, src, dst = argv[1], int(argv[2]), int(argv[3]), int(argv[4]), argv[5], argv[6]
    with open(src, "rb") as f:
        data = f.read()
    with np.errstate(invalid="ignore", over="ignore"):
        out = decode(fmt, dim, block, data, n_rows)
    out.astype("<f4").tofile(dst)


if __name__ == "__main__":
    main(sys.argv)
