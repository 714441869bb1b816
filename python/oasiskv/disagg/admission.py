"""Admitting a staged request on the decode side (:class:`AdmissionMixin`, a part of
:class:`~oasiskv.disagg.remote.RemoteKvSource`), in two steps, so that the decode loop never
waits on the network for a request it has not admitted yet:

1. :meth:`~AdmissionMixin.start_admission` checks the geometry and meta, reserves the request and
   turns it sparse (``Engine.admit_sparse``: its working-set pages and every host row it will
   own), writes what the read ahead brought (:mod:`.read_ahead`; read here when nothing was
   read ahead): the sections, and with a partial transfer (or a full one over an fp8 host pool)
   the summaries and the admission set. Then it hands the request's KV blocks to the Rust
   coordinator as background reads (``Coordinator.submit(..., background=True)``): with
   ``kv_transfer="full"`` every block of every layer, with ``"partial"`` each KV head's first
   working set (keys the read ahead selected). The coordinator's tasks write them straight into
   the request's host rows; no Python thread or bytes carry them. It returns at once.
2. :meth:`~AdmissionMixin.finish_admission` waits, layer by layer, for that layer's reads of
   this request alone (``Coordinator.wait_request``), builds the layer's summaries (full
   transfer), then puts the partial last block in the local page and selects the initial
   working set with the staged query. ``LLMEngine`` calls it once
   :meth:`~AdmissionMixin.admission_landed` (every read of the request has landed or failed; it
   asks each step while others decode), or at once when nothing else was running (then the
   per-layer waits overlap the summaries with the later layers' reads, and the requests
   admitted together start decoding together).

Policy: the rows are reserved at admission (step 1), not when the read ahead starts. The
request is next in line then, and its seat and rows are held only while its blocks stream in
beside the decode steps of the others; rows reserved at read-ahead would be held by requests
that may still wait long behind one that does not fit. The read ahead brings only what is
small (sections, summaries, and a partial transfer's admission set, which the daemon's
admission reply carries inline).

Faults: a read that fails (daemon gone or stalled past ``kv_timeout_s`` x ``kv_retries``, a
reply of the wrong size, a released request) fails this request alone: the coordinator marks
nothing of it present, drops its frames not sent yet, and :meth:`finish_admission` raises
:class:`~oasiskv.errors.RemoteError` with the message; everything it took goes back (rows,
pages, the daemon's copy) and ``LLMEngine`` finishes it with ``finish_reason="error"``.

An engine with an fp8 host tier (``KvConfig(kv_dtype="fp8_e4m3")`` or ``host_kv_dtype="fp8_e4m3"``)
admits fp8 blocks (the geometry's ``kv_format`` 1), codes into the pool and scales into its scales,
and refuses plain ones (and a plain engine fp8 ones) saying which ``KvConfig`` fixes it; a full
transfer then takes the staged summaries too (they bound the keys before quantization, which an
fp8 host pool no longer holds), and float pages take the local block from ``oasis/local_kv``.
"""

from __future__ import annotations

import json
import math

import torch

from .. import ops
from ..config import FP8_KV
from ..engine import Request, csr_tables, i32
from ..errors import ConfigError, RemoteError
from . import wire
from .read_ahead import Prefetched
from .state import Admitting, StagedState
from .wire import DTYPES, LOCAL_SECTION, META_FORMAT, META_SECTION, QUERY_SECTION, StagedRequest


