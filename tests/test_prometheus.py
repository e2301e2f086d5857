"""/metrics scraped by a real Prometheus, and the Grafana dashboard built from its series.

One pion-server (2 shards, --maxmemory 2mb so V-store chunks move to disk and back) gets a
fixed batch of V.*, KV.PREFIX.* and ATTEND.PREFIX.* commands, errors and rejections. Then:
- `promtool check metrics` on its exposition: no parse error, and no lint problem beyond
  KNOWN_LINT;
- Debian's `prometheus` (its own process on a free loopback port, its own config and TSDB in
  the test's tmp dir; the packaged systemd service plays no part) scrapes it every second: the
  target is up with no scrape error, every sample line was ingested, none dropped as a
  duplicate, HELP/TYPE arrive as metadata, and PromQL over the pion series gives the counts of
  the traffic sent, also after a second batch sent while it scrapes;
- every PromQL expression of docs/grafana-dashboard.json evaluates on that Prometheus, and
  every pion_* name in it is a series of the exposition (the cuda-only ones: CUDA_ONLY).

Skipped only where the prometheus or promtool binary is absent (scripts/install-deps.sh
installs them). Run with Debian's interpreter:

    PION_SERVER=build/pion-server /usr/bin/python3 -m pytest -q tests/test_prometheus.py
"""
from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from pionlib import (ATTENTION_BACKEND, HOST, REPO, RespError, ServerFactory, _LIVE,
                     _die_with_parent, _stop_process, free_port, wait_for)

DASHBOARD = REPO / "docs" / "grafana-dashboard.json"
METRICS_SRC = REPO / "src" / "server" / "metrics_http.cc"
PROMETHEUS = shutil.which("prometheus")
PROMTOOL = shutil.which("promtool")
NEEDS_PROMETHEUS = pytest.mark.skipif(
    PROMETHEUS is None, reason="no prometheus binary: Debian's prometheus package is not "
                               "installed (scripts/install-deps.sh installs it)")
NEEDS_PROMTOOL = pytest.mark.skipif(
    PROMTOOL is None, reason="no promtool binary: Debian's prometheus package is not "
                             "installed (scripts/install-deps.sh installs it)")

# promtool's lint findings that are known and accepted; any other fails the test.
KNOWN_LINT = {
    # A counter of microseconds (Prometheus wants base units: seconds). Renaming it would
    # break existing queries; the dashboard divides by 1e6.
    'pion_attention_compute_microseconds_total use base unit "seconds" instead of "microseconds"',
}
# Exposed only with --attention-backend cuda (metrics_http.cc: `if (server.gpu_attention())`).
CUDA_ONLY = {"pion_attention_gpu_bytes", "pion_attention_gpu_memory_limit_bytes",
             "pion_attention_gpu_upload_failures_total"}

SCRAPE_DEADLINE = 15.0  # seconds for Prometheus to start, scrape and see a change


# ------------------------------------------------------------------------------------------
# The traffic
# ------------------------------------------------------------------------------------------

D_V = 256           # V-store row width (fp32: 1 KiB a row, 64 KiB a 64-row chunk)
V_ROWS = 4096       # 4 MiB of rows against --maxmemory 2mb: chunks go to disk
V_BATCH = 512
H, N, D = 2, 64, 64  # attention slot: heads, tokens, head dim


def f32(a) -> bytes:
    return np.ascontiguousarray(a, dtype="<f4").tobytes()


def ok(reply):
    assert not isinstance(reply, RespError), reply
    return reply


