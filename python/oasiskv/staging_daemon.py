"""The ``oasis-rt`` staging daemon as a child process: ``StagingDaemon`` starts ``oasis-rt serve``
on a loopback port (by default a free one), waits for its address and stops it on ``close``.

What the Fig. 12 bench (``oasiskv.bench.disagg``) and the tests use to get a daemon; in
production run ``oasis-rt serve`` under your service manager instead. The daemon's log goes to a
file (a pipe nobody drains could stall it), read back into the error if it fails to start.
"""

from __future__ import annotations

import os
import select
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from .errors import ConfigError

#: How long the daemon may take to print its address (generous, for a loaded machine).
START_TIMEOUT_S = 30.0
#: The transports ``oasis-rt serve --transport`` takes, and each one's URL scheme.
SCHEMES = {"tcp": "oasis-rt://", "ucx": "oasis-rt+ucx://"}


def find_binary(path: str | None = None) -> str:
    """``path``, else ``$OASIS_RT_BIN``, ``target/release/oasis-rt`` of this checkout, or
    ``oasis-rt`` on the PATH: the first that is an executable file."""
    cands = [path] if path else []
    if not path:
        if os.environ.get("OASIS_RT_BIN"):
            cands.append(os.environ["OASIS_RT_BIN"])
        cands.append(str(Path(__file__).resolve().parents[2] / "target" / "release" / "oasis-rt"))
        cands.append(shutil.which("oasis-rt") or "")
    for c in cands:
        if c and os.path.isfile(c) and os.access(c, os.X_OK):
            return c
    raise ConfigError(
        f"no oasis-rt binary ({path or 'searched $OASIS_RT_BIN, target/release/oasis-rt, PATH'}): "
        "build it with cargo build --release -p oasis-rt --features ucx, or pass its path"
    )


class StagingDaemon:
    """``oasis-rt serve`` as a child process. ``addr`` is where it listens (``HOST:PORT``), ``url``
    the URL a client passes (``kv_source=``, ``PrefillWorker(addr=)``).

    Args:
        binary: the ``oasis-rt`` executable (default: :func:`find_binary`).
        memory: its staging budget (``--memory``, e.g. ``"64GiB"``).
        transport: ``"tcp"`` or ``"ucx"``.
        listen: ``HOST:PORT``; port 0 takes a free one. A non-loopback address needs ``token``.
        token: a shared token, written to a private file for ``--token-file``.
        lease_s: ``--lease`` (seconds a staged request lives unclaimed), or the daemon's default.
        idle_timeout_s: ``--idle-timeout-s`` (seconds a connection may sit between frames before
            the daemon closes it), or the daemon's default.
        log_level: ``--log``.

    Raises ``ConfigError`` when there is no binary or the daemon does not start (with its log).
    Use as a context manager, or call :meth:`close`.
    """

    def __init__(
        self,
        binary: str | None = None,
        *,
        memory: str = "1GiB",
        transport: str = "tcp",
        listen: str = "127.0.0.1:0",
        token: str | None = None,
        lease_s: int | None = None,
        idle_timeout_s: int | None = None,
        log_level: str = "warn",
        start_timeout_s: float = START_TIMEOUT_S,
    ) -> None:
        if transport not in SCHEMES:
            raise ConfigError(f"transport must be one of {tuple(SCHEMES)}, got {transport!r}")
        binary = find_binary(binary)
        args = [binary, "serve", "--listen", listen, "--memory", memory, "--log", log_level]
        args += ["--transport", transport]
        self._dir = tempfile.TemporaryDirectory(prefix="oasis-rt-")
        if token is not None:
            path = Path(self._dir.name) / "token"
            path.write_text(token + "\n")
            path.chmod(0o600)
            args += ["--token-file", str(path)]
        if lease_s is not None:
            args += ["--lease", str(int(lease_s))]
        if idle_timeout_s is not None:
            args += ["--idle-timeout-s", str(int(idle_timeout_s))]
        self.log_path = Path(self._dir.name) / "log"
        with self.log_path.open("w") as err:
            self.proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=err, text=True)
        line = self._first_line(start_timeout_s)
        if not line.startswith("oasis-rt listening on "):
            why = self.log_text()[-2000:].strip()
            self.close()
            raise ConfigError(f"the daemon did not start ({' '.join(args)}): {line.strip()!r} {why}")
        self.transport = transport
        self.addr = line.strip().rsplit(" ", 1)[1]
        self.url = SCHEMES[transport] + self.addr

    def _first_line(self, timeout_s: float) -> str:
        deadline = time.monotonic() + timeout_s
        assert self.proc.stdout is not None
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return ""
            ready, _, _ = select.select([self.proc.stdout], [], [], left)
            if ready:
                return self.proc.stdout.readline()  # "" at EOF: the daemon exited

    def log_text(self) -> str:
        """The daemon's log so far."""
        try:
            return self.log_path.read_text()
        except OSError:
            return ""

    def close(self) -> None:
        """Stop the daemon (SIGTERM, then SIGKILL after 10 s); idempotent."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        self._dir.cleanup()

    def __enter__(self) -> StagingDaemon:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
