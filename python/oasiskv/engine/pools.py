"""The KV pools: the per-layer tensors (GPU pages, host blocks, summaries, key codes, head-wise
mapping) in :class:`KvPools`, their growth (pinned host memory included), and the engine's side
of the pool accounting (:class:`PoolsMixin`): sizing from the budgets, the ``oasis-runtime``
:class:`~oasiskv._core.Runtime` that owns the block tables, admission, release and the mapping
updates. Also the small tensor helpers every room uses (:func:`i32`, :func:`copy_to_host`).
"""

from __future__ import annotations

import logging

import torch

from .. import ops
from ..config import MAX_POOL_BLOCKS
from ..errors import ConfigError, OutOfBlocksError
from ..memory import available_bytes, device_numa_node, ensure_fits, pinned_full
from ..policy import LocalHostPool
from .requests import Request

log = logging.getLogger("oasiskv.engine")

#: A pinned host-pool growth at least this large is announced (log line and a progress bar on a
#: terminal): pinning costs about 0.6 s per GiB, so a 100 GiB pool takes a minute.
PIN_NOTICE_BYTES = 1 << 30


#: Read at call time by :meth:`PoolsMixin.prefills_sparse`: a long prompt prefilled in one piece
#: goes straight to the host pool (True), or through dense pages that ``make_sparse`` copies and
#: frees after the prefill (False: the path before it, kept for comparison and its tests).
DIRECT_SPARSE_PREFILL = True

#: Where the host pool lives (``Engine(host_pool=...)``): pinned CPU memory, or the model's device
#: (the all-resident oracle: the same selection, but the gather copies device to device).
HOST_POOLS = ("pinned", "device")


