"""``oasiskv.staging_daemon``: the library's launcher of ``oasis-rt serve`` (what the Fig. 12
bench and the tests start daemons with)."""

from __future__ import annotations

import pytest

from oasiskv._core import RtClient
from oasiskv.errors import ConfigError
from oasiskv.staging_daemon import StagingDaemon, find_binary
from rtd import need_binary


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
