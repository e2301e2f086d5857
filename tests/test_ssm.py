"""SSM.PREFIX.* (seed 002): opaque per-layer recurrent state, the seed's reference
serialization, a 1 GiB blob, errors, memory accounting, tenants."""
from __future__ import annotations

import hashlib
import socket
import struct

import numpy as np
import pytest

from pionlib import RespError

DTYPE_CODE = {np.dtype(np.float32): 0, np.dtype(np.float16): 1}


def serialize_arrays(arrays) -> bytes:
    """Seed 002 reference format: version, n_arrays, per array ndim, shape, dtype_code, raw
    bytes; fp16/bf16 travel as fp32 (lossless)."""
    out = struct.pack("<II", 1, len(arrays))
    for a in arrays:
        out += struct.pack("<I", a.ndim) + struct.pack("<%dI" % a.ndim, *a.shape)
        out += struct.pack("<I", DTYPE_CODE[a.dtype]) + a.astype("<f4").tobytes()
    return out


def deserialize_arrays(blob: bytes):
    version, n = struct.unpack_from("<II", blob, 0)
    assert version == 1
    off, arrays = 8, []
    for _ in range(n):
        (ndim,) = struct.unpack_from("<I", blob, off)
        shape = struct.unpack_from("<%dI" % ndim, blob, off + 4)
        (code,) = struct.unpack_from("<I", blob, off + 4 + 4 * ndim)
        off += 8 + 4 * ndim
        count = int(np.prod(shape))
        vals = np.frombuffer(blob, "<f4", count, off).reshape(shape)
        off += 4 * count
        arrays.append(vals.astype(np.float16) if code == 1 else vals.copy())
    assert off == len(blob)
    return arrays


def test_mamba_like_state_round_trips_bit_exact(shared_pion):
    r = shared_pion.client()
    rng = np.random.default_rng(5)
    layers = {}
    for layer in range(24):
        conv = rng.standard_normal((1, 1536, 4)).astype(np.float32)
        ssm = rng.standard_normal((1, 1536, 16)).astype(np.float16)
        layers[layer] = (conv, ssm)
        assert r.execute_command("SSM.PREFIX.STORE", "mamba", layer,
                                 serialize_arrays([conv, ssm])) == b"OK"
    for layer, (conv, ssm) in layers.items():
        got = deserialize_arrays(r.execute_command("SSM.PREFIX.FETCH", "mamba", layer))
        np.testing.assert_array_equal(got[0], conv)
        np.testing.assert_array_equal(got[1], ssm)
        assert got[1].dtype == np.float16


def test_overwrite_drop_and_missing(shared_pion):
    with shared_pion.raw() as c:
        assert c.call("SSM.PREFIX.FETCH", "s", 0) is None
        assert c.call("SSM.PREFIX.STORE", "s", 0, b"one") == "OK"
        assert c.call("SSM.PREFIX.STORE", "s", 1, b"\x00\r\n") == "OK"
        assert c.call("SSM.PREFIX.STORE", "s", 0, b"two") == "OK"
        assert c.call("SSM.PREFIX.FETCH", "s", 0) == b"two"
        assert c.call("SSM.PREFIX.FETCH", "s", 1) == b"\x00\r\n"
        assert c.call("SSM.PREFIX.STORE", "s", 2, b"") == "OK"
        assert c.call("SSM.PREFIX.FETCH", "s", 2) == b""
        assert c.call("SSM.PREFIX.DROP", "s", 1) == "OK"
        assert c.call("SSM.PREFIX.FETCH", "s", 1) is None
        assert c.call("SSM.PREFIX.DROP", "s", 1) == "OK"  # idempotent
        assert c.call("SSM.PREFIX.DROP", "s") == "OK"
        assert c.call("SSM.PREFIX.FETCH", "s", 0) is None
        assert c.call("SSM.PREFIX.DROP", "never") == "OK"


@pytest.mark.parametrize("cmd,err", [
    (("SSM.PREFIX.STORE", "s", -1, b"x"), "ERR layer must be a non-negative integer, got '-1'"),
    (("SSM.PREFIX.FETCH", "s", "L"), "ERR layer must be a non-negative integer, got 'L'"),
    (("SSM.PREFIX.DROP", "s", "x"), "ERR layer must be a non-negative integer, got 'x'"),
    (("SSM.PREFIX.STORE", "s", 1), "ERR wrong number of arguments for 'ssm.prefix.store' command"),
    (("SSM.PREFIX.DROP",), "ERR wrong number of arguments for 'ssm.prefix.drop' command"),
])
def test_errors(shared_pion, cmd, err):
    with shared_pion.raw() as c:
        assert str(c.call(*cmd)) == err
        assert c.call("PING") == "PONG"


