"""Core server commands and process behaviour: COMMAND, CLIENT, CONFIG, SLOWLOG, INFO,
the Prometheus endpoint, SHUTDOWN / signals, TOML config files, command-line flags, QUIT."""
from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request

import numpy as np
import pytest

from pionlib import (HOST, SERVER_BIN, RespError, ServerFactory, encode, free_port,
                     parse_info, parse_metrics, wait_for)

ALL_COMMANDS = {"ping", "echo", "hello", "auth", "quit", "shutdown", "command", "client",
                "config", "info", "slowlog", "state.alloc", "state.write", "state.read",
                "state.free", "state.info", "state.save",
                "v.create", "v.storebatch", "v.fetch", "v.info", "v.drop", "v.snapshot",
                "v.restore", "v.commit",
                "ssm.prefix.store", "ssm.prefix.fetch", "ssm.prefix.drop", "ssm.prefix.save",
                "ssm.prefix.info",
                "kv.prefix.register", "kv.prefix.lookup", "kv.prefix.info", "kv.prefix.blocks",
                "kv.prefix.membership", "kv.prefix.owner", "kv.prefix.drop",
                "kv.prefix.save", "kv.prefix.warm",
                "attend.prefix.store", "attend.prefix.lookup", "attend.prefix.drop",
                "attend.prefix.info", "attend.prefix.query", "attend.prefix.query_fused",
                "attend.prefix.query_sparse", "attend.prefix.query_sparse_auto",
                "attend.prefix.query_sparse_auto_fused", "attend.prefix.query_mla",
                "attend.prefix.query_mla_sparse", "attend.prefix.query_mla_fused", "attend.prefix.export",
                "attend.prefix.save", "attend.create",
                "attend.store", "attend.finalize", "attend.query", "attend.info", "attend.drop",
                "kv.store", "kv.fetch", "kv.info", "kv.evict",
                "shm.attach", "shm.reserve", "shm.release",
                "shm.info",
                "cluster", "asking", "readonly", "readwrite", "cluster.put", "cluster.del",
                "cluster.refresh"}

CONFIG_PARAMS = ["bind", "port", "binary-port", "unixsocket", "unixsocketperm", "workers", "dir", "metrics-port", "kvcache", "fetch-copies", "users",
                 "attention-backend", "gpu-memory", "attention-fp16", "attention-memory",
                 "kv-cache-capacity", "compute-threads",
                 "compute-queue-depth",
                 "maxmemory", "requirepass", "proto-max-bulk-len", "max-multibulk-len",
                 "client-query-buffer-limit", "client-output-buffer-limit",
                 "client-output-buffer-timeout-ms", "maxclients", "shard-queue-depth", "poll-us",
                 "slowlog-log-slower-than", "slowlog-max-len", "loglevel"]

ALL_FLAGS = ["--help", "--version", "--config", "--bind", "--port", "--binary-port", "--unixsocket",
             "--unixsocketperm", "--shm-segment-size", "--shm-lease-ttl-ms", "--shm-max-leases",
             "--workers", "--dir",
             "--maxmemory", "--metrics-port", "--requirepass", "--users", "--proto-max-bulk-len",
             "--max-multibulk-len", "--client-query-buffer-limit", "--client-output-buffer-limit",
             "--client-output-buffer-timeout-ms", "--maxclients", "--poll-us",
             "--shard-queue-depth",
             "--attention-backend", "--gpu-memory", "--attention-fp16", "--attention-memory",
             "--kv-cache-capacity",
             "--compute-threads", "--compute-queue-depth",
             "--kvcache", "--loglevel", "--logfile", "--slowlog-log-slower-than",
             "--slowlog-max-len", "--cluster", "--cluster-name", "--node-id", "--announce",
             "--replicas", "--cluster-lease-ttl"]


def pairs(flat):
    """A flat RESP2 [k1, v1, k2, v2, ...] reply as a dict of str."""
    assert len(flat) % 2 == 0
    return {flat[i].decode(): flat[i + 1].decode() for i in range(0, len(flat), 2)}


# ------------------------------------------------------------------------------------------
# COMMAND
# ------------------------------------------------------------------------------------------

def test_command_count_list_info(shared_pion):
    with shared_pion.raw() as c:
        assert c.call("COMMAND", "COUNT") == len(ALL_COMMANDS)
        assert {n.decode() for n in c.call("COMMAND", "LIST")} == ALL_COMMANDS
        table = c.call("COMMAND")
        assert len(table) == len(ALL_COMMANDS)
        assert all(len(e) == 10 for e in table)
        assert c.call("COMMAND", "INFO") == table
        info = {e[0].decode(): e for e in table}
        # Flags are simple strings.
        assert info["ping"][1:3] == [-1, ["no_auth", "fast"]]
        assert info["echo"][1:3] == [2, ["fast"]]
        assert info["state.read"][1:6] == [-4, ["readonly"], 1, 1, 1]  # then DEADLINE <ms>
        assert info["state.alloc"][1:6] == [-3, ["write", "denyoom"], 1, 1, 1]
        assert info["state.info"][1:6] == [1, ["readonly"], 0, 0, 0]
        assert info["config"][1:3] == [-2, ["admin"]]
        assert info["shutdown"][2] == ["admin"]
        assert info["auth"][2] == ["no_auth", "fast"]
        assert info["ping"][6:] == [[], [], [], []]
        got = c.call("COMMAND", "INFO", "PING", "nope", "State.Read")
        assert got[0] == info["ping"] and got[1] is None and got[2] == info["state.read"]
        helptext = c.call("COMMAND", "HELP")
        assert helptext[0] == "COMMAND <subcommand> [<arg> ...]. Subcommands are:"
        assert "DOCS [<command-name> ...]" in helptext


def test_command_docs(shared_pion):
    with shared_pion.raw() as c:
        docs = c.call("COMMAND", "DOCS", "ping", "state.write", "nope")
        assert docs == [b"ping", [b"summary", b"Replies PONG, or the message given.",
                                  b"since", b"0.1.0", b"group", b"connection",
                                  b"syntax", b"ping [message]"],
                        b"state.write", [b"summary",
                                         b"Overwrites bytes of a slot in place; never grows it.",
                                         b"since", b"0.1.0", b"group", b"state",
                                         b"syntax",
                                         b"state.write <id> <offset> <data> [DEADLINE <ms>]"]]
        alldocs = c.call("COMMAND", "DOCS")
        assert {alldocs[i].decode() for i in range(0, len(alldocs), 2)} == ALL_COMMANDS
        assert c.call("COMMAND", "DOCS", "nope") == []
        c.call("HELLO", "3")
        docs = c.call("COMMAND", "DOCS", "quit")
        assert docs == {b"quit": {b"summary": b"Closes the connection after replying OK.",
                                  b"since": b"0.1.0", b"group": b"connection",
                                  b"syntax": b"quit"}}


# ------------------------------------------------------------------------------------------
# CLIENT
# ------------------------------------------------------------------------------------------

