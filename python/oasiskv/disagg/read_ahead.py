"""Reading staged requests' admission data ahead of their admission (:class:`ReadAhead`): while the
engine decodes, a background thread reads, for the first waiting staged requests, what their
admission needs besides the KV blocks, over connections of its own, into :class:`Prefetched`:

- the sections (meta, the staged query, the unquantized local block of an fp8 host pool);
- with a partial transfer (and a full one over an fp8 host pool, which cannot rebuild the
  summaries) the admission replies: every summary row (they go to the GPU's summaries, not the
  host pool) and the admission set;
- with a partial transfer, each KV head's first working set, selected on the CPU from the staged
  summaries and query: keys only, no bytes.

The KV blocks do not come this way: the admission hands them (a full transfer's every block, a
partial transfer's first working sets) to the Rust coordinator, which streams them straight into
the host rows the request owns (:mod:`.admission`). What is left in Python bytes here is small
beside them (summaries: 1/16 of the KV at block size 16) except a partial transfer's admission
set, which the daemon's admission reply carries inline.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from ..engine import Engine
from . import wire
from .wire import QUERY_SECTION, StagedRequest

log = logging.getLogger("oasiskv.disagg")


@dataclass
class Prefetched:
    """What the background read brought for a staged request before its admission: the sections,
    the admission replies (summaries and the admission set, per layer range; none for a full
    transfer over a float host pool), the first working sets' keys and the wire bytes it took."""

    sections: dict = field(default_factory=dict)
    adms: list = field(default_factory=list)
    #: ``"partial"``: each KV head's first-step blocks outside the admission set, ``(layer,
    #: logical, head)`` in layer order, selected on the CPU from the staged summaries and query.
    heads: list = field(default_factory=list)
    wire_bytes: int = 0


