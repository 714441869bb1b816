"""The decode side of disaggregation: :class:`RemoteKvSource`, the engine's
:class:`~oasiskv.policy.BlockSource` for requests staged in the ``oasis-rt`` daemon.

:class:`RemoteKvSource` (built by ``LLMEngine(kv_source=...)``) admits a staged
request directly as a sparse request: the runtime reserves and hands out its K working-set pages,
local page and host blocks and never the prompt's dense pages (``Engine.admit_sparse``, so it
reserves K + 1 GPU pages, not the prompt's), the admission's summary
rows and blocks are written into the host pool and summaries, the partial last block into the local
page, and the initial working set is selected with the staged query (``Engine.select_initial``,
as ``Engine.make_sparse`` does). Then it is an ordinary sparse request. ``kv_transfer``:

- ``"full"`` (the baseline): the admission reads every block (and the sections), so the host pool
  holds the whole context before the first step; the summaries are built locally from it, as a
  local transition to sparse builds them, and the daemon's copy is released at once.
- ``"partial"``: only the summaries and the admission set cross at admission. The host pool is a
  cache of the staged blocks: during decode, the engine calls :meth:`RemoteKvSource.before_gather`
  between each layer's delta selection and its gather, and the block-heads that selection brings
  into the working set and that are not in the host pool yet are read from the daemon, batched per
  layer across requests, into the host pool. A block-head crosses the network at most once per
  request. Blocks the request writes itself (the local block, the blocks decode completes) are
  local.

With an fp8 host tier (``KvConfig(kv_dtype="fp8_e4m3")`` or ``host_kv_dtype="fp8_e4m3"``, the same
as the prefill worker's) the staged blocks are fp8 (the geometry's ``kv_format`` 1): every read,
whole blocks and block-heads, writes E4M3 codes into ``host_k``/``host_v`` and their scales into
``host_k_scales``/``host_v_scales``, about half of bf16's bytes on the wire; a request staged in
the other format is refused at admission (:mod:`.admission`).

The fetch runs on the host, layer by layer before each gather, once the whole step's compute is
queued (``Engine._flush_deferred``): a host sync per layer that has misses, while the GPU computes
the step. On a GPU it belongs in the background chain (docs/ARCHITECTURE.md, "Disaggregated
prefill and decode"). A daemon that dies or stalls fails the requests whose blocks it holds (``finish_reason=
"error"``, within the client's timeout); the engine and its other requests go on.

This room holds the source's seams (the ``BlockSource`` verbs, ``end``, ``take_failed``), the
decode-time reads into the host pool, the bounded cache's rows (``Runtime.cache_blocks``) and the
failure bookkeeping. Its parts live beside it: the admission (:mod:`.admission`), the read ahead
(:mod:`.read_ahead`), the presence map (:mod:`.presence`), the daemon connections
(:mod:`.connections`) and the per-request state (:mod:`.state`).
"""

from __future__ import annotations

import logging
import math
import time

import torch

from ..engine import Engine, Request
from ..errors import ConfigError, OutOfBlocksError, RemoteError
from ..policy import BlockSource
from . import wire
from .admission import AdmissionMixin
from .connections import Connections
from .presence import PresenceMap
from .read_ahead import ReadAhead
from .state import StagedState, TransferStats
from .wire import KV_TRANSFERS, kv_source_url, split_kv_source

log = logging.getLogger("oasiskv.disagg")