CLIENT_LINE = re.compile(
    r"^id=(\d+) addr=127\.0\.0\.1:(\d+) laddr=127\.0\.0\.1:(\d+) fd=\d+ name=(\S*) age=\d+ "
    r"idle=\d+ flags=N db=0 qbuf=\d+ omem=\d+ cmd=(\S+) user=(\S+) tenant=(\S+) resp=([23]) "
    r"shard=(\d+)$")


def client_list(c) -> dict[int, re.Match]:
    out = {}
    text = c.call("CLIENT", "LIST")
    if isinstance(text, tuple):
        text = text[2]
    for line in text.decode().splitlines():
        m = CLIENT_LINE.match(line)
        assert m, "bad CLIENT LIST line: %r" % line
        out[int(m.group(1))] = m
    return out


def test_client_id_name_info_list(pion):
    with pion.raw() as a, pion.raw() as b:
        ida, idb = a.call("CLIENT", "ID"), b.call("CLIENT", "ID")
        assert isinstance(ida, int) and isinstance(idb, int) and ida != idb
        assert a.call("CLIENT", "GETNAME") is None
        assert a.call("CLIENT", "SETNAME", "alpha") == "OK"
        assert a.call("CLIENT", "GETNAME") == b"alpha"
        assert a.call("CLIENT", "SETNAME", "") == "OK"  # an empty name clears it
        assert a.call("CLIENT", "GETNAME") is None
        assert a.call("CLIENT", "SETNAME", "alpha") == "OK"
        b.call("HELLO", "3", "SETNAME", "beta")
        b.call("ECHO", "x")
        lst = client_list(a)
        assert {ida, idb} <= set(lst)
        assert lst[ida].group(4) == "alpha" and lst[idb].group(4) == "beta"
        assert lst[ida].group(5) == "client" and lst[idb].group(5) == "echo"
        assert lst[ida].group(8) == "2" and lst[idb].group(8) == "3"
        assert lst[ida].group(6) == "default" and lst[ida].group(7) == "default"
        assert int(lst[ida].group(2)) == a.sock.getsockname()[1]
        assert int(lst[ida].group(3)) == pion.port
        assert {int(m.group(9)) for m in lst.values()} <= {0, 1}
        info = a.call("CLIENT", "INFO").decode()
        assert CLIENT_LINE.match(info.rstrip("\n")) and info.startswith("id=%d " % ida)
        # RESP3: verbatim string.
        v = b.call("CLIENT", "INFO")
        assert v[0] == "verbatim" and v[1] == "txt" and v[2].startswith(b"id=%d " % idb)
        only = client_list_ids(a, "CLIENT", "LIST", "ID", idb, 999999)
        assert only == [idb]
        helptext = a.call("CLIENT", "HELP")
        assert helptext[0] == "CLIENT <subcommand> [<arg> ...]. Subcommands are:"


@pytest.mark.parametrize("bad", ["a b", "x\nid=999 addr=6.6.6.6:1 fake=1", "tab\there", "\x7f"],
                         ids=["space", "newline", "tab", "del"])
def test_hello_setname_validates_like_client_setname(pion, bad):
    """HELLO ... SETNAME must refuse the names CLIENT SETNAME refuses. Today it accepts them,
    so a client can inject forged lines into CLIENT LIST (and odd names into SLOWLOG)."""
    with pion.raw() as c, pion.raw() as admin:
        assert c.call("CLIENT", "SETNAME", bad) == RespError(
            "ERR Client names cannot contain spaces, newlines or special characters.")
        assert c.call("CLIENT", "SETNAME", "good") == "OK"
        reply = c.call("HELLO", "3", "SETNAME", bad)
        assert reply == RespError(
            "ERR Client names cannot contain spaces, newlines or special characters.")
        assert c.call("CLIENT", "GETNAME") == b"good"
        for line in admin.call("CLIENT", "LIST").decode().splitlines():
            assert CLIENT_LINE.match(line), "forged/broken CLIENT LIST line: %r" % line


def test_client_list_connected_clients_count(pion):
    with pion.raw() as c:
        wait_for(lambda: parse_info(c.call("INFO", "clients"))["connected_clients"] == "1",
                 timeout=5, what="only one client")
        extra = [pion.raw() for _ in range(5)]
        for e in extra:
            e.call("PING")
        assert parse_info(c.call("INFO", "clients"))["connected_clients"] == "6"
        assert len(client_list(c)) == 6
        assert pion.metric("pion_connected_clients") == 6
        for e in extra:
            e.close()
        wait_for(lambda: parse_info(c.call("INFO", "clients"))["connected_clients"] == "1",
                 timeout=5, what="closed clients to be gone")
        assert len(client_list(c)) == 1


def client_list_ids(c, *cmd):
    return [int(l.split()[0][3:]) for l in c.call(*cmd).decode().splitlines()]


def test_client_kill_forms(pion):
    admin = pion.raw()
    victims = [pion.raw() for _ in range(5)]
    ids = [v.call("CLIENT", "ID") for v in victims]
    addrs = ["127.0.0.1:%d" % v.sock.getsockname()[1] for v in victims]
    try:
        assert admin.call("CLIENT", "KILL", "ID", ids[0]) == 1
        victims[0].expect_closed()
        assert admin.call("CLIENT", "KILL", "ADDR", addrs[1]) == 1
        victims[1].expect_closed()
        assert admin.call("CLIENT", "KILL", addrs[2]) == "OK"  # old form
        victims[2].expect_closed()
        assert admin.call("CLIENT", "KILL", "ID", ids[3], "ADDR", addrs[4]) == 0  # filters AND
        assert admin.call("CLIENT", "KILL", "ID", ids[0]) == 0  # already gone
        assert admin.call("CLIENT", "KILL", addrs[0]) == RespError("ERR No such client")
        laddr = "127.0.0.1:%d" % pion.port
        # Kill every other connection by LADDR; SKIPME yes (default) spares the caller.
        assert admin.call("CLIENT", "KILL", "LADDR", laddr) == 2
        victims[3].expect_closed()
        victims[4].expect_closed()
        assert admin.call("PING") == "PONG"
        assert client_list_ids(admin, "CLIENT", "LIST") == [admin.call("CLIENT", "ID")]
        # Killing yourself: the reply arrives, then the connection closes.
        me = admin.call("CLIENT", "ID")
        assert admin.call("CLIENT", "KILL", "ID", me) == 0
        assert admin.call("CLIENT", "KILL", "ID", me, "SKIPME", "no") == 1
        admin.expect_closed()
        with pion.raw() as c:
            addr = "127.0.0.1:%d" % c.sock.getsockname()[1]
            assert c.call("CLIENT", "KILL", addr) == "OK"
            c.expect_closed()
        with pion.raw() as c, pion.raw() as d:
            assert c.call("CLIENT", "KILL", "USER", "default") == 1
            d.expect_closed()
            assert c.call("CLIENT", "KILL", "USER", "nobody") == 0
    finally:
        admin.close()
        for v in victims:
            v.close()
    assert pion.alive()


# ------------------------------------------------------------------------------------------
# CONFIG
# ------------------------------------------------------------------------------------------

