"""The same-host data plane (--unixsocket): SHM.ATTACH passes the tenant's memfd segments with
SCM_RIGHTS, V.FETCH … SHM answers with (segment, offset, length) pieces under a lease, and the
client reads the stored bytes straight from its read-only mapping."""
import mmap
import os
import socket
import time

import numpy as np
import pytest
import redis


class ShmConn:
    """A raw RESP connection on the Unix socket that also receives file descriptors."""

    def __init__(self, path):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(10)
        self.sock.connect(path)
        self.buf = b""
        self.fds = []

    def close(self):
        self.sock.close()
        for fd in self.fds:
            os.close(fd)

    def _fill(self):
        data, fds, _flags, _addr = socket.recv_fds(self.sock, 1 << 20, 64)
        if not data:
            raise ConnectionError("closed")
        self.buf += data
        self.fds += fds

    def _line(self):
        while b"\r\n" not in self.buf:
            self._fill()
        line, self.buf = self.buf.split(b"\r\n", 1)
        return line

    def _reply(self):
        line = self._line()
        t, rest = line[:1], line[1:]
        if t == b"+":
            return rest.decode()
        if t == b"-":
            return RuntimeError(rest.decode())
        if t == b":":
            return int(rest)
        if t == b"$":
            n = int(rest)
            while len(self.buf) < n + 2:
                self._fill()
            out, self.buf = self.buf[:n], self.buf[n + 2:]
            return out
        if t == b"*":
            return [self._reply() for _ in range(int(rest))]
        raise AssertionError(line)

    def call(self, *args):
        out = [b"*%d\r\n" % len(args)]
        for a in args:
            a = a if isinstance(a, bytes) else str(a).encode()
            out.append(b"$%d\r\n%s\r\n" % (len(a), a))
        self.sock.sendall(b"".join(out))
        return self._reply()


def attach(c):
    """SHM.ATTACH → {segment id: read-only mmap}."""
    before = len(c.fds)
    segs = c.call("SHM.ATTACH")
    fds = c.fds[before:]
    assert len(fds) == len(segs)
    maps = {}
    for (seg, size), fd in zip(segs, fds):
        maps[seg] = mmap.mmap(fd, size, prot=mmap.PROT_READ)
    return maps, fds


def shm_fetch(c, maps, sid, start, end):
    reply = c.call("V.FETCH", sid, "RANGE", start, end, "SHM")
    assert not isinstance(reply, Exception), reply
    r = dict(zip([k.decode() for k in reply[::2]], reply[1::2]))
    if any(seg not in maps for seg, _, _ in r["pieces"]):
        maps.update(attach(c)[0])  # a segment created since the last attach
    data = b"".join(maps[seg][off:off + ln] for seg, off, ln in r["pieces"])
    assert len(data) == r["bytes"]
    return r["lease"], data, r


@pytest.fixture
def shm_server(pion_factory, tmp_path):
    path = str(tmp_path / "s.sock")
    if len(path) > 100:
        pytest.skip("tmp path too long for a Unix socket")
    srv = pion_factory("--unixsocket", path, "--shm-segment-size", "4mb")
    srv.sock_path = path
    return srv


def test_shm_fetch_equals_tcp_fetch_byte_for_byte(shm_server):
    tcp = shm_server.client()
    rng = np.random.default_rng(3)
    for fmt, dim, n in (("fp16", 1024, 700), ("fp32", 256, 130), ("int8", 96, 100), ("turbo3", 128, 257)):
        sid = "sess_" + fmt
        tcp.execute_command("V.CREATE", sid, dim, fmt)
        rows = rng.standard_normal((n, dim)).astype(np.float32)
        tcp.execute_command("V.STOREBATCH", sid, 0, rows.tobytes())
        want = tcp.execute_command("V.FETCH", sid, "RANGE", 0, n, "RAW")
        c = ShmConn(shm_server.sock_path)
        try:
            maps, _ = attach(c)
            for a, b in ((0, n), (5, n - 3), (63, 65)):
                lease, got, r = shm_fetch(c, maps, sid, a, b)
                row = r["row_bytes"]
                assert got == want[a * row:b * row], (fmt, a, b)
                assert c.call("SHM.RELEASE", lease) == 1
        finally:
            c.close()


