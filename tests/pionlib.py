"""Helpers for the pion-server end-to-end tests: server processes, raw RESP sockets,
INFO / metrics parsing. Fixtures live in conftest.py."""
from __future__ import annotations

import atexit
import os
import re
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

import redis

REPO = Path(__file__).resolve().parent.parent
# Relative paths are taken from the directory pytest was started in (servers run elsewhere).
SERVER_BIN = os.path.abspath(os.environ.get("PION_SERVER") or REPO / "build" / "pion-server")
# The fault-injection test build (DEBUG.FAULT): beside pion-server unless named.
FAULT_SERVER_BIN = os.path.abspath(os.environ.get("PION_FAULT_SERVER") or
                                   Path(SERVER_BIN).parent / "pion-server-faults")
HOST = "127.0.0.1"
# Flags added to every test server, e.g. PION_TEST_SERVER_ARGS="--attention-backend cuda" runs
# the suites against the CUDA backend on the GPU machine (make test-gpu).
EXTRA_SERVER_ARGS = os.environ.get("PION_TEST_SERVER_ARGS", "").split()
ATTENTION_BACKEND = "cuda" if "cuda" in EXTRA_SERVER_ARGS else "cpu"
START_TIMEOUT = 10.0
STOP_TIMEOUT = 5.0

# Every process started by this harness, so a crashed test run never leaves one behind.
_LIVE: set[subprocess.Popen] = set()


def _reap_all() -> None:
    for proc in list(_LIVE):
        _stop_process(proc)


atexit.register(_reap_all)


def _stop_process(proc: subprocess.Popen, sig: int = signal.SIGTERM) -> int | None:
    """Stops one process we started: signal, bounded wait, then SIGKILL."""
    try:
        if proc.poll() is None:
            try:
                proc.send_signal(sig)
            except ProcessLookupError:
                pass
            try:
                proc.wait(timeout=STOP_TIMEOUT)
            except subprocess.TimeoutExpired:
                proc.kill()
                try:
                    proc.wait(timeout=STOP_TIMEOUT)
                except subprocess.TimeoutExpired:
                    pass
        return proc.poll()
    finally:
        _LIVE.discard(proc)


def _die_with_parent() -> None:
    """preexec_fn: the server gets SIGKILL if the test process dies without cleaning up."""
    try:
        import ctypes
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        PR_SET_PDEATHSIG = 1
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:
        pass


