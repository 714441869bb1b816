"""Admitting a staged request on the decode side (:class:`AdmissionMixin`, a part of
:class:`~oasiskv.disagg.remote.RemoteKvSource`): check its geometry and meta, reserve and turn it
sparse (``Engine.admit_sparse``), bring the admission (every summary row and the admission set,
or with ``kv_transfer="full"`` every block) into the host pool and summaries, from what the read
ahead brought (:class:`~oasiskv.disagg.read_ahead.ReadAhead`) or read in the loop, put the
partial last block in the local page, and select the initial working set with the staged query.

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
from .state import StagedState
from .wire import DTYPES, LOCAL_SECTION, META_FORMAT, META_SECTION, QUERY_SECTION, StagedRequest


class AdmissionMixin:
    """The admission steps of :class:`~oasiskv.disagg.remote.RemoteKvSource`, which provides the
    state they work on: ``engine``, ``transfer``, ``cache_blocks``, ``stats``, its components
    (``conns``: the admission's daemon connection, ``coord``: the Rust coordinator with the
    presence map and the reads into the host pool, ``read_ahead``) and the staged requests'
    bookkeeping (``_by_req``, ``_bounded``, ``_failed``, ``_collect_failures``, ``_admitting``), and
    the host pool writes and reads the admission shares with decode (``_grow_maps``, ``_take_row``,
    ``_rows_for``, ``_blocks_of``, ``_store``, ``_store_blocks``, ``_count_cached``, ``_ensure``,
    ``_read_blocks``, ``_release_remote``, ``end``)."""

    @torch.no_grad()
    def admit(self, r: Request, handle: StagedRequest) -> None:
        """Admit ``r`` (its prompt already set) from the daemon's staged KV of ``handle``: reserve,
        turn it sparse, fill the host pool with the admission (or everything, ``transfer="full"``)
        and select the initial working set. On failure everything it took goes back and the error
        propagates (a :class:`~oasiskv.errors.RemoteError`, or ``ConfigError`` when the staged
        geometry does not match this engine)."""
        try:
            self._admit(r, handle)
        except BaseException:
            # A staged request handed to the engine is the engine's: it ends here, so does the
            # daemon's copy (best effort), however the admission failed.
            self.end(r)
            self.conns.release(handle.request_id)
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

    def _admit(self, r: Request, handle: StagedRequest) -> None:
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
            raise ConfigError(
                f"a staged request decodes sparsely from its first step, but a {n}-token prompt with "
                f"max_tokens={r.max_new_tokens} never passes sparse_threshold={eng.kv.threshold_tokens}; "
                "lower KvConfig.sparse_threshold or raise max_tokens"
            )
        wire0 = self._wire()
        self._admitting = True
        try:
            self._admit_staged(r, handle, wire0)
        finally:
            self._admitting = False

    def _admit_staged(self, r: Request, handle: StagedRequest, wire0: int) -> None:
        eng = self.engine
        g = eng.geo
        layers = eng.cfg.num_hidden_layers
        n, b = len(r.prompt), eng.geo.block_size
        nb = math.ceil(n / b)
        tr = eng.admit_sparse(r, self.cache_blocks)
        st = None
        try:
            p = eng.pools
            host_rows = list(tr["host_rows"])
            bounded = self.cache_blocks is not None
            st = StagedState(
                handle.request_id, r, list(tr["host_blocks"]), host_rows, bounded, set(host_rows)
            )
            self._by_req[r.id] = st
            self.coord.stage(r.id, handle.request_id)
            self._bounded += bounded
            self._grow_maps()
            # The rows that hold a staged block now: every block's, or (bounded) the partial last
            # block's alone (the cache rows are empty; the filler only names the owner).
            first = n // b if bounded else 0
            if bounded:
                self.coord.set_owner(host_rows[0], r.id)
            for logical in range(first, nb):
                self._take_row(st, host_rows[logical], logical)
            pf = self.read_ahead.take(handle.request_id)
            if self.transfer == "full":
                # The baseline: every block crosses; the summaries are built here, as a local
                # transition to sparse builds them. Not from an fp8 host pool: the engine's
                # summaries bound the keys before quantization, so the staged rows come along.
                if eng.host_kv8:
                    sections = self._fetch_admission(st, layers, pf)
                elif pf is not None:
                    sections = self._checked_sections(st, pf.sections)
                else:
                    sections = self._fetch_sections(st)
                if pf is not None:
                    for layer, logicals, data in pf.frames:
                        self._install(st, layer, logicals, None, data)
                self._fetch_rest(st, layers)  # whatever the read ahead did not bring
                if not eng.host_kv8:
                    self._build_summaries(tr)
            else:
                sections = self._fetch_admission(st, layers, pf)
                if pf is not None:
                    for layer, pairs, data in pf.heads:
                        blocks, heads = zip(*pairs, strict=True)
                        self._install(st, layer, blocks, heads, data)
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
                raise ConfigError(
                    f"staged KV dtype {meta.get('dtype')!r} differs from this engine's {eng.dtype}"
                )
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
            query = torch.frombuffer(bytearray(raw), dtype=eng.dtype)
            query = query.view(layers, g.num_qo_heads, g.head_dim)
            if n % b:
                # The partial last block is the local block: its tokens go to the local page.
                last = torch.tensor([host_rows[-1]], dtype=torch.long)
                heads = torch.arange(g.num_kv_heads)
                local = self._local_kv(sections, layers)
                lp, row = tr["local_page"], host_rows[-1]
                for layer in range(layers):
                    self._ensure(layer, last.expand(g.num_kv_heads), heads)
                    if local is not None:  # float pages over an fp8 host pool: unquantized
                        p.k_pages[layer][lp] = local[layer, 0].to(p.k_pages[layer])
                        p.v_pages[layer][lp] = local[layer, 1].to(p.v_pages[layer])
                        continue
                    p.k_pages[layer][lp] = p.host_k[layer][row].to(p.k_pages[layer])
                    p.v_pages[layer][lp] = p.host_v[layer][row].to(p.v_pages[layer])
                    if eng.page_kv8:  # fp8 pages and host pool: the codes and their scales
                        p.k_scales[layer][lp] = p.host_k_scales[layer][row].to(p.k_scales[layer])
                        p.v_scales[layer][lp] = p.host_v_scales[layer][row].to(p.v_scales[layer])
            r.sparse = True
            r.metrics.sparse_since_token = r.kv_len
            self._select_initial(r, tr, query)
            self._collect_failures()
            if self._failed.pop(r.id, None) is not None:
                raise RemoteError(st.errors[-1] if st.errors else "admission fetch failed")
            st.admission_bytes = self._wire() - wire0 + (pf.wire_bytes if pf is not None else 0)
            r.metrics.network_admission_bytes = st.admission_bytes
            self.stats.requests += 1
            self.stats.admission_bytes += st.admission_bytes
            self.stats.kv_bytes += handle.kv_bytes
            if self.transfer == "full":
                # Everything is local now: the daemon's copy is not needed any more.
                self._release_remote(st)
        except BaseException:
            self.end(r)
            eng.release(r)
            raise

    # ---------------------------------------------------------------- reading ahead
    def prefetch(self, handle: StagedRequest) -> None:
        """Start reading ``handle``'s admission data in a background thread, on a connection of
        its own: the summaries and admission set (``"partial"``), or every block (``"full"``).
        Its admission then copies from host memory instead of stalling the decode loop on the
        network. At most :attr:`prefetch_depth` requests are read ahead (``LLMEngine`` asks for
        the first waiting ones every step); a failed read only means the admission reads in the
        loop, as without it (and reports the error there)."""
        self.read_ahead.start(handle, self._geometry(len(handle.prompt)))

    def ready(self, handle: StagedRequest) -> bool:
        """Whether admitting ``handle`` now would not wait for its read ahead."""
        return self.read_ahead.ready(handle)

    def drop_prefetch(self, daemon_id: int) -> None:
        """Forget a read ahead (its request ended before admission)."""
        self.read_ahead.drop(daemon_id)

    # ---------------------------------------------------------------- admission steps
    def _install(self, st: StagedState, layer: int, logicals, heads, data) -> None:
        """Blocks (``heads`` None) or block-heads read ahead, ``logicals`` of ``st`` in order, into
        their host rows."""
        rows = torch.tensor([st.host_rows[i] for i in logicals], dtype=torch.long)
        heads_t = None if heads is None else torch.tensor(heads, dtype=torch.long)
        self._count_cached(st, int(self._store(layer, rows, heads_t, data).sum()))

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

    def _local_kv(self, sections: dict, layers: int) -> torch.Tensor | None:
        """The staged partial last block, unquantized, ``[layers, 2, Hkv, b, D]``, when this
        engine's pages are float over an fp8 host pool (None otherwise: the host row holds the
        local page's bytes)."""
        eng = self.engine
        if not eng.host_kv8 or eng.page_kv8:
            return None
        g = eng.geo
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

    def _build_summaries(self, tr: dict) -> None:
        """Summaries of every block from the host pool (``transfer="full"``)."""
        eng = self.engine
        p, dev = eng.pools, eng.device
        dst, lens = i32(tr["host_blocks"], dev), i32(tr["lens"], dev)
        rows = i32(tr["host_rows"], dev)
        for layer in range(eng.cfg.num_hidden_layers):
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

    def _fetch_rest(self, st: StagedState, layers: int) -> None:
        """``transfer="full"``: read every block the admission did not bring (whole blocks, by the
        coordinator, every layer at once)."""
        self._read_blocks(list(st.host_rows), layers)

    def _wire(self) -> int:
        """Wire bytes so far of the admission's connection and of the coordinator's."""
        return self.conns.wire() + self.coord.stats()["wire_bytes"]

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