def test_config_get_reflects_flags_and_globs(pion_factory):
    srv = pion_factory("--workers", "2", "--maxmemory", "64mb", "--slowlog-max-len", "50",
                       "--maxclients", "77", "--loglevel", "debug", "--proto-max-bulk-len", "1gb",
                       "--client-output-buffer-timeout-ms", "1234", "--shard-queue-depth", "99")
    with srv.raw() as c:
        allp = pairs(c.call("CONFIG", "GET", "*"))
        assert list(allp) == CONFIG_PARAMS
        assert allp["bind"] == "127.0.0.1"
        assert allp["port"] == str(srv.port)
        assert allp["metrics-port"] == str(srv.metrics_port)
        assert allp["binary-port"] == str(srv.binary_port)
        assert allp["workers"] == "2"
        assert allp["dir"] == str(srv.data_dir)
        assert allp["kvcache"] == "on"
        assert allp["users"] == "" and allp["requirepass"] == ""
        assert allp["maxmemory"] == str(64 << 20)
        assert allp["proto-max-bulk-len"] == str(1 << 30)
        assert allp["max-multibulk-len"] == "1048576"
        assert allp["client-query-buffer-limit"] == str(4 << 30)
        assert allp["client-output-buffer-limit"] == str(1 << 30)
        assert allp["client-output-buffer-timeout-ms"] == "1234"
        assert allp["maxclients"] == "77"
        assert allp["shard-queue-depth"] == "99"
        assert allp["slowlog-log-slower-than"] == "10000"
        assert allp["slowlog-max-len"] == "50"
        assert allp["loglevel"] == "debug"

        def names(*patterns):
            return list(pairs(c.call("CONFIG", "GET", *patterns)))

        assert names("max*") == ["maxmemory", "max-multibulk-len", "maxclients"]
        assert names("*port") == ["port", "binary-port", "metrics-port"]
        assert names("?ort") == ["port"]
        assert names("[bp]*") == ["bind", "port", "binary-port", "proto-max-bulk-len", "poll-us"]
        assert names("[^a-m]*") == ["port", "unixsocket", "unixsocketperm", "workers", "users",
                                    "requirepass",
                                    "proto-max-bulk-len", "shard-queue-depth", "poll-us",
                                    "slowlog-log-slower-than", "slowlog-max-len"]
        assert names("CLIENT-*") == ["client-query-buffer-limit", "client-output-buffer-limit",
                                     "client-output-buffer-timeout-ms"]
        assert names("port", "*ort", "port") == ["port", "binary-port", "metrics-port"]
        assert names("slowlog-log-slower-tha?") == ["slowlog-log-slower-than"]
        assert names("nothing*") == []
        assert names("\\*") == []
        helptext = c.call("CONFIG", "HELP")
        assert helptext[0] == "CONFIG <subcommand> [<arg> ...]. Subcommands are:"


@pytest.mark.parametrize("pattern", ["[", "[^", "\\", "*[", "a[b-", "[]", "[a-]", "[z-a]*",
                                     "*?" * 40 + "x", "?" * 200, "\x00*"])
def test_config_get_odd_globs(shared_pion, pattern):
    with shared_pion.raw() as c:
        reply = c.call("CONFIG", "GET", pattern)
        assert isinstance(reply, list) and len(reply) % 2 == 0
        assert c.call("PING") == "PONG"
    assert shared_pion.alive()


def test_config_set_runtime_values(pion):
    with pion.raw() as c:
        for name, value, readback in [
            ("maxmemory", "1gb", str(1 << 30)), ("maxmemory", "0", "0"),
            ("proto-max-bulk-len", "512mb", str(512 << 20)),
            ("max-multibulk-len", "5000", "5000"),
            ("client-query-buffer-limit", "100mb", str(100 << 20)),
            ("client-output-buffer-limit", "64MB", str(64 << 20)),
            ("client-output-buffer-timeout-ms", "777", "777"),
            ("maxclients", "1234", "1234"), ("shard-queue-depth", "50", "50"),
            ("poll-us", "250", "250"),
            ("slowlog-log-slower-than", "-1", "-1"), ("slowlog-max-len", "9", "9"),
            ("loglevel", "DEBUG", "debug"), ("loglevel", "info", "info"),
            ("MaxClients", "4321", "4321"),
        ]:
            assert c.call("CONFIG", "SET", name, value) == "OK", name
            assert c.call("CONFIG", "GET", name.lower()) == [name.lower().encode(),
                                                            readback.encode()], name
        # Several pairs at once.
        assert c.call("CONFIG", "SET", "maxclients", "111", "slowlog-max-len", "22") == "OK"
        assert pairs(c.call("CONFIG", "GET", "maxclients", "slowlog-max-len")) == \
            {"maxclients": "111", "slowlog-max-len": "22"}
        # An unknown or immutable name anywhere refuses the whole command.
        assert c.call("CONFIG", "SET", "maxclients", "5", "port", "1") == RespError(
            "ERR CONFIG SET failed (possibly related to argument 'port') - can't set immutable "
            "config")
        assert c.call("CONFIG", "GET", "maxclients") == [b"maxclients", b"111"]
        assert c.call("CONFIG", "RESETSTAT") == "OK"
    info = pion.info("all")
    assert info["maxclients"] == "111"
    assert info["shard_queue_depth"] == "50"
    assert info["client_output_buffer_limit"] == str(64 << 20)
    assert "CONFIG SET maxclients: 4321 -> 111" in pion.log_text()


def test_config_set_with_a_bad_value_changes_nothing(pion):
    """CONFIG SET a b c d is all-or-nothing (config_family.cc: 'Validate every pair first, so a
    failing pair leaves all settings unchanged'). A bad *value* in a later pair is only found
    while applying, after the earlier pairs were already applied."""
    with pion.raw() as c:
        before = c.call("CONFIG", "GET", "maxclients")
        assert before == [b"maxclients", b"10000"]
        reply = c.call("CONFIG", "SET", "maxclients", "50", "slowlog-max-len", "abc")
        assert reply == RespError("ERR CONFIG SET failed (possibly related to argument "
                                  "'slowlog-max-len') - argument couldn't be parsed into an "
                                  "integer")
        assert c.call("CONFIG", "GET", "maxclients") == before


@pytest.mark.parametrize("level", ["trace", "debug", "info", "warn", "error"])
def test_config_loglevel_round_trips(pion_factory, level):
    """CONFIG GET loglevel must answer a value that --loglevel / CONFIG SET loglevel accept.
    For 'warn' it answers spdlog's name 'warning', which CONFIG SET then refuses."""
    srv = pion_factory("--workers", "1", "--loglevel", level)
    with srv.raw() as c:
        got = c.call("CONFIG", "GET", "loglevel")
        assert got == [b"loglevel", level.encode()]
        assert c.call("CONFIG", "SET", "loglevel", got[1]) == "OK"


# ------------------------------------------------------------------------------------------
# SLOWLOG
# ------------------------------------------------------------------------------------------

