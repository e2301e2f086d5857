"""AUTH, pre-auth caps, HELLO AUTH, and tenant isolation (--users)."""
from __future__ import annotations

import os
import subprocess

import pytest
import redis

from pionlib import SERVER_BIN, RespError, ServerFactory, bulk, encode, free_port

NOAUTH = b"-NOAUTH Authentication required.\r\n"
WRONGPASS = b"-WRONGPASS invalid username-password pair or user is disabled.\r\n"
HELLO_NOAUTH = (b"-NOAUTH HELLO must be called with the client already authenticated, otherwise "
                b"the HELLO <proto> AUTH <user> <pass> option can be used to authenticate the "
                b"client and select the RESP protocol version at the same time\r\n")
PASS = "s3cret"


@pytest.fixture(scope="module")
def authsrv(tmp_path_factory):
    f = ServerFactory(tmp_path_factory.mktemp("auth"))
    try:
        yield f("--workers", "2", "--requirepass", PASS, password=PASS)
    finally:
        f.stop_all()


def hello_bytes(proto: int, cid: int) -> bytes:
    head = b"%7\r\n" if proto == 3 else b"*14\r\n"
    return (head + bulk("server") + bulk("pion") + bulk("version") + bulk("0.1.0") +
            bulk("proto") + b":%d\r\n" % proto + bulk("id") + b":%d\r\n" % cid +
            bulk("mode") + bulk("standalone") + bulk("role") + bulk("master") +
            bulk("modules") + b"*0\r\n")


# ------------------------------------------------------------------------------------------
# --requirepass
# ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("cmd", [
    ("ECHO", "x"), ("ECHO",), ("STATE.ALLOC", "a", "1"), ("STATE.READ", "a", "0", "1"),
    ("STATE.INFO",), ("INFO",), ("CLIENT", "ID"), ("CLIENT", "LIST"), ("CONFIG", "GET", "port"),
    ("COMMAND", "COUNT"), ("SLOWLOG", "LEN"), ("SHUTDOWN",), ("NOPE", "x"),
], ids=lambda c: "-".join(c))
def test_commands_need_auth(authsrv, cmd):
    with authsrv.raw(auth=False, timeout=5) as c:
        c.send(encode(*cmd))
        assert c.read_exact(len(NOAUTH)) == NOAUTH
        c.send(b"PING\r\n")
        assert c.read_exact(7) == b"+PONG\r\n"
    assert authsrv.alive()


def test_no_auth_commands_work_before_auth(authsrv):
    with authsrv.raw(auth=False, timeout=5) as c:
        c.send(encode("PING") + encode("PING", "hi") + encode("HELLO", "3") + encode("HELLO"))
        assert c.read_exact(7) == b"+PONG\r\n"
        assert c.read_exact(len(bulk("hi"))) == bulk("hi")
        assert c.read_exact(len(HELLO_NOAUTH)) == HELLO_NOAUTH
        assert c.read_exact(len(HELLO_NOAUTH)) == HELLO_NOAUTH
        c.send(encode("QUIT"))
        assert c.read_exact(5) == b"+OK\r\n"
        c.expect_closed()


def test_wrong_password_then_right(authsrv):
    with authsrv.raw(auth=False, timeout=5) as c:
        for args in [("AUTH", "nope"), ("AUTH", "default", "nope"), ("AUTH", "nouser", PASS),
                     ("AUTH", "DEFAULT", PASS), ("AUTH", PASS + " ")]:
            c.send(encode(*args))
            assert c.read_exact(len(WRONGPASS)) == WRONGPASS, args
        c.send(encode("ECHO", "x"))
        assert c.read_exact(len(NOAUTH)) == NOAUTH
        assert c.call("AUTH", PASS) == "OK"
        assert c.call("ECHO", "x") == b"x"
        # A later failed AUTH does not log the connection out.
        c.send(encode("AUTH", "bad"))
        assert c.read_exact(len(WRONGPASS)) == WRONGPASS
        assert c.call("ECHO", "still") == b"still"
        assert c.call("AUTH", "default", PASS) == "OK"
        big = os.urandom(4 << 20)
        assert c.call("ECHO", big) == big
        assert c.call("CLIENT", "INFO").decode().count(" user=default tenant=default ") == 1
    stats = authsrv.info("stats")
    assert int(stats["rejected_wrongpass"]) >= 6
    assert int(stats["rejected_noauth"]) >= 1