def test_lease_keeps_old_bytes_across_an_overwrite_and_release(shm_server):
    tcp = shm_server.client()
    tcp.execute_command("V.CREATE", "ow", 512, "fp16")
    old = np.full((128, 512), 1.5, np.float32)
    tcp.execute_command("V.STOREBATCH", "ow", 0, old.tobytes())
    c = ShmConn(shm_server.sock_path)
    try:
        maps, _ = attach(c)
        lease, before, r0 = shm_fetch(c, maps, "ow", 0, 128)
        tcp.execute_command("V.STOREBATCH", "ow", 0, np.full((128, 512), -7.0, np.float32).tobytes())
        # A new fetch sees the new generation ...
        _, again, _ = shm_fetch(c, maps, "ow", 0, 128)
        assert np.all(np.frombuffer(again, np.float16) == -7.0)
        # ... while the first lease's pieces, re-read through the mappings now, still hold the
        # old bytes, whole: the overwrite copied the chunks instead of writing under the lease.
        now = b"".join(maps[sg][o:o + ln] for sg, o, ln in r0["pieces"])
        assert now == before and np.all(np.frombuffer(now, np.float16) == 1.5)
        assert c.call("SHM.RELEASE", lease) == 1
        assert c.call("SHM.RELEASE", lease) == 0  # once only
    finally:
        c.close()


def test_leased_region_is_not_reused_until_released(shm_server):
    tcp = shm_server.client()
    tcp.execute_command("V.CREATE", "reuse", 1024, "fp32")
    tcp.execute_command("V.STOREBATCH", "reuse", 0, np.full((64, 1024), 2.0, np.float32).tobytes())
    c = ShmConn(shm_server.sock_path)
    try:
        maps, _ = attach(c)
        reply = c.call("V.FETCH", "reuse", "RANGE", 0, 64, "SHM")
        r = dict(zip([k.decode() for k in reply[::2]], reply[1::2]))
        [(seg, off, ln)] = r["pieces"]
        # Drop the session and churn allocations: the leased region must keep its bytes.
        tcp.execute_command("V.DROP", "reuse")
        for i in range(6):
            tcp.execute_command("V.CREATE", "churn%d" % i, 1024, "fp32")
            tcp.execute_command("V.STOREBATCH", "churn%d" % i, 0,
                                np.full((64, 1024), 9.0 + i, np.float32).tobytes())
        maps.update(attach(c)[0])
        assert np.all(np.frombuffer(maps[seg][off:off + ln], np.float32) == 2.0)
        assert c.call("SHM.RELEASE", r["lease"]) == 1
    finally:
        c.close()


def test_client_that_dies_releases_its_leases(shm_server):
    tcp = shm_server.client()
    tcp.execute_command("V.CREATE", "die", 64, "fp16")
    tcp.execute_command("V.STOREBATCH", "die", 0, np.ones((64, 64), np.float32).tobytes())
    c = ShmConn(shm_server.sock_path)
    maps, _ = attach(c)
    for _ in range(3):
        shm_fetch(c, maps, "die", 0, 64)
    info = lambda: dict(zip([k.decode() for k in tcp.execute_command("SHM.INFO")[::2]],
                            tcp.execute_command("SHM.INFO")[1::2]))
    assert info()["leases"] == 3
    c.close()
    deadline = time.time() + 5
    while info()["leases"] != 0 and time.time() < deadline:
        time.sleep(0.02)
    assert info()["leases"] == 0


