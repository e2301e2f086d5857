"""Malformed input on raw sockets: every case gets its exact error text; protocol errors
close the connection; meanwhile another connection keeps getting PONG and the server lives."""
from __future__ import annotations

import pytest

from pionlib import RespError, ServerFactory, encode, parse_metrics

PROTO = "-ERR Protocol error: "

# Limits of the module's server, so the limit cases are cheap to trigger.
SERVER_FLAGS = ["--workers", "2", "--max-multibulk-len", "1000", "--proto-max-bulk-len", "4mb",
                "--client-query-buffer-limit", "1mb"]

# Counted by the cases, checked against INFO at the end of the module.
SEEN = {"protocol": 0, "query_buffer": 0, "unknown": 0, "arity": 0}


def perr(text: str) -> bytes:
    return (PROTO + text + "\r\n").encode()


def err(text: str) -> bytes:
    return ("-" + text + "\r\n").encode()


def inline(line: str) -> bytes:
    return line.encode() + b"\r\n"


# (id, bytes to send, exact reply, connection closed afterwards, counter)
CASES = [
    # --- protocol errors: reply, then close -------------------------------------------------
    ("mbulk-count-not-number", b"*x\r\n", perr("invalid multibulk length"), True, "protocol"),
    ("mbulk-count-empty", b"*\r\n", perr("invalid multibulk length"), True, "protocol"),
    ("mbulk-count-plus-sign", b"*+1\r\n", perr("invalid multibulk length"), True, "protocol"),
    ("mbulk-count-lf-only", b"*1\nPING\r\n", perr("invalid multibulk length"), True, "protocol"),
    ("mbulk-count-over-max", b"*1001\r\n", perr("invalid multibulk length"), True, "protocol"),
    ("mbulk-count-huge", b"*99999999999999999999999\r\n", perr("invalid multibulk length"), True,
     "protocol"),
    ("expected-dollar", b"*1\r\nx\r\n", perr("expected '$', got 'x'"), True, "protocol"),
    ("expected-dollar-star", b"*2\r\n$4\r\nECHO\r\n*1\r\n", perr("expected '$', got '*'"), True,
     "protocol"),
    ("expected-dollar-inline-in-mbulk", b"*2\r\n$4\r\nECHO\r\nhello\r\n",
     perr("expected '$', got 'h'"), True, "protocol"),
    ("bulk-len-not-number", b"*1\r\n$abc\r\n", perr("invalid bulk length"), True, "protocol"),
    ("bulk-len-negative", b"*2\r\n$4\r\nECHO\r\n$-1\r\n", perr("invalid bulk length"), True,
     "protocol"),
    ("bulk-len-empty", b"*1\r\n$\r\n", perr("invalid bulk length"), True, "protocol"),
    ("bulk-len-over-proto-max", b"*2\r\n$4\r\nECHO\r\n$5000000\r\n", perr("invalid bulk length"),
     True, "protocol"),
    ("bulk-missing-crlf-small", b"*2\r\n$4\r\nECHO\r\n$3\r\nabcd\r\n",
     perr("expected CRLF after bulk data"), True, "protocol"),
    ("bulk-lf-only", b"*1\r\n$4\r\nPING\nX", perr("expected CRLF after bulk data"), True,
     "protocol"),
    ("bulk-missing-crlf-big", b"*2\r\n$4\r\nECHO\r\n$40000\r\n" + b"z" * 40000 + b"XY",
     perr("expected CRLF after bulk data"), True, "protocol"),
    ("inline-unbalanced-double", b'ECHO "abc\r\n', perr("unbalanced quotes in request"), True,
     "protocol"),
    ("inline-unbalanced-single", b"ECHO 'abc\r\n", perr("unbalanced quotes in request"), True,
     "protocol"),
    ("inline-quote-then-text", b'ECHO "abc"def\r\n', perr("unbalanced quotes in request"), True,
     "protocol"),
    ("inline-too-big", b"a" * 65600, perr("too big inline request"), True, "protocol"),
    ("mbulk-count-too-big", b"*" + b"1" * 65600, perr("too big mbulk count string"), True,
     "protocol"),
    ("bulk-count-too-big", b"*1\r\n$" + b"1" * 65600, perr("too big bulk count string"), True,
     "protocol"),
    ("query-buffer-limit", b"*2\r\n$4\r\nECHO\r\n$2000000\r\n",
     perr("query buffer limit of 1048576 bytes exceeded (2000004 bytes in command)"), True,
     "query_buffer"),
    ("error-after-good-commands", b"PING\r\n*1\r\n$4\r\nPING\r\n*z\r\nPING\r\n",
     b"+PONG\r\n+PONG\r\n" + perr("invalid multibulk length"), True, "protocol"),

    # --- command errors: reply, connection stays open ---------------------------------------
    ("unknown-command", inline("FOO a b"),
     err("ERR unknown command 'FOO', with args beginning with: 'a' 'b' "), False, "unknown"),
    ("unknown-command-no-args", encode("NOPE"),
     err("ERR unknown command 'NOPE', with args beginning with: "), False, "unknown"),
    ("unknown-command-empty-name", b"*1\r\n$0\r\n\r\n",
     err("ERR unknown command '', with args beginning with: "), False, "unknown"),
    ("unknown-command-long-name", encode("X" * 200, "y" * 100),
     err("ERR unknown command '" + "X" * 128 + "', with args beginning with: '" + "y" * 64 + "' "),
     False, "unknown"),
    ("unknown-command-dotted", encode("KV.GET", "k"),
     err("ERR unknown command 'KV.GET', with args beginning with: 'k' "), False, "unknown"),
    ("arity-echo-none", encode("ECHO"), err("ERR wrong number of arguments for 'echo' command"),
     False, "arity"),
    ("arity-echo-two", encode("ECHO", "a", "b"),
     err("ERR wrong number of arguments for 'echo' command"), False, "arity"),
    ("arity-ping-two", encode("PING", "a", "b"),
     err("ERR wrong number of arguments for 'ping' command"), False, None),
    ("arity-state-alloc", encode("STATE.ALLOC", "x"),
     err("ERR wrong number of arguments for 'state.alloc' command"), False, "arity"),
    ("arity-state-write", encode("STATE.WRITE", "x", "0"),
     err("ERR wrong number of arguments for 'state.write' command"), False, "arity"),
    ("arity-state-read", encode("STATE.READ", "x", "0"),
     err("ERR wrong number of arguments for 'state.read' command"), False, "arity"),
    ("arity-state-read-many", encode("STATE.READ", "x", "0", "1", "2"),
     err("ERR wrong number of arguments for 'state.read' command"), False, "arity"),
    ("arity-state-free", encode("STATE.FREE"),
     err("ERR wrong number of arguments for 'state.free' command"), False, "arity"),
    ("arity-state-info", encode("STATE.INFO", "x"),
     err("ERR wrong number of arguments for 'state.info' command"), False, "arity"),
    ("arity-client", encode("CLIENT"), err("ERR wrong number of arguments for 'client' command"),
     False, "arity"),
    ("arity-config", encode("CONFIG"), err("ERR wrong number of arguments for 'config' command"),
     False, "arity"),
    ("arity-slowlog", encode("SLOWLOG"),
     err("ERR wrong number of arguments for 'slowlog' command"), False, "arity"),
    ("arity-auth", encode("AUTH"), err("ERR wrong number of arguments for 'auth' command"), False,
     "arity"),
    ("arity-lowercase-name", encode("echo"),
     err("ERR wrong number of arguments for 'echo' command"), False, "arity"),
    ("config-get-no-pattern", encode("CONFIG", "GET"),
     err("ERR wrong number of arguments for 'config|get' command"), False, None),
    ("config-set-odd", encode("CONFIG", "SET", "maxclients"),
     err("ERR wrong number of arguments for 'config|set' command"), False, None),
    ("state-alloc-bytes-not-int", encode("STATE.ALLOC", "s", "abc"),
     err("ERR bytes must be a non-negative integer, got 'abc'"), False, None),
    ("state-alloc-bytes-negative", encode("STATE.ALLOC", "s", "-1"),
     err("ERR bytes must be a non-negative integer, got '-1'"), False, None),
    ("state-alloc-bytes-zero", encode("STATE.ALLOC", "s", "0"), err("ERR bytes must be at least 1"),
     False, None),
    ("state-alloc-over-proto-max", encode("STATE.ALLOC", "s", "5000000"),
     err("ERR bytes 5000000 exceeds proto-max-bulk-len 4194304"), False, None),
    ("state-read-no-slot", encode("STATE.READ", "pe:none", "0", "1"),
     err("ERR no such state slot 'pe:none'"), False, None),
    ("state-write-no-slot", encode("STATE.WRITE", "pe:none", "0", "x"),
     err("ERR no such state slot 'pe:none'"), False, None),
    ("state-read-len-not-int", encode("STATE.READ", "pe:none", "0", "x"),
     err("ERR len must be a non-negative integer, got 'x'"), False, None),
    ("state-write-offset-not-int", encode("STATE.WRITE", "pe:none", "-3", "x"),
     err("ERR offset must be a non-negative integer, got '-3'"), False, None),
    ("state-alloc-other-size",
     encode("STATE.ALLOC", "pe:fixed", "8") + encode("STATE.ALLOC", "pe:fixed", "8") +
     encode("STATE.ALLOC", "pe:fixed", "9"),
     b"+OK\r\n+OK\r\n" + err("ERR state slot 'pe:fixed' exists with 8 bytes, not 9; STATE.FREE it "
                             "first"), False, None),
    ("state-read-out-of-range", encode("STATE.ALLOC", "pe:r", "8") + encode("STATE.READ", "pe:r",
                                                                            "4", "5"),
     b"+OK\r\n" + err("ERR read of 5 bytes at offset 4 exceeds slot 'pe:r' of 8 bytes"), False,
     None),
    ("state-read-offset-past-end", encode("STATE.ALLOC", "pe:r2", "8") +
     encode("STATE.READ", "pe:r2", "9", "0"),
     b"+OK\r\n" + err("ERR read of 0 bytes at offset 9 exceeds slot 'pe:r2' of 8 bytes"), False,
     None),
    ("state-write-out-of-range", encode("STATE.ALLOC", "pe:w", "8") +
     encode("STATE.WRITE", "pe:w", "6", "abc"),
     b"+OK\r\n" + err("ERR write of 3 bytes at offset 6 exceeds slot 'pe:w' of 8 bytes"), False,
     None),
    ("config-set-unknown", encode("CONFIG", "SET", "foo", "1"),
     err("ERR Unknown option or number of arguments for CONFIG SET - 'foo'"), False, None),
    ("config-set-immutable", encode("CONFIG", "SET", "port", "1"),
     err("ERR CONFIG SET failed (possibly related to argument 'port') - can't set immutable "
         "config"), False, None),
    ("config-set-immutable-kvcache", encode("CONFIG", "SET", "kvcache", "off"),
     err("ERR CONFIG SET failed (possibly related to argument 'kvcache') - can't set immutable "
         "config"), False, None),
    ("config-set-not-int", encode("CONFIG", "SET", "maxclients", "x"),
     err("ERR CONFIG SET failed (possibly related to argument 'maxclients') - argument couldn't "
         "be parsed into an integer"), False, None),
    ("config-set-out-of-range", encode("CONFIG", "SET", "maxclients", "0"),
     err("ERR CONFIG SET failed (possibly related to argument 'maxclients') - argument must be "
         "between 1 and 1000000 inclusive"), False, None),
    ("config-set-bad-size", encode("CONFIG", "SET", "maxmemory", "10q"),
     err("ERR CONFIG SET failed (possibly related to argument 'maxmemory') - argument must be a "
         "memory value"), False, None),
    ("config-set-bad-loglevel", encode("CONFIG", "SET", "loglevel", "loud"),
     err("ERR CONFIG SET failed (possibly related to argument 'loglevel') - argument must be one "
         "of trace, debug, info, warn, error"), False, None),
    ("config-set-slowlog-below-minus-one", encode("CONFIG", "SET", "slowlog-log-slower-than", "-2"),
     err("ERR CONFIG SET failed (possibly related to argument 'slowlog-log-slower-than') - "
         "argument must be between -1 and 9223372036854775807 inclusive"), False, None),
    ("config-unknown-subcommand", encode("CONFIG", "FOO"),
     err("ERR unknown subcommand 'FOO'. Try CONFIG HELP."), False, None),
    ("client-unknown-subcommand", encode("CLIENT", "FOO"),
     err("ERR unknown subcommand 'FOO'. Try CLIENT HELP."), False, None),
    ("slowlog-unknown-subcommand", encode("SLOWLOG", "FOO"),
     err("ERR unknown subcommand 'FOO'. Try SLOWLOG HELP."), False, None),
    ("command-unknown-subcommand", encode("COMMAND", "FOO"),
     err("ERR unknown subcommand 'FOO'. Try COMMAND HELP."), False, None),
    ("hello-4-noproto", encode("HELLO", "4"), err("NOPROTO unsupported protocol version"), False,
     None),
    ("hello-1-noproto", encode("HELLO", "1"), err("NOPROTO unsupported protocol version"), False,
     None),
    ("hello-not-int", encode("HELLO", "x"),
     err("ERR Protocol version is not an integer or out of range"), False, None),
    ("hello-bad-option", encode("HELLO", "3", "SETNAME"),
     err("ERR Syntax error in HELLO option 'SETNAME'"), False, None),
    ("client-setname-space", encode("CLIENT", "SETNAME", "a b"),
     err("ERR Client names cannot contain spaces, newlines or special characters."), False, None),
    ("client-setname-newline", encode("CLIENT", "SETNAME", "a\nb"),
     err("ERR Client names cannot contain spaces, newlines or special characters."), False, None),
    ("client-kill-no-such", encode("CLIENT", "KILL", "1.2.3.4:5"), err("ERR No such client"), False,
     None),
    ("client-kill-bad-id", encode("CLIENT", "KILL", "ID", "abc"),
     err("ERR client-id should be greater than 0"), False, None),
    ("client-kill-odd-filters", encode("CLIENT", "KILL", "ID", "1", "ADDR"), err("ERR syntax error"),
     False, None),
    ("client-kill-bad-skipme", encode("CLIENT", "KILL", "SKIPME", "maybe"), err("ERR syntax error"),
     False, None),
    ("client-list-bad-filter", encode("CLIENT", "LIST", "TYPE", "normal"),
     err("ERR syntax error: CLIENT LIST [ID client-id ...]"), False, None),
    ("client-list-bad-id", encode("CLIENT", "LIST", "ID", "x"), err("ERR Invalid client ID"), False,
     None),
    ("slowlog-get-bad-count", encode("SLOWLOG", "GET", "-5"),
     err("ERR count should be greater than or equal to -1"), False, None),
    ("auth-without-password", encode("AUTH", "pw"),
     err("ERR AUTH <password> called without any password configured for the default user. Are "
         "you sure your configuration is correct?"), False, None),
    ("auth-too-many-args", encode("AUTH", "a", "b", "c"), err("ERR syntax error"), False, None),
    ("shutdown-bad-arg", encode("SHUTDOWN", "LATER"),
     err("ERR syntax error: SHUTDOWN [NOSAVE|SAVE] [NOW] [FORCE]"), False, None),
]


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    f = ServerFactory(tmp_path_factory.mktemp("proto"))
    try:
        yield f(*SERVER_FLAGS)
    finally:
        f.stop_all()