def test_one_gib_blob_round_trips(pion_factory):
    """No 64 MB ceiling (seed 002's wire limit): 1 GiB in, 1 GiB out, byte-exact."""
    srv = pion_factory("-w", "1")
    size = 1 << 30
    blob = np.random.default_rng(1).integers(0, 256, size, dtype=np.uint8)
    digest = hashlib.sha256(memoryview(blob)).hexdigest()
    with socket.create_connection(("127.0.0.1", srv.port), timeout=120) as s:
        head = b"*4\r\n$16\r\nSSM.PREFIX.STORE\r\n$3\r\nbig\r\n$1\r\n0\r\n$%d\r\n" % size
        s.sendall(head)
        s.sendall(memoryview(blob))
        s.sendall(b"\r\n")
        assert s.recv(5) == b"+OK\r\n"
        s.sendall(b"*3\r\n$16\r\nSSM.PREFIX.FETCH\r\n$3\r\nbig\r\n$1\r\n0\r\n")
        header = b""
        while not header.endswith(b"\r\n"):
            header += s.recv(1)
        assert header == b"$%d\r\n" % size
        out = bytearray(size + 2)
        view, got = memoryview(out), 0
        while got < size + 2:
            n = s.recv_into(view[got:])
            assert n > 0
            got += n
    assert out[size:] == b"\r\n"
    assert hashlib.sha256(view[:size]).hexdigest() == digest
    assert int(srv.info("memory")["used_memory_ssm"]) == size


def test_memory_pressure_demotes_to_disk_instead_of_refusing(pion_factory):
    srv = pion_factory("--maxmemory", "1mb")
    r = srv.client()
    r.execute_command("SSM.PREFIX.STORE", "m", 0, b"x" * 600_000)
    # The second blob does not fit beside the first: the first moves to disk, nothing is refused.
    r.execute_command("SSM.PREFIX.STORE", "m", 1, b"y" * 600_000)
    assert int(srv.info("memory")["used_memory_ssm"]) <= 1 << 20
    info = dict(zip(*[iter(r.execute_command("SSM.PREFIX.INFO", "m"))] * 2))
    assert info[b"layers"] == 2 and info[b"bytes"] == 1_200_000 and info[b"bytes_disk_only"] > 0
    assert r.execute_command("SSM.PREFIX.FETCH", "m", 0) == b"x" * 600_000  # promoted back
    assert r.execute_command("SSM.PREFIX.FETCH", "m", 1) == b"y" * 600_000
    res = srv.info("residency")
    assert int(res["residency_demotions_host_disk"]) >= 1
    assert int(res["residency_promotions_disk_host"]) >= 1
    # One blob larger than all of maxmemory can never fit: refused at once, nothing changes.
    with pytest.raises(Exception, match="OOM command not allowed .*ssm write of 2000000 bytes"):
        r.execute_command("SSM.PREFIX.STORE", "m", 2, b"z" * 2_000_000)
    r.execute_command("SSM.PREFIX.DROP", "m")
    assert int(srv.info("memory")["used_memory_ssm"]) == 0
    r.execute_command("SSM.PREFIX.STORE", "m", 1, b"y" * 600_000)
    assert "ssm:sessions=1,blobs=1,bytes=600000" in srv.redis_cli("INFO", "keyspace").stdout


def test_tenants_do_not_share_state(pion_factory, tmp_path):
    users = tmp_path / "users.txt"
    users.write_text("alice apw teamA\nbob bpw teamB\n")
    srv = pion_factory("--users", str(users))
    a = srv.client(username="alice", password="apw")
    b = srv.client(username="bob", password="bpw")
    a.execute_command("SSM.PREFIX.STORE", "shared-name", 0, b"alice-state")
    assert b.execute_command("SSM.PREFIX.FETCH", "shared-name", 0) is None
    b.execute_command("SSM.PREFIX.STORE", "shared-name", 0, b"bob-state")
    assert a.execute_command("SSM.PREFIX.FETCH", "shared-name", 0) == b"alice-state"