def test_preauth_multibulk_cap(authsrv):
    # 10 arguments are accepted before AUTH...
    with authsrv.raw(auth=False, timeout=5) as c:
        c.send(encode("PING", *["a"] * 9))
        assert c.read_line() == b"-ERR wrong number of arguments for 'ping' command"
        c.send(encode("ECHO", *["a"] * 9))
        assert c.read_exact(len(NOAUTH)) == NOAUTH
    # ...11 are a protocol error that closes the connection.
    with authsrv.raw(auth=False, timeout=5) as c:
        c.send(encode("PING", *["a"] * 10))
        assert c.read_line() == b"-ERR Protocol error: unauthenticated multibulk length"
        c.expect_closed()
    # Also for inline commands.
    with authsrv.raw(auth=False, timeout=5) as c:
        c.send(b"PING " + b" ".join([b"a"] * 10) + b"\r\n")
        assert c.read_line() == b"-ERR Protocol error: unauthenticated multibulk length"
        c.expect_closed()


def test_preauth_bulk_cap(authsrv):
    with authsrv.raw(auth=False, timeout=5) as c:
        v = b"b" * 16384
        c.send(encode("PING", v))
        assert c.read_exact(len(bulk(v))) == bulk(v)
    with authsrv.raw(auth=False, timeout=5) as c:
        c.send(b"*2\r\n$4\r\nPING\r\n$16385\r\n")
        assert c.read_line() == b"-ERR Protocol error: unauthenticated bulk length"
        c.expect_closed()
    with authsrv.raw(auth=False, timeout=5) as c:
        c.send(encode("AUTH", "x" * 20000))
        assert c.read_line() == b"-ERR Protocol error: unauthenticated bulk length"
        c.expect_closed()


def test_caps_lifted_after_auth(authsrv):
    with authsrv.raw(auth=False, timeout=10) as c:
        # AUTH pipelined with commands over the caps in the same write.
        big = os.urandom(100_000)
        c.send(encode("AUTH", PASS) + encode("ECHO", big) +
               encode("CONFIG", "GET", *["nomatch%d" % i for i in range(20)]))
        assert c.read_exact(5) == b"+OK\r\n"
        assert c.read_exact(len(bulk(big))) == bulk(big)
        assert c.read_exact(4) == b"*0\r\n"  # CONFIG GET: no match (flat array in RESP2)
        c.send(encode("STATE.ALLOC", "auth:big", 1 << 20) +
               encode("STATE.WRITE", "auth:big", 0, big) + encode("STATE.READ", "auth:big", 0,
                                                                   len(big)))
        assert c.read_reply() == "OK"
        assert c.read_reply() == "OK"
        assert c.read_reply() == big
        assert c.call("STATE.FREE", "auth:big") == 1


def test_hello_auth(authsrv):
    with authsrv.raw(auth=False, timeout=5) as c:
        c.send(encode("HELLO", "3", "AUTH", "default", "wrong"))
        assert c.read_exact(len(WRONGPASS)) == WRONGPASS
        c.send(encode("ECHO", "x"))
        assert c.read_exact(len(NOAUTH)) == NOAUTH
        # Still RESP2 after the failed HELLO.
        c.send(encode("HELLO", "3", "AUTH", "default", PASS, "SETNAME", "h3"))
        got = c.read_until(b"$7\r\nmodules\r\n*0\r\n")
        cid = c.call("CLIENT", "ID")
        assert got == hello_bytes(3, cid)
        assert c.call("CLIENT", "GETNAME") == b"h3"
        info = c.call("STATE.INFO")
        assert isinstance(info, dict) and set(info) == {b"slots", b"bytes"}
        c.send(encode("CLIENT", "GETNAME", "extra"))
        assert c.read_line().startswith(b"-ERR unknown subcommand")


def test_failed_hello_does_not_authenticate(tenants):
    """A HELLO that answers an error must not have changed the connection. Today
    'HELLO 3 AUTH alice apw BOGUS' replies a syntax error but has already logged the
    connection in as alice (and moved it to alice's tenant)."""
    with tenants.raw(auth=False) as c:
        assert c.call("HELLO", "3", "AUTH", "alice", "apw", "BOGUS") == \
            RespError("ERR Syntax error in HELLO option 'BOGUS'")
        assert c.call("ECHO", "x") == RespError("NOAUTH Authentication required.")
    with login(tenants, "root", "rootpw") as c:
        assert c.call("HELLO", "2", "AUTH", "alice", "apw", "SETNAME") == \
            RespError("ERR Syntax error in HELLO option 'SETNAME'")
        # Still root (tenant 'default'): admin commands still allowed.
        assert c.call("CONFIG", "GET", "maxclients") == [b"maxclients", b"10000"]