def test_slowlog(pion):
    with pion.raw() as c:
        assert c.call("SLOWLOG", "LEN") == 0
        assert c.call("SLOWLOG", "GET") == []
        assert c.call("CLIENT", "SETNAME", "slowpoke") == "OK"
        assert c.call("CONFIG", "SET", "slowlog-log-slower-than", "0") == "OK"
        t0 = int(time.time())
        assert c.call("ECHO", "hello") == b"hello"
        assert c.call("PING") == "PONG"
        assert c.call("ECHO", b"x" * 200) == b"x" * 200
        assert c.call("CONFIG", "GET", *["p%d" % i for i in range(40)]) == []
        entries = c.call("SLOWLOG", "GET", "4")
        assert len(entries) == 4
        cfg, longecho, ping, echo = entries
        ids = [e[0] for e in entries]
        assert ids == sorted(ids, reverse=True) and len(set(ids)) == 4
        me = "127.0.0.1:%d" % c.sock.getsockname()[1]
        for e in entries:
            assert len(e) == 6
            assert abs(e[1] - t0) <= 5
            assert isinstance(e[2], int) and e[2] >= 0
            assert e[4] == me.encode() and e[5] == b"slowpoke"
        assert echo[3] == [b"ECHO", b"hello"]
        assert ping[3] == [b"PING"]
        assert longecho[3] == [b"ECHO", b"x" * 128 + b"... (72 more bytes)"]
        assert len(cfg[3]) == 32
        assert cfg[3][:3] == [b"CONFIG", b"GET", b"p0"]
        assert cfg[3][-1] == b"... (11 more arguments)"
        n = c.call("SLOWLOG", "LEN")
        assert n >= 6  # includes CONFIG SET ... 0 onwards
        # GET -1 returns everything logged before it (the GET itself is logged after).
        assert len(c.call("SLOWLOG", "GET", "-1")) + 1 == c.call("SLOWLOG", "LEN")
        assert c.call("SLOWLOG", "GET", "0") == []
        # max-len trims.
        assert c.call("CONFIG", "SET", "slowlog-max-len", "3") == "OK"
        for _ in range(5):
            c.call("PING")
        assert c.call("SLOWLOG", "LEN") == 3
        # Disable, then RESET empties it.
        assert c.call("CONFIG", "SET", "slowlog-log-slower-than", "-1") == "OK"
        assert c.call("SLOWLOG", "RESET") == "OK"
        assert c.call("SLOWLOG", "LEN") == 0
        c.call("ECHO", "not logged")
        assert c.call("SLOWLOG", "LEN") == 0
        helptext = c.call("SLOWLOG", "HELP")
        assert helptext[0] == "SLOWLOG <subcommand> [<arg> ...]. Subcommands are:"
        # CONFIG RESETSTAT also clears it.
        assert c.call("CONFIG", "SET", "slowlog-log-slower-than", "0") == "OK"
        c.call("PING")
        assert c.call("SLOWLOG", "LEN") >= 1
        assert c.call("CONFIG", "RESETSTAT") == "OK"
        assert c.call("SLOWLOG", "LEN") <= 1  # at most the RESETSTAT itself
    assert int(pion.info("stats")["slowlog_len"]) <= 2


def test_slowlog_does_not_record_passwords(pion_factory, tmp_path):
    """Like Redis, SLOWLOG must not reveal credentials: AUTH / HELLO AUTH arguments and
    CONFIG SET requirepass values. Today they are stored and returned verbatim, so the
    administrator (tenant 'default') can read every tenant user's password."""
    users = tmp_path / "users.txt"
    users.write_text("root rootpw default\nalice alice-secret-pw tenant-a\n")
    srv = pion_factory("--workers", "1", "--users", str(users),
                       "--slowlog-log-slower-than", "0")
    with srv.raw(auth=False) as a:
        assert a.call("AUTH", "alice", "alice-secret-pw") == "OK"
        assert isinstance(a.call("HELLO", "2", "AUTH", "alice", "alice-secret-pw"), list)
    with srv.raw(auth=False) as root:
        assert root.call("AUTH", "root", "rootpw") == "OK"
        assert root.call("CONFIG", "SET", "requirepass", "new-default-pw") == "OK"
        log = root.call("SLOWLOG", "GET", "-1")
    text = repr(log)
    assert len(log) >= 4
    for secret in ("alice-secret-pw", "rootpw", "new-default-pw"):
        assert secret not in text, "SLOWLOG reveals %r: %s" % (secret, text[:600])


# ------------------------------------------------------------------------------------------
# INFO
# ------------------------------------------------------------------------------------------

SECTIONS = ["Server", "Clients", "Memory", "Persistence", "Stats", "Commandstats", "Keyspace",
            "Attention", "Residency", "Cluster"]


def sections_of(text: bytes) -> list[str]:
    return re.findall(r"^# (\w+)\r$", text.decode(), flags=re.M)


def test_info_sections(pion):
    with pion.raw() as c, pion.raw() as other:
        other.call("PING")
        assert c.call("STATE.ALLOC", "info:slot", 10) == "OK"
        default = c.call("INFO")
        assert sections_of(default) == [s for s in SECTIONS if s != "Commandstats"]
        assert sections_of(c.call("INFO", "default")) == sections_of(default)
        assert sections_of(c.call("INFO", "all")) == SECTIONS
        assert sections_of(c.call("INFO", "everything")) == SECTIONS
        assert sections_of(c.call("INFO", "keyspace", "SERVER")) == ["Server", "Keyspace"]
        assert sections_of(c.call("INFO", "commandstats")) == ["Commandstats"]
        assert c.call("INFO", "nosuchsection") == b""
        # Sections are separated by one blank line.
        assert b"\r\n\r\n# Clients\r\n" in default

        srv = parse_info(c.call("INFO", "server"))
        assert srv["pion_version"] == "0.1.0" and srv["redis_version"] == "7.0.0"
        assert int(srv["process_id"]) == pion.pid
        assert srv["tcp_port"] == str(pion.port)
        assert srv["bind"] == "127.0.0.1"
        assert srv["workers"] == "2"
        assert srv["kvcache"] == "on"
        assert srv["metrics_port"] == str(pion.metrics_port)
        assert srv["multiplexing_api"] == "epoll"
        assert srv["config_file"] == ""
        assert os.path.realpath(srv["executable"]) == os.path.realpath(SERVER_BIN)
        assert int(srv["uptime_in_seconds"]) >= 0 and srv["uptime_in_days"] == "0"
        assert srv["os"].startswith("Linux ")

        cl = parse_info(c.call("INFO", "clients"))
        assert int(cl["connected_clients"]) >= 2
        assert cl["maxclients"] == "10000"
        assert cl["client_output_buffer_limit"] == str(1 << 30)
        assert cl["client_query_buffer_limit"] == str(4 << 30)
        for k in ("client_query_buffers_bytes", "client_output_buffers_bytes",
                  "client_biggest_output_buffer"):
            assert int(cl[k]) >= 0

        mem = parse_info(c.call("INFO", "memory"))
        assert int(mem["used_memory"]) == 10
        assert mem["used_memory_state"] == "10"
        for fam in ("ssm", "vstore", "attention", "index"):
            assert mem["used_memory_" + fam] == "0"
        assert int(mem["used_memory_rss"]) > 0
        assert int(mem["used_memory_peak_rss"]) >= int(mem["used_memory_rss"]) // 2
        # The default (auto): 3/4 of the machine's memory, beyond which objects move to disk.
        assert int(mem["maxmemory"]) > 0
        assert mem["maxmemory_policy"] == "demote-lru"
        assert mem["oom_rejections"] == "0"
        assert int(mem["used_memory_clients"]) >= 0
        assert int(mem["buffer_cache_bytes"]) >= 0
        assert mem["used_memory_human"] == "10B"

        assert parse_info(c.call("INFO", "persistence")) == {
            "loading": "0", "dir": str(pion.data_dir), "disk_objects_loaded": "0",
            "disk_objects_corrupt": "0", "disk_saves": "0", "disk_save_failures": "0",
            "disk_warms": "0", "disk_demotions": "0", "evictions": "0", "io_queued": "0"}

        st = parse_info(c.call("INFO", "stats"))
        for k in ("total_connections_received", "total_commands_processed",
                  "total_forwarded_commands", "total_net_input_bytes", "total_net_output_bytes",
                  "rejected_unknown_command", "rejected_wrong_arity", "rejected_noauth",
                  "rejected_wrongpass", "rejected_protocol_error", "rejected_query_buffer_limit",
                  "rejected_output_buffer_limit", "rejected_busy", "rejected_oom",
                  "rejected_maxclients", "rejected_kvcache_disabled", "rejected_connections",
                  "client_output_buffer_limit_disconnections", "shard_queue_depth",
                  "shard_queued_commands", "slowlog_len"):
            assert re.fullmatch(r"\d+", st[k]), k
        assert int(st["total_connections_received"]) >= 3
        assert int(st["total_commands_processed"]) >= 3
        assert st["shard_queue_depth"] == "1024"

        assert parse_info(c.call("INFO", "keyspace")) == {
            "state": "slots=1,bytes=10", "vstore": "sessions=0,rows=0,bytes=0",
            "ssm": "sessions=0,blobs=0,bytes=0"}