def first_batch(srv) -> None:
    """A fixed batch; the expected counts are in EXPECTED."""
    rng = np.random.default_rng(7)
    rows = rng.standard_normal((V_ROWS, D_V)).astype("<f4")
    with srv.raw() as c:
        # KV.PREFIX.*: a 2-layer, 64-token namespace written through its V sessions.
        assert c.call("KV.PREFIX.REGISTER", "ns", 2, N, H, D, "fp16", "MODEL", "m") == "OK"
        kv = rng.standard_normal((2 * N, H * D)).astype("<f4")
        assert c.call("V.STOREBATCH", "ns_pk", 0, f32(kv)) == 2 * N
        assert c.call("V.STOREBATCH", "ns_pv", 0, f32(kv)) == 2 * N
        assert c.call("KV.PREFIX.LOOKUP", "ns", "MODEL", "m") == "HIT"
        assert c.call("KV.PREFIX.SAVE", "ns") == "OK"
        ok(c.call("KV.PREFIX.INFO", "ns"))
        # ATTEND.PREFIX.*: a slot from a blob, 3 dense queries, a slot FROM the namespace, SAVE.
        k = rng.standard_normal((H, N, D)).astype("<f4")
        assert c.call("ATTEND.PREFIX.STORE", "a", 0, H, N, D, f32(k), f32(k)) == "OK"
        q = rng.standard_normal((H, 1, D)).astype("<f4")
        for _ in range(3):
            assert len(ok(c.call("ATTEND.PREFIX.QUERY", "a", 0, H, D, 0, f32(q)))) == H * D * 4
        assert c.call("ATTEND.PREFIX.STORE", "b", 0, "FROM", "ns") == "OK"
        assert c.call("ATTEND.PREFIX.SAVE", "a") == "OK"
        # V.*, twice --maxmemory of rows: 1 CREATE, 8 STOREBATCH, 1 FETCH (of chunks now on
        # disk), SNAPSHOT, COMMIT (last: it holds the chunks it writes), INFO.
        assert c.call("V.CREATE", "sess", D_V, "fp32") == "OK"
        for i in range(0, V_ROWS, V_BATCH):
            assert c.call("V.STOREBATCH", "sess", i, f32(rows[i:i + V_BATCH])) == V_BATCH
        assert c.call("V.FETCH", "sess", "RANGE", 0, 128) == f32(rows[:128])
        snap = ok(c.call("V.SNAPSHOT", "sess"))
        assert c.call("V.COMMIT", "sess", snap) == "OK"
        ok(c.call("V.INFO", "sess"))
        # Errors: two failing commands, an unknown command, a wrong arity.
        assert isinstance(c.call("V.FETCH", "nosuch", 0), RespError)
        assert isinstance(c.call("ATTEND.PREFIX.QUERY", "nope", 0, H, D, 0, f32(q)), RespError)
        assert isinstance(c.call("NOPE"), RespError)
        assert isinstance(c.call("V.CREATE", "x"), RespError)


SECOND_FETCHES = 5


def second_batch(srv) -> None:
    with srv.raw() as c:
        for i in range(SECOND_FETCHES):
            ok(c.call("V.FETCH", "sess", "RANGE", i * 64, i * 64 + 64))


# PromQL (job="pion" is the scrape job) -> the value it must have after first_batch.
EXPECTED = {
    'pion_commands_total{cmd="v.create"}': 1,
    'pion_commands_total{cmd="v.storebatch"}': V_ROWS // V_BATCH + 2,
    'pion_commands_total{cmd="v.fetch"}': 2,
    'pion_commands_total{cmd="v.commit"}': 1,
    'pion_commands_total{cmd="kv.prefix.register"}': 1,
    'pion_commands_total{cmd="kv.prefix.lookup"}': 1,
    'pion_commands_total{cmd="kv.prefix.save"}': 1,
    'pion_commands_total{cmd="attend.prefix.store"}': 2,
    'pion_commands_total{cmd="attend.prefix.query"}': 4,
    'pion_commands_total{cmd="attend.prefix.save"}': 1,
    'sum(pion_commands_total{cmd=~"v\\\\..*"})': 1 + V_ROWS // V_BATCH + 2 + 2 + 1 + 1 + 1,
    'pion_command_errors_total{cmd="v.fetch"}': 1,
    'pion_command_errors_total{cmd="attend.prefix.query"}': 1,
    'pion_command_rejected_total{cmd="v.create"}': 1,
    'pion_rejected_total{reason="unknown_command"}': 1,
    'pion_rejected_total{reason="wrong_arity"}': 1,
    'pion_attention_queries_total{form="dense"}': 3,
    'pion_attention_misses_total': 1,
    'pion_attention_slots': 2,
    'pion_command_duration_seconds_count{cmd="v.storebatch"}': V_ROWS // V_BATCH + 2,
    'pion_command_duration_seconds_bucket{cmd="attend.prefix.query",le="+Inf"}': 4,
}
# PromQL -> a predicate on its value.
CHECKS = {
    'pion_residency_demotions_total{from="host",to="disk"}': lambda v: v >= 1,
    'pion_residency_promotions_total{from="disk",to="host"}': lambda v: v >= 1,
    'pion_residency_bytes{tier="disk"}': lambda v: v >= 64 * 1024,
    'pion_residency_disk_used_bytes': lambda v: v > 0,
    'pion_memory_used_bytes{family="vstore"}': lambda v: 0 < v <= 2 * 1024 * 1024,
    'pion_memory_max_bytes': lambda v: v == 2 * 1024 * 1024,
    'pion_residency_limit_bytes{tier="host"}': lambda v: v == 2 * 1024 * 1024,
    'pion_process_resident_bytes': lambda v: v > 1e6,
    'pion_net_input_bytes_total': lambda v: v >= V_ROWS * D_V * 4,
    'pion_connections_received_total': lambda v: v >= 1,
    'histogram_quantile(0.5, pion_command_duration_seconds_bucket{cmd="v.storebatch"})':
        lambda v: 0 < v <= 10,
}