def test_mappings_are_read_only(shm_server):
    tcp = shm_server.client()
    tcp.execute_command("V.CREATE", "ro", 64, "fp32")
    tcp.execute_command("V.STOREBATCH", "ro", 0, np.ones((1, 64), np.float32).tobytes())
    c = ShmConn(shm_server.sock_path)
    try:
        _, fds = attach(c)
        assert fds
        with pytest.raises(PermissionError):
            mmap.mmap(fds[0], 4096, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        c.close()


def test_tcp_clients_get_no_mappings(shm_server):
    tcp = shm_server.client()
    tcp.execute_command("V.CREATE", "t", 8, "fp32")
    tcp.execute_command("V.STOREBATCH", "t", 0, np.ones((1, 8), np.float32).tobytes())
    with pytest.raises(redis.ResponseError, match="only given to clients on the Unix socket"):
        tcp.execute_command("V.FETCH", "t", "RANGE", 0, 1, "SHM")
    with pytest.raises(redis.ResponseError, match="only for clients on the Unix socket"):
        tcp.execute_command("SHM.ATTACH")
    c = ShmConn(shm_server.sock_path)
    try:
        err = c.call("V.FETCH", "t", 0, "SHM")
        assert isinstance(err, RuntimeError) and "SHM needs the RANGE form" in str(err)
    finally:
        c.close()


def test_lease_ttl_and_limit(pion_factory, tmp_path):
    path = str(tmp_path / "l.sock")
    srv = pion_factory("--unixsocket", path, "--shm-lease-ttl-ms", "200", "--shm-max-leases", "2")
    tcp = srv.client()
    tcp.execute_command("V.CREATE", "x", 16, "fp32")
    tcp.execute_command("V.STOREBATCH", "x", 0, np.ones((4, 16), np.float32).tobytes())
    c = ShmConn(path)
    try:
        maps, _ = attach(c)
        shm_fetch(c, maps, "x", 0, 4)
        shm_fetch(c, maps, "x", 0, 4)
        err = c.call("V.FETCH", "x", "RANGE", 0, 4, "SHM")
        assert isinstance(err, RuntimeError) and str(err).startswith("BUSY client holds 2 leases")
        time.sleep(0.6)  # past the TTL: the server released them
        info = c.call("SHM.INFO")
        info = dict(zip([k.decode() for k in info[::2]], info[1::2]))
        assert info["client_leases"] == 0 and info["expired"] >= 2
        shm_fetch(c, maps, "x", 0, 4)  # room again
    finally:
        c.close()


def test_shm_write_reserve_write_commit(shm_server):
    tcp = shm_server.client()
    tcp.execute_command("V.CREATE", "w", 256, "fp32")
    rows = np.random.default_rng(5).standard_normal((300, 256)).astype(np.float32)
    c = ShmConn(shm_server.sock_path)
    try:
        before = len(c.fds)
        lease, seg, off, length = c.call("SHM.RESERVE", rows.nbytes)
        assert length == rows.nbytes and len(c.fds) == before + 1
        fd = c.fds[-1]
        region = mmap.mmap(fd, off + length, prot=mmap.PROT_READ | mmap.PROT_WRITE)  # writable
        region[off:off + length] = rows.tobytes()
        assert c.call("V.STOREBATCH", "w", 10, "SHM", lease) == 300
        got = np.frombuffer(tcp.execute_command("V.FETCH", "w", "RANGE", 10, 310), np.float32)
        assert np.array_equal(got.reshape(300, 256), rows)
        # One commit per reservation.
        err = c.call("V.STOREBATCH", "w", 0, "SHM", lease)
        assert isinstance(err, RuntimeError) and "no SHM.RESERVE lease %d on this connection" % lease in str(err)
        # A region that is not whole rows is refused (and spent).
        lease2, _, _, _ = c.call("SHM.RESERVE", 1000)
        err = c.call("V.STOREBATCH", "w", 0, "SHM", lease2)
        assert isinstance(err, RuntimeError) and "expected a multiple of 4*dim = 1024" in str(err)
        # Read leases on fetched rows are still read-only: only staging fds are writable.
        maps, fds = attach(c)
        with pytest.raises(PermissionError):
            mmap.mmap(fds[0], 4096, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        region.close()
    finally:
        c.close()
    # Another connection cannot commit someone else's reservation.
    c1, c2 = ShmConn(shm_server.sock_path), ShmConn(shm_server.sock_path)
    try:
        lease, _, _, _ = c1.call("SHM.RESERVE", 1024)
        err = c2.call("V.STOREBATCH", "w", 0, "SHM", lease)
        assert isinstance(err, RuntimeError) and "no SHM.RESERVE lease" in str(err)
    finally:
        c1.close()
        c2.close()
    with pytest.raises(redis.ResponseError, match="only for clients on the Unix socket"):
        tcp.execute_command("SHM.RESERVE", 64)
    with pytest.raises(redis.ResponseError, match="SHM commits are only for clients on the Unix"):
        tcp.execute_command("V.STOREBATCH", "w", 0, "SHM", 1)
    assert tcp.ping()


def test_shm_commit_with_crc32(shm_server):
    import zlib
    tcp = shm_server.client()
    tcp.execute_command("V.CREATE", "crc", 64, "fp32")
    rows = np.arange(64 * 10, dtype=np.float32).reshape(10, 64)
    c = ShmConn(shm_server.sock_path)
    try:
        for good in (True, False):
            lease, seg, off, length = c.call("SHM.RESERVE", rows.nbytes)
            region = mmap.mmap(c.fds[-1], off + length, prot=mmap.PROT_READ | mmap.PROT_WRITE)
            region[off:off + length] = rows.tobytes()
            crc = zlib.crc32(rows.tobytes()) ^ (0 if good else 1)
            got = c.call("V.STOREBATCH", "crc", 0 if good else 20, "SHM", lease, "CRC32", crc)
            if good:
                assert got == 10
            else:
                assert isinstance(got, RuntimeError) and str(got).startswith(
                    "CORRUPT SHM region of lease %d has CRC32 %d, expected %d; nothing stored"
                    % (lease, crc ^ 1, crc))
            region.close()
        assert np.array_equal(np.frombuffer(tcp.execute_command("V.FETCH", "crc", "RANGE", 0, 10),
                                            np.float32).reshape(10, 64), rows)
        with pytest.raises(redis.ResponseError, match="id 20 was never stored"):
            tcp.execute_command("V.FETCH", "crc", "RANGE", 20, 21)  # the bad commit stored nothing
        lease, _, _, _ = c.call("SHM.RESERVE", 256)
        err = c.call("V.STOREBATCH", "crc", 0, "SHM", lease, "MD5", 1)
        assert isinstance(err, RuntimeError) and "expected CRC32 <value>" in str(err)
    finally:
        c.close()


def test_fetch_reports_the_arena_punch_epoch(shm_server):
    """Freed arena pages beyond the 256 MiB kept for reuse are given back (hole punch); a client
    that pinned a segment (cudaHostRegister) would then DMA from the old pages, so every SHM
    fetch names the arena's punch epoch and the epoch moves when pages are given back."""
    tcp = shm_server.client()
    tcp.execute_command("V.CREATE", "keep", 256, "fp32")
    tcp.execute_command("V.STOREBATCH", "keep", 0, np.ones((4, 256), np.float32).tobytes())
    c = ShmConn(shm_server.sock_path)
    try:
        maps, _ = attach(c)
        lease, _, r = shm_fetch(c, maps, "keep", 0, 4)
        before = r["epoch"]
        assert isinstance(before, int) and before >= 0
        c.call("SHM.RELEASE", lease)
        block = np.zeros((16384, 1024), np.float32)  # 64 MiB per batch, 320 MiB in all
        tcp.execute_command("V.CREATE", "big", 1024, "fp32")
        for i in range(5):
            tcp.execute_command("V.STOREBATCH", "big", i * 16384, block.tobytes())
        tcp.execute_command("V.DROP", "big")
        lease, data, r = shm_fetch(c, maps, "keep", 0, 4)
        assert r["epoch"] > before
        assert data == np.ones((4, 256), np.float32).tobytes()
        c.call("SHM.RELEASE", lease)
    finally:
        c.close()


def test_mappings_are_scoped_to_the_tenant(pion_factory, tmp_path):
    """Two tenants on one Unix socket: a tenant's SHM.ATTACH hands over only its own arena's
    segments (none of them holds the other tenant's bytes), it cannot fetch the other's
    session as a mapping (keys are per tenant), nor release the other's lease."""
    path = str(tmp_path / "t.sock")
    if len(path) > 100:
        pytest.skip("tmp path too long for a Unix socket")
    users = tmp_path / "users.txt"
    users.write_text("alice apw tenant-a\nbob bpw tenant-b\n")
    pion_factory("--unixsocket", path, "--shm-segment-size", "4mb", "--users", str(users))
    a, b = ShmConn(path), ShmConn(path)
    try:
        assert a.call("AUTH", "alice", "apw") == "OK" and b.call("AUTH", "bob", "bpw") == "OK"
        secret = np.full((64, 64), 1234.5, np.float32)
        assert a.call("V.CREATE", "kv", 64, "fp32") == "OK"
        assert a.call("V.STOREBATCH", "kv", 0, secret.tobytes()) == 64
        amaps, _ = attach(a)
        lease, data, _ = shm_fetch(a, amaps, "kv", 0, 64)
        assert data == secret.tobytes()
        # bob: his own (fresh) arena only, and nothing of alice's in it
        bmaps, _ = attach(b)
        assert not set(bmaps) & set(amaps)
        needle = secret.tobytes()[:256]
        assert all(m[:].find(needle) < 0 for m in bmaps.values())
        err = b.call("V.FETCH", "kv", "RANGE", 0, 64, "SHM")
        assert isinstance(err, RuntimeError) and "no such session" in str(err), err
        assert b.call("SHM.RELEASE", lease) == 0  # not his lease: nothing released
        assert a.call("SHM.RELEASE", lease) == 1  # still alice's
        # bob's own session lands in his arena, which alice never gets
        assert b.call("V.CREATE", "kv", 64, "fp32") == "OK"
        assert b.call("V.STOREBATCH", "kv", 0, np.zeros((64, 64), np.float32).tobytes()) == 64
        _, bdata, r = shm_fetch(b, bmaps, "kv", 0, 64)
        assert bdata == bytes(64 * 64 * 4)
        assert all(seg not in amaps for seg, _, _ in r["pieces"])
        assert not set(attach(a)[0]) & set(bmaps)
    finally:
        a.close()
        b.close()
