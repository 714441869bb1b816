"""``oasiskv.staging_daemon``: the library's launcher of ``oasis-rt serve`` (what the Fig. 12
bench and the tests start daemons with)."""

from __future__ import annotations

import subprocess

import pytest

from oasiskv._core import RtClient
from oasiskv.errors import ConfigError
from oasiskv.staging_daemon import StagingDaemon, find_binary
from support.rtd import need_binary

# Private names read here: ``RtClient`` from ``oasiskv._core`` (no public re-export): the client the
# tests talk to the launched daemon with.


def test_starts_serves_and_stops():
    with StagingDaemon(need_binary(), memory="64MiB") as d:
        assert d.url == f"oasis-rt://{d.addr}" and d.addr.startswith("127.0.0.1:")
        c = RtClient(d.url, timeout_s=10)
        assert c.stats()["live_requests"] == 0
        c.close()
    assert d.proc.poll() is not None  # stopped
    d.close()  # idempotent


def test_a_daemon_that_refuses_to_start_says_why():
    # A non-loopback address without a token: the daemon exits, and its own reason comes back.
    with pytest.raises(ConfigError, match="token"):
        StagingDaemon(need_binary(), listen="0.0.0.0:0")


def test_bad_arguments(tmp_path):
    with pytest.raises(ConfigError, match="transport"):
        StagingDaemon(need_binary(), transport="rdma")
    with pytest.raises(ConfigError, match="cargo build --release -p oasis-rt"):
        find_binary(str(tmp_path / "nope"))


def _serve_with_metrics(tmp_path, token: str) -> tuple[subprocess.Popen, str, str]:
    """``oasis-rt serve`` with a token and ``--metrics`` on free loopback ports: the process, the
    frames' address and the metrics' URL (the two lines it prints once bound)."""
    path = tmp_path / "token"
    path.write_text(token + "\n")
    path.chmod(0o600)
    args = [need_binary(), "serve", "--listen", "127.0.0.1:0", "--metrics", "127.0.0.1:0"]
    args += ["--memory", "64MiB", "--log", "warn", "--token-file", str(path)]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    assert proc.stdout is not None
    first, second = proc.stdout.readline().strip(), proc.stdout.readline().strip()
    assert first.startswith("oasis-rt listening on "), first
    assert second.startswith("oasis-rt metrics on "), second
    return proc, first.rsplit(" ", 1)[1], second.rsplit(" ", 1)[1]


#: Every family the daemon exposes (``prometheus_client`` names a counter without ``_total``).
RT_FAMILIES = {
    "oasis_rt_requests": "counter",
    "oasis_rt_errors": "counter",
    "oasis_rt_request_duration_seconds": "histogram",
    "oasis_rt_bytes_served": "counter",
    "oasis_rt_bytes_staged": "counter",
    "oasis_rt_bad_frames": "counter",
    "oasis_rt_connections": "counter",
    "oasis_rt_connections_refused": "counter",
    "oasis_rt_handshake_timeouts": "counter",
    "oasis_rt_evicted_requests": "counter",
    "oasis_rt_evicted_bytes": "counter",
    "oasis_rt_refused_stages": "counter",
    "oasis_rt_budget_bytes": "gauge",
    "oasis_rt_used_bytes": "gauge",
    "oasis_rt_live_requests": "gauge",
    "oasis_rt_expired_requests": "gauge",
    "oasis_rt_staged_blocks": "gauge",
    "oasis_rt_connections_active": "gauge",
    "oasis_rt_connection_slots": "gauge",
}


def test_metrics_parse_with_prometheus_client_and_need_the_token(tmp_path):
    """The daemon's ``/metrics`` is valid OpenMetrics (``prometheus_client``'s strict parser, and
    its Prometheus text parser), has every family, moves with traffic, and with a token needs it
    as a bearer token; another method is 405 with ``Allow`` (issue 33, finding 6)."""
    httpx = pytest.importorskip("httpx")
    from prometheus_client.openmetrics.parser import text_string_to_metric_families as parse_om
    from prometheus_client.parser import text_string_to_metric_families as parse_prom

    proc, addr, url = _serve_with_metrics(tmp_path, "s3cret")
    try:
        auth = {"Authorization": "Bearer s3cret"}
        assert httpx.get(url, timeout=10).status_code == 401
        assert httpx.get(url, headers={"Authorization": "Bearer nope"}, timeout=10).status_code == 401
        r = httpx.post(url, headers=auth, timeout=10)
        assert r.status_code == 405 and r.headers["allow"] == "GET, HEAD"

        c = RtClient(f"oasis-rt://{addr}", token=b"s3cret", timeout_s=10)
        geo = (2, 1, 4, 8, 2, 3, 0)  # 2 layers, 1 KV head, 4 tokens, head_dim 8, 2 bytes: 128 B blocks
        c.stage_blocks(7, geo, [(0, 0), (1, 2)], bytes(range(128)) * 2)
        r = httpx.get(url, headers=auth, timeout=10)
        assert r.status_code == 200 and r.headers["content-type"].startswith("application/openmetrics-text")
        families = {f.name: f for f in parse_om(r.text)}
        assert {n: f.type for n, f in families.items()} == RT_FAMILIES
        assert {f.name for f in parse_prom(r.text)} >= set(RT_FAMILIES)

        def value(family: str, sample: str, **labels: str) -> float:
            (v,) = [s.value for s in families[family].samples if s.name == sample and s.labels == labels]
            return v

        assert value("oasis_rt_requests", "oasis_rt_requests_total", kind="stage_blocks") == 1
        assert value("oasis_rt_requests", "oasis_rt_requests_total", kind="read_blocks") == 0
        assert value("oasis_rt_errors", "oasis_rt_errors_total", code="busy") == 0
        hist = "oasis_rt_request_duration_seconds"
        assert value(hist, hist + "_count", kind="stage_blocks") == 1
        assert value(hist, hist + "_bucket", kind="stage_blocks", le="+Inf") == 1
        # Accounted bytes: the request's 512, and each block's 128 with its 64.
        assert value("oasis_rt_bytes_staged", "oasis_rt_bytes_staged_total") == 512 + 2 * (128 + 64)
        assert value("oasis_rt_staged_blocks", "oasis_rt_staged_blocks") == 2
        assert value("oasis_rt_live_requests", "oasis_rt_live_requests") == 1
        assert value("oasis_rt_connections_active", "oasis_rt_connections_active") == 1
        assert value("oasis_rt_budget_bytes", "oasis_rt_budget_bytes") == 64 << 20
        c.close()
    finally:
        proc.terminate()
        proc.wait(timeout=10)
