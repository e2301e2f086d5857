"""End-to-end test harness for pion-server.

Every test talks to a real pion-server process started on a free loopback port. The
`pion_factory` fixture starts servers with per-test flags and always stops them (SIGTERM,
then SIGKILL, with bounded waits) at teardown; `pion` is a function-scoped default server
and `shared_pion` a module-scoped one for tests that do not change server state.

Run with Debian's interpreter (it has python3-redis, pytest, numpy, psutil):

    PION_SERVER=/work/main/build/pion-server /usr/bin/python3 -m pytest -q tests
"""
from __future__ import annotations

import os
import signal
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from pionlib import PionServer, ServerFactory  # noqa: E402

PER_TEST_TIMEOUT = int(os.environ.get("PION_TEST_TIMEOUT", "90"))


@pytest.fixture
def pion_factory(tmp_path):
    """Starts pion-server processes: pion_factory("--workers", "2", ...)."""
    f = ServerFactory(tmp_path)
    try:
        yield f
    finally:
        f.stop_all()


@pytest.fixture
def pion(pion_factory) -> PionServer:
    """A default server (2 shards) for one test."""
    return pion_factory("--workers", "2")


@pytest.fixture(scope="module")
def shared_pion(tmp_path_factory) -> PionServer:
    """A default server (2 shards) shared by one test module."""
    f = ServerFactory(tmp_path_factory.mktemp("shared"))
    try:
        yield f("--workers", "2")
    finally:
        f.stop_all()


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "time_limit(seconds): a longer limit than PION_TEST_TIMEOUT for one test "
        "whose work is fixed (e.g. the README's own examples), so sanitizer builds finish it")


@pytest.fixture(autouse=True)
def _per_test_time_limit(request):
    """Fails (rather than hangs) a test that runs past PER_TEST_TIMEOUT seconds (or its
    time_limit marker's, when larger)."""
    marker = request.node.get_closest_marker("time_limit")
    limit = max(PER_TEST_TIMEOUT, int(marker.args[0])) if marker else PER_TEST_TIMEOUT

    def on_alarm(signum, frame):
        raise TimeoutError("test exceeded %d s" % limit)

    old = signal.signal(signal.SIGALRM, on_alarm)
    signal.alarm(limit)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
