"""Reading staged requests ahead of their admission (:class:`ReadAhead`): while the engine decodes,
a background thread reads the admission data of the first waiting staged requests (their
sections and summaries with the admission set and each KV head's first working set, or with a
full transfer every block, and the summaries too over an fp8 host pool) into host memory,
spread over connections of its own. It touches nothing of the engine; the admission copies from
the :class:`Prefetched` bytes instead of stalling the decode loop on the network, and reads what
they lack itself.
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
    the admission replies (``"partial"``: summaries and the admission set, per layer range) or
    every block (``"full"``: ``(layer, logical blocks, their bytes)`` per frame), and the wire
    bytes it took."""

    sections: dict = field(default_factory=dict)
    adms: list = field(default_factory=list)
    frames: list = field(default_factory=list)
    #: ``"partial"``: each KV head's first-step blocks, ``(layer, [(logical, head)], bytes)``
    #: per frame, selected on the CPU from the staged summaries and query.
    heads: list = field(default_factory=list)
    wire_bytes: int = 0


class ReadAhead:
    """The background reads of one decode engine's waiting staged requests.

    ``transfer`` is the source's (``"partial"`` or ``"full"``: what is read); ``cache_blocks``
    its bounded cache (no first working set is read with one: its rows are handed out at
    admission); ``open_client()`` opens a connection to the daemon. ``depth``: how many
    requests are read ahead at most (0: none); ``connections``: how many connections (and
    threads) one request's reads spread over; ``pending``: daemon id -> the read of its data.
    """

    def __init__(
        self, engine: Engine, transfer: str, cache_blocks: int | None, open_client: Callable
    ) -> None:
        self.engine = engine
        self.transfer = transfer
        self.cache_blocks = cache_blocks
        self._open = open_client
        self._entry_bytes = wire.block_head_bytes(engine.geo, engine.dtype, engine.host_kv8)
        #: How many waiting staged requests :meth:`start` reads ahead (0: none; each admission
        #: then reads in the decode loop).
        self.depth = wire.PREFETCH_DEPTH
        self.pending: dict[int, Future] = {}  # daemon id -> the background read of its data
        #: Connections (and threads) the read ahead spreads one request's reads over.
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
        """The background read (nothing of the engine is touched): its units of work (a layer's
        blocks; a layer range's admission reply and first working set) spread round-robin over
        :attr:`connections` connections of its own, one thread each, merged in layer
        order (so the frames are those the loop would read)."""
        layers, hk, b, d, elem, nb, _ = h.geometry
        rid = h.request_id
        try:
            clients = self._open_clients()
            wire0 = [sum(c.wire_bytes) for c in clients]
            pf = Prefetched()
            chunks = wire.admission_chunks(layers, nb * hk * 2 * d * elem)
            if self.transfer == "full":
                if self.engine.host_kv8:
                    # An fp8 host pool cannot rebuild the summaries: they come with the sections.
                    pf.adms = list(wire.admission_replies(lambda fn: fn(clients[0]), rid, chunks))
                    pf.sections = dict(pf.adms[0]["sections"])
                else:
                    pf.sections = dict(clients[0].fetch_admission(rid, 0, 0, True)["sections"])
                units: list = list(range(layers))

                def work(c, layer):
                    return [], self._read_whole(c, h, layer), []

            else:
                first = list(wire.admission_replies(lambda fn: fn(clients[0]), rid, chunks[:1]))
                pf.sections = dict(first[0]["sections"])
                query = torch.frombuffer(bytearray(pf.sections[QUERY_SECTION]), dtype=self.engine.dtype)
                query = query.view(layers, -1, d)
                pf.adms = first
                pf.heads = self._read_first_heads(clients[0], h, first, query)
                units = chunks[1:]

                def work(c, chunk):
                    adms = list(wire.admission_replies(lambda fn: fn(c), rid, [chunk], sections=False))
                    return adms, [], self._read_first_heads(c, h, adms, query)

            # Unit i goes to connection (i + skew) % n: the first connection already read the
            # first admission chunk.
            n, skew = len(clients), 0 if self.transfer == "full" else 1
            owner = [(i + skew) % n for i in range(len(units))]
            helpers = {
                j: self._helpers.submit(
                    lambda j=j: [work(clients[j], u) for u, o in zip(units, owner, strict=True) if o == j]
                )
                for j in set(owner) - {0}
            }
            results = {0: [work(clients[0], u) for u, o in zip(units, owner, strict=True) if o == 0]}
            results.update({j: f.result() for j, f in helpers.items()})
            taken = dict.fromkeys(results, 0)
            for o in owner:  # merged in unit (layer) order
                adms, frames, heads = results[o][taken[o]]
                taken[o] += 1
                pf.adms += adms
                pf.frames += frames
                pf.heads += heads
            pf.wire_bytes = sum(sum(c.wire_bytes) - w for c, w in zip(clients, wire0, strict=True))
            return pf
        except BaseException:
            for c in self._clients:
                c.close()
            self._clients = []  # fresh connections for the next read
            raise

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

    def _read_whole(self, c, h: StagedRequest, layer: int) -> list:
        """Every block of ``layer``, whole: ``(layer, logicals, bytes)`` per frame."""
        hk, nb = h.geometry[1], h.geometry[5]
        per_frame = wire.entries_per_frame(self._entry_bytes * hk)
        frames = []
        for lo in range(0, nb, per_frame):
            logicals = list(range(lo, min(nb, lo + per_frame)))
            keys = [(h.request_id, layer, i, -1) for i in logicals]
            frames.append((layer, logicals, wire.read_all(c, keys, f"block of layer {layer}")))
        return frames

    def _read_first_heads(self, c, h: StagedRequest, adms: list, query: torch.Tensor) -> list:
        """The block-heads the admission's first selection will read for the layers of ``adms``
        (each KV head's top-K from the staged query, scored here by the CPU twins), as
        ``(layer, [(logical, head)], bytes)`` per frame. A GPU's scores may break a near-tie
        otherwise: the admission reads what this missed, in the loop. Nothing with a bounded
        cache (its rows are handed out at admission)."""
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
        sinks = min(getattr(eng.kv, "sink_blocks", 0), n_complete)
        per_frame = wire.entries_per_frame(self._entry_bytes)
        out = []
        for layer in sorted(summaries):
            pred = wire.first_top_k(g, query[layer], summaries[layer], indptr, indices, k)  # [hk, k]
            pairs = sorted(
                (blk, head)
                for blk, head in {(int(x), hd) for hd in range(hk) for x in pred[hd].tolist() if x >= 0}
                | {(x, hd) for hd in range(hk) for x in range(sinks)}
                if (layer, blk) not in whole
            )
            for lo in range(0, len(pairs), per_frame):
                part = pairs[lo : lo + per_frame]
                keys = [(h.request_id, layer, blk, head) for blk, head in part]
                out.append((layer, part, wire.read_all(c, keys, f"block-head of layer {layer}")))
        return out