# ------------------------------------------------------------------------------------------
# Fixtures
# ------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    """(server, its exposition right after first_batch)."""
    f = ServerFactory(tmp_path_factory.mktemp("prom_pion"))
    try:
        srv = f("--workers", "2", "--maxmemory", "2mb")
        first_batch(srv)
        yield srv, srv.metrics_text()
    finally:
        f.stop_all()


class Prometheus:
    """A prometheus process of our own, scraping one target every second."""

    def __init__(self, workdir: Path, target_port: int):
        self.workdir = workdir
        self.config = workdir / "prometheus.yml"
        self.config.write_text(
            "global:\n"
            "  scrape_interval: 1s\n"
            "  scrape_timeout: 1s\n"
            "  evaluation_interval: 1s\n"
            "scrape_configs:\n"
            "  - job_name: pion\n"
            "    static_configs:\n"
            "      - targets: ['%s:%d']\n" % (HOST, target_port))
        self.log_path = workdir / "prometheus.log"
        self.proc: subprocess.Popen | None = None
        self.port = 0

    def start(self) -> "Prometheus":
        for attempt in range(3):  # a port picked free may be taken before prometheus binds it
            self.port = free_port()
            log = open(self.log_path, "ab")
            try:
                self.proc = subprocess.Popen(
                    [PROMETHEUS, "--config.file=%s" % self.config,
                     "--storage.tsdb.path=%s" % (self.workdir / ("tsdb%d" % attempt)),
                     "--web.listen-address=%s:%d" % (HOST, self.port),
                     "--storage.tsdb.retention.time=1h"],
                    stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                    cwd=str(self.workdir), preexec_fn=_die_with_parent)
            finally:
                log.close()
            _LIVE.add(self.proc)
            deadline = time.monotonic() + SCRAPE_DEADLINE
            while time.monotonic() < deadline and self.proc.poll() is None:
                try:
                    with urllib.request.urlopen("http://%s:%d/-/ready" % (HOST, self.port),
                                                timeout=1) as r:
                        if r.status == 200:
                            return self
                except (urllib.error.URLError, OSError):
                    pass
                time.sleep(0.05)
            self.stop()
            if "address already in use" not in self.log_text():
                break
        raise RuntimeError("prometheus did not become ready:\n%s" % self.log_text()[-4000:])

    def stop(self) -> None:
        if self.proc is not None:
            _stop_process(self.proc)

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def get(self, path: str, **params) -> dict:
        url = "http://%s:%d%s" % (HOST, self.port, path)
        if params:
            url += "?" + urllib.parse.urlencode(params)
        try:
            with urllib.request.urlopen(url, timeout=5) as r:
                body = json.loads(r.read())
        except urllib.error.HTTPError as e:
            body = json.loads(e.read())
        assert body.get("status") == "success", "%s: %s" % (url, body)
        return body["data"]

    def text(self, path: str) -> str:
        with urllib.request.urlopen("http://%s:%d%s" % (HOST, self.port, path), timeout=5) as r:
            return r.read().decode()

    def query(self, expr: str) -> list[dict]:
        data = self.get("/api/v1/query", query=expr)
        assert data["resultType"] == "vector", (expr, data)
        return data["result"]

    def value(self, expr: str) -> float | None:
        """The single value of an instant query, None when it has no result yet."""
        result = self.query(expr)
        assert len(result) <= 1, (expr, result)
        return float(result[0]["value"][1]) if result else None


@pytest.fixture(scope="module")
def prom(loaded, tmp_path_factory):
    srv, _ = loaded
    p = Prometheus(tmp_path_factory.mktemp("prometheus"), srv.metrics_port)
    try:
        yield p.start()
    finally:
        p.stop()
        assert p.proc is None or p.proc.poll() is not None, "prometheus still running"


# ------------------------------------------------------------------------------------------
# Helpers
# ------------------------------------------------------------------------------------------

def sample_names(text: str) -> set[str]:
    """The series names of an exposition (histograms: their _bucket/_sum/_count)."""
    return {re.match(r"[a-zA-Z_:][a-zA-Z0-9_:]*", line).group(0)
            for line in text.splitlines() if line and not line.startswith("#")}


def sample_count(text: str) -> int:
    return sum(1 for line in text.splitlines() if line and not line.startswith("#"))


