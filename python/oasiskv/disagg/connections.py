"""The decode side's own connection to the ``oasis-rt`` daemon (:class:`Connections`): the
admission's reads (sections, summaries, the admission set) with their reconnect-and-retry
(:meth:`Connections.call`) and its wire bytes (:meth:`Connections.wire`).

The reads of block-heads into the host pool (decode-time misses, an admission's blocks) and the
releases of the daemon's copies are not here: the Rust coordinator (``oasiskv._core.Coordinator``,
crate ``oasis-coord``) makes them on connections and threads of its own
(:class:`~oasiskv.disagg.remote.RemoteKvSource`).
"""

from __future__ import annotations

import logging

from ..errors import RemoteError, RemoteTimeoutError, RemoteUnavailableError
from . import wire

log = logging.getLogger("oasiskv.disagg")


class Connections:
    """The clients of one decode engine's remote source.

    ``client`` is the decode loop's connection (replaced by a fresh one when :meth:`call`
    reconnects); ``retries``: how many times a call that failed in transport reconnects and tries
    again.
    """

    def __init__(self, url: str, token: str | bytes | None, timeout_s: float, retries: int) -> None:
        self.url = url
        self.token, self.timeout_s = token, float(timeout_s)
        self.retries = retries
        self.client = wire.connect(url, token, timeout_s)
        self._wire_base = 0  # wire bytes of the connections before the current one

    def open(self):
        """A fresh client of the same daemon (for a connection of the caller's own)."""
        return wire.connect(self.url, self.token, self.timeout_s)

    def wire(self) -> int:
        """Bytes of every frame sent and received so far, over this connection and the ones it
        replaced."""
        sent, received = self.client.wire_bytes
        return self._wire_base + sent + received

    def reconnect(self) -> bool:
        try:
            fresh = self.open()
        except RemoteError as e:
            log.warning("reconnecting to the staging daemon %s failed: %s", self.url, e)
            return False
        self._wire_base += sum(self.client.wire_bytes)
        self.client.close()
        self.client = fresh
        return True

    def call(self, fn, *args):
        """A client call, retried after a reconnect on a transport failure (``retries`` times)."""
        for attempt in range(self.retries + 1):
            try:
                return fn(self.client, *args)
            except (RemoteUnavailableError, RemoteTimeoutError):
                if attempt == self.retries or not self.reconnect():
                    raise
        raise AssertionError("unreachable")  # pragma: no cover

    def close(self) -> None:
        self.client.close()