class RemoteKvSource(AdmissionMixin, BlockSource):
    """The decode side of disaggregation for one :class:`~oasiskv.engine.Engine` (built by
    ``LLMEngine(kv_source=...)``; see the module docs). Installs itself as the engine's
    ``block_source``.

    ``transfer`` is one of :data:`KV_TRANSFERS`; ``retries``: how many times a read that failed
    in transport (daemon gone or stalled) reconnects and tries again before the requests whose
    blocks it carried fail.

    ``cache_blocks=C`` bounds the host pool of each staged request (the bounded decode-side host
    pool): host rows only for the blocks it writes itself plus ``C`` cache rows; before each
    layer's gather the planned blocks without a row get one (``Runtime.cache_blocks``, evicting
    the least recently used cached blocks the layer does not read), and a block evicted is read
    again if it is planned later. ``None``: a row for every block (the whole context).
    """

    def __init__(
        self,
        engine: Engine,
        addr: str,
        transfer: str = "partial",
        *,
        token: str | bytes | None = None,
        timeout_s: float = 30.0,
        retries: int = 0,
        cache_blocks: int | None = None,
    ) -> None:
        if transfer not in KV_TRANSFERS:
            raise ConfigError(
                f"kv_transfer must be one of {KV_TRANSFERS}, got {transfer!r}: 'partial' fetches the "
                "summaries and the first step's blocks, then misses on demand; 'full' fetches every block"
            )
        if engine.backend != "oasis":
            raise ConfigError("kv_source needs backend='oasis' (a staged request decodes sparsely)")
        if engine.key_codes:
            raise ConfigError(
                "kv_source stages min/max summaries only; pass KvConfig(block_score='quest') "
                "(key codes are not transferred yet)"
            )
        if not isinstance(retries, int) or isinstance(retries, bool) or retries < 0:
            raise ConfigError(f"kv_retries must be an int >= 0, got {retries!r}")
        if cache_blocks is not None:
            floor = engine.geo.num_kv_heads * engine.kv.top_k_blocks
            if not isinstance(cache_blocks, int) or isinstance(cache_blocks, bool) or cache_blocks < floor:
                raise ConfigError(
                    f"kv_cache_blocks must be an int >= num_kv_heads * top_k_blocks = {floor} (the "
                    f"first selection may plan that many distinct blocks in one layer), got {cache_blocks!r}"
                )
            if transfer == "full":
                raise ConfigError(
                    "kv_cache_blocks bounds the host pool of a partial transfer; kv_transfer='full' "
                    "brings every block: pass kv_transfer='partial' or kv_cache_blocks=None"
                )
        #: Host rows per staged request's cache (None: a row for every block).
        self.cache_blocks = cache_blocks
        self.engine = engine
        #: The daemon's ``HOST:PORT``, its URL (the scheme names the transport) and transport.
        self.url = kv_source_url(addr)
        self.transport, self.addr = split_kv_source(self.url)
        self.transfer = transfer
        #: The daemon connections: the decode loop's client, its retries, the extra connections
        #: of large reads.
        self.conns = Connections(self.url, token, timeout_s, retries)
        self.stats = TransferStats()
        self._by_req: dict[int, StagedState] = {}  # engine request id -> its staged state
        self.presence = PresenceMap(engine.cfg.num_hidden_layers, engine.geo.num_kv_heads)
        self._bounded = 0  # live staged requests with a bounded cache
        self._admitting = False  # reads now are an admission's (its first working set)
        self._failed: dict[int, str] = {}
        self.read_ahead = ReadAhead(engine, transfer, cache_blocks, self.conns.open)
        engine.block_source = self

    # ---------------------------------------------------------------- the parts' settings
    @property
    def client(self):
        """The decode loop's connection to the daemon (``oasiskv._core.RtClient``)."""
        return self.conns.client

    @client.setter
    def client(self, c) -> None:
        self.conns.client = c

    @property
    def retries(self) -> int:
        """Reconnects and retries of a read that failed in transport."""
        return self.conns.retries

    @retries.setter
    def retries(self, n: int) -> None:
        self.conns.retries = n

    @property
    def read_connections(self) -> int:
        """Connections a large read in the decode loop spreads its frames over (1: the loop's
        own connection alone)."""
        return self.conns.read_connections

    @read_connections.setter
    def read_connections(self, n: int) -> None:
        self.conns.read_connections = n

    @property
    def prefetch_depth(self) -> int:
        """How many waiting staged requests :meth:`prefetch` reads ahead (0: none; each admission
        then reads in the decode loop)."""
        return self.read_ahead.depth

    @prefetch_depth.setter
    def prefetch_depth(self, n: int) -> None:
        self.read_ahead.depth = n

    @property
    def prefetch_connections(self) -> int:
        """Connections (and threads) the read ahead spreads one request's reads over."""
        return self.read_ahead.connections

    @prefetch_connections.setter
    def prefetch_connections(self, n: int) -> None:
        self.read_ahead.connections = n

    # NOTE: the three below are kept for tests/disagg/test_disagg.py, which reads and replaces the extra
    # read connections, checks that no read ahead is left, and names an evicted row's block.
    @property
    def _read_clients(self) -> list:
        return self.conns.read_clients

    @_read_clients.setter
    def _read_clients(self, clients: list) -> None:
        self.conns.read_clients = clients

    @property
    def _prefetch(self) -> dict:
        return self.read_ahead.pending

    @property
    def _logical(self) -> torch.Tensor:
        return self.presence.logical

    # ---------------------------------------------------------------- maps
    def _grow_maps(self) -> None:
        self.presence.grow(self.engine.pools.num_host_rows)

    def _entry_bytes(self) -> int:
        """Bytes of one block-head, K and V (fp8 host pool: codes and scales)."""
        return wire.block_head_bytes(self.engine.geo, self.engine.dtype, self.engine.host_kv8)

    # ---------------------------------------------------------------- decode-time misses
    @property
    def idle(self) -> bool:
        """Whether :meth:`before_gather` has nothing to do: every staged block-head of the live
        requests is in the host pool and none has a bounded cache (a full transfer after its
        admission). The engine then runs its steps as it would without a source (captured
        CUDA graphs included)."""
        return self.presence.missing == 0 and self._bounded == 0

    @property
    def fixes_up_graph_steps(self) -> bool:
        """Whether the engine may replay captured CUDA graphs while blocks are left to read: the
        graph's gathers copy whatever the host rows hold, then the engine calls
        :meth:`before_gather` for each layer's plan and gathers again where it read anything,
        before the next step reads those slots. Not with a bounded cache, whose rows change
        hands between the layers of a step."""
        return self._bounded == 0

    @property
    def may_evict(self) -> bool:
        """Whether :meth:`before_gather` may give a cached block's host row to another block (a
        staged request with a bounded cache is running): the engine then lets the previous
        layer's gather finish before calling it."""
        return self._bounded > 0

    def before_gather(self, layer: int, plan_slots, plan_blocks, host_indptr, host_indices) -> bool:
        """Called by the engine between a layer's delta selection and its gather: read the
        planned block-heads that are still only in the daemon into the host pool (one batched
        read per layer, across requests). A failed read marks the requests it carried failed
        (:meth:`take_failed`); the gather then copies stale bytes for them, and their step's
        output is discarded.

        With a bounded cache the layer's planned blocks of each such request first get host rows
        (``Runtime.cache_blocks``, pinned = this layer's planned blocks of the request: an
        eviction never takes a row this gather reads; earlier layers' gathers are done: the
        engine waits for them while :attr:`may_evict`), and ``host_indices`` (the
        step's, on the device) is patched at ``indptr[seq] + logical`` with them; the next plan
        reads the runtime's rows.

        Returns whether the gather's inputs changed (block-heads read, rows patched): a CUDA-graph
        step, whose gather ran before this, gathers the layer again then."""
        t0 = time.perf_counter()
        try:
            return self._before_gather(layer, plan_slots, plan_blocks, host_indptr, host_indices)
        finally:
            self.stats.read_seconds += time.perf_counter() - t0

    def _before_gather(self, layer: int, plan_slots, plan_blocks, host_indptr, host_indices) -> bool:
        if self.presence.missing == 0 and self._bounded == 0:
            return False
        ps, pb = plan_slots.cpu(), plan_blocks.cpu()
        sel = ps >= 0
        if not bool(sel.any()):
            return False
        seq, head, _ = sel.nonzero(as_tuple=True)
        logical = pb[sel].long()
        indptr, indices = host_indptr.cpu().long(), host_indices.cpu().long()
        pos = indptr[seq] + logical
        hb = indices[pos]
        patched = False
        if self._bounded:
            # A request's first row (logical block 0's: the filler or its own) names its owner.
            owner = self.presence.owner[indices[indptr[seq]]]
            for o in torch.unique(owner).tolist():
                st = self._by_req.get(o)
                if st is None or not st.bounded or o in self._failed:
                    continue
                mine = owner == o
                wanted = torch.unique(logical[mine]).tolist()
                try:
                    rows = self._rows_for(st, wanted, wanted)
                except OutOfBlocksError as e:
                    self._fail(o, f"its bounded host pool cannot hold one layer's planned blocks: {e}")
                    continue
                row_of = torch.full((max(wanted) + 1,), -1, dtype=torch.long)
                row_of[torch.tensor(wanted, dtype=torch.long)] = torch.tensor(rows, dtype=torch.long)
                new = row_of[logical[mine]]
                hb[mine] = new
                dev = host_indices.device
                host_indices[pos[mine].to(dev)] = new.to(dev, host_indices.dtype)
                patched = True
        return self._ensure(layer, hb, head) or patched

    def before_gathers(self, plans: list) -> list[bool]:
        """:meth:`before_gather` for every layer of a step at once, ``plans`` a list of
        ``(layer, plan_slots, plan_blocks, host_indptr, host_indices)`` in layer order: the
        absent block-heads of all the layers go to the daemon in one batched read (frames carry
        entries of several layers), not one round trip per layer. Returns, per plan, whether
        its gather's inputs changed. With a bounded cache, layer by layer (rows change hands
        between the layers of a step)."""
        t0 = time.perf_counter()
        try:
            return self._before_gathers(plans)
        finally:
            self.stats.read_seconds += time.perf_counter() - t0

    def _before_gathers(self, plans: list) -> list[bool]:
        if self.presence.missing == 0 and self._bounded == 0 or not plans:
            return [False] * len(plans)
        shared = len({(id(p[3]), id(p[4])) for p in plans}) == 1 and len({p[1].shape for p in plans}) == 1
        if self._bounded or not shared:
            # Layer by layer: a bounded cache's rows change hands between layers; plans of
            # other tables or shapes than one step's.
            return [self._before_gather(*p) for p in plans]
        self._grow_maps()
        # Every layer's plan in one copy to the host (a copy per layer and tensor is a device
        # sync each); the step's host tables are shared by its layers.
        ps = torch.stack([p[1] for p in plans]).cpu()  # [layers, seqs, heads, cap]
        pb = torch.stack([p[2] for p in plans]).cpu()
        indptr, indices = plans[0][3].cpu().long(), plans[0][4].cpu().long()
        sel = ps >= 0
        li, seq, head, _ = sel.nonzero(as_tuple=True)
        if not li.numel():
            return [False] * len(plans)
        layer_of = torch.tensor([p[0] for p in plans], dtype=torch.long)
        got = self.presence.absent(layer_of[li], indices[indptr[seq] + pb[sel].long()], head, self._failed)
        if got is None:
            return [False] * len(plans)
        self._read(*got, whole=False)
        read = set(got[0].unique().tolist())
        return [p[0] in read for p in plans]

    def _ensure(self, layer: int, hb: torch.Tensor, head: torch.Tensor) -> bool:
        """Make the block-heads ``(hb[i], head[i])`` present, reading the absent ones; whether
        any was read."""
        self._grow_maps()  # the pools may have grown for other requests (theirs are local)
        got = self.presence.absent(torch.full_like(hb, layer), hb, head, self._failed)
        if got is None:
            return False
        self._read(*got, whole=False)
        return True

    def _read(self, layers: torch.Tensor, hb: torch.Tensor, head: torch.Tensor, whole: bool) -> None:
        """Read ``(layers[i], hb[i], head[i])`` (``whole``: every head of ``hb[i]``) from the
        daemon into the host pool, in frames under the limit. A pool in CPU memory (pinned with
        a GPU) is written by the client itself (``RtClient.read_blocks_into``: one copy per entry
        from the received frame); another (``host_pool="device"``) through :meth:`_store`."""
        p = self.engine.pools
        into = p.host_device.type == "cpu"
        entry = self._entry_bytes() * (self.engine.geo.num_kv_heads if whole else 1)
        per_frame = wire.entries_per_frame(
            entry, min(self.conns.client.max_frame * wire.FRAME_FILL, wire.BULK_FRAME_BYTES)
        )
        owners = self.presence.owner[hb].tolist()
        logical = self.presence.logical[hb].tolist()
        heads = [-1] * len(owners) if whole else head.tolist()
        lay = layers.tolist()
        rows = hb.tolist()
        n = len(owners)
        conns = self.conns.read_connections if into and n >= 2 * wire.READ_SPLIT_MIN_ENTRIES else 1
        count = max(math.ceil(n / per_frame), min(conns, n // wire.READ_SPLIT_MIN_ENTRIES))
        size = math.ceil(n / count) if n else 1
        bounds = [(lo, min(n, lo + size)) for lo in range(0, n, size)]

        def keys_of(lo: int, hi: int) -> list:
            return [(self._by_req[owners[i]].daemon_id, lay[i], logical[i], heads[i]) for i in range(lo, hi)]

        # An fp8 pool: each head's codes into host_k/host_v, the scale after them into the scales.
        scales = (p.host_k_scales, p.host_v_scales) if p.host_kv8 else ()

        def read_into(c, lo: int, hi: int) -> list:
            """One frame's entries written into the pool by ``c``; their errors."""
            return c.read_blocks_into(keys_of(lo, hi), rows[lo:hi], p.host_k, p.host_v, *scales)[1]

        k, wait = (
            self.conns.start_parallel_reads(bounds, read_into) if conns > 1 and len(bounds) > 1 else (1, None)
        )
        try:
            for j, (lo, hi) in enumerate(bounds):
                data = None
                got = wait(j) if j % k else None
                try:
                    if got is not None:
                        errors, nbytes = got
                    else:
                        wire0 = self.conns.wire()
                        if into:
                            errors = self.conns.call(read_into, lo, hi)
                        else:
                            keys = keys_of(lo, hi)
                            data, _, errors = self.conns.call(lambda c, keys=keys: c.read_blocks(keys))
                        nbytes = self.conns.wire() - wire0
                except RemoteError as e:
                    for i in range(lo, hi):
                        self._fail(owners[i], f"reading KV from the staging daemon failed: {e}")
                    continue
                good = [i for i, err in enumerate(errors) if err is None]
                for i, err in enumerate(errors):
                    if err is not None:
                        self._fail(
                            owners[lo + i],
                            f"reading block {logical[lo + i]} of layer {lay[lo + i]} from the staging daemon "
                            f"failed ({err}); was the request released or evicted after its lease "
                            "(oasis-rt serve --lease)?",
                        )
                if good:
                    sel = torch.tensor(good, dtype=torch.long) + lo
                    if into:
                        new = self.presence.mark_present(layers[sel], hb[sel], None if whole else head[sel])
                    else:
                        new = self._store_frame(data, entry, lay, good, lo, hb, None if whole else head)
                    per_owner: dict[int, int] = {}
                    for i, cnt in zip(good, new.tolist(), strict=True):
                        per_owner[owners[lo + i]] = per_owner.get(owners[lo + i], 0) + int(cnt)
                    for owner, cnt in per_owner.items():
                        self._count_cached(self._by_req[owner], cnt)
                if not whole and not self._admitting:
                    # Decode-time traffic (reads while a request is admitted count as its admission:
                    # the first working set's block-heads); shared among a frame's requests by entries.
                    self.stats.fetched_bytes += nbytes
                    self.stats.fetched_entries += len(good)
                    share = nbytes / (hi - lo)
                    for i in range(lo, hi):
                        self._by_req[owners[i]].fetched_bytes += share
                    for i in set(owners[lo:hi]):
                        st = self._by_req[i]
                        st.req.metrics.network_fetched_bytes = round(st.fetched_bytes)
        finally:
            for j in range(1, min(k, len(bounds))):  # no thread writes into the pool after this
                try:
                    wait(j)
                except Exception:  # noqa: BLE001, S110  the loop's own error is on its way out
                    pass

    def _blocks_of(self, data, n: int, heads: int) -> tuple:
        """``n`` read entries of ``heads`` KV heads each (every head: whole blocks), back to back
        in ``data``, as ``(k, v, k_scales, v_scales)``: K and V ``[n, heads, block_size,
        head_dim]`` in the host pool's dtype, and with an fp8 pool (``kv_format`` 1: codes, then
        each head's scale) their scales ``[n, heads]`` (None otherwise)."""
        eng = self.engine
        g = eng.geo
        if eng.host_kv8:
            return wire.unpack_kv8(data, n, heads, g.block_size, g.head_dim)
        x = torch.frombuffer(data, dtype=eng.dtype).view(n, 2, heads, g.block_size, g.head_dim)
        return x[:, 0], x[:, 1], None, None

    def _write_host(self, layer: int, at: tuple, kv: tuple) -> None:
        """``(k, v, k_scales, v_scales)`` (:meth:`_blocks_of`) into the host pool at ``at``."""
        p = self.engine.pools
        dev = p.host_device
        at = tuple(i.to(dev) for i in at)
        k, v, ks, vs = kv
        p.host_k[layer][at] = k.to(dev)
        p.host_v[layer][at] = v.to(dev)
        if ks is not None:
            p.host_k_scales[layer][at] = ks.to(dev)
            p.host_v_scales[layer][at] = vs.to(dev)

    def _store(self, layer: int, rows: torch.Tensor, heads: torch.Tensor | None, data) -> torch.Tensor:
        """Write read bytes into the host pool: block-heads ``(rows[i], heads[i])``, or with
        ``heads`` None every head of ``rows[i]``; mark them present. Returns how many of each
        entry's block-heads were absent before."""
        g = self.engine.geo
        if heads is None:
            kv = self._blocks_of(data, len(rows), g.num_kv_heads)
            at = (rows,)
        else:
            kv = tuple(None if x is None else x[:, 0] for x in self._blocks_of(data, len(rows), 1))
            at = (rows, heads)
        self._write_host(layer, at, kv)
        return self.presence.mark_present(torch.full_like(rows, layer), rows, heads)

    def _store_frame(self, data, entry: int, lay: list, good: list, lo: int, hb, head) -> torch.Tensor:
        """:meth:`_store` for one frame's good entries (``lo + good[j]``), one layer at a time:
        ``data`` holds them back to back."""
        view = memoryview(data)
        out = []
        a = 0
        while a < len(good):
            b = a
            while b < len(good) and lay[lo + good[b]] == lay[lo + good[a]]:
                b += 1
            sel = torch.tensor(good[a:b], dtype=torch.long) + lo
            part = view[a * entry : b * entry]
            out.append(self._store(lay[lo + good[a]], hb[sel], None if head is None else head[sel], part))
            a = b
        return torch.cat(out)

    # ---------------------------------------------------------------- the bounded cache's rows
    def _take_row(self, st: StagedState, row: int, logical: int) -> None:
        """Host row ``row`` now holds staged block ``logical`` of ``st``: nothing of it read yet."""
        self.presence.take_row(row, st.req.id, logical)
        st.rows.add(row)

    def _forget_row(self, st: StagedState, row: int) -> None:
        """The block cached in ``row`` was evicted: its bytes are gone (read again if planned)."""
        had = self.presence.forget_row(row)
        st.cached_entries -= had
        self.stats.cached_bytes -= had * self._entry_bytes()
        self.stats.evicted_blocks += 1

    def _rows_for(self, st: StagedState, logicals: list[int], pinned: list[int]) -> list[int]:
        """The host rows of ``st``'s logical blocks ``logicals``: with a bounded cache the
        uncached ones get rows (``Runtime.cache_blocks``; evicting the least recently used blocks
        outside ``pinned``), the evicted rows' bytes are forgotten and the new ones are absent
        until read."""
        rows, given, evicted = self.engine.runtime.cache_blocks(st.req.id, logicals, pinned)
        if not st.bounded:
            return rows
        for _, row in evicted:
            self._forget_row(st, row)
        row_of = dict(zip(logicals, rows, strict=True))
        for logical in given:
            self._take_row(st, row_of[logical], logical)
        return rows

    def _store_blocks(self, st: StagedState, layer: int, hb: torch.Tensor, blocks: tuple) -> None:
        """Whole blocks ``(k, v, k_scales, v_scales)`` (:meth:`_blocks_of`) into host rows
        ``hb``; marks every head present."""
        self._write_host(layer, (hb,), blocks)
        self._count_cached(st, self.presence.mark_blocks(layer, hb))

    def _count_cached(self, st: StagedState, entries: int) -> None:
        st.cached_entries += entries
        self.presence.filled(entries)
        s = self.stats
        s.cached_bytes += entries * self._entry_bytes()
        s.peak_cached_bytes = max(s.peak_cached_bytes, s.cached_bytes)

    # ---------------------------------------------------------------- failures
    def _fail(self, owner: int, message: str) -> None:
        st = self._by_req.get(owner)
        if owner not in self._failed:
            self._failed[owner] = message
            self.stats.failures += 1
            log.warning("request %s: %s", owner, message)
        if st is not None:
            st.errors.append(message)

    def take_failed(self) -> dict[int, str]:
        """Engine request ids whose KV could not be read since the last call -> why; the engine
        finishes them with ``finish_reason="error"``."""
        out, self._failed = self._failed, {}
        return out

    # ---------------------------------------------------------------- end
    def _release_remote(self, st: StagedState) -> None:
        if st.alive:
            st.alive = False
            self.conns.release(st.daemon_id)

    def end(self, r: Request) -> None:
        """``r`` ends (finished, aborted, failed): forget its staged blocks and release the
        daemon's copy (best effort). Call before the engine frees its host blocks."""
        st = self._by_req.pop(r.id, None)
        if st is None:
            return
        self._bounded -= st.bounded
        self.presence.release(torch.tensor(sorted(st.rows), dtype=torch.long))
        self.stats.cached_bytes -= st.cached_entries * self._entry_bytes()
        self._failed.pop(r.id, None)
        self._release_remote(st)

    def close(self) -> None:
        self.read_ahead.close()
        self.conns.close()
