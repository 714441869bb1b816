"""The decode side of disaggregation: :class:`RemoteKvSource`, the engine's
:class:`~oasiskv.policy.BlockSource` for requests staged in the ``oasis-rt`` daemon.

:class:`RemoteKvSource` (built by ``LLMEngine(kv_source=...)``) admits a staged
request directly as a sparse request: the runtime reserves and hands out its K working-set pages,
local page and host blocks and never the prompt's dense pages (``Engine.admit_sparse``, so it
reserves K + 1 GPU pages, not the prompt's), the admission's summary
rows and blocks are written into the host pool and summaries, the partial last block into the local
page, and the initial working set is selected with the staged query (``Engine.select_initial``,
as ``Engine.make_sparse`` does). Then it is an ordinary sparse request. ``kv_transfer``:

- ``"full"`` (the baseline): every block crosses at admission, streamed by the coordinator straight
  into the request's host rows while the others decode (:mod:`.admission`), so the host pool holds
  the whole context before its first step; the summaries are built locally from it, as a local
  transition to sparse builds them, and the daemon's copy is released at once.
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

The reads are the Rust coordinator's (``oasiskv._core.Coordinator``, crate ``oasis-coord``), at
decode time and at admission: it owns the presence map (which ``(layer, host row, KV head)``
entries hold their bytes), the staged requests' daemon ids, the failed requests and N connections
of its own, and writes each read entry straight into the pinned host pool from tokio tasks on its
own threads. Per decode step the engine hands :meth:`RemoteKvSource.before_gathers` every layer's
plan once the step's selections are done; the absent entries of all layers go out at once, in layer
order over every connection, and the call returns; before each layer's gather the engine calls
:meth:`RemoteKvSource.wait_for_layer_load`, which waits for that layer's entries only, so the reads
of later layers overlap the gathers (and, on a GPU, the compute) of earlier ones. An entry is
marked present only once its bytes are written; a failed read marks nothing and fails the requests
whose entries it carried (``finish_reason="error"``, within the connection's ``kv_timeout_s`` and
``kv_retries``); the engine and its other requests go on. A bounded cache reads layer by layer (its
rows change hands between the layers of a step), through the same coordinator. An admission's
blocks are background reads of the same coordinator, which no step waits for (``wait_layer`` skips
them): the admission waits for them per layer (``wait_request``), once they landed. The host pool
must be in CPU memory (pinned with a GPU): ``host_pool="device"`` is refused.

Prefetch (:attr:`RemoteKvSource.decode_prefetch`, default ``wire.DECODE_PREFETCH``; 0: off): with a
step's plans the coordinator also queues background reads of what the next steps likely plan, the
successor of each planned block and each request's most recent staged blocks (per planned layer,
request and KV head), at most ``decode_prefetch`` block-heads per step and in flight at once, so
only while the link has room. No wait covers them; a later step that plans one finds it present
(a hit, ``stats.prefetch_hits``), or takes it over (still queued: read on the step's own queue) or
waits for its frame already on the wire. A prefetched entry is present only once written, and a
failed prefetch fails its request like any read. A bounded cache (``kv_cache_blocks``) prefetches
nothing: its rows change hands between a step's layers. When the host pool moves (the engine
copies it into new tensors between steps) the prefetches that landed since the last step may have
missed the copy: the coordinator marks them absent again, to be read again. ``stats.miss_entries``
counts the block-heads steps read for themselves (their misses), ``stats.prefetched_entries`` the
prefetched ones.

This room holds the source's seams (``end``, ``take_failed``, the in-step reads' switch), the
host pool's bookkeeping with the coordinator and the failure and traffic counts. Its parts live
beside it: the reads after each step and the bounded cache's rows (:mod:`.step_reads`), the
reads inside the step (:mod:`.in_step`), the admission (:mod:`.admission`), the read ahead
(:mod:`.read_ahead`), the admission's own daemon connection (:mod:`.connections`) and the
per-request state (:mod:`.state`).
"""

from __future__ import annotations

import logging

import torch

