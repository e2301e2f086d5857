"""The documentation against the server it documents.

Every command the server has (COMMAND LIST) is in docs/PROTOCOL.md, and every flag of
`pion-server --help` is in docs/OPERATIONS.md.

The READMEs' tours run as a reader runs them, against a real server.

README.md's five-minute tour: the console block's commands run in a shell as written
(redis-cli prints as it would in a terminal unless its output goes into a pipe, as there) and
their output must be what the README shows; then its Python blocks run in order in one
namespace, as one session pasted into one interpreter. clients/python/README.md: the Python
blocks of "Five minutes", "Same-host shared memory", "MLA" and "Binary protocol" likewise (the
transformers section needs torch and a model: tests/test_hf.py covers it on the GPU machine).
Only the addresses change: this server's ports and socket instead of 1974, 1975, 9174 and
/tmp/pion.sock. A README that no longer works from the first try fails here.
"""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from pionlib import SERVER_BIN

README = Path(__file__).resolve().parent.parent / "README.md"
CLIENT_DIR = README.parent / "clients" / "python"
CLIENT_README = CLIENT_DIR / "README.md"
DOCS = README.parent / "docs"


def test_every_command_is_in_protocol_md(shared_pion):
    with shared_pion.raw() as c:
        names = sorted(n.decode().upper() for n in c.call("COMMAND", "LIST"))
    assert len(names) > 40, names
    protocol = (DOCS / "PROTOCOL.md").read_text()
    missing = [n for n in names if not re.search(r"(?<![\w.])%s(?![\w.])" % re.escape(n), protocol)]
    assert not missing, "commands missing from docs/PROTOCOL.md: %s" % missing


def test_every_flag_is_in_operations_md():
    out = subprocess.run([SERVER_BIN, "--help"], capture_output=True, text=True, timeout=10).stdout
    flags = sorted(set(re.findall(r"^\s+(?:-\w,)?(--[a-z0-9-]+)", out, re.M)) - {"--help", "--version"})
    assert len(flags) > 20, out
    operations = (DOCS / "OPERATIONS.md").read_text()
    missing = [f for f in flags if not re.search(r"%s(?![a-z0-9-])" % re.escape(f), operations)]
    assert not missing, "flags missing from docs/OPERATIONS.md: %s" % missing


def section_blocks(path: Path, heading: str, kind: str) -> list[str]:
    """The fenced `kind` blocks of one `## heading` section of a markdown file."""
    text = path.read_text()
    start = text.index("\n## %s" % heading)
    end = text.find("\n## ", start + 1)
    return re.findall(r"```%s\n(.*?)```" % kind, text[start:end if end >= 0 else None], re.S)


def tour_blocks(kind: str) -> list[str]:
    return section_blocks(README, "Five-minute tour", kind)


def run_python(code: str, path: Path, srv, sock: str) -> dict:
    """Runs a README's Python in one namespace, aimed at `srv`; returns the namespace."""
    code = (code.replace("port=1974", "port=%d" % srv.port)
                .replace('"127.0.0.1", 1974)', '"127.0.0.1", %d)' % srv.port)
                .replace("port=1975", "port=%d" % srv.binary_port)
                .replace('"/tmp/pion.sock"', repr(sock))
                .replace('"clients/python"', repr(str(CLIENT_DIR))))
    namespace: dict = {"__name__": "readme_tour"}
    exec(compile(code, str(path), "exec"), namespace)  # noqa: S102 - the README's own code
    return namespace


def console_steps(block: str) -> list[tuple[str, str]]:
    """(command, expected output) pairs of a console block: `$ ` lines and what follows them."""
    steps: list[tuple[str, str]] = []
    for line in block.splitlines():
        if line.startswith("$ "):
            steps.append((line[2:], ""))
        else:
            cmd, out = steps[-1]
            steps[-1] = (cmd, out + line + "\n")
    return steps


def localize(cmd: str, srv) -> str:
    """A tour command aimed at this test's server; redis-cli in terminal format when its output
    is not piped (a reader's terminal), raw when it is (as redis-cli itself decides)."""
    piped = "|" in cmd.split("#")[0]
    cli = "redis-cli -h 127.0.0.1 -p %d" % srv.port + ("" if piped else " --no-raw")
    return (cmd.replace("redis-cli -p 1974", cli)
               .replace("127.0.0.1:9174", "127.0.0.1:%d" % srv.metrics_port))


# The tour builds an HNSW graph over 50,000 keys (~10 s here; several times that under TSan).
@pytest.mark.time_limit(600)
def test_readme_tour_runs_as_written(pion_factory, tmp_path):
    sock = str(tmp_path / "pion.sock")
    srv = pion_factory("--workers", "2", "--unixsocket", sock)

    steps = [s for block in tour_blocks("console") for s in console_steps(block)]
    assert len(steps) >= 8, "the tour's console block was not found"
    for cmd, expected in steps:
        got = subprocess.run(["bash", "-c", localize(cmd, srv)], capture_output=True, text=True,
                             timeout=30)
        assert got.stdout == expected, "README step `%s`:\nexpected %r\ngot %r (stderr %r)" % (
            cmd, expected, got.stdout, got.stderr)

    code = "\n".join(tour_blocks("python"))
    assert "redis.Redis(port=1974)" in code and "/tmp/pion.sock" in code
    namespace = run_python(code, README, srv, sock)
    # What the blocks left behind is what they say.
    assert namespace["c"].last_fetch_path == "shm"
    assert namespace["hit"] is not None


def test_client_readme_runs_as_written(pion_factory, tmp_path):
    sock = str(tmp_path / "pion.sock")
    srv = pion_factory("--workers", "2", "--unixsocket", sock)
    sections = ("Five minutes", "Same-host shared memory", "MLA (DeepSeek V2/V3 latent caches)",
                "Binary protocol (port 1975)")
    blocks = [b for h in sections for b in section_blocks(CLIENT_README, h, "python")]
    assert len(blocks) == 4, "a section's Python block was not found"
    namespace = run_python("import sys\nsys.path.insert(0, %r)\n" % str(CLIENT_DIR)
                           + "\n".join(blocks), CLIENT_README, srv, sock)
    assert namespace["c"].last_fetch_path == "shm"
    assert namespace["res"].receipt["exact"]


def test_deadline_grammar_matches_command_docs(shared_pion):
    """PROTOCOL.md's grammar table of the commands that take DEADLINE is what COMMAND DOCS says,
    command for command (and names exactly those commands)."""
    protocol = (DOCS / "PROTOCOL.md").read_text()
    start = protocol.index("| command | grammar (as `COMMAND DOCS` gives it) |")
    table = protocol[start:protocol.index("\n\n", start)].splitlines()[2:]
    documented = {}
    for row in table:
        m = re.match(r"^\| `([A-Z._]+)` \| `(.*)` \|$", row)
        assert m, row
        documented[m.group(1)] = m.group(2).replace("\\|", "|")
    with shared_pion.raw() as c:
        names = [n.decode() for n in c.call("COMMAND", "LIST")]
        docs = c.call("COMMAND", "DOCS", *names)
    served = {}
    for i in range(0, len(docs), 2):
        d = docs[i + 1]
        fields = {d[j].decode(): d[j + 1] for j in range(0, len(d), 2)}
        syntax = fields.get("syntax", b"").decode()
        if "DEADLINE" in syntax:
            name, _, grammar = syntax.partition(" ")
            served[name.upper()] = grammar
    assert documented == served
    for name in ("V.FETCH", "V.STOREBATCH", "ATTEND.PREFIX.QUERY"):
        assert "[DEADLINE <ms>]" in served[name], name