@pytest.fixture(scope="module")
def watchdog(srv):
    """A second connection that must keep answering PING throughout."""
    c = srv.raw(timeout=5)
    yield c
    c.close()


def test_case_table_is_large_enough():
    assert len(CASES) >= 25
    assert sum(1 for c in CASES if c[3]) >= 15  # protocol errors that close
    assert len({c[0] for c in CASES}) == len(CASES)


@pytest.mark.parametrize("payload,reply,closes,counter", [c[1:] for c in CASES],
                         ids=[c[0] for c in CASES])
def test_malformed_input(srv, watchdog, payload, reply, closes, counter):
    with srv.raw(timeout=5) as c:
        c.send(payload)
        got = c.read_exact(len(reply))
        assert got == reply
        if closes:
            c.expect_closed(timeout=5)
        else:
            c.send(b"PING\r\n")
            assert c.read_exact(7) == b"+PONG\r\n"
    if counter:
        SEEN[counter] += 1
    # The rest of the server is unaffected.
    watchdog.send(b"PING\r\n")
    assert watchdog.read_exact(7) == b"+PONG\r\n"
    assert srv.alive()


def test_protocol_error_with_pipelined_tail_still_replies_first(srv):
    """Commands before the bad one are answered; nothing after it runs."""
    with srv.raw(timeout=5) as c:
        c.send(encode("STATE.ALLOC", "pe:tail", "4") + b"*1\r\n$4\r\nPINGxx" +
               encode("STATE.FREE", "pe:tail"))
        assert c.read_exact(5) == b"+OK\r\n"
        assert c.read_exact(len(perr("expected CRLF after bulk data"))) == \
            perr("expected CRLF after bulk data")
        c.expect_closed()
    SEEN["protocol"] += 1
    with srv.raw() as c:
        # STATE.FREE after the error never ran: the slot still exists.
        assert c.call("STATE.FREE", "pe:tail") == 1