from .._core import Coordinator
from ..engine import Engine, Request
from ..errors import ConfigError, RemoteError
from ..policy import BlockSource
from . import wire
from .admission import AdmissionMixin
from .connections import Connections
from .in_step import InStepReads
from .read_ahead import ReadAhead
from .state import StagedState, TransferStats
from .step_reads import StepReadsMixin
from .wire import KV_TRANSFERS, kv_source_url, split_kv_source

log = logging.getLogger("oasiskv.disagg")


class RemoteKvSource(AdmissionMixin, StepReadsMixin, BlockSource):
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
        if engine.host_pool != "pinned":
            raise ConfigError(
                "kv_source reads staged blocks straight into a host pool in CPU memory (the Rust "
                "coordinator writes it from its own threads); pass host_pool='pinned'"
            )
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
        #: The admission's daemon connection (sections, summaries, admission sets; releases).
        self.conns = Connections(self.url, token, timeout_s, retries)
        self.stats = TransferStats()
        self._by_req: dict[int, StagedState] = {}  # engine request id -> its staged state
        self._token, self._timeout_s = token, float(timeout_s)
        self._read_connections = wire.READ_CONNECTIONS
        self._decode_prefetch = wire.DECODE_PREFETCH
        #: The reads into the host pool, the presence map, the failed requests (oasis-coord).
        self.coord = self._open_coordinator()
        self._pools_key: tuple = ()  # the registered pools' identity (_sync_pools)
        self._waiting: set[int] = set()  # layers submitted by before_gathers, not waited for yet
        self._bounded = 0  # live staged requests with a bounded cache
        self._failed: dict[int, str] = {}  # failures taken from the coordinator, not reported yet
        self.read_ahead = ReadAhead(engine, transfer, cache_blocks, self.conns.open)
        self._in_step: InStepReads | None = None  # in_step_reads: the mailbox and its reader
        engine.block_source = self

    def _open_coordinator(self) -> Coordinator:
        eng = self.engine
        frame = int(min(self.conns.client.max_frame * wire.FRAME_FILL, wire.BULK_FRAME_BYTES))
        return Coordinator(
            self.url,
            eng.cfg.num_hidden_layers,
            eng.geo.num_kv_heads,
            token=self._token,
            timeout_s=self._timeout_s,
            retries=self.conns.retries,
            connections=self._read_connections,
            # A thread per connection up to COORD_THREADS: the entries' copies into the pool run
            # on them.
            threads=max(1, min(self._read_connections, wire.COORD_THREADS)),
            split_min_entries=wire.READ_SPLIT_MIN_ENTRIES,
            frame_bytes=frame,
        )

    def _reopen(self) -> None:
        """A new coordinator with the current settings (nothing staged may be live: the presence
        map starts empty)."""
        if self._by_req:
            raise ConfigError(
                "change read_connections and retries before the first staged request is admitted "
                "(the coordinator holds the live requests' presence)"
            )
        self.coord.close()
        self.coord = self._open_coordinator()
        self._pools_key = ()
        if self._in_step is not None:  # its reader reads for the coordinator it was started with
            self._in_step.restart(self.coord, self._decode_prefetch)

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
        """Reconnects and retries of a read that failed in transport (the admission's and the
        coordinator's; set it before the first staged request)."""
        return self.conns.retries

    @retries.setter
    def retries(self, n: int) -> None:
        self.conns.retries = n
        self._reopen()

    @property
    def read_connections(self) -> int:
        """Connections the coordinator spreads the reads over (set it before the first staged
        request)."""
        return self._read_connections

    @read_connections.setter
    def read_connections(self, n: int) -> None:
        self._read_connections = n
        self._reopen()

    @property
    def decode_prefetch(self) -> int:
        """Block-heads the coordinator prefetches per decode step (and in flight at once) after
        the step's own reads: the successors of the planned blocks and each request's most recent
        staged blocks (see the module docs); 0: none. Not with ``kv_cache_blocks`` (ignored)."""
        return self._decode_prefetch

    @decode_prefetch.setter
    def decode_prefetch(self, n: int) -> None:
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise ConfigError(f"decode_prefetch must be an int >= 0 (block-heads a step; 0: off), got {n!r}")
        self._decode_prefetch = n
        if self._in_step is not None:  # the step reader submits with it
            self._in_step.restart(self.coord, n)

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

    # NOTE: kept for tests/disagg/test_disagg.py, which checks that no read ahead is left.
    @property
    def _prefetch(self) -> dict:
        return self.read_ahead.pending

    # ---------------------------------------------------------------- the coordinator's inputs
    def _streaming(self) -> bool:
        """Whether an admission's blocks are in flight (a request still admitting)."""
        return any(st.admitting is not None and self.coord.in_flight(o) for o, st in self._by_req.items())

    def _moves_pools(self, prompt_len: int, max_new_tokens: int) -> bool:
        """Whether admitting a staged request of this size grows the host pool, which the engine
        does by copying it into new tensors."""
        eng = self.engine
        need = eng.runtime.pool_sizes_needed(
            prompt_len, max_new_tokens, sparse=True, cache_blocks=self.cache_blocks
        )
        return need[2] > eng.pools.num_host_rows

    def _sync_pools(self, restream: bool = True) -> None:
        """Register the host pools with the coordinator when they are not the ones it has (it
        waits for its reads in flight first, and keeps the tensors alive until the next
        registration).

        The engine grows the pools by copying them into new tensors (an admission that needs
        more rows, a local request's); an admission's background reads that land after that copy
        wrote the old tensors. So the requests still admitting are streamed again: their rows'
        entries forgotten and their blocks read again into the new pools (not with ``restream``
        False: the caller let every stream land before the pools grew, as a staged admission
        does). NOTE: rare (the pools grow geometrically; a local request's admission beside
        staged ones streaming), and costs those requests their reads so far."""
        p = self.engine.pools
        key = (p.num_host_rows, p.host_k[0].data_ptr(), p.host_v[0].data_ptr())
        if key == self._pools_key:
            return
        moved = bool(self._pools_key)
        scales = (list(p.host_k_scales), list(p.host_v_scales)) if p.host_kv8 else ()
        dropped = self.coord.register_pools(list(p.host_k), list(p.host_v), *scales)
        self._pools_key = key
        for owner, n in dropped.items():  # prefetches that may have missed the copy: read again
            st = self._by_req.get(owner)
            if st is not None:
                st.cached_entries -= n
                self.stats.cached_bytes -= n * self._entry_bytes()
        if moved and restream:
            for st in self._by_req.values():
                if st.admitting is not None and st.admitting.stream is not None:
                    self._restream(st)

    def _restream(self, st: StagedState) -> None:
        """Read ``st``'s admission blocks again into the (new) pools: every row of it absent, its
        stream submitted again."""
        self._sync_landed()
        row_of = {row: logical for logical, row in enumerate(st.host_rows)}
        for row in sorted(st.rows):
            had = self.coord.forget_row(row)
            st.cached_entries -= had
            self.stats.cached_bytes -= had * self._entry_bytes()
            if row in row_of:
                self.coord.take_row(row, st.req.id, row_of[row])
        layers, rows, heads = st.admitting.stream
        self.coord.submit(layers, rows, heads, background=True)

    def _entry_bytes(self) -> int:
        """Bytes of one block-head, K and V (fp8 host pool: codes and scales)."""
        return wire.block_head_bytes(self.engine.geo, self.engine.dtype, self.engine.host_kv8)

    def _submit(
        self, layers: torch.Tensor, rows: torch.Tensor, heads: torch.Tensor, prefetch: int = 0
    ) -> list[int]:
        """Hand a step's entries ``(layers[i], rows[i], heads[i])`` to the coordinator, which
        reads the absent ones (taking over background reads of them) and then prefetches up to
        ``prefetch`` block-heads; per layer, how many its ``wait_layer`` waits for."""
        self._sync_pools()
        return self.coord.submit(layers.tolist(), rows.tolist(), heads.tolist(), prefetch=prefetch)

    def _sync_landed(self) -> None:
        """Take the coordinator's per-request counts of landed block-heads into the requests'
        and the engine's traffic (reads of a request still admitting count as its admission),
        and its step and prefetch counts into :attr:`stats`."""
        c = self.coord.stats()
        s = self.stats
        s.miss_entries, s.prefetched_entries = c["step_entries"], c["prefetched_entries"]
        s.prefetch_hits = c["prefetch_hits"]
        for owner, (entries, nbytes) in self.coord.take_landed().items():
            st = self._by_req.get(owner)
            if st is None:
                continue
            self._count_cached(st, entries)
            if st.admitting is not None:
                st.admitting.coord_bytes += nbytes
            else:
                self.stats.fetched_bytes += nbytes
                self.stats.fetched_entries += entries
                st.fetched_bytes += nbytes
                st.req.metrics.network_fetched_bytes = round(st.fetched_bytes)

    # ---------------------------------------------------------------- decode-time misses
    @property
    def idle(self) -> bool:
        """Whether :meth:`before_gather` has nothing to do: every staged block-head of the
        decoding requests is in the host pool and none has a bounded cache. The engine then
        runs its steps as it would without a source (captured CUDA graphs included). A full
        transfer always is: a request decodes only once its admission saw every block land,
        and what is missing belongs to requests still admitting, which no step reads."""
        return self._bounded == 0 and (self.transfer == "full" or self.coord.missing == 0)

    @property
    def fixes_up_graph_steps(self) -> bool:
        """Whether the engine may replay captured CUDA graphs while blocks are left to read: the
        graph's gathers copy whatever the host rows hold, then the engine hands the step's plans
        to :meth:`before_gathers`, waits for each layer and gathers again where it read
        anything, before the next step reads those slots. Not with a bounded cache, whose rows
        change hands between the layers of a step."""
        return self._bounded == 0

    @property
    def reads_in_step(self) -> bool:
        """Whether the steps publish their plans for the coordinator's step reader
        (:attr:`in_step_reads`; not while a staged request has a bounded cache)."""
        return self._in_step is not None and self._bounded == 0

    @property
    def can_read_in_step(self) -> bool:
        """Whether :attr:`in_step_reads` applies to this source: a partial transfer without
        ``kv_cache_blocks`` (a bounded cache's rows change hands between layers). ``LLMEngine``
        turns in-step reads on where this holds (``kv_in_step_reads=None``)."""
        return self.transfer == "partial" and self.cache_blocks is None

    @property
    def in_step_reads(self) -> bool:
        """Read each step's misses while the step runs (:mod:`.in_step`): every layer publishes
        its plan to the coordinator's step reader and its gather waits, on its own stream, for
        that layer's reads alone; the reads overlap the step, nothing waits on the host between
        steps (no plans copied back, no second gather). ``LLMEngine`` turns it on wherever it
        applies (``kv_in_step_reads=None``); a source made directly starts with it off, and False
        sends the plans to the coordinator after the step (:meth:`before_gathers`). Only where
        :attr:`can_read_in_step`."""
        return self._in_step is not None

    @in_step_reads.setter
    def in_step_reads(self, on: bool) -> None:
        if not isinstance(on, bool):
            raise ConfigError(f"in_step_reads must be a bool, got {on!r}")
        if on == (self._in_step is not None):
            return
        if on and not self.can_read_in_step:
            raise ConfigError(
                "in_step_reads reads a partial transfer's misses in the step: it needs "
                "kv_transfer='partial' and kv_cache_blocks=None"
            )
        eng = self.engine
        # Captured steps bake the mailbox's addresses in (and publish, or not).
        eng.drop_graphs()
        if on:
            # A captured step's plan has a row per padded request: at most twice the batch.
            rows = 2 * eng.max_num_seqs
            self._in_step = InStepReads(eng, self.coord, rows, self._decode_prefetch, self._timeout_s)
        else:
            self._in_step.close()
            self._in_step = None

    def begin_step(self, host_indptr, host_indices) -> int:
        """The next step's host block table to the step reader (the pools registered first);
        returns the step's epoch."""
        self._sync_pools()
        self._sync_landed()
        return self._in_step.begin_step(host_indptr, host_indices)

    def publish(self, layer: int, plan_slots, plan_blocks, epoch) -> None:
        """Layer ``layer``'s plan to the step reader (on the current stream;
        :meth:`InStepReads.publish`)."""
        self._in_step.publish(layer, plan_slots, plan_blocks, epoch)

    def wait_published(self, layer: int, epoch) -> None:
        """The wait for layer ``layer``'s reads, on the current stream
        (:meth:`InStepReads.wait`)."""
        self._in_step.wait(layer, epoch)

    @property
    def may_evict(self) -> bool:
        """Whether :meth:`before_gather` may give a cached block's host row to another block (a
        staged request with a bounded cache is running): the engine then lets the previous
        layer's gather finish before calling it."""
        return self._bounded > 0

    # ---------------------------------------------------------------- the admission's writes
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

    def _mark(self, layer: int, rows: torch.Tensor, heads: torch.Tensor | None) -> torch.Tensor:
        """Entries the admission wrote itself are present; how many of each were absent."""
        n = rows.numel()
        hs = [-1] * n if heads is None else heads.tolist()
        self._sync_pools()
        return torch.tensor(self.coord.mark_present([layer] * n, rows.tolist(), hs), dtype=torch.long)

    # ---------------------------------------------------------------- failures
    def _fail(self, owner: int, message: str) -> None:
        """Fail ``owner`` for this side's own reason: the coordinator reads nothing more of it and
        reports it with its read failures (:meth:`take_failed`)."""
        self.coord.fail(owner, message)

    def _collect_failures(self) -> None:
        """The coordinator's failed requests into :attr:`_failed` (logged and counted once)."""
        for owner, message in self.coord.take_failed().items():
            if owner in self._failed:
                continue
            self._failed[owner] = message
            self.stats.failures += 1
            log.warning("request %s: %s", owner, message)
            st = self._by_req.get(owner)
            if st is not None:
                st.errors.append(message)

    def take_failed(self) -> dict[int, str]:
        """Engine request ids whose KV could not be read since the last call -> why; the engine
        finishes them with ``finish_reason="error"``. Not the requests still admitting: their
        admission reports them (:meth:`finish_admission` raises). A layer's wait on its reads
        that gave up (:attr:`in_step_reads`; the daemon or the reader stalled past ``timeout_s``)
        fails every staged request that was decoding: its step gathered rows that had not
        landed."""
        if self._in_step is not None:
            gave_up, held = self._in_step.poll()
            self.stats.wait_seconds += held
            if gave_up:
                for o, st in self._by_req.items():
                    if st.admitting is None:
                        self._fail(
                            o,
                            f"the staging daemon {self.url} did not serve a step's remote reads "
                            f"within kv_timeout_s={self._timeout_s} s (the step's wait gave up)",
                        )
        self._collect_failures()
        out = {
            o: m
            for o, m in self._failed.items()
            if o not in self._by_req or self._by_req[o].admitting is None
        }
        for o in out:
            del self._failed[o]
        return out

    # ---------------------------------------------------------------- end
    def _release_remote(self, st: StagedState) -> None:
        if st.alive:
            st.alive = False
            self._release(st.daemon_id)

    def _release(self, daemon_id: int) -> None:
        """Release a staged request's copy in the daemon, from a coordinator connection's thread
        (best effort, never waiting on the daemon: a stalled one would stall the decode loop)."""
        try:
            self.coord.release(daemon_id)
        except RemoteError as e:
            log.warning("releasing staged request %s in the daemon failed: %s", daemon_id, e)

    def end(self, r: Request) -> None:
        """``r`` ends (finished, aborted, failed): wait for its reads in flight, forget its staged
        blocks and release the daemon's copy (best effort). Call before the engine frees its host
        blocks."""
        st = self._by_req.get(r.id)
        if st is None:
            return
        self.coord.end(r.id, sorted(st.rows))
        self._sync_landed()
        del self._by_req[r.id]
        self._bounded -= st.bounded
        self.stats.cached_bytes -= st.cached_entries * self._entry_bytes()
        self._failed.pop(r.id, None)
        self._release_remote(st)

    @property
    def coordinator_stats(self) -> dict:
        """The coordinator's counters (``oasiskv._core.Coordinator.stats``): its threads' seconds
        on reads, the decode loop's seconds waiting, wire bytes, entries, frames."""
        return dict(self.coord.stats())

    def close(self) -> None:
        self.read_ahead.close()
        if self._in_step is not None:
            self._in_step.close()
        self.coord.close()
        self.conns.close()
