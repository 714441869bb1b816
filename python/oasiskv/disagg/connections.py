"""The decode side's connections to the ``oasis-rt`` daemon (:class:`Connections`): the decode
loop's own client with its reconnect-and-retry (:meth:`Connections.call`), the wire bytes of
every connection (:meth:`Connections.wire`), the release of a daemon's copy, and the extra
connections a large read spreads its frames over, one thread each
(:meth:`Connections.start_parallel_reads`).

What reads and where the bytes go is :class:`~oasiskv.disagg.remote.RemoteKvSource`'s; this room
only holds and drives the clients (issue 37 moves these reads into a Rust coordinator).
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor

from ..errors import RemoteError, RemoteTimeoutError, RemoteUnavailableError
from . import wire

log = logging.getLogger("oasiskv.disagg")


class Connections:
    """The clients of one decode engine's remote source.

    ``client`` is the decode loop's connection (replaced by a fresh one when :meth:`call`
    reconnects); ``retries``: how many times a call that failed in transport reconnects and tries
    again; ``read_connections``: connections a large read spreads its frames over (1: the loop's
    own alone; the others, ``read_clients``, are opened on first use).
    """

    def __init__(self, url: str, token: str | bytes | None, timeout_s: float, retries: int) -> None:
        self.url = url
        self.token, self.timeout_s = token, float(timeout_s)
        self.retries = retries
        self.client = wire.connect(url, token, timeout_s)
        #: Connections a large read in the decode loop spreads its frames over (1: the loop's
        #: own connection alone).
        self.read_connections = wire.READ_CONNECTIONS
        self.read_clients: list = []  # the extra connections of those reads
        self._read_helpers: ThreadPoolExecutor | None = None
        self._wire_base = 0  # wire bytes of the connections before the current one

    def open(self):
        """A fresh client of the same daemon (for a connection of the caller's own)."""
        return wire.connect(self.url, self.token, self.timeout_s)

    def wire(self) -> int:
        """Bytes of every frame sent and received so far, over every connection."""
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

    def release(self, daemon_id: int) -> None:
        """Release a staged request's copy in the daemon (best effort: a failure is logged)."""
        try:
            self.client.release(daemon_id)
        except RemoteError as e:
            log.warning("releasing staged request %s in the daemon failed: %s", daemon_id, e)

    def start_parallel_reads(self, bounds: list, read_into):
        """Read the frames ``bounds[j] = (lo, hi)`` with ``j % k != 0`` into the host pool
        (``read_into(client, lo, hi)``, returning the entries' errors) on ``k - 1`` extra
        connections, one thread each (``k = read_connections``); the caller reads
        the others on the loop's own connection meanwhile. Returns ``(k, wait)``: ``wait(j)``
        blocks until frame ``j``'s connection is done and gives ``(errors, wire bytes)``, or None
        when that connection failed first (the caller reads the frame again on its own
        connection, with retries; the failed connection is dropped, a fresh one opened next
        time)."""
        k = min(self.read_connections, len(bounds))
        while len(self.read_clients) < k - 1:
            self.read_clients.append(self.open())
        if self._read_helpers is None:
            self._read_helpers = ThreadPoolExecutor(
                max_workers=self.read_connections - 1, thread_name_prefix="oasis-read"
            )

        def work(c, mine: list) -> dict:
            out = {}
            for lo, hi in mine:
                w0 = sum(c.wire_bytes)
                try:
                    errors = read_into(c, lo, hi)
                except RemoteError as e:
                    log.warning("a parallel read from the staging daemon failed: %s", e)
                    break  # the caller reads the rest of this connection's frames
                out[lo] = (errors, sum(c.wire_bytes) - w0)
            return out

        clients = self.read_clients[: k - 1]
        futures = [self._read_helpers.submit(work, c, bounds[j::k]) for j, c in enumerate(clients, start=1)]
        results: dict = {}

        def wait(j: int):
            i = j % k - 1
            f, futures[i] = futures[i], None
            if f is not None:
                got = f.result()
                results.update(got)
                # Their traffic counts in wire() (every connection), as the loop connection's does.
                self._wire_base += sum(w for _, w in got.values())
                c = clients[i]
                if not c.connected:
                    self.read_clients.remove(c)
                    c.close()
            return results.get(bounds[j][0])

        return k, wait

    def close(self) -> None:
        if self._read_helpers is not None:
            self._read_helpers.shutdown(wait=True)
            self._read_helpers = None
        for c in self.read_clients:
            c.close()
        self.read_clients = []
        self.client.close()