class KvPools:
    """The per-layer pools (one page id addresses the same page in every layer). The ids are
    handed out by the engine's :class:`oasiskv._core.Runtime`; :meth:`grow` enlarges the tensors
    as admitted requests need them, keeping every block's contents.

    ``host_pool`` places ``host_k``/``host_v``: ``"pinned"`` in CPU memory (pinned with a GPU: the
    kernels read and write it over PCIe through unified addressing), ``"device"`` on ``device``
    beside the pages (the all-resident oracle: every kernel that takes the host pool accepts it
    there, and the gather becomes a device-to-device copy). Without a GPU both are CPU memory.

    ``host_kv8`` (``KvConfig.host_kv_dtype="fp8_e4m3"``): the host pool holds E4M3 codes (uint8)
    with float32 scales per (row, KV head) in ``host_k_scales``/``host_v_scales``; every kernel
    that reads or writes it takes them (:meth:`host_scales`)."""

    def __init__(
        self,
        geo,
        num_layers: int,
        dtype: torch.dtype,
        num_pages: int,
        num_host_blocks: int,
        device: torch.device,
        key_codes: bool = False,
        host_pool: str = "pinned",
        num_host_rows: int | None = None,
        host_kv8: bool = False,
        page_kv8: bool = False,
    ) -> None:
        self.geo, self.dtype, self.num_layers, self.device = geo, dtype, num_layers, device
        self.host_kv8, self.page_kv8 = host_kv8, page_kv8
        page_dtype = torch.uint8 if page_kv8 else dtype
        host_dtype = torch.uint8 if host_kv8 else dtype
        self.num_pages, self.num_host_blocks, self.num_host_rows = 0, 0, 0
        hk, b, d = geo.num_kv_heads, geo.block_size, geo.head_dim
        self.host_pool = host_pool
        self.host_device = device if host_pool == "device" else torch.device("cpu")
        self.host_pin = device.type == "cuda" and host_pool != "device"
        #: The NUMA node the pinned host pool's pages are placed on: the GPU's, where the machine
        #: shows one (None: the kernel's default placement).
        self.numa_node = device_numa_node(device) if self.host_pin else None
        pin, host_dev = self.host_pin, self.host_device
        # Empty pools first (every kernel takes a tensor, also of 0 rows); grow() fills them.
        self.k_pages = [torch.zeros(0, hk, b, d, dtype=page_dtype, device=device) for _ in range(num_layers)]
        self.v_pages = [torch.zeros(0, hk, b, d, dtype=page_dtype, device=device) for _ in range(num_layers)]

        # fp8 pages (and below, an fp8 host pool): a power-of-two scale per (page, KV head), K and
        # V apart; float32, empty until grow().
        def scales(dev, pin=False):
            return [torch.zeros(0, hk, device=dev, pin_memory=pin) for _ in range(num_layers)]

        self.k_scales = scales(device) if page_kv8 else None
        self.v_scales = scales(device) if page_kv8 else None
        self.page_map = torch.full((num_layers, 0, hk), -1, dtype=torch.int32, device=device)
        self.page_last_selected = torch.full((num_layers, 0, hk), -1, dtype=torch.int32, device=device)
        hd = host_dtype
        self.host_k = [
            torch.zeros(0, hk, b, d, dtype=hd, device=host_dev, pin_memory=pin) for _ in range(num_layers)
        ]
        self.host_v = [
            torch.zeros(0, hk, b, d, dtype=hd, device=host_dev, pin_memory=pin) for _ in range(num_layers)
        ]
        self.host_k_scales = scales(host_dev, pin) if host_kv8 else None
        self.host_v_scales = scales(host_dev, pin) if host_kv8 else None
        self.summaries = [torch.zeros(0, hk, 2, d, dtype=dtype, device=device) for _ in range(num_layers)]
        # KvConfig(block_score="codes"): every key of a complete block at 2 bits per channel,
        # [num_host_blocks, num_kv_heads, block_size, head_dim // 4] bytes per layer (GPU).
        self.codes = (
            [torch.zeros(0, hk, b, d // 4, dtype=torch.uint8, device=device) for _ in range(num_layers)]
            if key_codes
            else None
        )
        # With the codes, the 8-bit Quest bound of each complete block, which the codes are
        # encoded in (the codes scores read it, never the summaries) and the two stages' first
        # stage reads (KvConfig.candidate_bound="fp8"): [num_host_blocks, num_kv_heads, 2,
        # head_dim] E4M3 bytes and [num_host_blocks, num_kv_heads] f32 scales per layer (GPU).
        self.bounds8, self.bound_scales = self._empty_bounds8(0) if key_codes else (None, None)
        self.grow(num_pages, num_host_blocks, num_host_rows)

    def write_kv8(self, layer: int, pages: torch.Tensor, start: int, k: torch.Tensor, v: torch.Tensor):
        """fp8 pages (``page_kv8``): store positions ``start .. start + len(k) - 1`` (``k``, ``v``
        ``[m, num_kv_heads, head_dim]``) of a request whose page table is ``pages`` (long, from
        position 0). Every page the rows touch is quantized whole (:func:`ops.quantize_kv8` over
        its rows so far); a page the rows continue is first dequantized, so its scale can grow
        as an append's does."""
        g, b = self.geo, self.geo.block_size
        m = k.shape[0]
        end = start + m
        first, last = start // b, (end - 1) // b
        ids = pages[first : last + 1]
        n, off = ids.numel(), start - first * b
        valid = (end - (first + torch.arange(n, device=self.device)) * b).clamp(max=b).to(torch.int32)
        for codes, scales, x in ((self.k_pages, self.k_scales, k), (self.v_pages, self.v_scales, v)):
            buf = torch.zeros(n * b, g.num_kv_heads, g.head_dim, dtype=self.dtype, device=self.device)
            if off:
                prev = ops.dequantize_kv8(codes[layer][ids[0]], scales[layer][ids[0]], self.dtype)
                buf[:off] = prev.transpose(0, 1)[:off]
            buf[off : off + m] = x.to(self.device, self.dtype)
            src = buf.view(n, b, g.num_kv_heads, g.head_dim).transpose(1, 2).contiguous()
            new_codes, new_scales = ops.empty_kv8(g, n, self.device)
            ops.quantize_kv8(g, src, valid, new_codes, new_scales)
            codes[layer][ids] = new_codes
            scales[layer][ids] = new_scales

    def read_kv8(self, layer: int, pages: torch.Tensor, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """fp8 pages: positions ``0 .. end - 1`` of the request whose page table is ``pages``, as
        ``[end, num_kv_heads, head_dim]`` K and V in ``dtype`` (code x scale)."""
        g = self.geo
        k, v = self.pages_kv(layer, pages[: -(-end // g.block_size)])  # [n, H, B, D]
        k, v = (x.transpose(1, 2).reshape(-1, g.num_kv_heads, g.head_dim)[:end] for x in (k, v))
        return k, v

    def page_scales(self, layer: int, prefix: str = "") -> dict:
        """The keyword arguments that give a kernel ``layer``'s GPU page scales (none unless
        ``page_kv8``): ``{prefix}k_scales`` and ``{prefix}v_scales``."""
        if not self.page_kv8:
            return {}
        return {f"{prefix}k_scales": self.k_scales[layer], f"{prefix}v_scales": self.v_scales[layer]}

    def host_scales(self, layer: int, prefix: str = "host_") -> dict:
        """The keyword arguments that give a kernel ``layer``'s host-pool scales (none unless
        ``host_kv8``): ``{prefix}k_scales`` and ``{prefix}v_scales`` (``"host_"`` for
        ``append_kv``/``gather_blocks``, ``"dst_"`` for ``copy_pages`` into the pool)."""
        if not self.host_kv8:
            return {}
        return {
            f"{prefix}k_scales": self.host_k_scales[layer],
            f"{prefix}v_scales": self.host_v_scales[layer],
        }

    def _empty_bounds8(self, rows: int) -> tuple[list, list]:
        """Zeroed 8-bit bounds and scales of ``rows`` host blocks (:func:`ops.empty_bounds8`), per
        layer."""
        per_layer = [ops.empty_bounds8(self.geo, rows, self.device) for _ in range(self.num_layers)]
        return [b.zero_() for b, _ in per_layer], [s.zero_() for _, s in per_layer]

    def pages_kv(self, layer: int, pages: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``layer``'s GPU pages ``pages`` (long) as float K and V ``[n, num_kv_heads, block_size,
        head_dim]`` in ``dtype``: a copy of the pages, or with ``page_kv8`` their values (code x
        scale)."""
        if not self.page_kv8:
            return self.k_pages[layer][pages], self.v_pages[layer][pages]
        k = ops.dequantize_kv8(self.k_pages[layer][pages], self.k_scales[layer][pages], self.dtype)
        v = ops.dequantize_kv8(self.v_pages[layer][pages], self.v_scales[layer][pages], self.dtype)
        return k, v

    def host_kv(self, layer: int, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``layer``'s host rows ``rows`` (long) as float K and V ``[n, num_kv_heads, block_size,
        head_dim]`` in ``dtype``, on the host pool's device: a copy of the rows, or with
        ``host_kv8`` their values (code x scale)."""
        k, v = self.host_k[layer].index_select(0, rows), self.host_v[layer].index_select(0, rows)
        if not self.host_kv8:
            return k, v
        ks = self.host_k_scales[layer].index_select(0, rows)
        vs = self.host_v_scales[layer].index_select(0, rows)
        return ops.dequantize_kv8(k, ks, self.dtype), ops.dequantize_kv8(v, vs, self.dtype)

    def key_rows(self, layer: int, pages: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(keys, rows)`` for a kernel that reads the keys of ``layer``'s GPU pages ``pages``
        (int32) by row (``build_summaries``, ``build_key_codes``): the pool itself and the page
        ids, or with ``page_kv8`` the pages' values (code x scale, the keys attention reads) and
        ``0 .. n - 1``."""
        if not self.page_kv8:
            return self.k_pages[layer], pages
        keys, _ = self.pages_kv(layer, pages.long())
        return keys, torch.arange(pages.numel(), dtype=torch.int32, device=pages.device)

    def encode_blocks(
        self, layer: int, block_ids: torch.Tensor, key_pages: torch.Tensor, keys: torch.Tensor | None = None
    ) -> None:
        """The 8-bit bound and the key codes (inside it) of ``layer``'s complete host blocks
        ``block_ids``, whose summaries are final and whose keys are in the GPU pages ``key_pages``
        (HBM reads, not the host rows' copies; fp8 pages: their values), or in the pages ``key_pages`` of
        ``keys`` (a page-layout tensor, ``[n, num_kv_heads, block_size, head_dim]``, of the
        pool's dtype: a prompt's keys on their way to the host pool). Pools made with
        ``key_codes`` only. One launch (:func:`ops.encode_blocks`): it runs every layer of every
        step, in the graph."""
        g = self.geo
        keys, rows = self.key_rows(layer, key_pages) if keys is None else (keys, key_pages)
        ops.encode_blocks(
            g,
            keys,
            self.summaries[layer],
            block_ids,
            self.codes[layer],
            self.bounds8[layer],
            self.bound_scales[layer],
            block_rows=rows,
        )

    def blocks_to_host(
        self,
        layer: int,
        src: torch.Tensor,
        rows: torch.Tensor,
        dst: torch.Tensor,
        lens: torch.Tensor,
        n_complete: int,
        codes: bool,
        pages: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> None:
        """``layer``'s blocks from pages ``src`` (int32) into host rows ``rows``, with the
        summaries (and, with ``codes``, the key codes and 8-bit bound of the first ``n_complete``)
        of their host block ids ``dst``, ``lens`` valid rows each: the pool's own GPU pages
        (``make_sparse``), or ``pages = (k, v)``, page-layout tensors of the pool's dtype (a
        prompt's layer on its way to the host pool). Summaries and codes come from the same keys
        as the copy, read from the pages (HBM, not PCIe reads; fp8 pages: the keys as stored,
        code x scale, which attention reads)."""
        g = self.geo
        k, v = (self.k_pages[layer], self.v_pages[layer]) if pages is None else pages
        ops.copy_pages(
            g,
            k,
            v,
            src,
            self.host_k[layer],
            self.host_v[layer],
            rows,
            valid=lens,  # an fp8 host pool quantizes each block over its own rows
            **self.host_scales(layer, "dst_"),
            **(self.page_scales(layer, "src_") if pages is None else {}),
        )
        keys, key_rows = self.key_rows(layer, src) if pages is None else (k, src)
        ops.build_summaries(g, keys, dst, lens, self.summaries[layer], block_rows=key_rows)
        if codes and n_complete:
            self.encode_blocks(layer, dst[:n_complete], src[:n_complete], keys=None if pages is None else k)

    def enable_key_codes(self) -> None:
        """Add (empty) key-code tensors to pools made without them (pools shared, while idle,
        between engines of different block scores); codes are written as blocks enter the host
        pool (the transition to sparse, then each completed block)."""
        if self.codes is None:
            g = self.geo
            shape = (self.num_host_blocks, g.num_kv_heads, g.block_size, g.head_dim // 4)
            self.codes = [
                torch.zeros(shape, dtype=torch.uint8, device=self.device) for _ in range(self.num_layers)
            ]
            self.bounds8, self.bound_scales = self._empty_bounds8(self.num_host_blocks)

    def grow(self, num_pages: int, num_host_blocks: int, num_host_rows: int | None = None) -> None:
        """Enlarge the pools to at least these sizes (never shrinks). New pages map nowhere.

        ``num_host_blocks`` sizes what is indexed by host block id (the summaries and key codes,
        on the GPU), ``num_host_rows`` (None: as many) the host pool itself (``host_k``/``host_v``,
        indexed by host row): a local request holds a row with every id, a staged request with a
        bounded cache (``LLMEngine(kv_cache_blocks=)``) fewer rows than ids."""
        device, layers = self.device, self.num_layers
        num_host_rows = num_host_blocks if num_host_rows is None else num_host_rows
        if num_pages > self.num_pages:
            ensure_fits(
                (num_pages - self.num_pages) * self.page_bytes * layers,
                device,
                f"growing the page pool to {num_pages} pages x {layers} layers",
                "lower gpu_kv_budget_bytes / KvConfig.num_gpu_pages, max_num_seqs or max_tokens",
            )
            self.k_pages = [_grown(t, num_pages) for t in self.k_pages]
            self.v_pages = [_grown(t, num_pages) for t in self.v_pages]
            if self.page_kv8:
                self.k_scales = [_grown(t, num_pages) for t in self.k_scales]
                self.v_scales = [_grown(t, num_pages) for t in self.v_scales]
            # Head-wise mapping per layer: [num_pages, num_kv_heads], logical block held, -1 empty.
            self.page_map = _grown(self.page_map, num_pages, dim=1, fill=-1)
            self.page_last_selected = _grown(self.page_last_selected, num_pages, dim=1, fill=-1)
            self.num_pages = num_pages
        if num_host_rows > self.num_host_rows:
            ensure_fits(
                (num_host_rows - self.num_host_rows) * self.host_row_bytes * layers,
                self.host_device,
                f"growing the host pool to {num_host_rows} blocks x {layers} layers",
                "lower host_kv_budget_bytes / KvConfig.num_host_blocks, max_num_seqs or max_tokens",
            )
            # With a GPU the host pool is pinned: the gather and write-through kernels read and
            # write it directly through unified virtual addressing (host_pool="device": it stays
            # on the GPU, where _grown keeps it). The pool grows geometrically with what admitted
            # requests need (Engine._grow_to), so it is pinned in chunks, never all up front;
            # a large growth says so, since pinning is slow.
            pin_bytes = num_host_rows * self.host_row_bytes * layers
            bar = None
            if self.host_pin and pin_bytes >= PIN_NOTICE_BYTES:
                log.info(
                    "pinning %.1f GiB of host memory for the KV host pool (%d blocks x %d layers); "
                    "about 0.6 s per GiB",
                    pin_bytes / (1 << 30),
                    num_host_rows,
                    layers,
                )
                from tqdm import tqdm

                # disable=None: a bar on a terminal only (logs and CI stay clean).
                tensors = 4 * layers if self.host_kv8 else 2 * layers
                bar = tqdm(total=tensors, desc="pinning host KV pool", unit="tensor", disable=None)

            if self.host_pin and device.type == "cuda":
                # Kernels read the old pool through UVA; its pages are unpinned when it is freed.
                torch.cuda.synchronize(device)

            def grown_host(tensors):
                # In place, one layer at a time: the old layer is freed as soon as it is copied,
                # so the growth peaks at the new pool plus one old layer.
                for i, t in enumerate(tensors):
                    tensors[i] = _grown(t, num_host_rows, pin=self.host_pin, numa_node=self.numa_node)
                    if bar is not None:
                        bar.update()
                return tensors

            try:
                self.host_k = grown_host(self.host_k)
                self.host_v = grown_host(self.host_v)
                if self.host_kv8:
                    self.host_k_scales = grown_host(self.host_k_scales)
                    self.host_v_scales = grown_host(self.host_v_scales)
            finally:
                if bar is not None:
                    bar.close()
            self.num_host_rows = num_host_rows
        if num_host_blocks > self.num_host_blocks:
            self.summaries = [_grown(t, num_host_blocks) for t in self.summaries]
            if self.codes is not None:
                self.codes = [_grown(t, num_host_blocks) for t in self.codes]
                self.bounds8 = [_grown(t, num_host_blocks) for t in self.bounds8]
                self.bound_scales = [_grown(t, num_host_blocks) for t in self.bound_scales]
            self.num_host_blocks = num_host_blocks

    @property
    def page_bytes(self) -> int:
        """Bytes of one page, K and V (and their scales with ``page_kv8``), one layer."""
        return kv_block_bytes(self.geo, self.dtype, self.page_kv8)

    @property
    def host_row_bytes(self) -> int:
        """Bytes of one host-pool row, K and V (and their scales with ``host_kv8``), one layer."""
        g = self.geo
        return kv_block_bytes(g, self.dtype, self.host_kv8)

    @property
    def summary_block_bytes(self) -> int:
        """Bytes of one block's summaries (and key codes and 8-bit bound, with them), all KV heads,
        one layer."""
        return summary_block_bytes(self.geo, self.dtype, self.codes is not None)


def summary_block_bytes(geo, dtype: torch.dtype, key_codes: bool) -> int:
    """Bytes of the GPU-resident metadata of one block, every KV head, one layer: its summaries
    (min and max keys in ``dtype``) and, with ``key_codes`` (the ``codes`` block score, the
    default selection's second stage), its key codes and 8-bit bound."""
    g = geo
    codes = g.num_kv_heads * (g.block_size * (g.head_dim // 4) + 2 * g.head_dim + 4) if key_codes else 0
    return 2 * g.num_kv_heads * g.head_dim * dtype.itemsize + codes


def kv_block_bytes(geo, dtype: torch.dtype, kv8: bool) -> int:
    """Bytes of one host-pool row or GPU page (a block's K and V, every KV head), one layer:
    ``dtype`` elements, or E4M3 bytes plus a float32 scale per KV head for K and for V with
    ``kv8``."""
    g = geo
    values = 2 * g.num_kv_heads * g.block_size * g.head_dim
    return values + 2 * g.num_kv_heads * 4 if kv8 else values * dtype.itemsize


def _grown(
    old: torch.Tensor, rows: int, dim: int = 0, fill=0, pin: bool = False, numa_node: int | None = None
) -> torch.Tensor:
    """``old`` with ``rows`` rows along ``dim``: its rows copied first, then ``fill``; on its own
    device (in pinned CPU memory with ``pin``, on NUMA node ``numa_node`` when given)."""
    shape = list(old.shape)
    shape[dim] = rows
    if pin:  # exactly its size: torch's pin_memory rounds up to a power of two
        new = pinned_full(shape, fill, old.dtype, numa_node=numa_node)
    else:
        new = torch.full(shape, fill, dtype=old.dtype, device=old.device)
    new.narrow(dim, 0, old.shape[dim]).copy_(old)
    return new


def copy_to_host(t: torch.Tensor):
    """``(host copy, event)``: on a GPU an asynchronous copy into pinned memory and the event
    that marks it done (wait on it before reading); on the CPU the tensor itself and None."""
    if not t.is_cuda:
        return t, None
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    ready = torch.cuda.Event()
    ready.record()
    return host, ready


def i32(x, device=None) -> torch.Tensor:
    t = torch.tensor(x, dtype=torch.int32)
    return t if device is None or device.type == "cpu" else t.to(device, non_blocking=True)


class PoolsMixin:
    """The engine's pools, runtime and request admission (mixed into :class:`~.core.Engine`)."""

    # ---------------------------------------------------------------- pools
    @property
    def page_bytes_all_layers(self) -> int:
        """Bytes of one GPU page, K and V (and scales in fp8), every layer."""
        return kv_block_bytes(self.geo, self.dtype, self.page_kv8) * self.cfg.num_hidden_layers

    @property
    def host_row_bytes_all_layers(self) -> int:
        """Bytes of one host-pool row, K and V (and scales in fp8), every layer: a page's bytes
        unless ``KvConfig.host_kv_dtype`` is fp8 (about half of bf16)."""
        return kv_block_bytes(self.geo, self.dtype, self.host_kv8) * self.cfg.num_hidden_layers

    @property
    def summary_bytes_all_layers(self) -> int:
        """Bytes of one block's GPU-resident metadata, every layer (:func:`summary_block_bytes`:
        summaries, and key codes with the 8-bit bound when the block score is ``codes``): a
        sparse request keeps it on the GPU for every block of its context."""
        return summary_block_bytes(self.geo, self.dtype, self.key_codes) * self.cfg.num_hidden_layers

    def default_caps(self) -> tuple[int, int]:
        """The pools' caps in blocks: ``KvConfig.num_gpu_pages`` / ``num_host_blocks`` when set
        (then the pools are that size from the start), else the constructor's budgets, else 40 % of
        the free memory of the model's device (pages) and of the host (host blocks; 0 for the
        dense backend) -- on a CPU-only machine both from the same RAM. With ``host_pool="device"``
        the host blocks share the device with the pages: 40 % of its free memory past the pages'
        cap. Never past 2**31 - 1."""
        kv, per, per_row = self.kv, self.page_bytes_all_layers, self.host_row_bytes_all_layers
        gpu_budget, host_budget = self._budgets
        gpu = None if gpu_budget is None else gpu_budget // per
        host = None if host_budget is None else host_budget // per_row
        if kv.num_gpu_pages is not None:
            gpu = kv.num_gpu_pages
        if kv.num_host_blocks is not None:
            host = kv.num_host_blocks
        elif kv.num_gpu_pages is not None and host is None:
            host = kv.num_gpu_pages
        if gpu is None:
            free = available_bytes(self.device)
            gpu = int(0.4 * free) // per if free is not None else 1 << 20
        if host is None and self.backend != "oasis":
            host = 0
        elif host is None:
            on_device = self.host_pool == "device"
            free = available_bytes(self.device if on_device else "cpu")
            if free is not None and on_device:
                free = max(0, free - int(gpu) * per)
            host = int(0.4 * free) // per_row if free is not None else 1 << 20
        cap = MAX_POOL_BLOCKS
        return max(0, min(int(gpu), cap)), max(0, min(int(host), cap))

    def _new_runtime(self, pages: int, host: int, rows: int) -> None:
        from .._core import Runtime

        gcap, hcap = self.default_caps()
        gcap, hcap = max(gcap, pages), max(hcap, rows)
        kv = self.kv
        self.runtime = Runtime(
            block_size=kv.block_size,
            top_k_blocks=kv.top_k_blocks,
            sparse_threshold=kv.threshold_tokens,
            sparse=self.backend == "oasis",
            rows=self.rows,
            measure_recall=bool(kv.measure_recall),
            plan_blk_seq=kv.select_queries == "lookahead+current",
            max_num_seqs=self.max_num_seqs,
            gpu_pages=pages,
            host_blocks=min(host, rows),
            gpu_cap=gcap,
            host_cap=hcap,
        )
        # The host cap bounds the rows; ids (summaries) grow with the reservations.
        self.runtime.grow(pages, host, rows)
        self._runtime_pools = self.pools

    def _sync_runtime(self) -> None:
        """Create the runtime and pools on first use; follow pools swapped in from outside (the
        evaluation shares one set of pools between engines) while no request is running."""
        if self.pools is None:
            kv = self.kv
            pages = kv.num_gpu_pages or 0
            host = kv.num_host_blocks or kv.num_gpu_pages or 0
            self.pools = KvPools(
                self.geo,
                self.cfg.num_hidden_layers,
                self.dtype,
                pages,
                host,
                self.device,
                self.key_codes,
                host_pool=self.host_pool,
                host_kv8=self.host_kv8,
                page_kv8=self.page_kv8,
            )
        if self.key_codes:
            self.pools.enable_key_codes()
        if self.runtime is None or self._runtime_pools is not self.pools:
            if self.runtime is not None and self.runtime.num_requests:
                raise ConfigError("the engine's pools were replaced while requests are running")
            p = self.pools
            self._new_runtime(p.num_pages, p.num_host_blocks, p.num_host_rows)

    def _grow_to(self, pages: int, host: int, rows: int | None = None) -> None:
        """Grow the pool tensors and the runtime's id ranges to at least these sizes (pages, host
        block ids, host rows; None: as many rows as ids), geometrically (to at most the caps) so
        that a stream of admissions reallocates O(log n) times."""
        p, rt = self.pools, self.runtime
        rows = host if rows is None else rows
        if pages <= p.num_pages and host <= p.num_host_blocks and rows <= p.num_host_rows:
            return
        gcap, icap, hcap = rt.caps
        if pages > p.num_pages:
            pages = min(gcap, max(pages, 2 * p.num_pages))
        if host > p.num_host_blocks:
            host = min(icap, max(host, 2 * p.num_host_blocks))
        if rows > p.num_host_rows:
            rows = min(hcap, max(rows, 2 * p.num_host_rows))
        self._join_background()
        self.drop_graphs()  # they hold the old pools' addresses
        p.grow(pages, host, rows)
        rt.grow(p.num_pages, p.num_host_blocks, p.num_host_rows)

    def ensure_pools(self, requests: list[Request]) -> None:
        """Make room for admitting ``requests`` together (grow the pools to their reservations)."""
        self._reserve_kv([(len(r.prompt), r.max_new_tokens) for r in requests])

    def reserve_pools(self, sizes: list[tuple[int, int]]) -> None:
        """Grow the pools now (up to the caps) so that requests of these ``(prompt_len,
        max_new_tokens)`` fit beside the running ones: one allocation instead of several as a
        batch is admitted. A prompt the engine admits sparse (:meth:`prefills_sparse`: prefilled
        in one piece) reserves its working set; one prefilled in chunks grows the pools at its
        admission. The drafter's own per-request device state (the EAGLE-3 head's KV) is reserved
        the same way (``Drafter.reserve``); an admission grows it as it needs."""
        self._reserve_kv(sizes)
        if self.drafter is not None:
            self.drafter.reserve([n + m for n, m in sizes])

    def _reserve_kv(self, sizes: list[tuple[int, int]]) -> None:
        """Grow the KV pools (up to the caps) for requests of these sizes beside the running ones."""

        self._sync_runtime()
        rt = self.runtime
        g, h, w = rt.reserved
        for n, m in sizes:
            # A local request: a host row with every id.
            rg, rh, _ = rt.reservation(n, m, sparse=self.prefills_sparse(n))
            g, h, w = g + rg, h + rh, w + rh
        gcap, _, hcap = rt.caps
        self._grow_to(min(g, gcap), h, min(w, hcap))

    # ---------------------------------------------------------------- request lifecycle
    def can_admit(
        self, prompt_len: int, max_new_tokens: int, *, sparse: bool = False, cache_blocks: int | None = None
    ) -> bool:
        """Whether a request of this size can be admitted now (a seat, and its peak need in both
        tiers fits beside the running requests' reservations). ``sparse=True``: admitted with
        :meth:`admit_sparse` (the working set only on the GPU; ``cache_blocks`` as there)."""
        self._sync_runtime()
        return self.runtime.can_admit(prompt_len, max_new_tokens, sparse=sparse, cache_blocks=cache_blocks)

    def check_fits(
        self, prompt_len: int, max_new_tokens: int, *, sparse: bool = False, cache_blocks: int | None = None
    ) -> None:
        """Raise :class:`OutOfBlocksError` when a request of this size could never be admitted,
        even alone: its peak need passes a pool's cap (``sparse``, ``cache_blocks``: as
        :meth:`can_admit`)."""
        self._sync_runtime()
        rt = self.runtime
        if rt.fits_ever(prompt_len, max_new_tokens, sparse=sparse, cache_blocks=cache_blocks):
            return
        g, h, _ = rt.reservation(prompt_len, max_new_tokens, sparse=sparse, cache_blocks=cache_blocks)
        gcap, _, hcap = rt.caps
        per, per_row = self.page_bytes_all_layers, self.host_row_bytes_all_layers
        raise OutOfBlocksError(
            f"a request of {prompt_len} prompt tokens and max_tokens={max_new_tokens} needs up to "
            f"{g} GPU pages and {h} host blocks ({g * per} / {h * per_row} bytes) but the caps are "
            f"{gcap} / {hcap}; raise gpu_kv_budget_bytes / host_kv_budget_bytes (or KvConfig."
            "num_gpu_pages / num_host_blocks), lower max_tokens, or lower sparse_threshold so the "
            "request turns sparse sooner"
        )

    def prefills_sparse(self, prompt_len: int) -> bool:
        """Whether a prompt of ``prompt_len`` tokens is admitted sparse (:meth:`admit` with
        ``whole`` or ``chunked``): its K/V go from the forward straight to the host pool, layer by
        layer, and only its working set takes GPU pages, so admitting a long prompt needs no room
        for its dense pages (19 GiB at 128K on Qwen3-8B shapes). True for the ``oasis`` backend
        over the local host pool, when the prompt alone passes ``sparse_threshold`` (so it would
        turn sparse right after a dense prefill) and :data:`DIRECT_SPARSE_PREFILL` is on; not over
        fp8 pages (``kv_dtype="fp8_e4m3"``), whose prefill quantizes page by page. In one piece or
        in chunks (:meth:`Engine.prefill_chunk`), whose later chunks read the prompt's earlier
        positions back from the host pool: as the pages hold them over a float host pool; over an
        fp8 one as stored (code x scale), as fp8 pages would give them and as every decode step
        reads them."""
        return (
            DIRECT_SPARSE_PREFILL
            and self.backend == "oasis"
            and not self.page_kv8
            and isinstance(self.block_source, LocalHostPool)
            and prompt_len > self.kv.threshold_tokens
        )

    def admit(self, r: Request, whole: bool = False, chunked: bool = False) -> dict | None:
        """Reserve ``r``'s peak need, take its accumulator slot and the prompt's pages. ``whole``:
        its prompt will be prefilled in one piece; ``chunked``: in chunks. Either way it is
        admitted sparse when :meth:`prefills_sparse` says so: then only its working set, and the
        dict of :meth:`admit_sparse` is returned (its prefill fills the host rows). Else None."""
        if (whole or chunked) and self.prefills_sparse(len(r.prompt)):
            return self.admit_sparse(r)
        self._sync_runtime()
        rt = self.runtime
        n, m = len(r.prompt), r.max_new_tokens
        self._grow_to(*rt.pool_sizes_needed(n, m))
        try:
            slot, _pages = rt.admit(r.id, n, m)
        except OutOfBlocksError as e:
            raise OutOfBlocksError(
                f"{e} while admitting request {r.id}; wait for running requests to finish "
                "(LLMEngine does), raise the pool budgets, or submit fewer requests at once"
            ) from None
        self._seat(r, slot, False)
        return None

    def admit_sparse(self, r: Request, cache_blocks: int | None = None) -> dict:
        """Admit ``r``, whose prompt's KV is stored elsewhere (a staging daemon), directly sparse:
        reserve and take only its working set (K slot pages, the local page) and the prompt's host
        blocks, never the prompt's dense pages. Returns ``Runtime.admit_sparse``'s dict (the slot
        pages, local page, host block ids and rows, their lens and ``n_complete``); the caller
        fills the host rows, summaries and local page and selects the initial working set.
        ``cache_blocks=C``: host rows only for the blocks it writes plus ``C`` cache rows
        (``Runtime.cache_blocks`` hands them out)."""
        self._sync_runtime()
        rt = self.runtime
        n, m = len(r.prompt), r.max_new_tokens
        self._grow_to(*rt.pool_sizes_needed(n, m, sparse=True, cache_blocks=cache_blocks))
        try:
            tr = rt.admit_sparse(r.id, n, m, cache_blocks)
        except OutOfBlocksError as e:
            raise OutOfBlocksError(
                f"{e} while admitting request {r.id}; wait for running requests to finish "
                "(LLMEngine does), raise the pool budgets, or submit fewer requests at once"
            ) from None
        self._seat(r, tr["slot"], True)
        return tr

    def _seat(self, r: Request, slot: int, sparse: bool) -> None:
        """``r`` was admitted at accumulator ``slot``: reset the slot, apply the new mapping."""
        r.slot, r.sparse, r.runtime = slot, sparse, self.runtime
        self._acc_fetched[slot] = 0
        self._acc_recall[slot] = 0
        self._acc_recall_n[slot] = 0
        for pins in self._pins:  # a previous occupant's pins (the initial selection sets new ones)
            if pins is not None:
                pins[slot] = -1
        self._flush_map()

    def transfer_wait(self) -> tuple[float, int]:
        """``(seconds, waits)``: how long the compute stream has waited on background work (the
        selection chain and its transfers) since the engine was made, and how many waits: at each
        layer's transfer event in eager steps, at the end-of-step join in CUDA-graph steps. Each
        wait includes a kernel launch gap (about a microsecond). ``(0.0, 0)`` on the CPU, where
        the chain runs inline. Reads device counters: synchronises with the current stream."""
        if self._wait_stamps is None:
            return 0.0, 0
        _, total_ns, waits = self._wait_stamps.tolist()
        return total_ns / 1e9, int(waits)

    def _side(self, layer: int):
        """The background stream of ``layer``'s chain."""
        return self._sides[layer % len(self._sides)]

    def _join_background(self) -> None:
        """Make the compute stream wait for all background work (before pages change owners)."""
        if self.cuda:
            cur = torch.cuda.current_stream(self.device)
            for side in self._sides:
                cur.wait_stream(side)
            if self._transfer is not None:
                cur.wait_stream(self._transfer)

    def release(self, r: Request) -> None:
        """Return everything ``r`` holds to the pools (safe to call twice)."""
        if r.runtime is not None and r.runtime is self.runtime:
            self._join_background()
            self.runtime.release(r.id)
        r.runtime = None
        if self.drafter is not None:
            self.drafter.end(r.id)

    def _flush_map(self) -> None:
        """Apply the runtime's pending head-wise mapping updates on the device, every layer."""
        pages, values = self.runtime.take_map_updates()
        if pages:
            idx = torch.tensor(pages, dtype=torch.long).to(self.device, non_blocking=True)
            self._apply_map(idx, i32(values, self.device))

    def _apply_map(self, pages: torch.Tensor, values: torch.Tensor) -> None:
        """``page_map[:, pages, :] = values`` in every layer (and those pages' last-selected
        steps reset): device tensors, long page ids and int32 logical blocks."""
        p = self.pools
        p.page_map[:, pages, :] = values.view(1, -1, 1)
        p.page_last_selected[:, pages, :] = -1
