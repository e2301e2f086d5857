"""The Unix-domain listener (--unixsocket, --unixsocketperm): same-host clients beside TCP."""
import os
import stat
import subprocess

import numpy as np
import pytest
import redis

from pionlib import SERVER_BIN, free_port


def sock_path(tmp_path):
    # sun_path is limited to 107 bytes; pytest's tmp paths can be long.
    p = tmp_path / "p.sock"
    if len(str(p)) > 100:
        pytest.skip("tmp path too long for a Unix socket")
    return str(p)


def test_unix_socket_serves_every_command_and_is_private(pion_factory, tmp_path):
    path = sock_path(tmp_path)
    srv = pion_factory("--unixsocket", path)
    st = os.stat(path)
    assert stat.S_ISSOCK(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o700
    r = redis.Redis(unix_socket_path=path)
    assert r.ping()
    k = np.arange(2 * 64 * 32, dtype=np.float32).reshape(2, 64, 32) / 1000
    assert r.execute_command("ATTEND.PREFIX.STORE", "u", 0, 2, 64, 32, k.tobytes(), k.tobytes())
    out = np.frombuffer(r.execute_command("ATTEND.PREFIX.QUERY", "u", 0, 2, 32, 0,
                                          np.zeros((2, 32), np.float32).tobytes()), np.float32)
    assert np.allclose(out.reshape(2, 32), k.mean(axis=1), atol=1e-6)  # q = 0: uniform weights
    # TCP clients see the same data.
    assert srv.client().execute_command("ATTEND.PREFIX.LOOKUP", "u", 0) == b"HIT"
    clients = r.client_list()
    assert any(c["addr"] == path + ":0" and c["flags"] == "U" for c in clients), clients
    info = r.info("server")
    assert info["unixsocket"] == path
    assert srv.client().config_get("unixsocket*") == {"unixsocket": path, "unixsocketperm": "700"}
    srv.stop()
    assert not os.path.exists(path)  # removed at shutdown


def test_unixsocketperm_and_stale_socket(pion_factory, tmp_path):
    path = sock_path(tmp_path)
    first = pion_factory("--unixsocket", path, "--unixsocketperm", "660")
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o660
    first.proc.kill()  # kill -9 leaves the socket file behind
    first.proc.wait()
    assert os.path.exists(path)
    second = pion_factory("--unixsocket", path)  # a stale socket is replaced
    assert redis.Redis(unix_socket_path=path).ping()
    second.stop()


def test_refuses_a_path_that_is_not_a_socket(tmp_path):
    path = sock_path(tmp_path)
    with open(path, "w") as f:
        f.write("precious")
    p = subprocess.run([SERVER_BIN, "--port", str(free_port()), "--metrics-port", "0", "--binary-port", "0",
                        "--dir", str(tmp_path / "d"), "--unixsocket", path],
                       capture_output=True, text=True, timeout=20)
    assert p.returncode != 0
    assert "cannot listen on unix socket " + path + ": a file that is not a socket is there" in (
        p.stdout + p.stderr)
    assert open(path).read() == "precious"  # never deleted


def test_bad_unixsocketperm_is_a_flag_error(tmp_path):
    p = subprocess.run([SERVER_BIN, "--unixsocket", str(tmp_path / "x.sock"),
                        "--unixsocketperm", "9x"], capture_output=True, text=True, timeout=20)
    assert p.returncode != 0
    assert "expected octal permissions like 700, got 9x" in p.stdout + p.stderr