def test_deferred_commands_are_timed_and_failed_at_their_reply(pion_factory):
    """Commands that reply later (compute-pool queries, saves after their disk I/O) count
    their whole time and their error replies in the command stats, not the handler's return."""
    import numpy as np

    def stat(c, name):
        line = parse_info(c.call("INFO", "commandstats")).get("cmdstat_" + name, "")
        return {k: float(v) if "." in v else int(v)
                for k, v in (kv.split("=") for kv in line.split(",") if kv)}

    srv = pion_factory("-w", "2", "--disk-quota", "64kb")
    h, n, d = 8, 8192, 128
    kv = np.random.default_rng(0).standard_normal((h, n, d)).astype(np.float32).tobytes()
    q = np.ones((h, d), np.float32).tobytes()
    with srv.raw() as c:
        assert c.call("ATTEND.PREFIX.STORE", "big", 0, h, n, d, kv, kv) == "OK"
        t0 = time.perf_counter()
        for _ in range(5):
            c.call("ATTEND.PREFIX.QUERY", "big", 0, h, d, 0, q)
        client_us = (time.perf_counter() - t0) * 1e6
        st = stat(c, "attend.prefix.query")
        assert st["calls"] == 5
        # The server's time is most of what the client waited (the kernel runs on the pool).
        assert st["usec"] >= 0.3 * client_us, (st, client_us)
        assert c.call("SSM.PREFIX.STORE", "s", 0, b"x" * (1 << 20)) == "OK"
        e = c.call("SSM.PREFIX.SAVE", "s")
        assert isinstance(e, RespError) and str(e).startswith("OOM tier=disk"), e
        st = stat(c, "ssm.prefix.save")
        assert st["calls"] == 1 and st["failed_calls"] == 1, st


def test_info_commandstats_counts(pion):
    def stat(c, name):
        cs = parse_info(c.call("INFO", "commandstats"))
        line = cs.get("cmdstat_" + name)
        if line is None:
            return {"calls": 0, "rejected_calls": 0, "failed_calls": 0}
        return {k: float(v) if "." in v else int(v)
                for k, v in (kv.split("=") for kv in line.split(","))}

    with pion.raw() as c:
        before = stat(c, "ping")
        for _ in range(7):
            c.call("PING")
        c.call("PING", "a", "b")  # an error reply from the handler: failed
        after = stat(c, "ping")
        assert after["calls"] == before["calls"] + 8
        assert after["failed_calls"] == before["failed_calls"] + 1
        assert after["usec_per_call"] == pytest.approx(after["usec"] / after["calls"], abs=0.01)
        assert stat(c, "echo")["calls"] == 0
        c.send(encode("ECHO"))  # arity: rejected before running
        c.read_reply()
        e = stat(c, "echo")
        assert e["calls"] == 0 and e["rejected_calls"] == 1
        c.call("STATE.READ", "nope", 0, 1)
        r = stat(c, "state.read")
        assert r["calls"] == 1 and r["failed_calls"] == 1


# ------------------------------------------------------------------------------------------
# Prometheus /metrics
# ------------------------------------------------------------------------------------------

BUCKETS = ["0.00001", "0.000025", "0.00005", "0.0001", "0.00025", "0.0005", "0.001", "0.0025",
           "0.005", "0.01", "0.025", "0.05", "0.1", "0.25", "0.5", "1", "2.5", "5", "10", "+Inf"]


def http_get(port: int, path: str):
    try:
        with urllib.request.urlopen("http://127.0.0.1:%d%s" % (port, path), timeout=10) as r:
            return r.status, dict(r.headers), r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read().decode()


