"""The reads of a step's misses after the step, and the bounded cache's rows
(:class:`StepReadsMixin`, a part of :class:`~oasiskv.disagg.remote.RemoteKvSource`; see that
module's docs): the ``BlockSource`` verbs the engine calls around its gathers
(``before_gather``: one layer, read and waited for here; ``before_gathers``: every layer's plan
handed to the coordinator at once; ``wait_for_layer_load``: one layer's wait), and the host rows
a bounded cache (``kv_cache_blocks``) gives and takes back (``Runtime.cache_blocks``). The
in-step reads, the default where they apply, bypass the first two (:mod:`.in_step`)."""

from __future__ import annotations

import time

import torch

from ..errors import OutOfBlocksError
from .state import StagedState


class StepReadsMixin:
    """``RemoteKvSource``'s after-step reads and bounded-cache rows: uses its coordinator
    (``coord``), state (``_by_req``, ``_failed``, ``_waiting``, ``_bounded``, ``stats``) and
    helpers (``_submit``, ``_sync_landed``, ``_fail``, ``_entry_bytes``)."""

    def before_gather(self, layer: int, plan_slots, plan_blocks, host_indptr, host_indices) -> bool:
        """Called by the engine between a layer's delta selection and its gather: read the
        planned block-heads that are still only in the daemon into the host pool, and wait for
        them (one layer: the inline path, a bounded cache, an admission's first working set). A
        failed read marks the requests it carried failed (:meth:`take_failed`); the gather then
        copies stale bytes for them, and their step's output is discarded.

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
        if self.idle:
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
            firsts = indices[indptr[seq]]
            owner = torch.tensor([o for o, _ in self.coord.owners(firsts.tolist())], dtype=torch.long)
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
        """The plans of a step's layers at once, ``plans`` a list of ``(layer, plan_slots,
        plan_blocks, host_indptr, host_indices)`` in layer order: the absent block-heads of all
        the layers go to the coordinator in one submission (layer order, every connection), and
        this returns without waiting; the engine calls :meth:`wait_for_layer_load` before each
        layer's gather. Returns, per plan, whether its gather's inputs change (entries of its
        layer were submitted). With a bounded cache, or plans of other tables than one step's,
        layer by layer (each read and waited for here: rows change hands between layers)."""
        t0 = time.perf_counter()
        try:
            return self._before_gathers(plans)
        finally:
            self.stats.read_seconds += time.perf_counter() - t0

    def _before_gathers(self, plans: list) -> list[bool]:
        if self.idle or not plans:
            return [False] * len(plans)
        shared = len({(id(p[3]), id(p[4])) for p in plans}) == 1 and len({p[1].shape for p in plans}) == 1
        if self._bounded or not shared:
            return [self._before_gather(*p) for p in plans]
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
        sent = self._submit(layer_of[li], indices[indptr[seq] + pb[sel].long()], head, self._decode_prefetch)
        self._waiting.update(layer for layer, n in enumerate(sent) if n)
        return [sent[p[0]] > 0 for p in plans]

    def wait_for_layer_load(self, layer: int) -> float:
        """Block (the GIL released) until the entries :meth:`before_gathers` submitted for
        ``layer`` have landed or failed; the seconds waited (0 when it submitted none). The one
        place the decode loop waits for the network; the last layer's wait also takes the
        landed counts into the traffic statistics."""
        if layer not in self._waiting:
            return 0.0
        self._waiting.discard(layer)
        waited = self.coord.wait_layer(layer)
        self.stats.wait_seconds += waited
        if not self._waiting:
            self._sync_landed()
        return waited

    def _ensure(self, layer: int, hb: torch.Tensor, head: torch.Tensor) -> bool:
        """Make the block-heads ``(hb[i], head[i])`` of ``layer`` present, reading the absent
        ones and waiting for them; whether any was read."""
        sent = self._submit(torch.full_like(hb, layer), hb, head)
        if not sent[layer]:
            return False
        self.stats.wait_seconds += self.coord.wait_layer(layer)
        self._sync_landed()
        return True

    # ---------------------------------------------------------------- the bounded cache's rows
    def _take_row(self, st: StagedState, row: int, logical: int) -> None:
        """Host row ``row`` now holds staged block ``logical`` of ``st``: nothing of it read yet."""
        self.coord.take_row(row, st.req.id, logical)
        st.rows.add(row)

    def _forget_row(self, st: StagedState, row: int) -> None:
        """The block cached in ``row`` was evicted: its bytes are gone (read again if planned)."""
        had = self.coord.forget_row(row)
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
        self._sync_landed()  # an evicted row's landed entries are counted before they go
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
        self._count_cached(st, int(self._mark(layer, hb, None).sum()))

    def _count_cached(self, st: StagedState, entries: int) -> None:
        st.cached_entries += entries
        s = self.stats
        s.cached_bytes += entries * self._entry_bytes()
        s.peak_cached_bytes = max(s.peak_cached_bytes, s.cached_bytes)
