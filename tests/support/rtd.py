"""The ``oasis-rt`` staging daemon for the tests: the cargo-built binary, as its own process on a
free loopback port (``Daemon``, over TCP or UCX), and the binary's path (``rt_binary``).

``TRANSPORTS`` parametrizes a test over both transports: the UCX case carries the ``ucx`` marker,
so ``make test`` (no UCX needed) deselects it and ``make test-ucx`` runs it, where a missing libucp
is a failure, never a skip."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from functools import cache
from pathlib import Path

import pytest

from oasiskv.staging_daemon import StagingDaemon

#: ``@pytest.mark.parametrize("transport", TRANSPORTS)``: TCP, and UCX under the ``ucx`` marker.
TRANSPORTS = ["tcp", pytest.param("ucx", marks=pytest.mark.ucx)]

ROOT = Path(__file__).resolve().parents[2]
#: How long the daemon may take to print its address (arbitrary, generous for a loaded CI box).
START_TIMEOUT_S = 30.0


@cache
def rt_binary() -> str | None:
    """``$OASIS_RT_BIN``, else ``oasis-rt`` in cargo's target directory (``cargo metadata``'s, so
    ``CARGO_TARGET_DIR`` counts), built (or brought up to date: a no-op when fresh) with cargo when
    cargo is here; None when there is neither binary nor cargo. Built with the ``ucx`` feature
    (libucp is loaded at run time, so it also serves TCP where UCX is absent)."""
    env = os.environ.get("OASIS_RT_BIN")
    if env:
        return env
    path = ROOT / "target" / "release" / "oasis-rt"
    cargo = shutil.which("cargo")
    if cargo is not None:
        subprocess.run(
            [cargo, "build", "--release", "--quiet", "-p", "oasis-rt", "--features", "ucx"]
            + ["--bin", "oasis-rt"],
            cwd=ROOT,
            check=True,
        )
        meta = subprocess.run(
            [cargo, "metadata", "--format-version", "1", "--no-deps"],
            cwd=ROOT,
            check=True,
            capture_output=True,
            text=True,
        )
        path = Path(json.loads(meta.stdout)["target_directory"]) / "release" / "oasis-rt"
    return str(path) if path.exists() else None


def need_binary() -> str:
    b = rt_binary()
    if b is None:
        pytest.skip("no oasis-rt binary and no cargo: cargo build --release -p oasis-rt, or set OASIS_RT_BIN")
    return b


class Daemon(StagingDaemon):
    """``oasis-rt serve`` on ``127.0.0.1:0`` over ``transport`` (``"tcp"`` or ``"ucx"``), from the
    cargo-built binary (``oasiskv.staging_daemon.StagingDaemon``, the library's launcher); ``addr``
    is where it listens, ``url`` the client's URL for it. Adds the signals the fault tests send:
    :meth:`kill`, :meth:`stop` and :meth:`cont` (SIGKILL, SIGSTOP, SIGCONT)."""

    def __init__(
        self,
        memory: str = "256MiB",
        token: str | None = None,
        lease_s: int | None = None,
        transport: str = "tcp",
        idle_timeout_s: int | None = None,
    ):
        super().__init__(
            need_binary(), memory=memory, transport=transport, token=token, lease_s=lease_s,
            idle_timeout_s=idle_timeout_s, start_timeout_s=START_TIMEOUT_S,
        )  # fmt: skip

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def stop(self) -> None:
        """SIGSTOP, and wait until the process is stopped (delivery is asynchronous)."""
        os.kill(self.proc.pid, signal.SIGSTOP)
        stat = Path(f"/proc/{self.proc.pid}/stat")
        if stat.exists():
            assert wait_until(lambda: stat.read_text().rsplit(")", 1)[1].split()[0] in "Tt"), "not stopped"

    def cont(self) -> None:
        os.kill(self.proc.pid, signal.SIGCONT)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.cont()  # a stopped daemon would ignore SIGTERM until continued
        super().close()


def wait_until(cond, timeout_s: float = 10.0) -> bool:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.02)
    return cond()
