"""Helpers every benchmark script shares, with no dependency beyond the standard library (the
GPU machine's Python has no psutil or redis of its own)."""
from __future__ import annotations

import platform
import socket
import subprocess
import tempfile
import time
from pathlib import Path


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_pion(binary: str, args: list[str], prefix: str = "pion-bench-"):
    """Starts `binary` (pion-server) on a free loopback port, its data directory and log in a new
    temporary directory, and returns (process, port, directory) once it answers PING (10 s)."""
    port = free_port()
    work = Path(tempfile.mkdtemp(prefix=prefix))
    proc = subprocess.Popen([str(binary), "--port", str(port), "--dir", str(work / "data"),
                             "--metrics-port", "0", *args],
                            stdout=open(work / "server.log", "w"), stderr=subprocess.STDOUT)
    for _ in range(200):
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1) as s:
                s.sendall(b"PING\r\n")
                if s.recv(16).startswith(b"+PONG"):
                    return proc, port, work
        except OSError:
            time.sleep(0.05)
    proc.kill()
    raise RuntimeError("pion-server did not answer on port %d: %s"
                       % (port, (work / "server.log").read_text()[-2000:]))


def cpu_model() -> str:
    """This machine's CPU model name (/proc/cpuinfo), for a results file."""
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def report(lines: list[str], out: str | Path | None) -> None:
    """Prints a results table (markdown lines) and, given a path, writes it there too."""
    text = "\n".join(lines) + "\n"
    print(text)
    if out:
        Path(out).write_text(text)