def test_redis_py_and_cli_with_password(authsrv):
    r = authsrv.client()
    assert r.ping() is True
    assert r.echo(b"ok") == b"ok"
    bad = redis.Redis(host="127.0.0.1", port=authsrv.port, password="wrong", socket_timeout=5)
    with pytest.raises(redis.ResponseError, match="^WRONGPASS invalid username-password pair"):
        bad.ping()
    anon = redis.Redis(host="127.0.0.1", port=authsrv.port, socket_timeout=5)
    assert anon.ping() is True
    with pytest.raises(redis.AuthenticationError):
        anon.echo("x")
    assert authsrv.redis_cli("ECHO", "via-cli").stdout == "via-cli\n"
    assert authsrv.redis_cli("--no-raw", "CONFIG", "GET", "requirepass").stdout == \
        '1) "requirepass"\n2) "%s"\n' % PASS
    assert authsrv.redis_cli("HELLO", "3", resp3=True).returncode == 0
    out = subprocess.run(["redis-cli", "-p", str(authsrv.port), "--no-raw", "ECHO", "x"],
                         capture_output=True, text=True, timeout=10).stdout
    assert out == "(error) NOAUTH Authentication required.\n"


def test_requirepass_at_runtime(pion_factory):
    srv = pion_factory("--workers", "2")
    with srv.raw() as admin:
        assert admin.call("ECHO", "free") == b"free"
        assert admin.call("CONFIG", "SET", "requirepass", "newpw") == "OK"
        # The connection that set it stays authenticated; new ones must AUTH.
        assert admin.call("ECHO", "still") == b"still"
        with srv.raw(auth=False) as c:
            c.send(encode("ECHO", "x"))
            assert c.read_exact(len(NOAUTH)) == NOAUTH
            assert c.call("AUTH", "newpw") == "OK"
            assert c.call("ECHO", "x") == b"x"
        assert admin.call("CONFIG", "SET", "requirepass", "") == "OK"
        with srv.raw(auth=False) as c:
            assert c.call("ECHO", "open") == b"open"
            c.send(encode("AUTH", "x"))
            assert c.read_line().startswith(b"-ERR AUTH <password> called without any password")


def test_hello_auth_default_when_auth_is_off(pion):
    """Like Redis: with no password configured, HELLO ... AUTH default <anything> succeeds,
    while AUTH <password> reports that no password is configured."""
    with pion.raw(auth=False) as c:
        reply = c.call("HELLO", "3", "AUTH", "default", "whatever")
        assert isinstance(reply, dict) and reply[b"proto"] == 3
        assert c.call("ECHO", "x") == b"x"
        assert c.call("HELLO", "2", "AUTH", "someone", "pw") == RespError(
            "WRONGPASS invalid username-password pair or user is disabled.")
        assert c.call("AUTH", "pw") == RespError(
            "ERR AUTH <password> called without any password configured for the default user. "
            "Are you sure your configuration is correct?")


# ------------------------------------------------------------------------------------------
# Tenants (--users)
# ------------------------------------------------------------------------------------------

USERS = """# user password tenant
alice apw tenant-a
carol cpw tenant-a   # a second user of tenant-a

bob bpw tenant-b
root rootpw default
"""


@pytest.fixture(scope="module")
def tenants(tmp_path_factory):
    base = tmp_path_factory.mktemp("tenants")
    users = base / "users.txt"
    users.write_text(USERS)
    f = ServerFactory(base)
    try:
        yield f("--workers", "2", "--users", str(users))
    finally:
        f.stop_all()


def login(srv, user, pw, timeout=10):
    c = srv.raw(auth=False, timeout=timeout)
    assert c.call("AUTH", user, pw) == "OK"
    return c


def test_users_file_auth(tenants):
    with tenants.raw(auth=False) as c:
        c.send(encode("STATE.INFO"))
        assert c.read_exact(len(NOAUTH)) == NOAUTH
        for user, pw in [("alice", "bpw"), ("bob", "apw"), ("default", ""), ("default", "x"),
                         ("eve", "apw")]:
            c.send(encode("AUTH", user, pw))
            assert c.read_exact(len(WRONGPASS)) == WRONGPASS, user
        # One-argument AUTH is the 'default' user, which has no password here.
        c.send(encode("AUTH", "apw"))
        assert c.read_exact(len(WRONGPASS)) == WRONGPASS
    for user, pw, tenant in [("alice", "apw", "tenant-a"), ("carol", "cpw", "tenant-a"),
                             ("bob", "bpw", "tenant-b"), ("root", "rootpw", "default")]:
        with login(tenants, user, pw) as c:
            info = c.call("CLIENT", "INFO").decode()
            assert " user=%s tenant=%s " % (user, tenant) in info