def test_metrics_endpoint(pion):
    pings_before = parse_metrics(pion.metrics_text()).get('pion_commands_total{cmd="ping"}', 0)
    with pion.raw() as c:
        for _ in range(5):
            c.call("PING")
        c.call("NOPE")
        c.send(encode("ECHO"))
        c.read_reply()
        c.call("STATE.ALLOC", "m:slot", 1000)
        c.call("STATE.READ", "m:none", 0, 1)
        status, headers, text = http_get(pion.metrics_port, "/metrics")
    assert status == 200
    assert headers["Content-Type"] == "text/plain; version=0.0.4; charset=utf-8"
    assert int(headers["Content-Length"]) == len(text.encode())
    m = parse_metrics(text)
    # HELP and TYPE for every family.
    for name, kind in [("pion_uptime_seconds", "gauge"), ("pion_connected_clients", "gauge"),
                       ("pion_connections_received_total", "counter"),
                       ("pion_net_input_bytes_total", "counter"),
                       ("pion_net_output_bytes_total", "counter"),
                       ("pion_forwarded_commands_total", "counter"),
                       ("pion_rejected_total", "counter"), ("pion_memory_used_bytes", "gauge"),
                       ("pion_memory_max_bytes", "gauge"),
                       ("pion_process_resident_bytes", "gauge"),
                       ("pion_commands_total", "counter"),
                       ("pion_command_errors_total", "counter"),
                       ("pion_command_rejected_total", "counter"),
                       ("pion_command_duration_seconds", "histogram")]:
        assert "# TYPE %s %s\n" % (name, kind) in text
        assert "# HELP %s " % name in text
    # Per-command counters.
    assert m['pion_commands_total{cmd="ping"}'] == pings_before + 5
    assert m['pion_commands_total{cmd="state.alloc"}'] == 1
    assert m['pion_command_errors_total{cmd="state.read"}'] == 1
    assert m['pion_command_rejected_total{cmd="echo"}'] == 1
    assert 'pion_commands_total{cmd="slowlog"}' not in m  # zero counters are omitted
    # Rejections by reason: every reason is always present.
    reasons = ["unknown_command", "wrong_arity", "noauth", "wrongpass", "protocol_error",
               "query_buffer_limit", "output_buffer_limit", "busy", "oom", "maxclients",
               "kvcache_disabled"]
    for r in reasons:
        assert 'pion_rejected_total{reason="%s"}' % r in m
    assert m['pion_rejected_total{reason="unknown_command"}'] == 1
    assert m['pion_rejected_total{reason="wrong_arity"}'] == 1
    # Memory by family.
    assert m['pion_memory_used_bytes{family="state"}'] == 1000
    for fam in ("ssm", "vstore", "attention", "index", "clients"):
        assert 'pion_memory_used_bytes{family="%s"}' % fam in m
    assert m["pion_memory_max_bytes"] == int(pion.info("memory")["maxmemory"]) > 0
    assert m["pion_process_resident_bytes"] > 0
    assert m["pion_connected_clients"] >= 1
    assert m["pion_connections_received_total"] >= 2
    assert m["pion_net_input_bytes_total"] > 0 and m["pion_net_output_bytes_total"] > 0
    # Histogram: cumulative buckets in order, +Inf == count == calls.
    for cmd in ("ping", "state.alloc", "state.read"):
        values = [m['pion_command_duration_seconds_bucket{cmd="%s",le="%s"}' % (cmd, le)]
                  for le in BUCKETS]
        assert values == sorted(values)
        assert values[-1] == m['pion_command_duration_seconds_count{cmd="%s"}' % cmd]
        assert values[-1] == m['pion_commands_total{cmd="%s"}' % cmd]
        assert m['pion_command_duration_seconds_sum{cmd="%s"}' % cmd] >= 0
    lines = [l for l in text.splitlines()
             if l.startswith('pion_command_duration_seconds_bucket{cmd="ping"')]
    assert [re.search(r'le="([^"]+)"', l).group(1) for l in lines] == BUCKETS
    assert re.search(r'^pion_command_duration_seconds_sum\{cmd="ping"\} \d+\.\d{6}$', text,
                     flags=re.M)


def test_metrics_other_paths(pion):
    status, _, body = http_get(pion.metrics_port, "/")
    assert status == 200 and body == "pion-server metrics: GET /metrics\n"
    status, _, body = http_get(pion.metrics_port, "/nope")
    assert status == 404 and body == "not found; try GET /metrics\n"
    # A client that connects and sends nothing does not block the endpoint for long.
    idle = socket.create_connection(("127.0.0.1", pion.metrics_port), timeout=5)
    try:
        t0 = time.monotonic()
        status, _, _ = http_get(pion.metrics_port, "/metrics")
        assert status == 200 and time.monotonic() - t0 < 5
    finally:
        idle.close()
    # Non-GET requests are not served.
    with socket.create_connection(("127.0.0.1", pion.metrics_port), timeout=5) as s:
        s.sendall(b"POST /metrics HTTP/1.0\r\n\r\n")
        data = b""
        while True:
            chunk = s.recv(65536)
            if not chunk:
                break
            data += chunk
    assert data.startswith(b"HTTP/1.1 404 Not Found\r\n")


def test_metrics_disabled_with_port_zero(pion_factory):
    srv = pion_factory("--workers", "1", metrics=False)
    assert srv.info("server")["metrics_port"] == "0"
    assert "metrics on" not in srv.log_text()


# ------------------------------------------------------------------------------------------
# SHUTDOWN, signals
# ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("args", [(), ("NOSAVE",), ("save", "now", "force")],
                         ids=["plain", "nosave", "save-now-force"])
def test_shutdown_command_exits_zero(pion_factory, args):
    srv = pion_factory("--workers", "2")
    bystander = srv.raw()
    with srv.raw() as c:
        c.send(encode("SHUTDOWN", *args))
        c.expect_closed()  # like Redis: no reply
    srv.proc.wait(timeout=10)
    assert srv.proc.returncode == 0
    bystander.expect_closed()
    bystander.close()
    log = srv.log_text()
    assert "SHUTDOWN requested by client" in log
    assert "ready to exit" in log


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_signal_exits_cleanly(pion_factory, sig):
    srv = pion_factory("--workers", "2")
    busy = srv.raw()
    busy.send(b"*2\r\n$4\r\nECHO\r\n$1000000\r\n" + b"x" * 1000)  # a command half received
    idle = srv.raw()
    assert idle.call("PING") == "PONG"
    time.sleep(0.1)
    t0 = time.monotonic()
    srv.proc.send_signal(sig)
    srv.proc.wait(timeout=10)
    assert srv.proc.returncode == 0
    assert time.monotonic() - t0 < 5
    idle.expect_closed()
    busy.close()
    idle.close()
    name = "SIGTERM" if sig == signal.SIGTERM else "SIGINT"
    assert "received %s, shutting down" % name in srv.log_text()


# ------------------------------------------------------------------------------------------
# TOML config file, flags
# ------------------------------------------------------------------------------------------

def test_toml_config_file_and_cli_override(tmp_path):
    conf = tmp_path / "pion.toml"
    conf.write_text('# Pion settings\n'
                    'workers = 2\n'
                    'slowlog-max-len = 7\n'
                    'maxclients = 33\n'
                    'maxmemory = "2mb"\n'
                    'kvcache = false\n'
                    'loglevel = "error"\n'
                    'port = 1\n'  # overridden by the harness' --port
                    'client-output-buffer-timeout-ms = 4321\n')
    f = ServerFactory(tmp_path)
    try:
        srv = f("--maxclients", "44", config_file=conf)
        with srv.raw() as c:
            got = pairs(c.call("CONFIG", "GET", "workers", "slowlog-max-len", "maxclients",
                               "maxmemory", "kvcache", "loglevel", "port",
                               "client-output-buffer-timeout-ms"))
            assert got == {"port": str(srv.port), "workers": "2", "kvcache": "off",
                           "maxmemory": str(2 << 20), "client-output-buffer-timeout-ms": "4321",
                           "maxclients": "44", "slowlog-max-len": "7", "loglevel": "error"}
            assert c.call("STATE.INFO") == RespError("ERR state cache not enabled (use --kvcache)")
            assert parse_info(c.call("INFO", "server"))["config_file"] == str(conf)
    finally:
        f.stop_all()


@pytest.mark.parametrize("content,message", [
    ("port = [1, 2]\n", "key 'port' must be a string, integer or boolean"),
    ("port = \n", "cannot parse config file"),
    ("no-such-option = 1\n", "no-such-option"),
    ("maxmemory = \"lots\"\n", "expected a size like 512mb or auto, got lots"),
], ids=["array-value", "syntax-error", "unknown-key", "bad-size"])
def test_bad_toml_config_refuses_to_start(tmp_path, content, message):
    conf = tmp_path / "bad.toml"
    conf.write_text(content)
    p = subprocess.run([SERVER_BIN, "--config", str(conf), "--port", str(free_port()),
                        "--metrics-port", "0", "--binary-port", "0", "--dir", str(tmp_path)],
                       capture_output=True, text=True, timeout=10)
    assert p.returncode != 0
    assert message in p.stdout + p.stderr