def with_job(expr: str) -> str:
    """Scopes every pion_* selector of one of our queries to job="pion"."""
    def add(m):
        name, labels = m.group(1), m.group(2)
        if labels:
            return '%s{job="pion",%s}' % (name, labels[1:-1])
        return '%s{job="pion"}' % name
    return re.sub(r'\b(pion_[a-zA-Z0-9_]+)(\{[^}]*\})?', add, expr)


def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def all_panels(d: dict) -> list[dict]:
    out = []
    for p in d["panels"]:
        out.append(p)
        out.extend(p.get("panels", []))  # collapsed rows hold their panels
    return out


def dashboard_exprs(d: dict) -> list[str]:
    return [t["expr"] for p in all_panels(d) for t in p.get("targets", []) if "expr" in t]


def dashboard_queries(d: dict) -> list[str]:
    """Everything in the dashboard that names series: panel exprs and variable queries."""
    out = dashboard_exprs(d)
    for v in d.get("templating", {}).get("list", []):
        q = v.get("query")
        out.append(q["query"] if isinstance(q, dict) else (q or ""))
        out.append(v.get("definition", ""))
    return out


def as_promql(expr: str) -> str:
    """A dashboard expr with Grafana's variables as Grafana would substitute them."""
    return (expr.replace("$__rate_interval", "5s").replace("$__interval", "1s")
                .replace("$__range", "1m").replace("$job", ".*").replace("$instance", ".*"))


# ------------------------------------------------------------------------------------------
# Tests
# ------------------------------------------------------------------------------------------

@NEEDS_PROMTOOL
def test_promtool_check_metrics(loaded):
    srv, text = loaded
    for body in (text, srv.metrics_text()):
        p = subprocess.run([PROMTOOL, "check", "metrics"], input=body, capture_output=True,
                           text=True, timeout=30)
        # promtool: 0 clean, 3 lint problems only, anything else a parse error.
        findings = [line.strip() for line in (p.stdout + p.stderr).splitlines() if line.strip()]
        assert p.returncode in (0, 3), "promtool check metrics failed (rc %d):\n%s" % (
            p.returncode, "\n".join(findings))
        unexpected = [f for f in findings if f not in KNOWN_LINT]
        assert not unexpected, "promtool lint problems:\n%s" % "\n".join(unexpected)
        assert (p.returncode == 0) == (not findings), (p.returncode, findings)


@NEEDS_PROMETHEUS
def test_prometheus_scrapes_pion(loaded, prom):
    srv, text = loaded

    def target():
        active = prom.get("/api/v1/targets")["activeTargets"]  # [] until discovery ran
        assert len(active) <= 1, active
        return active[0] if active and active[0]["health"] == "up" else None

    t = wait_for(target, timeout=SCRAPE_DEADLINE, interval=0.1, what="the pion target up")
    assert t["lastError"] == "", t
    assert t["scrapeUrl"] == "http://%s:%d/metrics" % (HOST, srv.metrics_port)
    assert t["labels"]["job"] == "pion"
    assert prom.value('up{job="pion"}') == 1

    # Every sample line arrived (the traffic is over: the set of series is fixed now).
    assert prom.value('scrape_samples_scraped{job="pion"}') == sample_count(srv.metrics_text())
    # The batch's counts, through PromQL.
    for expr, want in EXPECTED.items():
        got = wait_for(lambda: prom.value(with_job(expr)), timeout=5, interval=0.1, what=expr)
        assert got == want, "%s = %s, expected %s" % (expr, got, want)
    for expr, pred in CHECKS.items():
        got = prom.value(with_job(expr))
        assert got is not None and pred(got), "%s = %s" % (expr, got)
    # Every reason label is a series, zero or not.
    reasons = prom.query('pion_rejected_total{job="pion"}')
    assert len(reasons) == text.count("pion_rejected_total{reason=")

    # HELP and TYPE arrive as metadata.
    meta = prom.get("/api/v1/metadata", metric="pion_command_duration_seconds")
    assert meta["pion_command_duration_seconds"][0]["type"] == "histogram"
    meta = prom.get("/api/v1/metadata", metric="pion_commands_total")
    assert meta["pion_commands_total"][0] == {"type": "counter", "help": "Commands executed.",
                                              "unit": ""}

    # A live scrape: more traffic shows up within a few scrape intervals.
    fetch = with_job('pion_commands_total{cmd="v.fetch"}')
    before = prom.value(fetch)
    second_batch(srv)
    wait_for(lambda: prom.value(fetch) == before + SECOND_FETCHES, timeout=SCRAPE_DEADLINE,
             interval=0.2, what="v.fetch to reach %d" % (before + SECOND_FETCHES))
    wait_for(lambda: (prom.value('rate(%s[5s])' % fetch) or 0) > 0, timeout=SCRAPE_DEADLINE,
             interval=0.2, what="a non-zero rate of v.fetch")

    # Nothing Prometheus had to drop (duplicate series, out-of-order samples).
    own = prom.text("/metrics")
    for name in ("prometheus_target_scrapes_sample_duplicate_timestamp_total",
                 "prometheus_target_scrapes_sample_out_of_order_total",
                 "prometheus_target_scrapes_sample_out_of_bounds_total"):
        m = re.search(r"^%s (\S+)$" % name, own, re.M)
        assert m and float(m.group(1)) == 0, "%s: %s" % (name, m and m.group(0))