class ReadAhead:
    """The background reads of one decode engine's waiting staged requests.

    ``transfer`` is the source's (``"partial"`` or ``"full"``: what is read); ``cache_blocks``
    its bounded cache (no first working set is selected with one: its rows are handed out at
    admission); ``open_client()`` opens a connection to the daemon. ``depth``: how many
    requests are read ahead at most (0: none); ``connections``: how many connections (and
    threads) one request's admission replies spread over; ``pending``: daemon id -> the read of
    its data.
    """

    def __init__(
        self, engine: Engine, transfer: str, cache_blocks: int | None, open_client: Callable
    ) -> None:
        self.engine = engine
        self.transfer = transfer
        self.cache_blocks = cache_blocks
        self._open = open_client
        #: How many waiting staged requests :meth:`start` reads ahead (0: none; each admission
        #: then reads them in the decode loop).
        self.depth = wire.PREFETCH_DEPTH
        self.pending: dict[int, Future] = {}  # daemon id -> the background read of its data
        #: Connections (and threads) the read ahead spreads one request's admission replies over.
        self.connections = wire.PREFETCH_CONNECTIONS
        self._prefetcher: ThreadPoolExecutor | None = None
        self._helpers: ThreadPoolExecutor | None = None
        self._clients: list = []  # the background reads' own connections

    def start(self, handle: StagedRequest, geometry: tuple) -> None:
        """Start reading ``handle``'s admission data in the background, unless :attr:`depth`
        requests are pending or its geometry is not ``geometry`` (the admission refuses it,
        with the reason)."""
        rid = handle.request_id
        if rid in self.pending or len(self.pending) >= self.depth:
            return
        if tuple(handle.geometry) != geometry:
            return  # the admission refuses it, with the reason
        if self._prefetcher is None:
            self._prefetcher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="oasis-prefetch")
        self.pending[rid] = self._prefetcher.submit(self._read, handle)

    def ready(self, handle: StagedRequest) -> bool:
        """Whether admitting ``handle`` now would not wait for its read ahead."""
        f = self.pending.get(handle.request_id)
        return f is None or f.done()

    def drop(self, daemon_id: int) -> None:
        """Forget a read ahead (its request ended before admission)."""
        f = self.pending.pop(daemon_id, None)
        if f is not None:
            f.cancel()

    def take(self, daemon_id: int) -> Prefetched | None:
        """What was read ahead for ``daemon_id`` (waiting for it), or None: none was started, or
        it failed (logged; the admission reads in the loop and reports it)."""
        f = self.pending.pop(daemon_id, None)
        if f is None:
            return None
        try:
            return f.result()
        except Exception as e:  # noqa: BLE001  the admission reads in the loop and reports it
            log.info("reading staged request %s ahead failed (%s); reading it at admission", daemon_id, e)
            return None

    def close(self) -> None:
        if self._prefetcher is not None:
            self._prefetcher.shutdown(wait=True, cancel_futures=True)
            self._prefetcher = None
        if self._helpers is not None:
            self._helpers.shutdown(wait=True)
            self._helpers = None
        self.pending.clear()
        for c in self._clients:
            c.close()
        self._clients = []

    def _read(self, h: StagedRequest) -> Prefetched:
        """The background read (nothing of the engine is touched): the sections alone (a full
        transfer over a float host pool), or the admission replies, their layer ranges spread
        round-robin over :attr:`connections` connections of its own (one thread each) and merged
        in layer order (so the replies are those the loop would read); then, for a partial
        transfer, the first working sets' keys."""
        layers, hk, _, d, elem, nb, _ = h.geometry
        rid = h.request_id
        try:
            clients = self._open_clients()
            wire0 = [sum(c.wire_bytes) for c in clients]
            pf = Prefetched()
            if self.transfer == "full" and not self.engine.host_kv8:
                pf.sections = dict(clients[0].fetch_admission(rid, 0, 0, True)["sections"])
            else:
                chunks = wire.admission_chunks(layers, nb * hk * 2 * d * elem)
                pf.adms = list(wire.admission_replies(lambda fn: fn(clients[0]), rid, chunks[:1]))
                pf.sections = dict(pf.adms[0]["sections"])
                pf.adms += self._spread(clients, rid, chunks[1:])
                if self.transfer == "partial":
                    query = torch.frombuffer(bytearray(pf.sections[QUERY_SECTION]), dtype=self.engine.dtype)
                    pf.heads = self._first_heads(h, pf.adms, query.view(layers, -1, d))
            pf.wire_bytes = sum(sum(c.wire_bytes) - w for c, w in zip(clients, wire0, strict=True))
            return pf
        except BaseException:
            for c in self._clients:
                c.close()
            self._clients = []  # fresh connections for the next read
            raise

    def _spread(self, clients: list, rid: int, chunks: list) -> list:
        """The admission replies of ``chunks`` (no sections), chunk i on connection (i + 1) % n
        (the first connection read the first chunk already), merged in chunk order."""
        n = len(clients)
        owner = [(i + 1) % n for i in range(len(chunks))]

        def work(j: int) -> list:
            return [
                list(wire.admission_replies(lambda fn: fn(clients[j]), rid, [chunk], sections=False))
                for chunk, o in zip(chunks, owner, strict=True)
                if o == j
            ]

        helpers = {j: self._helpers.submit(work, j) for j in set(owner) - {0}}
        results = {0: work(0)} if 0 in owner else {}
        results.update({j: f.result() for j, f in helpers.items()})
        taken = dict.fromkeys(results, 0)
        out = []
        for o in owner:  # merged in chunk (layer) order
            out += results[o][taken[o]]
            taken[o] += 1
        return out

    def _open_clients(self) -> list:
        """The read ahead's connections (opened on first use), and the threads of all but the
        first."""
        while len(self._clients) < self.connections:
            self._clients.append(self._open())
        if self._helpers is None and self.connections > 1:
            self._helpers = ThreadPoolExecutor(
                max_workers=self.connections - 1, thread_name_prefix="oasis-prefetch"
            )
        return self._clients

    def _first_heads(self, h: StagedRequest, adms: list, query: torch.Tensor) -> list:
        """The block-heads the admission's first selection will read, outside the admission set
        (each KV head's top-K from the staged query, scored here by the CPU twins, and the sink
        blocks), as ``(layer, logical, head)`` in layer order. A GPU's scores may break a near-tie
        otherwise: the admission reads what this missed. Nothing with a bounded cache (its rows
        are handed out at admission)."""
        eng, g = self.engine, self.engine.geo
        _, hk, b, d, _, nb, _ = h.geometry
        n_complete = len(h.prompt) // b
        if n_complete == 0 or self.cache_blocks is not None:
            return []
        dt = eng.dtype
        summaries: dict[int, torch.Tensor] = {}
        for adm in adms:
            rows = torch.frombuffer(bytearray(adm["summaries"]), dtype=dt).view(-1, hk, 2, d)
            at = 0
            for layer, first, num in adm["summary_runs"]:
                if layer not in summaries:
                    summaries[layer] = torch.zeros(nb, hk, 2, d, dtype=dt)
                summaries[layer][first : first + num] = rows[at : at + num]
                at += num
        # Whole blocks of the admission set ("union") come with it.
        whole = {(layer, blk) for adm in adms for layer, blk in adm["block_keys"]}
        indptr = torch.tensor([0, n_complete], dtype=torch.int32)
        indices = torch.arange(n_complete, dtype=torch.int32)
        k = eng.kv.top_k_blocks
        sinks = min(eng.kv.sink_blocks, n_complete)
        out = []
        for layer in sorted(summaries):
            pred = wire.first_top_k(g, query[layer], summaries[layer], indptr, indices, k)  # [hk, k]
            pairs = sorted(
                {(int(x), hd) for hd in range(hk) for x in pred[hd].tolist() if x >= 0}
                | {(x, hd) for hd in range(hk) for x in range(sinks)}
            )
            out += [(layer, blk, head) for blk, head in pairs if (layer, blk) not in whole]
        return out
