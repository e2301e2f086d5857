"""RAW row decoding of every V-store codec in numpy (fp32, fp16, bf16, int8, turbo4/3/2, fp8,
fp8_e5m2, fp8_ds_mla).

Written from src/store/codec/README.md (adapted from src/store/codec/reference_decode.py):
decoding follows the document's float32 steps, so the result is bit-identical to the server's
own decode (`V.FETCH` without RAW).

    decode(fmt, dim, block, data)  -> float32 [n_rows, dim]
    row_bytes(fmt, dim, block)     -> bytes per stored row
"""
from __future__ import annotations

import functools

import numpy as np

from . import _pool

FORMATS = ("fp32", "fp16", "bf16", "int8", "turbo4", "turbo3", "turbo2", "fp8", "fp8_e5m2",
           "fp8_ds_mla")
FP8 = ("fp8", "fp8_e5m2")  # rows [f32 scale][dim × fp8 byte]
TURBO_BITS = {"turbo4": 4, "turbo3": 3, "turbo2": 2}
# README "fp8_ds_mla" (DeepSeek-V3.2's MLA latent): [nope e4m3][nope/128 f32 scales][64 bf16]
DS_MLA_GROUP, DS_MLA_ROPE = 128, 64
DEFAULT_TURBO_BLOCK = 128

# README "Centroid tables": float32 bit patterns, index 0 .. 2^B - 1.
CENTROID_BITS = {
    2: [0xBFC1555D, 0xBEE7D2C9, 0x3EE7D2C9, 0x3FC1555D],
    3: [0xC009B97A, 0xBFAC0538, 0xBF418990, 0xBE7AF9F8,
        0x3E7AF9F8, 0x3F418990, 0x3FAC0538, 0x4009B97A],
    4: [0xC02EE2BF, 0xC0046AC7, 0xBFCF1C25, 0xBFA0CC2F,
        0xBF713D39, 0xBF28215E, 0xBEC6AE44, 0xBE0379FD,
        0x3E0379FD, 0x3EC6AE44, 0x3F28215E, 0x3F713D39,
        0x3FA0CC2F, 0x3FCF1C25, 0x40046AC7, 0x402EE2BF],
}

# README "Sign vectors": SplitMix64 seeds "PION" + 1 / + 2.
SIGN_SEED_1 = 0x50494F4E00000001
SIGN_SEED_2 = 0x50494F4E00000002
_MASK64 = (1 << 64) - 1


def splitmix64(seed: int, count: int) -> list[int]:
    """The first `count` SplitMix64 outputs from `seed`."""
    state = seed
    out = []
    for _ in range(count):
        state = (state + 0x9E3779B97F4A7C15) & _MASK64
        z = state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
        out.append(z ^ (z >> 31))
    return out