@NEEDS_PROMETHEUS
def test_dashboard_exprs_evaluate(prom, loaded):
    """Every expression of the dashboard is valid PromQL on a real Prometheus and, after the
    traffic, has data."""
    wait_for(lambda: prom.value('up{job="pion"}') == 1, timeout=SCRAPE_DEADLINE, interval=0.1,
             what="the pion target up")
    # rate() over $__rate_interval (5s here) needs two scrapes in the window.
    wait_for(lambda: (prom.value('count_over_time(up{job="pion"}[5s])') or 0) >= 3,
             timeout=SCRAPE_DEADLINE, interval=0.2, what="three scrapes")
    exprs = dashboard_exprs(dashboard())
    empty = []
    for e in exprs:
        q = as_promql(e)
        data = prom.get("/api/v1/query", query=q)  # asserts status success
        if data["resultType"] == "vector" and not data["result"]:
            empty.append(q)
    # Only a query that hides zeros (`> 0`) or reads a cuda-only series may come back empty:
    # any other empty one is a broken selector (a misspelt label value, a wrong regex).
    def may_be_empty(q):
        return q.rstrip().endswith("> 0") or (
            ATTENTION_BACKEND != "cuda" and any(n in q for n in CUDA_ONLY))
    broken = [q for q in empty if not may_be_empty(q)]
    assert not broken, "dashboard queries without data:\n%s" % "\n".join(broken)


def test_dashboard_uses_only_exposed_series(loaded):
    srv, text = loaded
    names = sample_names(text) | sample_names(srv.metrics_text())
    d = dashboard()
    used = set()
    for q in dashboard_queries(d):
        used |= set(re.findall(r"\bpion_[a-zA-Z0-9_:]*", q))
    assert len(used) >= 30, sorted(used)
    src = METRICS_SRC.read_text()
    if ATTENTION_BACKEND == "cuda":
        missing = sorted(used - names)
    else:
        # The cuda-only series: absent here, and in the GPU-only block of the exposition.
        assert not (CUDA_ONLY & names), sorted(CUDA_ONLY & names)
        gpu_block = src[src.index("if (server.gpu_attention())"):src.index(
            "if (residency::Engine* e = server.residency())")]
        for n in CUDA_ONLY:
            assert '"%s"' % n in gpu_block, n
        missing = sorted(used - names - CUDA_ONLY)
    assert not missing, "dashboard names series pion-server does not expose: %s" % missing


def test_dashboard_is_importable():
    """The shape Grafana's import needs: a datasource input every panel and variable uses,
    unique panel ids, a grid position per panel, a uid and a title."""
    d = dashboard()
    assert d["title"] and re.fullmatch(r"[a-zA-Z0-9_-]{1,40}", d["uid"])
    assert 36 <= d["schemaVersion"] <= 40
    inputs = {i["name"]: i for i in d["__inputs"]}
    assert inputs["DS_PROMETHEUS"]["type"] == "datasource"
    assert inputs["DS_PROMETHEUS"]["pluginId"] == "prometheus"
    ds = {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}
    panels = all_panels(d)
    assert len({p["id"] for p in panels}) == len(panels)
    for p in panels:
        assert {"x", "y", "w", "h"} <= set(p["gridPos"]), p["title"]
        if p["type"] == "row":
            continue
        assert p["datasource"] == ds, p["title"]
        assert p["targets"], p["title"]
        for t in p["targets"]:
            assert t["datasource"] == ds and t["expr"] and t["refId"], p["title"]
    for v in d["templating"]["list"]:
        if v["type"] == "query":
            assert v["datasource"] == ds, v["name"]
    # Each panel's selectors honour the dashboard's variables.
    for e in dashboard_exprs(d):
        for sel in re.findall(r"\bpion_[a-zA-Z0-9_]+(\{[^}]*\})?", e):
            assert 'job=~"$job"' in sel and 'instance=~"$instance"' in sel, e