def test_missing_config_file(tmp_path):
    p = subprocess.run([SERVER_BIN, "--config", str(tmp_path / "none.toml"), "--port",
                        str(free_port()), "--metrics-port", "0", "--binary-port", "0"],
                       capture_output=True, text=True, timeout=10)
    assert p.returncode != 0
    assert "none.toml" in p.stdout + p.stderr


def test_help_mentions_every_flag():
    p = subprocess.run([SERVER_BIN, "--help"], capture_output=True, text=True, timeout=10)
    assert p.returncode == 0
    text = p.stdout
    assert text.startswith("pion-server: shared inference-state server")
    for flag in ALL_FLAGS:
        assert re.search(r"(^|[ ,])%s\b" % re.escape(flag), text, flags=re.M), flag
    assert "-w,--workers" in text and "-h,--help" in text
    # Every CONFIG parameter is also a flag.
    for name in CONFIG_PARAMS:
        assert "--" + name in text, name
    assert subprocess.run([SERVER_BIN, "-h"], capture_output=True, text=True,
                          timeout=10).stdout == text


def test_version_flag():
    p = subprocess.run([SERVER_BIN, "--version"], capture_output=True, text=True, timeout=10)
    assert p.returncode == 0
    assert p.stdout.strip() == "0.1.0"


@pytest.mark.parametrize("args,message", [
    (["--nope"], "--nope"),
    (["--port", "0"], "--port"),
    (["--port", "70000"], "--port"),
    (["--port", "abc"], "--port"),
    (["--workers", "-1"], "--workers"),
    (["--maxmemory", "10q"], "expected a size like 512mb or auto, got 10q"),
    (["--client-output-buffer-limit", "big"], "expected a size like 512mb, got big"),
    (["--kvcache", "maybe"], "expected on|off, got maybe"),
    (["--loglevel", "loud"], "--loglevel"),
    (["--maxclients", "0"], "--maxclients"),
    (["--client-output-buffer-timeout-ms", "0"], "--client-output-buffer-timeout-ms"),
    (["--slowlog-max-len", "-1"], "--slowlog-max-len"),
    (["extra-positional"], "extra-positional"),
], ids=lambda a: " ".join(a) if isinstance(a, list) else None)
def test_bad_flag_exits_nonzero_with_message(args, message):
    p = subprocess.run([SERVER_BIN, "--metrics-port", "0", "--binary-port", "0", "--port", str(free_port())] + args,
                       capture_output=True, text=True, timeout=10)
    assert p.returncode != 0
    assert message in p.stdout + p.stderr


def test_port_in_use(tmp_path):
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen(1)
    port = holder.getsockname()[1]
    try:
        p = subprocess.run([SERVER_BIN, "--bind", "127.0.0.1", "--port", str(port),
                            "--metrics-port", "0", "--binary-port", "0", "--dir", str(tmp_path)],
                           capture_output=True, text=True, timeout=10)
        assert p.returncode == 4  # cannot listen
        assert "cannot start" in p.stdout + p.stderr
        assert "127.0.0.1:%d" % port in p.stdout + p.stderr
        p = subprocess.run([SERVER_BIN, "--bind", "127.0.0.1", "--port", str(free_port()),
                            "--metrics-port", str(port), "--binary-port", "0", "--dir",
                            str(tmp_path)],
                           capture_output=True, text=True, timeout=10)
        assert p.returncode == 4  # cannot listen
        assert "metrics endpoint" in p.stdout + p.stderr
        p = subprocess.run([SERVER_BIN, "--bind", "127.0.0.1", "--port", str(free_port()),
                            "--metrics-port", "0", "--binary-port", str(port), "--dir",
                            str(tmp_path)],
                           capture_output=True, text=True, timeout=10)
        assert p.returncode == 4  # cannot listen
        assert "127.0.0.1:%d" % port in p.stdout + p.stderr
    finally:
        holder.close()


def test_logfile_flag(pion_factory, tmp_path):
    log = tmp_path / "pion.log"
    srv = pion_factory("--workers", "1", "--logfile", str(log), "--loglevel", "debug")
    assert srv.raw().call("PING") == "PONG"
    srv.stop()
    text = log.read_text()
    assert "Pion ready" in text and "bye bye" in text
    not_a_dir = tmp_path / "plain-file"
    not_a_dir.write_text("")
    p = subprocess.run([SERVER_BIN, "--port", str(free_port()), "--metrics-port", "0",
                        "--logfile", str(not_a_dir / "x.log")],
                       capture_output=True, text=True, timeout=10)
    assert p.returncode == 3  # the log file
    assert "cannot open log file" in p.stderr


# ------------------------------------------------------------------------------------------
# QUIT
# ------------------------------------------------------------------------------------------

def test_quit(shared_pion):
    with shared_pion.raw() as c:
        c.send(encode("QUIT"))
        assert c.read_exact(5) == b"+OK\r\n"
        c.expect_closed()
    # Commands pipelined after QUIT are not run.
    with shared_pion.raw() as c:
        c.send(encode("PING") + encode("QUIT", "bye") + encode("STATE.ALLOC", "quit:after", 1))
        assert c.read_exact(12) == b"+PONG\r\n+OK\r\n"
        c.expect_closed()
    with shared_pion.raw() as c:
        assert c.call("STATE.FREE", "quit:after") == 0
    r = shared_pion.client()
    assert r.ping() is True
    p = shared_pion.redis_cli(input="PING\nQUIT\nPING\n")
    assert p.returncode == 0 and p.stdout.startswith("PONG\n")


def _cpu_seconds(pid: int) -> float:
    fields = open("/proc/%d/stat" % pid).read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def test_polling_shards_forward_and_then_sleep(pion_factory):
    """--poll-us: after activity a shard polls instead of sleeping (a forwarded command and its
    reply need no scheduler wake-up); the results are the same, and an idle server stops
    polling: its CPU time stays flat."""
    srv = pion_factory("-w", "4", "--poll-us", "200")
    with srv.raw() as c:
        assert c.call("CONFIG", "GET", "poll-us") == [b"poll-us", b"200"]
        for i in range(40):  # keys on every shard: most commands are forwarded
            assert c.call("STATE.ALLOC", "poll:%d" % i, 8) == "OK"
            assert c.call("STATE.WRITE", "poll:%d" % i, 0, b"%08d" % i) == "OK"
        c.send(b"".join(encode("STATE.READ", "poll:%d" % i, 0, 8) for i in range(40)))
        assert [c.read_reply() for _ in range(40)] == [b"%08d" % i for i in range(40)]
    assert int(srv.info("stats")["total_forwarded_commands"]) > 0
    time.sleep(0.3)
    before = _cpu_seconds(srv.proc.pid)
    time.sleep(1.0)
    assert _cpu_seconds(srv.proc.pid) - before < 0.25, "an idle server kept polling"
    with srv.raw() as c:  # and a sleeping server still answers
        assert c.call("CONFIG", "SET", "poll-us", "0") == "OK"
        assert c.call("STATE.READ", "poll:7", 0, 8) == b"00000007"
        assert c.call("CONFIG", "SET", "poll-us", "-1") == RespError(
            "ERR CONFIG SET failed (possibly related to argument 'poll-us') - argument must be "
            "between 0 and 1000000 inclusive")