def free_port() -> int:
    """A currently free loopback TCP port (bind to port 0, read it, close)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


# --------------------------------------------------------------------------------------
# RESP helpers for raw sockets
# --------------------------------------------------------------------------------------

class RespError(Exception):
    """An error reply ('-...') read from a raw socket; str() is the text without '-'."""

    def __eq__(self, other):
        return isinstance(other, RespError) and str(self) == str(other)

    def __hash__(self):
        return hash(str(self))


class Closed(Exception):
    """The server closed the connection."""


def encode(*args) -> bytes:
    """Encodes one command as a RESP multibulk."""
    out = [b"*%d\r\n" % len(args)]
    for a in args:
        if isinstance(a, str):
            a = a.encode()
        elif isinstance(a, int):
            a = str(a).encode()
        out.append(b"$%d\r\n" % len(a))
        out.append(a)
        out.append(b"\r\n")
    return b"".join(out)


def bulk(data: bytes | str) -> bytes:
    """The RESP bulk-string wire form of data."""
    if isinstance(data, str):
        data = data.encode()
    return b"$%d\r\n%s\r\n" % (len(data), data)


class RawConn:
    """A plain TCP connection speaking RESP by hand, with a bounded timeout everywhere."""

    def __init__(self, port: int, timeout: float = 10.0, rcvbuf: int | None = None,
                 host: str = HOST):
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        if rcvbuf is not None:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        self.sock.settimeout(timeout)
        self.sock.connect((host, port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.buf = bytearray()
        self.pos = 0

    # --- low level ---
    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def cmd(self, *args) -> None:
        self.send(encode(*args))

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _fill(self) -> None:
        if self.pos > 0 and self.pos >= len(self.buf) // 2:
            del self.buf[: self.pos]
            self.pos = 0
        chunk = self.sock.recv(4 << 20)
        if not chunk:
            raise Closed("connection closed by server")
        self.buf += chunk

    def read_exact(self, n: int) -> bytes:
        have = len(self.buf) - self.pos
        if n - have > (1 << 20):  # large: receive straight into the result
            out = bytearray(n)
            out[:have] = self.buf[self.pos:]
            self.buf = bytearray()
            self.pos = 0
            view = memoryview(out)
            while have < n:
                got = self.sock.recv_into(view[have:], n - have)
                if got == 0:
                    raise Closed("connection closed by server after %d of %d bytes" % (have, n))
                have += got
            return bytes(out)
        while len(self.buf) - self.pos < n:
            self._fill()
        out = bytes(self.buf[self.pos: self.pos + n])
        self.pos += n
        return out

    def read_line(self) -> bytes:
        while True:
            i = self.buf.find(b"\r\n", self.pos)
            if i >= 0:
                out = bytes(self.buf[self.pos: i])
                self.pos = i + 2
                return out
            self._fill()

    def read_until(self, marker: bytes, limit: int = 1 << 20) -> bytes:
        """Raw bytes up to and including the first occurrence of marker."""
        while True:
            i = self.buf.find(marker, self.pos)
            if i >= 0:
                out = bytes(self.buf[self.pos: i + len(marker)])
                self.pos = i + len(marker)
                return out
            assert len(self.buf) - self.pos <= limit, "marker %r not found" % marker
            self._fill()

    def read_until_closed(self, limit: int = 1 << 20) -> bytes:
        """Everything until EOF (raises socket.timeout if the server keeps it open)."""
        out = bytes(self.buf[self.pos:])
        self.pos = len(self.buf)
        while len(out) <= limit:
            try:
                chunk = self.sock.recv(65536)
            except ConnectionResetError:
                return out
            if not chunk:
                return out
            out += chunk
        raise AssertionError("server kept sending more than %d bytes" % limit)

    def expect_closed(self, timeout: float = 5.0) -> None:
        """Asserts the server closes the connection (EOF or reset) with no further data."""
        old = self.sock.gettimeout()
        self.sock.settimeout(timeout)
        try:
            rest = self.read_until_closed()
        finally:
            self.sock.settimeout(old)
        assert rest == b"", "unexpected bytes before close: %r" % rest[:200]

    # --- RESP reply parsing (RESP2 + RESP3) ---
    def read_reply(self):
        """Reads one reply. Errors are returned as RespError instances (not raised)."""
        line = self.read_line()
        t, rest = line[:1], line[1:]
        if t == b"+":
            return rest.decode()
        if t == b"-":
            return RespError(rest.decode())
        if t == b":":
            return int(rest)
        if t == b"$":
            n = int(rest)
            if n < 0:
                return None
            data = self.read_exact(n + 2)
            assert data[-2:] == b"\r\n", "bulk not terminated by CRLF"
            return data[:-2]
        if t == b"=":
            n = int(rest)
            data = self.read_exact(n + 2)
            assert data[-2:] == b"\r\n"
            return ("verbatim", data[:3].decode(), data[4:-2])
        if t == b"*":
            n = int(rest)
            if n < 0:
                return None
            return [self.read_reply() for _ in range(n)]
        if t == b"~":
            return ("set", [self.read_reply() for _ in range(int(rest))])
        if t == b"%":
            n = int(rest)
            d = {}
            for _ in range(n):
                k = self.read_reply()
                d[k] = self.read_reply()
            return d
        if t == b"_":
            return None
        if t == b"#":
            return rest == b"t"
        if t == b",":
            return float(rest)
        raise AssertionError("unknown RESP type in line %r" % line[:100])

    def call(self, *args):
        self.cmd(*args)
        return self.read_reply()


# --------------------------------------------------------------------------------------
# Server process
# --------------------------------------------------------------------------------------

SANITIZER_MARKERS = ("ERROR: AddressSanitizer", "WARNING: ThreadSanitizer",
                     "ERROR: LeakSanitizer", "runtime error:")


class PionServer:
    def __init__(self, workdir: Path, args: list[str], metrics: bool = True,
                 config_file: Path | None = None, password: str | None = None,
                 binary: str | None = None):
        self.binary = binary or SERVER_BIN
        self.workdir = workdir
        self.extra = list(args)
        self.metrics = metrics
        self.config_file = config_file
        self.password = password
        self.port = 0
        self.metrics_port = 0
        self.binary_port = 0  # the 0xCA5E protocol's port (a free one per start)
        self.proc: subprocess.Popen | None = None
        self.log_path = workdir / "server.log"
        self.data_dir = workdir / "data"

    # --- lifecycle ---
    def command_line(self) -> list[str]:
        cmd = [self.binary]
        if self.config_file is not None:
            cmd += ["--config", str(self.config_file)]
        cmd += ["--bind", HOST, "--port", str(self.port), "--dir", str(self.data_dir),
                "--metrics-port", str(self.metrics_port), "--binary-port", str(self.binary_port)]
        return cmd + EXTRA_SERVER_ARGS + self.extra

    def start(self) -> "PionServer":
        self.data_dir.mkdir(parents=True, exist_ok=True)
        last_error = ""
        for _attempt in range(3):  # a port picked free may be taken before we bind it
            self.port = free_port()
            self.metrics_port = free_port() if self.metrics else 0
            while self.metrics and self.metrics_port == self.port:
                self.metrics_port = free_port()
            self.binary_port = free_port()
            while self.binary_port in (self.port, self.metrics_port):
                self.binary_port = free_port()
            log = open(self.log_path, "ab")
            try:
                self.proc = subprocess.Popen(self.command_line(), stdin=subprocess.DEVNULL,
                                             stdout=log, stderr=subprocess.STDOUT,
                                             cwd=str(self.workdir),
                                             preexec_fn=_die_with_parent)
            finally:
                log.close()
            _LIVE.add(self.proc)
            ok, last_error = self._wait_ready()
            if ok:
                return self
            self.stop()
            if "cannot listen" not in last_error and "Address already in use" not in last_error:
                break
        raise RuntimeError("pion-server did not start: %s\n--- log ---\n%s"
                           % (last_error, self.log_text()[-4000:]))

    def _wait_ready(self) -> tuple[bool, str]:
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                return False, "exited with %s: %s" % (self.proc.returncode, self.log_text()[-2000:])
            try:
                with socket.create_connection((HOST, self.port), timeout=1.0) as s:
                    s.settimeout(1.0)
                    s.sendall(b"PING\r\n")  # PING needs no AUTH
                    data = b""
                    want = b"+PONG\r\n"
                    while len(data) < len(want):
                        chunk = s.recv(1024)
                        if not chunk:
                            break
                        data += chunk
                    if data == want:
                        return True, ""
            except OSError:
                pass
            time.sleep(0.02)
        return False, "no PONG within %.0f s" % START_TIMEOUT

    def stop(self, sig: int = signal.SIGTERM) -> int | None:
        if self.proc is None:
            return None
        rc = _stop_process(self.proc, sig)
        # Under `make asan` / `make tsan` a sanitizer report fails the test that ran the server
        # (ThreadSanitizer only prints; the process keeps running).
        report = [line for line in self.log_text().splitlines()
                  if any(m in line for m in SANITIZER_MARKERS)]
        if report:
            raise AssertionError("sanitizer report in %s:\n%s" % (self.log_path,
                                                                  "\n".join(report[:20])))
        return rc

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def pid(self) -> int:
        return self.proc.pid

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    # --- clients ---
    def client(self, **kw) -> redis.Redis:
        kw.setdefault("socket_timeout", 20)
        kw.setdefault("socket_connect_timeout", 5)
        if self.password and "password" not in kw:
            kw["password"] = self.password
        return redis.Redis(host=HOST, port=self.port, **kw)

    def raw(self, timeout: float = 10.0, rcvbuf: int | None = None, auth: bool = True) -> RawConn:
        c = RawConn(self.port, timeout=timeout, rcvbuf=rcvbuf)
        if auth and self.password:
            assert c.call("AUTH", self.password) == "OK"
        return c

    def redis_cli(self, *args: str, resp3: bool = False, input: str | None = None,
                  timeout: float = 15.0, extra: list[str] | None = None) -> subprocess.CompletedProcess:
        cmd = ["redis-cli", "-h", HOST, "-p", str(self.port)]
        if self.password:
            cmd += ["-a", self.password, "--no-auth-warning"]
        if resp3:
            cmd.append("-3")
        cmd += extra or []
        cmd += list(args)
        return subprocess.run(cmd, input=input, capture_output=True, text=True, timeout=timeout)

    def info(self, section: str = "default") -> dict[str, str]:
        with self.raw() as c:
            reply = c.call("INFO", section)
        assert isinstance(reply, bytes), reply
        return parse_info(reply)

    def metrics_text(self) -> str:
        assert self.metrics_port, "server started without a metrics port"
        with urllib.request.urlopen("http://%s:%d/metrics" % (HOST, self.metrics_port),
                                    timeout=10) as r:
            return r.read().decode()

    def metric(self, name_labels: str) -> float:
        return parse_metrics(self.metrics_text())[name_labels]

    def rss(self) -> int:
        import psutil
        return psutil.Process(self.pid).memory_info().rss


def parse_info(text: bytes | str) -> dict[str, str]:
    if isinstance(text, bytes):
        text = text.decode()
    out = {}
    for line in text.split("\r\n"):
        if not line or line.startswith("#"):
            continue
        k, _, v = line.partition(":")
        out[k] = v
    return out


_METRIC_RE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*(?:\{[^}]*\})?) (\S+)$")


def parse_metrics(text: str) -> dict[str, float]:
    out = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _METRIC_RE.match(line)
        assert m, "malformed metrics line: %r" % line
        out[m.group(1)] = float(m.group(2))
    return out


def wait_for(pred, timeout: float = 10.0, interval: float = 0.05, what: str = "condition"):
    """Polls pred() until it returns a truthy value (returned) or the timeout passes."""
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = pred()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError("timed out after %.1f s waiting for %s (last: %r)" % (timeout, what, last))


class ServerFactory:
    """Starts servers under one base directory and stops them all on stop_all()."""

    def __init__(self, base: Path):
        self.base = base
        self.servers: list[PionServer] = []

    def __call__(self, *args: str, metrics: bool = True, config_file: Path | None = None,
                 password: str | None = None, start: bool = True,
                 binary: str | None = None) -> PionServer:
        d = self.base / ("srv%d" % len(self.servers))
        d.mkdir(parents=True, exist_ok=True)
        srv = PionServer(d, list(args), metrics=metrics, config_file=config_file,
                         password=password, binary=binary)
        self.servers.append(srv)
        return srv.start() if start else srv

    def stop_all(self) -> None:
        for s in self.servers:
            s.stop()