def test_runtime_limits_apply_to_new_commands(srv):
    with srv.raw() as admin:
        assert admin.call("CONFIG", "SET", "proto-max-bulk-len", "1kb") == "OK"
        try:
            with srv.raw(timeout=5) as c:
                c.send(encode("ECHO", b"a" * 1024))
                assert c.read_reply() == b"a" * 1024
                c.send(encode("ECHO", b"a" * 1025))
                assert c.read_exact(len(perr("invalid bulk length"))) == perr("invalid bulk length")
                c.expect_closed()
            SEEN["protocol"] += 1
        finally:
            assert admin.call("CONFIG", "SET", "proto-max-bulk-len", "4mb") == "OK"
        # 4 arguments still fit, so the admin connection can restore the setting.
        assert admin.call("CONFIG", "SET", "max-multibulk-len", "4") == "OK"
        try:
            with srv.raw(timeout=5) as c:
                assert c.call("PING", "x") == b"x"
                assert c.call("STATE.READ", "pe:none", "0", "1") == \
                    RespError("ERR no such state slot 'pe:none'")
                c.send(encode("STATE.WRITE", "pe:none", "0", "x", "y"))
                assert c.read_exact(len(perr("invalid multibulk length"))) == \
                    perr("invalid multibulk length")
                c.expect_closed()
            SEEN["protocol"] += 1
        finally:
            assert admin.call("CONFIG", "SET", "max-multibulk-len", "1000") == "OK"


def test_rejections_are_counted(srv):
    """INFO stats and /metrics count what the cases above provoked."""
    stats = srv.info("stats")
    assert int(stats["rejected_protocol_error"]) >= SEEN["protocol"]
    assert int(stats["rejected_query_buffer_limit"]) >= SEEN["query_buffer"]
    assert int(stats["rejected_unknown_command"]) >= SEEN["unknown"]
    assert int(stats["rejected_wrong_arity"]) >= SEEN["arity"]
    m = srv.metrics_text()
    pm = parse_metrics(m)
    assert pm['pion_rejected_total{reason="protocol_error"}'] == \
        float(stats["rejected_protocol_error"])
    assert pm['pion_rejected_total{reason="query_buffer_limit"}'] == \
        float(stats["rejected_query_buffer_limit"])
    assert srv.alive()