# ------------------------------------------------------------------------------------------
# Issue 54 §5: what a new user meets in the first hour
# ------------------------------------------------------------------------------------------

def test_ready_line_names_addresses_dir_and_budgets(pion_factory):
    srv = pion_factory("--workers", "1", "--maxmemory", "1.5mb", "--disk-quota", "2gb")
    line = [x for x in srv.log_text().splitlines() if "Pion ready" in x][0]
    assert "RESP on %s:%d" % (HOST, srv.port) in line, line
    assert "binary protocol on %s:%d" % (HOST, srv.binary_port) in line, line
    assert "metrics on http://%s:%d/metrics" % (HOST, srv.metrics_port) in line, line
    assert "data dir %s" % srv.data_dir.resolve() in line, line
    assert "maxmemory 1.50M," in line and "disk-quota 2.00G," in line, line
    assert "gpu-memory none (attention on the cpu)" in line or "gpu-memory " in line, line
    assert int(srv.info("memory")["maxmemory"]) == 1536 * 1024  # decimals are taken


def test_ready_line_brackets_ipv6(tmp_path):
    try:
        probe = socket.socket(socket.AF_INET6)
        probe.bind(("::1", 0))
        probe.close()
    except OSError:
        pytest.skip("no IPv6 loopback here")
    port = free_port()
    p = subprocess.Popen([SERVER_BIN, "--bind", "::1", "--port", str(port), "--metrics-port",
                          "0", "--binary-port", "0", "--dir", str(tmp_path)],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 10
        line = ""
        while time.monotonic() < deadline and "Pion ready" not in line:
            line = p.stdout.readline()
        assert "RESP on [::1]:%d" % port in line, line
    finally:
        p.terminate()
        p.wait(timeout=10)


def test_unitless_small_size_warns_and_exit_codes_name_the_class(tmp_path):
    base = [SERVER_BIN, "--metrics-port", "0", "--binary-port", "0"]
    p = subprocess.run(base + ["--port", str(free_port()), "--maxmemory", "10", "--nope"],
                       capture_output=True, text=True, timeout=10)
    assert "warning: --maxmemory 10 is 10 bytes" in p.stderr, p.stderr
    # One exit status per class of start-up error (docs/OPERATIONS.md § Exit codes).
    assert subprocess.run(base + ["--nope"], capture_output=True, timeout=10).returncode == 2
    p = subprocess.run(base + ["--maxmemory", "1.5b"], capture_output=True, text=True, timeout=10)
    assert p.returncode == 2 and "expected a size like 512mb or auto, got 1.5b" in p.stderr
    plain = tmp_path / "file"
    plain.write_text("")
    p = subprocess.run(base + ["--port", str(free_port()), "--logfile", str(plain / "x.log")],
                       capture_output=True, text=True, timeout=10)
    assert p.returncode == 3, p.stderr
    p = subprocess.run(base + ["--port", str(free_port()), "--attention-backend", "cuda",
                               "--dir", str(tmp_path / "d1")],
                       capture_output=True, text=True, timeout=20)
    if "no usable CUDA device" in p.stdout + p.stderr:
        assert p.returncode == 5
    p = subprocess.run(base + ["--port", str(free_port()), "--dir", str(plain / "data")],
                       capture_output=True, text=True, timeout=20)
    assert p.returncode == 6, (p.returncode, p.stdout + p.stderr)
    p = subprocess.run(base + ["--port", str(free_port()), "--dir", str(tmp_path / "d2"),
                               "--cluster", "etcd://127.0.0.1:%d" % free_port(), "--node-id",
                               "n1"], capture_output=True, text=True, timeout=60)
    assert p.returncode == 7, (p.returncode, p.stdout + p.stderr)


def test_info_and_metrics_show_no_unmeasured_rate_and_no_limit_zero(pion_factory):
    srv = pion_factory("--workers", "1", "--maxmemory", "0", "--attention-backend", "cpu")
    res = srv.info("residency")
    assert "residency_rate_gpu_upload" not in res and "residency_rate_gpu_download" not in res
    assert res["residency_host_limit"] == "unlimited"
    assert srv.info("memory")["maxmemory_human"] == "unlimited"
    assert srv.info("attention")["attention_memory_limit"] == "unlimited"
    text = srv.metrics_text()
    assert "pion_memory_max_bytes +Inf" in text
    assert 'pion_residency_limit_bytes{tier="host"} +Inf' in text
    assert 'transfer_rate_bytes_per_second{path="gpu_upload"}' not in text
    # STORE ... FROM is counted as such, not as a promotion.
    r = srv.client()
    r.execute_command("KV.PREFIX.REGISTER", "sf", 1, 64, 1, 32, "fp32")
    for part in ("pk", "pv"):
        r.execute_command("V.STOREBATCH", "sf_" + part, 0, np.ones((64, 32), np.float32).tobytes())
    r.execute_command("ATTEND.PREFIX.STORE", "sfa", 0, "FROM", "sf")
    a = srv.info("attention")
    assert (a["attention_stores_from"], a["attention_promotions"]) == ("1", "0"), a


def test_receipt_times_are_rounded_doubles_and_counts_integers(pion_factory):
    srv = pion_factory("--workers", "1", "--attention-backend", "cpu")
    r = srv.client()
    k = np.ones((2, 64, 32), np.float32)
    r.execute_command("ATTEND.PREFIX.STORE", "rc", 0, 2, 64, 32, k.tobytes(), k.tobytes())
    q = np.ones((2, 32), np.float32).tobytes()
    for proto in (2, 3):
        with srv.raw() as c:
            if proto == 3:
                c.call("HELLO", "3")
            c.send(encode("ATTEND.PREFIX.QUERY", "rc", 0, 2, 32, 0, q, "RECEIPT"))
            c.read_exact(2 * 32 * 4 + len("*2\r\n$256\r\n\r\n"))  # the output blob
            raw = c.read_until(b"estimate_us\r\n")
            raw += c.read_line() + b"\r\n"
            if proto == 2:
                raw += c.read_line() + b"\r\n"
        text = raw.decode()
        for key in ("micros", "queue_us", "merge_us", "estimate_us"):
            if proto == 3:
                m = re.search(r"\$%d\r\n%s\r\n,(-?[0-9.e+-]+)\r\n" % (len(key), key), text)
            else:
                m = re.search(r"\$%d\r\n%s\r\n\$\d+\r\n(-?[0-9.e+-]+)\r\n" % (len(key), key),
                              text)
            assert m, (key, text)
            assert len(m.group(1).split(".")[1]) <= 3 if "." in m.group(1) else True, m.group(1)
        for key in ("rows_attended", "visible_rows", "prefix_rows", "splits"):
            assert re.search(r"\$%d\r\n%s\r\n:\d+\r\n" % (len(key), key), text), (key, text)
        assert re.search(r"omitted_mass_estimate\r\n(,|\$\d+\r\n)0\r\n", text), text