@functools.lru_cache(maxsize=None)
def sign_vector(seed: int, n: int) -> np.ndarray:
    """float32 [n] of ±1: sign i is -1 when bit (i % 64) of the (i // 64)-th output is set."""
    words = splitmix64(seed, (n + 63) // 64)
    bits = np.array([(words[i // 64] >> (i % 64)) & 1 for i in range(n)], dtype=np.uint8)
    out = np.where(bits == 1, np.float32(-1), np.float32(1)).astype(np.float32)
    out.flags.writeable = False
    return out


# Widening runs in pieces of this many elements (numpy's whole-array float16 cast into fresh
# memory is 4x slower than piecewise on the machines measured), shared with the copy threads
# of pion.shm above PARALLEL_ELEMS.
_PIECE = 1 << 18
PARALLEL_ELEMS = 1 << 20


def _piecewise(n: int, fn) -> None:
    """fn(lo, hi) over [0, n) in pieces, spread over the calling thread and the shm copy
    pool when n is large."""
    _run_spread([(lo, min(n, lo + _PIECE)) for lo in range(0, n, _PIECE)], fn, n)


def _run_spread(jobs, fn, n: int) -> None:
    """fn(*job) for every job, spread over the calling thread and the shm copy pool when the
    jobs cover n >= PARALLEL_ELEMS elements (numpy releases the GIL in its loops)."""
    pool = None
    if n >= PARALLEL_ELEMS:
        from .shm import _copy_pool
        pool = _copy_pool()
    if pool is None or len(jobs) < 2:
        for j in jobs:
            fn(*j)
        return
    workers = min(len(jobs), 1 + pool._max_workers)
    share = [jobs[i::workers] for i in range(workers)]

    def run(part):
        for j in part:
            fn(*j)

    futures = [pool.submit(run, part) for part in share[1:]]
    run(share[0])
    for f in futures:
        f.result()


_F16_SCALE = np.float32(2.0 ** 112)  # 2^(127 - 15): half's exponent bias to float's
_F16_INF = np.float32(65536.0)  # past the largest finite half: what exponent 31 turns into


def _widen_f16(src: np.ndarray, dst: np.ndarray) -> None:
    """binary16 bits (uint16 [n]) -> float32 dst [n], exact, in four passes over the piece.
    Sign-extended and shifted left by 13, a half's sign lands in float32's sign bit and its
    exponent and mantissa in place for the value times 2^-112 (subnormal halves too), once
    the three sign-extension bits above the exponent are cleared; one multiply by 2^112
    rebiases. Exponent 31 (inf, NaN) comes out as |x| >= 2^16 and gets exponent 255. About
    1.5x numpy 1.24's float16 cast, which converts one element at a time."""
    x = dst.view(np.int32)
    np.left_shift(src.view(np.int16), 13, out=x, dtype=np.int32, casting="unsafe")
    x &= np.int32(0x8FFFFFFF - (1 << 32))
    np.multiply(dst, _F16_SCALE, out=dst)
    if dst.max(initial=0) >= _F16_INF or dst.min(initial=0) <= -_F16_INF:
        special = np.abs(dst) >= _F16_INF
        x[special] |= np.int32(0x7F800000)


def fp16_to_f32(u16) -> np.ndarray:
    """IEEE binary16 bits -> float32 (exact)."""
    h = np.asarray(u16, dtype="<u2")
    src = h.reshape(-1)
    out = _pool.empty(src.size, np.float32)
    _piecewise(src.size, lambda lo, hi: _widen_f16(src[lo:hi], out[lo:hi]))
    return out.reshape(h.shape)


ELEMENTWISE = {"fp32": 4, "fp16": 2, "bf16": 2}  # formats whose rows are plain elements


def decode_pieces(fmt: str, pieces, out: np.ndarray) -> None:
    """Decodes the concatenation of `pieces` (uint8 views, e.g. straight into a shared-memory
    mapping, each a whole number of elements) of an element-wise format (ELEMENTWISE) into the
    float32 array `out` (flat, exactly their elements), without first copying them together."""
    decode_pieces_many(fmt, [(pieces, out)])


def decode_pieces_many(fmt: str, work, copies=None) -> None:
    """decode_pieces for several (pieces, out) pairs at once: every pair's pieces are shared
    out over the same threads (K and V of a layer decode together). copies: per pair, None or
    a uint8 array that also receives the pieces' bytes, each piece copied there and decoded
    from the copy while it is in cache (fetch_raw(into=..., decode=True))."""
    size = ELEMENTWISE[fmt]
    jobs, total = [], 0
    for i, (pieces, out) in enumerate(work):
        at = 0
        copy = copies[i] if copies is not None else None
        for p in pieces:
            n = p.size // size
            for lo in range(0, n, _PIECE):
                hi = min(n, lo + _PIECE)
                cp = None if copy is None else copy[(at + lo) * size:(at + hi) * size]
                jobs.append((p[lo * size:hi * size], out[at + lo:at + hi], cp))
            at += n
        if at != out.size:
            raise ValueError("the pieces hold %d elements, out has %d" % (at, out.size))
        total += at

    def run(src, dst, cp):
        if cp is not None:
            cp[:] = src
            src = cp
        if fmt == "fp32":
            dst.view(np.uint8)[:] = src
        elif fmt == "fp16":
            _widen_f16(src.view("<u2"), dst)
        else:
            d = dst.view(np.uint32)
            np.copyto(d, src.view("<u2"), casting="unsafe")
            d <<= 16

    _run_spread(jobs, run, total)


def bf16_to_f32(u16) -> np.ndarray:
    """bfloat16 bits -> float32 (exact: the bits shifted up)."""
    h = np.asarray(u16, dtype="<u2")
    src = h.reshape(-1)
    out = _pool.empty(src.size, np.uint32)

    def widen(lo, hi):
        np.copyto(out[lo:hi], src[lo:hi])
        out[lo:hi] <<= 16

    _piecewise(src.size, widen)
    return out.view(np.float32).reshape(h.shape)


def fwht(v: np.ndarray) -> np.ndarray:
    """Walsh-Hadamard butterflies on the last axis (n = 2^k) in float32, stages h = 1 .. n/2."""
    n = v.shape[-1]
    h = 1
    while h < n:
        w = v.reshape(v.shape[:-1] + (n // (2 * h), 2, h))
        a = w[..., 0, :]
        b = w[..., 1, :]
        v = np.stack((a + b, a - b), axis=-2).reshape(v.shape)
        h *= 2
    return v


def unpack_indices(packed: np.ndarray, bits: int, n: int) -> np.ndarray:
    """uint8 [..., n*bits/8] -> uint8 [..., n]: LSB-first bit stream, index i at bit i*bits."""
    stream = np.unpackbits(packed, axis=-1, bitorder="little")
    stream = stream.reshape(packed.shape[:-1] + (n, bits))
    weights = (1 << np.arange(bits)).astype(np.uint8)
    return (stream * weights).sum(axis=-1).astype(np.uint8)


def default_block(fmt: str) -> int:
    """The block a session gets without `BLOCK n`: 32 for int8, 128 for turbo, 0 otherwise."""
    fmt = fmt.lower()
    if fmt == "fp8_ds_mla":
        return DS_MLA_GROUP
    return DEFAULT_TURBO_BLOCK if fmt in TURBO_BITS else 32 if fmt == "int8" else 0


def row_bytes(fmt: str, dim: int, block: int | None = None) -> int:
    """Bytes of one stored row (README table)."""
    fmt = fmt.lower()
    if fmt == "fp32":
        return 4 * dim
    if fmt in ("fp16", "bf16"):
        return 2 * dim
    if fmt == "int8":
        return dim + 2 * ((dim + 31) // 32)
    if fmt in FP8:
        return 4 + dim
    if fmt in TURBO_BITS:
        n = block or DEFAULT_TURBO_BLOCK
        return (dim // n) * (2 + n * TURBO_BITS[fmt] // 8)
    if fmt == "fp8_ds_mla":
        nope = dim - DS_MLA_ROPE
        if nope <= 0 or nope % DS_MLA_GROUP:
            raise ValueError("fp8_ds_mla rows are kv_lora_rank + 64 values, kv_lora_rank a "
                             "multiple of 128, got dim %d" % dim)
        return nope + 4 * (nope // DS_MLA_GROUP) + 2 * DS_MLA_ROPE
    raise ValueError("format must be one of %s, got %r" % ("|".join(FORMATS), fmt))


def decode(fmt: str, dim: int, block: int | None, data, n_rows: int | None = None) -> np.ndarray:
    """Decodes RAW rows (`V.FETCH ... RAW` bytes) into float32 [n_rows, dim].

    `block` is the session's block (V.INFO `block`); None or 0 takes the format's default.
    `n_rows` defaults to len(data) / row_bytes."""
    fmt = fmt.lower()
    rb = row_bytes(fmt, dim, block)
    raw = np.frombuffer(data, dtype=np.uint8)
    if n_rows is None:
        if raw.size % rb:
            raise ValueError("%d bytes is not a multiple of the %s row size %d (dim %d)"
                             % (raw.size, fmt, rb, dim))
        n_rows = raw.size // rb
    elif raw.size != n_rows * rb:
        raise ValueError("expected %d rows * %d bytes = %d bytes, got %d"
                         % (n_rows, rb, n_rows * rb, raw.size))
    with np.errstate(invalid="ignore", over="ignore"):
        return _decode(fmt, dim, block, raw, n_rows)


def _e4m3_table() -> np.ndarray:
    """float32 [256]: the value of every e4m3fn byte (README "fp8")."""
    b = np.arange(256)
    e, m = (b >> 3) & 15, b & 7
    v = np.where(e == 0, np.ldexp(m.astype(np.float64), -9),
                 np.ldexp((8 + m).astype(np.float64), e - 10))
    v = np.where((b & 0x7F) == 0x7F, np.nan, v)
    return np.where(b & 0x80, -v, v).astype(np.float32)


E4M3 = _e4m3_table()
# README "fp8_e5m2": byte b is the top byte of the IEEE binary16 with bits b << 8 (exact in f32).
E5M2 = (np.arange(256, dtype=np.uint16) << 8).view(np.float16).astype(np.float32)
FP8_TABLES = {"fp8": E4M3, "fp8_e5m2": E5M2}
TORCH_FP8 = {"fp8": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}  # the torch dtype of the bytes


def fp8_parts(data, dim: int):
    """RAW fp8 or fp8_e5m2 rows split without a copy: (q, scale) — q a uint8 [n_rows, dim]
    view of the fp8 bytes (strided: rows are 4 + dim apart), scale float32 [n_rows]. For torch:
    `torch.from_numpy(q).view(torch.float8_e4m3fn)` (fp8; `torch.float8_e5m2` for fp8_e5m2,
    TORCH_FP8 names them) is the fp8 tensor, and q·scale[:, None] the row's values (as
    decode())."""
    raw = np.frombuffer(data, dtype=np.uint8)
    if raw.size % (4 + dim):
        raise ValueError("%d bytes is not a multiple of the fp8 row size %d (dim %d)"
                         % (raw.size, 4 + dim, dim))
    rows = raw.reshape(-1, 4 + dim)
    return rows[:, 4:], rows[:, :4].copy().view("<f4").reshape(-1)


def ds_mla_parts(data, dim: int = 576):
    """RAW fp8_ds_mla rows split without a copy: (q, scales, rope) — q uint8 [n_rows, nope] (the
    e4m3 bytes, torch.float8_e4m3fn), scales float32 [n_rows, nope/128], rope uint16
    [n_rows, 64] (bf16 bits). What FlashMLA's fp8 sparse decode reads, and decode()'s input."""
    rb = row_bytes("fp8_ds_mla", dim)
    nope = dim - DS_MLA_ROPE
    rows = np.frombuffer(data, dtype=np.uint8).reshape(-1, rb)
    groups = nope // DS_MLA_GROUP
    scales = rows[:, nope:nope + 4 * groups].copy().view("<f4")
    rope = rows[:, nope + 4 * groups:].copy().view("<u2")
    return rows[:, :nope], scales, rope


def _decode(fmt, dim, block, raw, n_rows):
    if fmt == "fp8_ds_mla":
        q, scales, rope = ds_mla_parts(raw, dim)
        nope = dim - DS_MLA_ROPE
        out = np.empty((n_rows, dim), dtype=np.float32)
        vals = E4M3[q].reshape(n_rows, nope // DS_MLA_GROUP, DS_MLA_GROUP)
        out[:, :nope] = (vals * scales[:, :, None]).reshape(n_rows, nope)
        out[:, nope:] = bf16_to_f32(rope)
        return out
    if fmt in FP8:
        rows = raw.reshape(n_rows, 4 + dim)
        scale = rows[:, :4].copy().view("<f4")  # [n_rows, 1]
        return FP8_TABLES[fmt][rows[:, 4:]] * scale
    if fmt == "fp32":
        return raw.view("<f4").reshape(n_rows, dim)
    if fmt == "fp16":
        return fp16_to_f32(raw.view("<u2")).reshape(n_rows, dim)
    if fmt == "bf16":
        return bf16_to_f32(raw.view("<u2")).reshape(n_rows, dim)
    if fmt == "int8":
        out = np.empty((n_rows, dim), dtype=np.float32)
        rows = raw.reshape(n_rows, row_bytes("int8", dim))
        pos = 0
        for start in range(0, dim, 32):
            length = min(32, dim - start)
            scale = fp16_to_f32(rows[:, pos:pos + 2].copy().view("<u2"))  # [n_rows, 1]
            q = rows[:, pos + 2:pos + 2 + length].view(np.int8).astype(np.float32)
            out[:, start:start + length] = q * scale
            pos += 2 + length
        return out
    bits = TURBO_BITS[fmt]
    n = block or DEFAULT_TURBO_BLOCK
    n_blocks = dim // n
    blocks = raw.reshape(n_rows * n_blocks, 2 + n * bits // 8)
    k = fp16_to_f32(blocks[:, 0:2].copy().view("<u2")) * np.float32(1.0 / n)  # exact: 2^-k
    idx = unpack_indices(blocks[:, 2:], bits, n)
    table = np.array(CENTROID_BITS[bits], dtype=np.uint32).view(np.float32)
    v = table[idx] * sign_vector(SIGN_SEED_2, n)  # D2: exact sign flips
    v = fwht(v)
    x = (v * k) * sign_vector(SIGN_SEED_1, n)  # one rounding, then D1
    return x.astype(np.float32).reshape(n_rows, dim)