def test_same_slot_id_is_per_tenant(tenants):
    a, b, carol, root = (login(tenants, "alice", "apw"), login(tenants, "bob", "bpw"),
                         login(tenants, "carol", "cpw"), login(tenants, "root", "rootpw"))
    try:
        assert a.call("STATE.ALLOC", "shared-id", 16) == "OK"
        # Same id, other tenant, other size: no conflict.
        assert b.call("STATE.ALLOC", "shared-id", 8) == "OK"
        assert root.call("STATE.ALLOC", "shared-id", 4) == "OK"
        assert a.call("STATE.WRITE", "shared-id", 0, b"A" * 16) == "OK"
        assert b.call("STATE.WRITE", "shared-id", 0, b"B" * 8) == "OK"
        assert root.call("STATE.WRITE", "shared-id", 0, b"R" * 4) == "OK"
        assert a.call("STATE.READ", "shared-id", 0, 16) == b"A" * 16
        assert b.call("STATE.READ", "shared-id", 0, 8) == b"B" * 8
        assert root.call("STATE.READ", "shared-id", 0, 4) == b"R" * 4
        # carol shares alice's tenant and sees alice's slot.
        assert carol.call("STATE.READ", "shared-id", 0, 16) == b"A" * 16
        # bob's slot is 8 bytes: alice's 16-byte read shape does not apply to it.
        assert b.call("STATE.READ", "shared-id", 0, 16) == \
            RespError("ERR read of 16 bytes at offset 0 exceeds slot 'shared-id' of 8 bytes")
        # Freeing bob's slot leaves alice's.
        assert b.call("STATE.FREE", "shared-id") == 1
        assert a.call("STATE.READ", "shared-id", 0, 16) == b"A" * 16
        assert a.call("STATE.FREE", "shared-id") == 1
        assert root.call("STATE.FREE", "shared-id") == 1
    finally:
        for c in (a, b, carol, root):
            c.close()


def test_tenant_cannot_reach_other_tenants_slot(tenants):
    a, b = login(tenants, "alice", "apw"), login(tenants, "bob", "bpw")
    try:
        assert a.call("STATE.ALLOC", "only-a", 32) == "OK"
        assert a.call("STATE.WRITE", "only-a", 0, b"secret") == "OK"
        assert b.call("STATE.READ", "only-a", 0, 6) == RespError("ERR no such state slot 'only-a'")
        assert b.call("STATE.WRITE", "only-a", 0, b"x") == \
            RespError("ERR no such state slot 'only-a'")
        assert b.call("STATE.FREE", "only-a") == 0
        assert b.call("STATE.READ", "{only-a}", 0, 6) == \
            RespError("ERR no such state slot '{only-a}'")
        assert a.call("STATE.READ", "only-a", 0, 6) == b"secret"
        # Every test of this module frees what it allocates.
        assert a.call("STATE.INFO") == [b"slots", 1, b"bytes", 32]
        assert b.call("STATE.INFO") == [b"slots", 0, b"bytes", 0]
        assert a.call("STATE.FREE", "only-a") == 1
    finally:
        a.close()
        b.close()


def test_many_slots_per_tenant_across_shards(tenants):
    a, b = login(tenants, "alice", "apw", 30), login(tenants, "bob", "bpw", 30)
    try:
        for c, tag in ((a, b"a"), (b, b"b")):
            c.send(b"".join(encode("STATE.ALLOC", "k%d" % i, 8) +
                            encode("STATE.WRITE", "k%d" % i, 0, tag + b"%07d" % i)
                            for i in range(300)))
        for c in (a, b):
            for _ in range(600):
                assert c.read_reply() == "OK"
        for c, tag in ((a, b"a"), (b, b"b")):
            c.send(b"".join(encode("STATE.READ", "k%d" % i, 0, 8) for i in range(300)))
            for i in range(300):
                assert c.read_reply() == tag + b"%07d" % i
        assert a.call("STATE.INFO") == [b"slots", 300, b"bytes", 2400]
        assert b.call("STATE.INFO") == [b"slots", 300, b"bytes", 2400]
        for c in (a, b):
            c.send(b"".join(encode("STATE.FREE", "k%d" % i) for i in range(300)))
            for _ in range(300):
                assert c.read_reply() == 1
    finally:
        a.close()
        b.close()


