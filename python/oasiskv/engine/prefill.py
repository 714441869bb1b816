"""The prefill of a prompt admitted sparse: :class:`SparsePrefill` stores each layer's K/V where
:meth:`Engine.make_sparse <oasiskv.engine.Engine.make_sparse>` would have copied them from dense
pages, and reads a chunked prompt's earlier positions back from the host pool, the next layer's
read overlapping this layer's compute on a GPU.

The engine's prefill (:meth:`Engine.prefill`, :meth:`Engine.prefill_chunk`) owns the forward and
the request's admission; this room owns what a sparse admission's prefill does with the K/V.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

import torch

from .. import ops
from .pools import i32

if TYPE_CHECKING:
    from .core import Engine

#: Runs of consecutive host rows a read-back copies with one ``copy_`` each (the GPU's copy
#: engine, SMs free for the forward); a prompt's rows in more runs than this are read by the page
#: copy kernel instead (one launch, rows in any order, but it holds SMs while it waits on PCIe).
#: A fresh pool hands a prompt one run; a fragmented one a few.
MAX_COPY_RUNS = 64


def row_runs(rows: list[int]) -> list[tuple[int, int, int]]:
    """``rows`` as runs of consecutive rows: ``(at, row, length)``, ``rows[at + i] == row + i``
    for ``i < length``; the runs cover ``rows`` in order."""
    runs: list[tuple[int, int, int]] = []
    for i, r in enumerate(rows):
        if runs and runs[-1][1] + runs[-1][2] == r:
            at, row, n = runs[-1]
            runs[-1] = (at, row, n + 1)
        else:
            runs.append((i, r, 1))
    return runs


def clip_runs(runs: list[tuple[int, int, int]], nb: int) -> list[tuple[int, int, int]]:
    """The runs of :func:`row_runs` cut at ``nb`` rows."""
    out = []
    for at, row, n in runs:
        if at >= nb:
            break
        out.append((at, row, min(n, nb - at)))
    return out


class SparsePrefill:
    """The prefill of a prompt admitted sparse (:meth:`Engine.admit` with ``whole`` or
    ``chunked``; transition ``tr`` of ``Runtime.admit_sparse``): :meth:`store` puts each layer's
    K/V where :meth:`Engine.make_sparse` would have copied them from dense pages -- the request's
    host rows, the summaries (and key codes) of its blocks from the same keys, its partial last
    block in the local page -- while the forward holds them, so the device holds one layer of the
    prompt at a time instead of every layer's pages. The same kernels as ``make_sparse`` on the
    same values: the same pools, bit for bit. A chunked prefill stores each chunk's blocks (a block
    a chunk ends inside goes to its host row as far as it is written, and again, whole, with the
    next chunk) and reads the prompt's earlier positions back from the host rows
    (:meth:`prefix`), where the path through pages reads them from the pages: the same values (an
    fp8 host pool gives them back as stored, code x scale, as fp8 pages would).

    The read-back is the price of holding no pages: a prompt of n tokens in chunks of c reads
    about n^2 / 2c positions per layer. On a GPU :meth:`prefetch` starts a layer's read on a
    background stream (``side``) and :meth:`prefix` waits for it, so the engine reads layer l + 1
    while layer l computes; the rows go by the copy engine where they lie in few runs
    (:data:`MAX_COPY_RUNS`)."""

    def __init__(self, eng: Engine, tr: dict, side: torch.cuda.Stream | None = None) -> None:
        dev = eng.device
        self.eng, self.tr = eng, tr
        self.b = eng.kv.block_size
        self.dst, self.rows = (i32(tr[x], dev) for x in ("host_blocks", "host_rows"))
        self.nb, self.n_complete = len(tr["host_blocks"]), tr["n_complete"]
        self.n = (self.nb - 1) * self.b + tr["lens"][-1] if self.nb else 0  # the prompt's length
        self.runs = row_runs(list(tr["host_rows"]))
        self.side = side if dev.type == "cuda" else None
        # layer -> (k, v, event) of a read started by prefetch(); the event None on the CPU.
        self._pending: dict[int, tuple] = {}
        if self.side is not None:
            # The reads see every earlier chunk's stores (launched on the compute stream).
            self.side.wait_stream(torch.cuda.current_stream(dev))

    def _paged(self, x: torch.Tensor, nb: int) -> torch.Tensor:
        """``[n, Hkv, D]`` as ``nb`` of the pool's pages ``[nb, Hkv, b, D]`` (zeros past ``n``)."""
        eng = self.eng
        b, hk, d = self.b, eng.geo.num_kv_heads, eng.geo.head_dim
        x = x.to(eng.device, eng.dtype, non_blocking=True)
        pad = nb * b - x.shape[0]
        if pad:
            x = torch.cat([x, x.new_zeros(pad, hk, d)])
        return x.view(nb, b, hk, d).transpose(1, 2).contiguous()

    def store(self, layer: int, k: torch.Tensor, v: torch.Tensor, first: int = 0) -> None:
        """``k``, ``v`` ``[m, Hkv, D]``: positions ``first * b ..`` of the prompt (the whole
        prompt by default), each touched block whole as far as the prompt is written."""
        eng = self.eng
        p, b, dev = eng.pools, self.b, eng.device
        m = k.shape[0]
        nb = -(-m // b)
        end = first * b + m
        kp, vp = self._paged(k, nb), self._paged(v, nb)
        part = slice(first, first + nb)
        src = torch.arange(nb, dtype=torch.int32, device=dev)
        lens = torch.clamp(end - (src + first) * b, max=b).to(torch.int32)  # rows written of each block
        nc = m // b  # the touched blocks complete now (all but a last one the prompt or chunk ends in)
        p.blocks_to_host(layer, src, self.rows[part], self.dst[part], lens, nc, eng.key_codes, pages=(kp, vp))
        if end == self.n and self.n_complete < self.nb:
            # The prompt's partial last block: the local page's (attention reads it there).
            local = self.tr["local_page"]
            p.k_pages[layer][local] = kp[-1]
            p.v_pages[layer][local] = vp[-1]

    def prefetch(self, layer: int, n: int) -> None:
        """Start reading positions ``0 .. n - 1`` of ``layer`` back (:meth:`prefix` takes them):
        on the background stream on a GPU, at once on the CPU. Once per layer and chunk."""
        if layer in self._pending or not 0 <= layer < self.eng.cfg.num_hidden_layers:
            return
        k, v = self._read(layer, n, self.side)
        done = None
        if self.side is not None:
            done = torch.cuda.Event()
            done.record(self.side)
        self._pending[layer] = (k, v, done)

    def prefix(self, layer: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Positions ``0 .. n - 1`` of ``layer``'s K and V as stored by the earlier chunks, ``[n,
        Hkv, D]`` in the pool's dtype on the device: their host rows read back (an fp8 pool's codes
        come back dequantized, code x scale, as fp8 pages read them); a read :meth:`prefetch`
        started, waited for on the current stream, or one made now."""
        self.prefetch(layer, n)
        k, v, done = self._pending.pop(layer)
        if done is not None:
            torch.cuda.current_stream(self.eng.device).wait_event(done)
        return k, v

    def _read(self, layer: int, n: int, side: torch.cuda.Stream | None = None) -> tuple:
        """The read of :meth:`prefix`: its buffers allocated and its copies launched on ``side``
        (None: the current stream), its outputs ``[n, Hkv, D]`` marked as the current stream's
        too. (Buffers allocated on the current stream and written on ``side`` raced: the caching
        allocator hands the current stream memory that its queued kernels still read.)"""
        eng = self.eng
        p, b, dev = eng.pools, self.b, eng.device
        nb = -(-n // b)
        hk, d = eng.geo.num_kv_heads, eng.geo.head_dim
        runs = clip_runs(self.runs, nb)
        by_engine = len(runs) <= MAX_COPY_RUNS
        cur = torch.cuda.current_stream(dev) if side is not None else None
        with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
            out = [torch.empty(nb * b, hk, d, dtype=eng.dtype, device=dev) for _ in range(2)]
            pages = [torch.empty(nb, hk, b, d, dtype=eng.dtype, device=dev) for _ in range(2)]
            ids = torch.arange(nb, dtype=torch.int32, device=dev)
            if not by_engine:  # rows in any order: the page copy kernel reads them in place
                kw = p.host_scales(layer, "src_")
                ops.copy_pages(eng.geo, p.host_k[layer], p.host_v[layer], self.rows[:nb], *pages, ids, **kw)
            else:
                # The runs of rows by the copy engine: into the pages, or an fp8 pool's codes and
                # scales into a staging copy that one page copy then dequantizes into them.
                srcs, dsts = [p.host_k[layer], p.host_v[layer]], pages
                if p.host_kv8:
                    srcs += [p.host_k_scales[layer], p.host_v_scales[layer]]
                    dsts = [torch.empty(nb, hk, b, d, dtype=torch.uint8, device=dev) for _ in range(2)]
                    dsts += [torch.empty(nb, hk, dtype=torch.float32, device=dev) for _ in range(2)]
                for dst, src in zip(dsts, srcs, strict=True):
                    for at, row, m in runs:
                        dst[at : at + m].copy_(src[row : row + m], non_blocking=True)
                if p.host_kv8:
                    ks, vs = dsts[2:]
                    ops.copy_pages(eng.geo, *dsts[:2], ids, *pages, ids, src_k_scales=ks, src_v_scales=vs)
            for o, pg in zip(out, pages, strict=True):
                o.view(nb, b, hk, d).copy_(pg.transpose(1, 2))
        if cur is not None:
            for o in out:  # freed after the current stream's use, not before
                o.record_stream(cur)
        return out[0][:n], out[1][:n]