class AdmissionMixin:
    """The admission steps of :class:`~oasiskv.disagg.remote.RemoteKvSource`, which provides the
    state they work on: ``engine``, ``transfer``, ``cache_blocks``, ``stats``, its components
    (``conns``: the admission's daemon connection, ``coord``: the Rust coordinator with the
    presence map and the reads into the host pool, ``read_ahead``) and the staged requests'
    bookkeeping (``_by_req``, ``_bounded``, ``_failed``, ``_collect_failures``), and the host pool
    writes and reads the admission shares with decode (``_sync_pools``, ``_streaming``,
    ``_moves_pools``, ``_take_row``, ``_rows_for``, ``_blocks_of``, ``_store_blocks``,
    ``_sync_landed``, ``_ensure``, ``_release_remote``, ``_release``, ``end``)."""

    @torch.no_grad()
    def start_admission(self, r: Request, handle: StagedRequest) -> None:
        """Start admitting ``r`` (its prompt already set) from the daemon's staged KV of
        ``handle`` (step 1 of the module docs): reserve, turn it sparse, write the admission
        data, and hand its blocks to the coordinator, which streams them into its host rows in
        the background. Returns at once. On failure everything it took goes back and the error
        propagates (a :class:`~oasiskv.errors.RemoteError`, or ``ConfigError`` when the staged
        geometry or meta does not match this engine)."""
        try:
            self._start(r, handle)
        except BaseException:
            # A staged request handed to the engine is the engine's: it ends here, so does the
            # daemon's copy (best effort), however the admission failed.
            self.end(r)
            self._release(handle.request_id)
            raise

    def admission_landed(self, r: Request) -> bool:
        """Whether every read :meth:`start_admission` handed the coordinator for ``r`` has
        landed or failed: :meth:`finish_admission` would not wait for the network. (Pools that
        moved meanwhile, a local request's growth, stream it again first: ``_sync_pools``.)"""
        self._sync_pools()
        return self.coord.in_flight(r.id) == 0

    @torch.no_grad()
    def finish_admission(self, r: Request) -> None:
        """Finish admitting ``r`` (step 2 of the module docs): per layer, wait for its reads of
        that layer and build its summaries; the local page; the initial working set. Then ``r``
        decodes as any sparse request. On failure (a read of it failed: RemoteError with the
        message) everything it took goes back and the error propagates."""
        st = self._by_req[r.id]
        try:
            self._finish(st)
        except BaseException:
            self.end(r)
            self.engine.release(r)
            raise

    def _geometry(self, prompt_len: int) -> tuple[int, int, int, int, int, int, int]:
        """The daemon geometry a staged ``prompt_len``-token request must have for this engine:
        its blocks in the host pool's format (fp8 host tier: ``kv_format`` fp8)."""
        eng, g = self.engine, self.engine.geo
        nb = math.ceil(prompt_len / g.block_size)
        fmt = wire.KV_FORMAT_FP8 if eng.host_kv8 else wire.KV_FORMAT_PLAIN
        return (
            eng.cfg.num_hidden_layers,
            g.num_kv_heads,
            g.block_size,
            g.head_dim,
            eng.dtype.itemsize,
            nb,
            fmt,
        )

    def _start(self, r: Request, handle: StagedRequest) -> None:
        eng = self.engine
        n = len(r.prompt)
        expect = self._geometry(n)
        got = tuple(handle.geometry)
        if len(got) == len(expect) and got[:-1] == expect[:-1] and got[-1] != expect[-1]:
            staged, mine = wire.kv_format_name(got[-1]), wire.kv_format_name(expect[-1])
            fix = (
                "pass KvConfig(host_kv_dtype='fp8_e4m3') (or the worker's kv_dtype='fp8_e4m3') to this engine"
                if got[-1] == wire.KV_FORMAT_FP8
                else "stage it with a PrefillWorker whose KvConfig has the same kv_dtype and host_kv_dtype "
                "(fp8_e4m3), or drop them from this engine's KvConfig"
            )
            raise ConfigError(
                f"the staged request's blocks are {staged} (geometry kv_format {got[-1]}) but this engine's "
                f"host pool holds {mine} blocks; {fix}"
            )
        if got != expect:
            raise ConfigError(
                f"the staged request has geometry {got} (layers, kv heads, block size, head dim, dtype "
                f"bytes, blocks, kv format) but this engine needs {expect}; prefill with the same model, "
                "KvConfig.block_size and kv dtypes"
            )
        if not eng.runtime.reservation(n, r.max_new_tokens)[2]:
            # Below the threshold the single-process engine attends densely. A staged request
            # decodes sparsely from its first step, which is the same attention where the budget
            # holds its whole context (always with the default threshold, K blocks).
            kv, b = eng.kv, eng.geo.block_size
            budget = (min(kv.layer_blocks or (kv.top_k_blocks,)) + 1) * b
            context = n + r.max_new_tokens - 1
            if context > budget:
                raise ConfigError(
                    f"a staged request decodes sparsely from its first step, but a {n}-token prompt "
                    f"with max_tokens={r.max_new_tokens} stays below sparse_threshold="
                    f"{kv.threshold_tokens} (dense attention in a single-process engine) while its "
                    f"{context} tokens pass the sparse budget of {budget}; lower KvConfig.sparse_threshold "
                    f"to at most {budget - b} (the smallest layer budget in tokens), or raise the budget"
                )
        c0 = self.conns.wire()
        pf = self.read_ahead.take(handle.request_id)
        if self._streaming() and self._moves_pools(n, r.max_new_tokens):
            # NOTE: the host pool grows (new tensors, the old copied): the streams in flight land
            # first. LLMEngine starts such an admission while others decode only once they have
            # (ready), so this waits only when nothing else is running.
            self.stats.wait_seconds += self.coord.drain()
        moving = self._streaming()  # streams in flight if the pools move after all
        tr = eng.admit_sparse(r, self.cache_blocks)
        try:
            self._start_staged(r, handle, tr, pf, moving)
        except BaseException:
            self.end(r)
            eng.release(r)
            raise
        st = self._by_req[r.id]
        st.admitting.wire_bytes += self.conns.wire() - c0 + (pf.wire_bytes if pf is not None else 0)

    def _start_staged(
        self, r: Request, handle: StagedRequest, tr: dict, pf: Prefetched | None, restream: bool
    ) -> None:
        eng = self.engine
        layers = eng.cfg.num_hidden_layers
        n, b = len(r.prompt), eng.geo.block_size
        nb = math.ceil(n / b)
        host_rows = list(tr["host_rows"])
        bounded = self.cache_blocks is not None
        st = StagedState(handle.request_id, r, list(tr["host_blocks"]), host_rows, bounded, set(host_rows))
        st.admitting = Admitting(tr, kv_bytes=handle.kv_bytes)
        self._by_req[r.id] = st
        self.coord.stage(r.id, handle.request_id)
        self._bounded += bounded
        self._sync_pools(restream)  # none in flight: they landed before the pools grew
        # The rows that hold a staged block now: every block's, or (bounded) the partial last
        # block's alone (the cache rows are empty; the filler only names the owner).
        first = n // b if bounded else 0
        if bounded:
            self.coord.set_owner(host_rows[0], r.id)
        for logical in range(first, nb):
            self._take_row(st, host_rows[logical], logical)
        if self.transfer == "full" and not eng.host_kv8:
            # The baseline: every block crosses; the summaries are built from the host pool at
            # finish, as a local transition to sparse builds them.
            sections = self._checked_sections(st, pf.sections) if pf is not None else self._fetch_sections(st)
        else:
            # Partial: the summaries and the admission set. Full over an fp8 host pool: the
            # engine's summaries bound the keys before quantization, so the staged rows come along.
            sections = self._fetch_admission(st, layers, pf)
        st.admitting.query = self._checked_meta(sections, n)
        st.admitting.local = self._local_kv(sections, layers, n)
        # Its blocks, streamed into its rows by the coordinator while others decode: every
        # block of every layer (whole), or each KV head's first working set.
        if self.transfer == "full":
            stream = (
                [layer for layer in range(layers) for _ in range(nb)],
                host_rows * layers,
                [-1] * (layers * nb),
            )
        elif pf is not None and pf.heads:
            stream = tuple(list(x) for x in zip(*pf.heads, strict=True))
            stream = (stream[0], [host_rows[blk] for blk in stream[1]], stream[2])
        else:
            return
        st.admitting.stream = stream
        self.coord.submit(*stream, background=True)

    def _finish(self, st: StagedState) -> None:
        eng, r = self.engine, st.req
        g, p = eng.geo, eng.pools
        layers = eng.cfg.num_hidden_layers
        adm = st.admitting
        tr = adm.tr
        c0 = self.conns.wire()
        self._sync_pools()  # pools that moved since it started: its blocks stream again
        for layer in range(layers):
            self.stats.wait_seconds += self.coord.wait_request(r.id, layer)
            self._raise_if_failed(st)
            if self.transfer == "full" and not eng.host_kv8:
                self._build_summaries(tr, layer)
        if len(r.prompt) % g.block_size:
            # The partial last block is the local block: its tokens go to the local page.
            row = st.host_rows[-1]
            last = torch.tensor([row], dtype=torch.long)
            heads = torch.arange(g.num_kv_heads)
            lp = tr["local_page"]
            for layer in range(layers):
                self._ensure(layer, last.expand(g.num_kv_heads), heads)
                if adm.local is not None:  # float pages over an fp8 host pool: unquantized
                    p.k_pages[layer][lp] = adm.local[layer, 0].to(p.k_pages[layer])
                    p.v_pages[layer][lp] = adm.local[layer, 1].to(p.v_pages[layer])
                    continue
                p.k_pages[layer][lp] = p.host_k[layer][row].to(p.k_pages[layer])
                p.v_pages[layer][lp] = p.host_v[layer][row].to(p.v_pages[layer])
                if eng.page_kv8:  # fp8 pages and host pool: the codes and their scales
                    p.k_scales[layer][lp] = p.host_k_scales[layer][row].to(p.k_scales[layer])
                    p.v_scales[layer][lp] = p.host_v_scales[layer][row].to(p.v_scales[layer])
        r.sparse = True
        r.metrics.sparse_since_token = r.kv_len
        self._select_initial(r, tr, adm.query)
        self._raise_if_failed(st)
        self._sync_landed()  # the coordinator's bytes of this request so far: its admission's
        st.admission_bytes = adm.wire_bytes + self.conns.wire() - c0 + round(adm.coord_bytes)
        r.metrics.network_admission_bytes = st.admission_bytes
        st.admitting = None
        self.stats.requests += 1
        self.stats.admission_bytes += st.admission_bytes
        self.stats.kv_bytes += adm.kv_bytes
        if self.transfer == "full":
            # Everything is local now: the daemon's copy is not needed any more.
            self._release_remote(st)

    def _raise_if_failed(self, st: StagedState) -> None:
        """RemoteError with the message when a read of ``st`` failed."""
        self._collect_failures()
        if st.req.id in self._failed:
            raise RemoteError(self._failed.pop(st.req.id))

    def _checked_meta(self, sections: dict, n: int) -> torch.Tensor:
        """The staged query ``[layers, num_qo_heads, head_dim]``, after checking that the meta
        matches this engine and an ``n``-token prompt."""
        eng = self.engine
        g = eng.geo
        layers = eng.cfg.num_hidden_layers
        try:
            meta = json.loads(sections[META_SECTION])
        except (ValueError, UnicodeDecodeError):
            meta = None
        if not isinstance(meta, dict) or meta.get("format") != META_FORMAT or meta.get("prompt_len") != n:
            raise ConfigError(
                f"the staged request's meta {meta!r} does not match a {n}-token prompt; pass the "
                "handle its PrefillWorker returned"
            )
        if DTYPES.get(meta.get("dtype")) != eng.dtype:
            raise ConfigError(f"staged KV dtype {meta.get('dtype')!r} differs from this engine's {eng.dtype}")
        pages = FP8_KV if eng.page_kv8 else wire.dtype_name(eng.dtype)
        if meta.get("kv_dtype", meta.get("dtype")) != pages:
            raise ConfigError(
                f"the staged request was prefilled over {meta.get('kv_dtype')} GPU pages, this engine "
                f"keeps {pages} pages: pass the same KvConfig.kv_dtype to the PrefillWorker and the "
                "decode engine (the staged summaries bound the keys its pages hold)"
            )
        raw = sections[QUERY_SECTION]
        want = layers * g.num_qo_heads * g.head_dim * eng.dtype.itemsize
        if len(raw) != want:
            raise ConfigError(
                f"the staged query section holds {len(raw)} bytes, this engine needs {want} "
                "(layers x query heads x head dim); prefill with the same model"
            )
        return torch.frombuffer(bytearray(raw), dtype=eng.dtype).view(layers, g.num_qo_heads, g.head_dim)

    # ---------------------------------------------------------------- reading ahead
    def prefetch(self, handle: StagedRequest) -> None:
        """Start reading ``handle``'s admission data in a background thread, on a connection of
        its own: the sections, and the summaries and admission set (``"partial"``; ``"full"``
        over an fp8 host pool), and select each KV head's first working set (``"partial"``). Its
        admission then takes them from host memory instead of stalling the decode loop on the
        network; its blocks stream in through the coordinator. At most :attr:`prefetch_depth`
        requests are read ahead (``LLMEngine`` asks for the first waiting ones every step); a
        failed read only means the admission reads in the loop, as without it (and reports the
        error there)."""
        self.read_ahead.start(handle, self._geometry(len(handle.prompt)))

    def ready(self, handle: StagedRequest, max_new_tokens: int) -> bool:
        """Whether starting ``handle``'s admission now (with ``max_new_tokens``) would not wait:
        its read ahead is done, and it does not grow the host pool while other admissions'
        blocks are in flight (they land first)."""
        if not self.read_ahead.ready(handle):
            return False
        return not (self._streaming() and self._moves_pools(len(handle.prompt), max_new_tokens))

    def drop_prefetch(self, daemon_id: int) -> None:
        """Forget a read ahead (its request ended before admission)."""
        self.read_ahead.drop(daemon_id)

    # ---------------------------------------------------------------- admission steps
    def _fetch_admission(self, st: StagedState, layers: int, pf: Prefetched | None = None) -> dict:
        """Read the admission set of every layer (in as many calls as the frame limit needs), or
        take what ``pf`` read ahead, into the host pool and summaries; returns the sections."""
        g = self.engine.geo
        row = g.num_kv_heads * 2 * g.head_dim * self.engine.dtype.itemsize
        replies = (
            pf.adms
            if pf is not None
            else wire.admission_replies(
                self.conns.call, st.daemon_id, wire.admission_chunks(layers, len(st.host_blocks) * row)
            )
        )
        sections: dict = {}
        for i, adm in enumerate(replies):
            if i == 0:
                sections = dict(adm["sections"])
            self._write_admission(st, adm)
        return self._checked_sections(st, sections)

    def _fetch_sections(self, st: StagedState) -> dict:
        """The admission's sections alone (no layers)."""
        adm = self.conns.call(lambda c: c.fetch_admission(st.daemon_id, 0, 0, True))
        return self._checked_sections(st, dict(adm["sections"]))

    def _checked_sections(self, st: StagedState, sections: dict) -> dict:
        missing = [s for s in (META_SECTION, QUERY_SECTION) if s not in sections]
        if missing:
            raise ConfigError(
                f"staged request {st.daemon_id} has no {missing} section(s); stage it with "
                "oasiskv.disagg.PrefillWorker"
            )
        return sections

    def _local_kv(self, sections: dict, layers: int, prompt_len: int) -> torch.Tensor | None:
        """The staged partial last block, unquantized, ``[layers, 2, Hkv, b, D]``, when this
        engine's pages are float over an fp8 host pool (None otherwise: the host row holds the
        local page's bytes; and for a prompt of whole blocks, which has no partial last block:
        its first token starts a fresh local page)."""
        eng = self.engine
        g = eng.geo
        if not eng.host_kv8 or eng.page_kv8 or prompt_len % g.block_size == 0:
            return None
        raw = sections.get(LOCAL_SECTION)
        want = layers * 2 * g.num_kv_heads * g.block_size * g.head_dim * eng.dtype.itemsize
        if raw is None or len(raw) != want:
            got = "none" if raw is None else f"{len(raw)} bytes"
            raise ConfigError(
                f"the staged request's {LOCAL_SECTION} section has {got}, this engine needs {want} "
                "(the partial last block unquantized, for its float local page); stage it with a "
                "PrefillWorker of this engine's KvConfig (kv_dtype, host_kv_dtype)"
            )
        x = torch.frombuffer(bytearray(raw), dtype=eng.dtype)
        return x.view(layers, 2, g.num_kv_heads, g.block_size, g.head_dim)

    def _build_summaries(self, tr: dict, layer: int) -> None:
        """Summaries of every block of ``layer`` from the host pool (``transfer="full"``)."""
        eng = self.engine
        p, dev = eng.pools, eng.device
        dst, lens = i32(tr["host_blocks"], dev), i32(tr["lens"], dev)
        rows = i32(tr["host_rows"], dev)
        ops.build_summaries(eng.geo, p.host_k[layer], dst, lens, p.summaries[layer], block_rows=rows)

    def _write_admission(self, st: StagedState, adm: dict) -> None:
        eng = self.engine
        p, g, dt = eng.pools, eng.geo, eng.dtype
        hk, d = g.num_kv_heads, g.head_dim
        hb = st.host_blocks
        if adm["summary_runs"]:
            rows = torch.frombuffer(adm["summaries"], dtype=dt).view(-1, hk, 2, d)
            at = 0
            for layer, first, num in adm["summary_runs"]:
                idx = torch.tensor(hb[first : first + num], dtype=torch.long, device=eng.device)
                p.summaries[layer][idx] = rows[at : at + num].to(eng.device)
                at += num
        if adm["block_keys"]:
            blocks = self._blocks_of(adm["blocks"], len(adm["block_keys"]), hk)
            by_layer: dict[int, list[int]] = {}
            for i, (layer, _) in enumerate(adm["block_keys"]):
                by_layer.setdefault(layer, []).append(i)
            for layer, rows_i in by_layer.items():
                logicals = [adm["block_keys"][i][1] for i in rows_i]
                if st.bounded:
                    # A layer's admission set gets cache rows (evicting other layers' blocks
                    # if it must); past C blocks (a worker with a larger K) the rest is read
                    # on demand.
                    keep = list(dict.fromkeys(logicals))[: self.cache_blocks]
                    rows_i = [i for i, lg in zip(rows_i, logicals, strict=True) if lg in set(keep)]
                    logicals = [adm["block_keys"][i][1] for i in rows_i]
                rows = self._rows_for(st, logicals, logicals)
                sel = torch.tensor(rows_i, dtype=torch.long)
                chosen = tuple(None if x is None else x.index_select(0, sel) for x in blocks)
                self._store_blocks(st, layer, torch.tensor(rows, dtype=torch.long), chosen)

    def _select_initial(self, r: Request, tr: dict, query: torch.Tensor) -> None:
        """The initial working set, selected with the staged query without the cap (as
        ``Engine.make_sparse`` does with the latest lookahead query)."""
        eng = self.engine
        g, dev = eng.geo, eng.device
        n_complete = tr["n_complete"]
        slot_pages = i32([tr["slot_pages"]], dev)
        blk = csr_tables([tr["host_blocks"][:n_complete]], dev)
        host = csr_tables([tr["host_rows"]], dev)  # patched by before_gather (bounded cache)
        for layer in range(eng.cfg.num_hidden_layers):
            q = query[layer].view(1, g.num_qo_heads, g.head_dim).to(dev).contiguous()
            k = eng.kv.layer_budget(layer)  # KvConfig.layer_blocks: the layer's first k slots
            slots = slot_pages if k == slot_pages.shape[1] else slot_pages[:, :k].contiguous()
            eng.select_initial(r, layer, q, slots, blk, host, k)