def test_client_list_and_kill_are_tenant_scoped(tenants):
    a, carol, b, root = (login(tenants, "alice", "apw"), login(tenants, "carol", "cpw"),
                         login(tenants, "bob", "bpw"), login(tenants, "root", "rootpw"))
    try:
        ids = {n: c.call("CLIENT", "ID") for n, c in
               (("alice", a), ("carol", carol), ("bob", b), ("root", root))}
        bob_addr = [l for l in root.call("CLIENT", "LIST").decode().splitlines()
                    if l.startswith("id=%d " % ids["bob"])][0].split(" addr=")[1].split(" ")[0]

        lines = a.call("CLIENT", "LIST").decode().splitlines()
        assert lines and all(" tenant=tenant-a " in l for l in lines), lines
        listed = {int(l.split()[0][3:]) for l in lines}
        assert {ids["alice"], ids["carol"]} <= listed
        assert ids["bob"] not in listed and ids["root"] not in listed

        lines = b.call("CLIENT", "LIST").decode().splitlines()
        assert all(" tenant=tenant-b " in l for l in lines)
        assert ids["bob"] in {int(l.split()[0][3:]) for l in lines}

        # The default tenant (administrator) sees everyone.
        listed = {int(l.split()[0][3:]) for l in root.call("CLIENT", "LIST").decode().splitlines()}
        assert set(ids.values()) <= listed
        assert a.call("CLIENT", "LIST", "ID", ids["bob"]) == b""

        # alice cannot kill bob, by id or address.
        assert a.call("CLIENT", "KILL", "ID", ids["bob"]) == 0
        assert a.call("CLIENT", "KILL", "ADDR", bob_addr) == 0
        assert a.call("CLIENT", "KILL", bob_addr) == RespError("ERR No such client")
        assert a.call("CLIENT", "KILL", "USER", "bob") == 0
        assert b.call("PING") == "PONG"
        # alice can kill carol (same tenant).
        assert a.call("CLIENT", "KILL", "ID", ids["carol"]) == 1
        carol.expect_closed()
        # root can kill bob.
        assert root.call("CLIENT", "KILL", "ADDR", bob_addr) == 1
        b.expect_closed()
    finally:
        for c in (a, carol, b, root):
            c.close()


@pytest.mark.parametrize("cmd", [("CONFIG", "GET", "*"), ("CONFIG", "SET", "maxclients", "5"),
                                 ("CONFIG", "RESETSTAT"), ("SLOWLOG", "GET"), ("SLOWLOG", "RESET"),
                                 ("SHUTDOWN",), ("SHUTDOWN", "NOSAVE")],
                         ids=lambda c: "-".join(c))
def test_admin_commands_need_default_tenant(tenants, cmd):
    name = cmd[0].lower()
    want = ("-NOPERM this user has no permissions to run the '%s' command (administrative "
            "commands need a user of tenant 'default')\r\n" % name).encode()
    for user, pw in (("alice", "apw"), ("bob", "bpw")):
        with login(tenants, user, pw) as c:
            c.send(encode(*cmd))
            assert c.read_exact(len(want)) == want
            assert c.call("PING") == "PONG"
    assert tenants.alive()
    # Non-admin introspection stays available to tenants.
    with login(tenants, "alice", "apw") as c:
        assert isinstance(c.call("INFO", "server"), bytes)
        assert isinstance(c.call("COMMAND", "COUNT"), int)
    with login(tenants, "root", "rootpw") as c:
        assert c.call("CONFIG", "GET", "maxclients") == [b"maxclients", b"10000"]


# ------------------------------------------------------------------------------------------
# Bad users files
# ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("content,message", [
    ("alice apw\n", "line 1: expected '<user> <password> <tenant>'"),
    ("alice apw t extra\n", "line 1: expected '<user> <password> <tenant>'"),
    ("# ok\nalice a t\nalice b t\n", "line 3: user 'alice' defined twice"),
], ids=["two-fields", "four-fields", "duplicate"])
def test_bad_users_file_refuses_to_start(tmp_path, content, message):
    users = tmp_path / "users.txt"
    users.write_text(content)
    p = subprocess.run([SERVER_BIN, "--port", str(free_port()), "--metrics-port", "0", "--binary-port", "0",
                        "--dir", str(tmp_path), "--users", str(users)],
                       capture_output=True, text=True, timeout=10)
    assert p.returncode != 0
    assert message in p.stdout + p.stderr


def test_missing_users_file_refuses_to_start(tmp_path):
    p = subprocess.run([SERVER_BIN, "--port", str(free_port()), "--metrics-port", "0", "--binary-port", "0",
                        "--users", str(tmp_path / "nope.txt")],
                       capture_output=True, text=True, timeout=10)
    assert p.returncode != 0
    assert "nope.txt" in p.stdout + p.stderr
