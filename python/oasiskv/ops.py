"""Tensor-level entry points of the OasisKV kernels.

Each function takes torch tensors laid out as in ``docs/CORE_CONTRACT.md`` and dispatches on the
tensors' device: CPU tensors run the Rust CPU twins in ``oasiskv._core`` (synchronously, with every
table entry validated); CUDA tensors, all on one ``cuda:N``, queue the NVRTC-compiled kernels on
``torch.cuda.current_stream(device)`` and return without synchronising. A CUDA call may take the
host pool (``host_k``/``host_v``, one side of :func:`copy_pages`) as pinned CPU memory
(``pin_memory=True``), which the kernels read and write through unified addressing.

Validation (shape, dtype, device, contiguity, aliasing; table ranges on the CPU only) happens in
the native module, which raises the classes of :mod:`oasiskv.errors`; the GIL is released while a
kernel runs or is launched. On the GPU, table contents are not validated up front (that would need
a host synchronisation): the kernels check ids against their pools and each CSR row against the
length of its indices, skip a bad id and read a malformed row as empty (``docs/CORE_CONTRACT.md``,
last section), so test a new caller on the CPU first, where the same tables raise.

Outputs allocated here live on the device of the call's tensors. Results that the CPU returns as
Python numbers (the selection statistics, the number of gathered entries) are ``None`` on the GPU:
reading them back would synchronise.
"""

from __future__ import annotations

import torch

from . import _core
from .errors import ConfigError, DeviceError, ShapeError

KvGeometry = _core.KvGeometry
BlockPool = _core.BlockPool

# Split-KV workspaces of decode_attention, one per (device, stream), grown on demand. Kept for the
# life of the process: a kernel queued on that stream may still be reading the buffer.
_WORKSPACES: dict[tuple[torch.device, int], torch.Tensor] = {}
_NUM_SMS: dict[torch.device, int] = {}


def _check_device(*tensors: torch.Tensor | None) -> torch.device:
    """The device of the first tensor given; only CPU and CUDA tensors are accepted here (the native
    module checks that they agree, and which may be pinned host memory)."""
    devs = [t.device for t in tensors if t is not None]
    bad = sorted({str(d) for d in devs if d.type not in ("cpu", "cuda")})
    if bad:
        raise DeviceError(
            f"tensors on {bad}: the kernels run on CPU tensors or on CUDA tensors; move every tensor to "
            "the CPU (tensor.cpu()) or to one CUDA device (tensor.to('cuda'))"
        )
    return devs[0]


def _stream(device: torch.device) -> int:
    """The raw handle of the current stream of a CUDA device (0, ignored, on the CPU)."""
    return torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0


def _num_sms(device: torch.device) -> int:
    n = _NUM_SMS.get(device)
    if n is None:
        n = _NUM_SMS[device] = torch.cuda.get_device_properties(device).multi_processor_count
    return n


def _workspace(device: torch.device, stream: int, numel: int) -> torch.Tensor:
    """A float32 buffer of at least ``numel`` elements for split-KV attention on ``stream``.

    Reusing one buffer per stream is safe: the kernels that use it run in stream order. A larger
    request replaces it; the caching allocator only hands the old memory out again in that
    stream's order.
    """
    key = (device, stream)
    ws = _WORKSPACES.get(key)
    if ws is None or ws.numel() < numel:
        ws = _WORKSPACES[key] = torch.empty(numel, dtype=torch.float32, device=device)
    return ws


def append_kv(
    geo,
    k_new,
    v_new,
    page_ids,
    page_offsets,
    host_block_ids,
    k_pages,
    v_pages,
    host_k,
    host_v,
    summaries,
    host_rows=None,
    *,
    k_scales=None,
    v_scales=None,
    host_k_scales=None,
    host_v_scales=None,
) -> None:
    """Append one token per sequence (write-through + summary update for sparse sequences): K/V to
    host row ``host_rows[s]`` (``None``: the block id), the summary to block ``host_block_ids[s]``.

    A tier in fp8_e4m3 (:func:`empty_kv8`: uint8 pages) passes its scales: ``k_scales``/
    ``v_scales`` for the GPU pages, ``host_k_scales``/``host_v_scales`` for the host pool. The
    summaries come from the unquantized keys."""
    dev = _check_device(k_new, k_pages, host_k)
    _core.append_kv(
        geo,
        k_new,
        v_new,
        page_ids,
        page_offsets,
        host_block_ids,
        k_pages,
        v_pages,
        host_k,
        host_v,
        summaries,
        host_rows=host_rows,
        k_scales=k_scales,
        v_scales=v_scales,
        host_k_scales=host_k_scales,
        host_v_scales=host_v_scales,
        stream=_stream(dev),
    )


def decode_attention(
    geo,
    q,
    k_pages,
    v_pages,
    kv_indptr,
    kv_indices,
    kv_last_page_len,
    *,
    page_map=None,
    extra_k=None,
    extra_v=None,
    sm_scale: float | None = None,
    out: torch.Tensor | None = None,
    max_pages_per_seq: int = 0,
    num_splits: int = 0,
    workspace: torch.Tensor | None = None,
    k_scales: torch.Tensor | None = None,
    v_scales: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of stacked query rows ``q [num_seqs, num_rows, num_qo_heads, head_dim]``.

    Pages in fp8_e4m3 (uint8 codes, :func:`empty_kv8`) come with ``k_scales``/``v_scales``
    ``[num_pages, num_kv_heads]`` float32 (each value is code x scale); ``q`` and the output
    stay float.

    ``max_pages_per_seq`` (a bound on any sequence's page count; 0 = ``len(kv_indices)``) lets the
    GPU path plan its split of long contexts without reading the tables back; ``num_splits`` forces
    a split count (0 = plan it from the SM count). ``workspace`` (float32, at least
    ``_core.decode_attn_workspace_len`` elements) replaces the per-stream split workspace, for a
    caller that must own it (a captured CUDA graph). The CPU ignores all three."""
    dev = _check_device(q, k_pages, out)
    if out is None:
        out = torch.empty_like(q)
    if sm_scale is None:
        sm_scale = geo.head_dim**-0.5
    gpu = {}  # the CPU path takes none of these
    if dev.type == "cuda":
        stream = _stream(dev)
        splits = int(num_splits)
        if q.dim() == 4:  # else the native module raises the shape error
            num_seqs, num_rows = q.shape[0], q.shape[1]
            if splits == 0:
                max_pages = int(max_pages_per_seq) or kv_indices.numel()
                splits = _core.plan_num_splits(_num_sms(dev), num_seqs, geo.num_kv_heads, max_pages)
            if splits > 1 and workspace is None:
                need = _core.decode_attn_workspace_len(
                    num_seqs, num_rows, geo.num_qo_heads, geo.head_dim, splits
                )
                workspace = _workspace(dev, stream, need)
            elif splits <= 1:
                workspace = None
        gpu = dict(
            num_splits=splits, max_pages_per_seq=int(max_pages_per_seq), workspace=workspace, stream=stream
        )
    _core.decode_attention(
        geo,
        q,
        k_pages,
        v_pages,
        kv_indptr,
        kv_indices,
        kv_last_page_len,
        page_map,
        extra_k,
        extra_v,
        float(sm_scale),
        out,
        k_scales=k_scales,
        v_scales=v_scales,
        **gpu,
    )
    return out


def build_summaries(geo, host_k, block_ids, block_lens, summaries, block_rows=None) -> None:
    """Summaries of blocks ``block_ids`` from the keys in rows ``block_rows`` of ``host_k`` (``None``:
    the row is the block id); ``host_k`` is the host pool, or any pool of the same block layout on
    the call's device (``make_sparse`` passes the GPU pages the host rows were copied from)."""
    dev = _check_device(summaries, host_k)
    _core.build_summaries(
        geo, host_k, block_ids, block_lens, summaries, block_rows=block_rows, stream=_stream(dev)
    )


def score_blocks(
    geo, q, summaries, blk_indptr, blk_indices, scores: torch.Tensor | None = None
) -> torch.Tensor:
    """Quest scores ``[nnz, num_kv_heads]`` (f32) of lookahead queries ``[num_seqs, num_qo_heads,
    head_dim]``."""
    dev = _check_device(q, summaries)
    if scores is None:
        scores = torch.empty(blk_indices.shape[0], geo.num_kv_heads, dtype=torch.float32, device=dev)
    _core.score_blocks(geo, q, summaries, blk_indptr, blk_indices, scores, stream=_stream(dev))
    return scores


def empty_key_codes(geo, num_host_blocks: int, device=None) -> torch.Tensor:
    """An uninitialised uint8 codes tensor for a host pool of ``num_host_blocks`` blocks:
    ``[num_host_blocks, num_kv_heads, block_size, head_dim // 4]`` (2 bits per key channel, the same
    bytes as the pool's summaries in 16-bit storage). Keep it beside the 8-bit bounds it is encoded
    in (:func:`empty_bounds8`), on their device."""
    if geo.head_dim % 4:
        raise ConfigError(f"2-bit key codes need head_dim divisible by 4, got {geo.head_dim}")
    return torch.empty(
        num_host_blocks, geo.num_kv_heads, geo.block_size, geo.head_dim // 4, dtype=torch.uint8, device=device
    )


def build_key_codes(geo, host_k, bounds8, scales, block_ids, codes, block_rows=None) -> None:
    """Encode every key of the complete host blocks ``block_ids`` (keys in host rows ``block_rows``;
    ``None``: the row is the block id) to 2 bits per channel inside the block's decoded 8-bit bound
    ``[e4m3(lo8) s, e4m3(hi8) s]`` (``bounds8``, ``scales`` of :func:`build_bounds8`: build the
    bound first, on the GPU on the same stream, or call :func:`encode_blocks`, which does both).
    A block whose scale is NaN (a non-finite key) gets codes 0. Definition:
    ``oasis_core::kernels::codes``."""
    dev = _check_device(bounds8, scales, host_k)
    _core.build_key_codes(
        geo, host_k, bounds8, scales, block_ids, codes, block_rows=block_rows, stream=_stream(dev)
    )


def empty_bounds8(geo, num_host_blocks: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Uninitialised 8-bit Quest bounds for a host pool of ``num_host_blocks`` blocks: ``(bounds8
    [num_host_blocks, num_kv_heads, 2, head_dim] uint8, scales [num_host_blocks, num_kv_heads]
    f32)``, half the bytes of 16-bit summaries. Keep them beside the summaries, on their device."""
    b8 = torch.empty(num_host_blocks, geo.num_kv_heads, 2, geo.head_dim, dtype=torch.uint8, device=device)
    scales = torch.empty(num_host_blocks, geo.num_kv_heads, dtype=torch.float32, device=device)
    return b8, scales


def build_bounds8(geo, summaries, block_ids, bounds8, scales) -> None:
    """The 8-bit Quest bounds of the complete host blocks ``block_ids``: each ``[min; max]``
    summary row in E4M3, rounded outward after dividing by the row's power-of-two scale, so that
    :func:`score_blocks_bound8` is an upper bound like :func:`score_blocks` (build the summaries
    first; on the GPU, on the same stream). Definition: ``oasis_core::kernels::bound8``."""
    dev = _check_device(summaries, bounds8, scales)
    _core.build_bounds8(geo, summaries, block_ids, bounds8, scales, stream=_stream(dev))


def encode_blocks(geo, host_k, summaries, block_ids, codes, bounds8, scales, block_rows=None) -> None:
    """:func:`build_bounds8` of the complete host blocks ``block_ids`` from their ``summaries``, then
    :func:`build_key_codes` of their keys inside that bound, in one launch (bit-exact with the two
    calls): the engine's per-step encode of the blocks a step completed
    (:meth:`oasiskv.engine.pools.Pools.encode_blocks`), one launch per layer instead of two.
    Arguments as those two functions; ``codes``, ``bounds8`` and ``scales`` are written."""
    dev = _check_device(summaries, host_k, bounds8, scales)
    _core.encode_blocks(
        geo, host_k, summaries, block_ids, codes, bounds8, scales, block_rows=block_rows, stream=_stream(dev)
    )


def score_blocks_bound8(
    geo, q, bounds8, scales, blk_indptr, blk_indices, scores: torch.Tensor | None = None
) -> torch.Tensor:
    """Quest block scores ``[nnz, num_kv_heads]`` (f32) over the 8-bit bounds of
    :func:`build_bounds8`: at least :func:`score_blocks` of the same summaries (each channel looser
    by under one E4M3 step), for half the bytes read. The two-stage selection's first stage."""
    dev = _check_device(q, bounds8, scales)
    if scores is None:
        scores = torch.empty(blk_indices.shape[0], geo.num_kv_heads, dtype=torch.float32, device=dev)
    _core.score_blocks_bound8(geo, q, bounds8, scales, blk_indptr, blk_indices, scores, stream=_stream(dev))
    return scores


def set_bound8_score_kernel(kernel: str) -> None:
    """The kernel that scores the 8-bit bound in :func:`score_blocks_bound8` on a GPU: ``"mma"``
    (the default: eight entries per tensor-core MMA, the codes exact in f16, the query's
    coefficients as an f16 value and remainder; head_dim 64/128/256, else ``"fma"``) or ``"fma"``
    (each code converted to f32 and multiplied into the group-summed query). Both match
    the CPU twin within f32 summation-order rounding. Process-wide, for measuring; a captured CUDA
    graph keeps the kernel it captured. ValueError for any other name."""
    _core.set_bound8_score_kernel(kernel)


def bound8_score_kernel() -> str:
    """The kernel :func:`set_bound8_score_kernel` chose: ``"fma"`` or ``"mma"``."""
    return _core.bound8_score_kernel()


def score_blocks_codes(
    geo, q, bounds8, scales, codes, blk_indptr, blk_indices, scores: torch.Tensor | None = None
) -> torch.Tensor:
    """Block scores from the 2-bit key codes, ``[nnz, num_kv_heads]`` (f32): for each listed block and
    KV head, the sum over the GQA group of the block's largest approximate logit of the lookahead
    queries ``[num_seqs, num_qo_heads, head_dim]``, each key decoded as ``lo + c (hi - lo) / 3``
    inside the block's 8-bit bound (``bounds8``, ``scales`` of :func:`build_bounds8`, which the
    codes were built in). A block whose scale is NaN scores NaN (last in :func:`topk_blocks`).
    Feed them to :func:`topk_blocks` like :func:`score_blocks`'s."""
    dev = _check_device(q, bounds8, scales, codes)
    if scores is None:
        scores = torch.empty(blk_indices.shape[0], geo.num_kv_heads, dtype=torch.float32, device=dev)
    _core.score_blocks_codes(
        geo, q, bounds8, scales, codes, blk_indptr, blk_indices, scores, stream=_stream(dev)
    )
    return scores


def rescore_blocks_codes(
    geo, q, bounds8, scales, codes, blk_indptr, blk_indices, cand, scores: torch.Tensor | None = None
) -> torch.Tensor:
    """The codes score of candidate logical blocks ``cand [num_seqs, num_kv_heads, m]`` (int32,
    negative: none), as :func:`score_blocks_codes` gives each for its head:
    ``[num_seqs * m, num_kv_heads]`` f32, -inf for a negative candidate. It is a CSR of ``m``
    entries per sequence: :func:`topk_blocks` over it (``blk_indptr = [0, m, 2 m, ...]``) gives
    positions into ``cand``. The second stage of ``KvConfig(score_candidates=...)``: per candidate
    and KV head it reads the block's bound and codes, ``2 head_dim + block_size head_dim / 4``
    bytes (768 at head_dim 128, block 16) and a 4-byte scale."""
    dev = _check_device(q, bounds8, scales, codes)
    if scores is None:
        if cand.dim() != 3:
            raise ShapeError(f"cand must be [num_seqs, num_kv_heads, m], got shape {tuple(cand.shape)}")
        n, h, m = cand.shape
        scores = torch.empty(n * m, h, dtype=torch.float32, device=dev)
    _core.rescore_blocks_codes(
        geo, q, bounds8, scales, codes, blk_indptr, blk_indices, cand, scores, stream=_stream(dev)
    )
    return scores


def rescore_topk_codes(
    geo,
    q,
    bounds8,
    scales,
    codes,
    blk_indptr,
    blk_indices,
    cand: torch.Tensor,
    k: int,
    *,
    successors: int = 0,
    forced: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    counters: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`rescore_blocks_codes` then :func:`topk_candidates` in one launch: the two-stage codes
    score's last ``k``, ``[num_seqs, num_kv_heads, k]`` logical blocks (-1 padded), the same bits
    as the two calls, ties included. On the GPU the thread blocks of each (sequence, KV head)
    score its candidates and the last to finish selects: it finds itself by a ticket in
    ``counters`` (int32, at least ``num_seqs * num_kv_heads`` elements, zero, left zero; None: a
    zeroed tensor per call, one more memset). Pass a buffer kept per stream to save that launch
    (two launches must not share it at once). For scores used as they come: a caller that
    reduces them between the two steps (``Engine.score_reduce``) calls the two apart."""
    dev = _check_device(q, bounds8, scales, codes)
    if cand.dim() != 3:
        raise ShapeError(f"cand must be [num_seqs, num_kv_heads, m], got shape {tuple(cand.shape)}")
    n, heads, m = cand.shape
    if out is None:
        out = torch.empty(n, geo.num_kv_heads, k, dtype=torch.int32, device=dev)
    scratch = torch.empty(n, heads, m, dtype=torch.float32, device=dev)
    if counters is None:
        counters = torch.zeros(n, heads, dtype=torch.int32, device=dev)
    else:
        counters = counters.view(-1)[: n * heads].view(n, heads)
    _core.rescore_topk_codes(
        geo,
        q,
        bounds8,
        scales,
        codes,
        blk_indptr,
        blk_indices,
        cand,
        k,
        out,
        scratch,
        counters,
        successors=successors,
        forced=forced,
        stream=_stream(dev),
    )
    return out


def topk_blocks(
    num_kv_heads: int,
    scores,
    blk_indptr,
    k: int,
    out: torch.Tensor | None = None,
    *,
    index_map: torch.Tensor | None = None,
    forced: torch.Tensor | None = None,
) -> torch.Tensor:
    """Top-k logical blocks per (seq, kv head), best first, -1 padded: ``[num_seqs, num_kv_heads, k]``.

    ``index_map`` (int32 ``[num_seqs, num_kv_heads, m]``): each chosen position ``i`` comes back as
    ``index_map[s, h, i]`` instead (-1 past ``m`` and for the padding), in the same launch: the
    two-stage codes score's candidates mapped back to logical blocks. ``forced`` (int32
    ``[num_seqs, num_kv_heads, F]``): :func:`force_scores` first (those entries of ``scores`` set
    to +inf in place), in the same launch; not with ``index_map``."""
    dev = _check_device(scores)
    if out is None:
        out = torch.empty(blk_indptr.shape[0] - 1, num_kv_heads, k, dtype=torch.int32, device=dev)
    _core.topk_blocks(
        num_kv_heads, scores, blk_indptr, k, out, index_map=index_map, forced=forced, stream=_stream(dev)
    )
    return out


def force_scores(num_kv_heads: int, scores: torch.Tensor, blk_indptr, forced: torch.Tensor) -> torch.Tensor:
    """Set the forced entries of ``scores [nnz, num_kv_heads]`` (float32) to +inf in place and
    return it: ``forced [num_seqs, num_kv_heads, F]`` (int32) holds, per CSR row of ``blk_indptr``
    and KV head, logical blocks every top-K then takes first; -1 and positions past the row are
    ignored. One launch (:func:`oasiskv.engine.keep_pins` composed of device ops is its
    definition)."""
    dev = _check_device(scores)
    _core.force_scores(num_kv_heads, scores, blk_indptr, forced, stream=_stream(dev))
    return scores


def topk_candidates(
    num_kv_heads: int,
    scores: torch.Tensor,
    cand: torch.Tensor,
    blk_indptr,
    k: int,
    *,
    successors: int = 0,
    forced: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The two-stage codes score's last top-``k``, ``[num_seqs, num_kv_heads, k]`` logical blocks
    (-1 padded): the candidates ``cand [num_seqs, num_kv_heads, m]`` (int32, < 0: none) with their
    scores ``[num_seqs * m, num_kv_heads]`` (:func:`rescore_blocks_codes`); the next block of each
    of the ``successors`` best (inside its row of ``blk_indptr``, the requests' blocks) and the
    blocks of ``forced [num_seqs, num_kv_heads, F]`` go first, a successor that is no candidate
    appended. One launch (``KvConfig.successor_blocks`` with ``score_candidates``)."""
    dev = _check_device(scores)
    if out is None:
        out = torch.empty(cand.shape[0], num_kv_heads, k, dtype=torch.int32, device=dev)
    st = _stream(dev)
    _core.topk_candidates(
        num_kv_heads, scores, cand, blk_indptr, k, out, successors=successors, forced=forced, stream=st
    )
    return out


def delta_select(
    num_kv_heads: int,
    predicted,
    slot_pages,
    page_map,
    page_last_selected,
    step: int | torch.Tensor,
    fetch_cap: int,
    plan_slots=None,
    plan_blocks=None,
    *,
    stats: torch.Tensor | None = None,
):
    """Delta selection with capped eviction. Returns ``(plan_slots, plan_blocks, stats)``.

    ``step`` may be an int32 tensor of one element on the device of the call: the kernel then
    reads it when it runs (a captured CUDA graph replays with the step of the replay).

    ``stats`` is ``(pairs, kept, missing)`` summed over sequences and heads on the CPU. On the GPU it
    is the ``stats`` tensor passed in (int32 ``[num_seqs, num_kv_heads, 3]``, filled per (seq, head)
    on the stream), or ``None``."""
    dev = _check_device(predicted, page_map)
    n = predicted.shape[0]
    if plan_slots is None:
        plan_slots = torch.empty(n, num_kv_heads, fetch_cap, dtype=torch.int32, device=dev)
    if plan_blocks is None:
        plan_blocks = torch.empty(n, num_kv_heads, fetch_cap, dtype=torch.int32, device=dev)
    step_now = None
    if isinstance(step, torch.Tensor):
        if dev.type == "cuda":
            step_now, step = step, 0
        else:
            step = int(step)
    totals = _core.delta_select(
        num_kv_heads,
        predicted,
        slot_pages,
        page_map,
        page_last_selected,
        int(step),
        int(fetch_cap),
        plan_slots,
        plan_blocks,
        stats=stats,
        step_now=step_now,
        stream=_stream(dev),
    )
    return plan_slots, plan_blocks, (totals if dev.type != "cuda" else stats)


def gather_blocks(
    geo,
    plan_slots,
    plan_blocks,
    slot_pages,
    host_indptr,
    host_indices,
    host_k,
    host_v,
    k_pages,
    v_pages,
    *,
    host_k_scales=None,
    host_v_scales=None,
    k_scales=None,
    v_scales=None,
) -> int | None:
    """Copy the planned block-head entries from the host pool into GPU slots.

    Returns the number of entries copied on the CPU, ``None`` on the GPU (queued, not yet run).
    On a GPU, a pinned pool is read with :func:`set_gather_launch`'s launch; a pool in device
    memory (``Engine(host_pool="device")``, the all-resident oracle) with the many-block launch
    that device reads need. A tier in fp8_e4m3 passes its scales (as :func:`append_kv`): an
    fp8 host pool into float pages is dequantized (code x scale)."""
    dev = _check_device(plan_slots, k_pages, host_k)
    return _core.gather_blocks(
        geo,
        plan_slots,
        plan_blocks,
        slot_pages,
        host_indptr,
        host_indices,
        host_k,
        host_v,
        k_pages,
        v_pages,
        host_k_scales=host_k_scales,
        host_v_scales=host_v_scales,
        k_scales=k_scales,
        v_scales=v_scales,
        stream=_stream(dev),
    )


def wait_stamp(stamps: torch.Tensor, mode: int) -> None:
    """Time a wait of the current stream on background work: ``stamps`` int64 ``[3]`` = (start of
    the current wait, total waited, waits), nanoseconds. ``mode`` 0 marks the start, 1 the end
    (``stamps[1] += now - stamps[0]``, ``stamps[2] += 1``). On a GPU a one-thread kernel on the
    current stream reads the device clock when the stream reaches it (captured into CUDA graphs);
    on the CPU a monotonic clock, at once."""
    dev = stamps.device
    _core.wait_stamp(stamps, mode, stream=_stream(dev))


def wait_epoch(
    landed: torch.Tensor, layer: int, epoch: torch.Tensor, stats: torch.Tensor, timeout_s: float
) -> None:
    """Hold the current stream until ``landed[layer]`` (int64 ``[layers]``, CPU, pinned on a
    GPU: the landed epochs a coordinator's ``StepReader`` writes) reaches ``epoch[0]`` (int64
    ``[1]`` on the device), or give up after ``timeout_s``. ``stats`` (int64 ``[4]`` on the
    device): waits that gave up, the last one's epoch, nanoseconds the stream was held, waits. On
    a GPU a one-thread kernel (captured into CUDA graphs); on the CPU the wait itself, at once."""
    _core.wait_epoch(landed, layer, epoch, stats, timeout_s, stream=_stream(epoch.device))


def set_kv8_attention_kernel(kernel: str) -> None:
    """The tensor-core kernel that reads fp8_e4m3 pages in :func:`decode_attention` on a GPU
    (head_dim 64/128/256, block_size a multiple of 16, up to 16 query vectors per KV head):
    ``"registers"`` (the default: the MMA fragments taken from the codes by ldmatrix, one
    conversion per two codes into f16, the scales applied to the scores and to the accumulator;
    bf16 and f16), ``"tile"`` (each 16-token chunk dequantized into a bf16 tile in shared
    memory, then the bf16 pages' MMA; bf16 only; 1.26x slower on an H100) or ``"registers-deep"``
    (``"registers"`` with twice the pipeline depth, the bf16 kernel's bytes in flight per warp;
    on an H100 0.95-0.98x the speed of ``"registers"``). All match the CPU twin within the bf16
    tolerances. Process-wide, for measuring; a captured CUDA graph keeps the kernel it captured.
    ValueError for any other name."""
    _core.set_kv8_attention_kernel(kernel)


def kv8_attention_kernel() -> str:
    """The kernel :func:`set_kv8_attention_kernel` chose: ``"tile"``, ``"registers"`` or
    ``"registers-deep"``."""
    return _core.kv8_attention_kernel()


def set_gather_launch(
    max_blocks: int | None = None,
    warps_per_block: int | None = None,
    entries_per_warp: int | None = None,
    stage_entries: int | None = None,
    *,
    kv8: bool = False,
) -> None:
    """Launch shape of the GPU gather: at most ``max_blocks`` thread blocks (0: no cap) of
    ``warps_per_block`` warps (1-4), each warp checking ``entries_per_warp`` plan entries (1-32)
    per pass and copying ``stage_entries`` (0-32) of them at once through shared memory (0: one
    at a time through registers; lowered to what fits the device's shared memory).

    Two launches, each process-wide, for tuning: ``kv8=False``, gathers from float host pools,
    default ``(4, 4, 32, 6)`` (the measured best on the H200, docs/PERF.md); ``kv8=True``, gathers
    from fp8_e4m3 host pools, default ``(0, 4, 8, 0)``: each warp converts its entries, so a few
    staging blocks leave PCIe idle (s20 on an H100: 8.3 ms against 29.4 ms for the float
    default's shape, 65,536 entries). A staged kv8 launch stages twice as many entries per warp
    (an entry is half the bytes), at most 32 and what fits the shared memory. A field left out
    (None) takes that launch's default. Every shape copies the same bytes; they trade PCIe reads
    in flight against SMs held beside the compute stream. A captured CUDA graph keeps its launch.
    Gathers from a pool in device memory (the all-resident oracle) keep the many-block register
    launch ``(0, 4, 8, 0)`` whatever is set here."""
    _core.set_gather_launch(max_blocks, warps_per_block, entries_per_warp, stage_entries, kv8=kv8)


def gather_launch(*, kv8: bool = False) -> tuple[int, int, int, int]:
    """``(max_blocks, warps_per_block, entries_per_warp, stage_entries)`` of
    :func:`set_gather_launch` (``kv8``: of gathers from fp8_e4m3 host pools)."""
    return _core.gather_launch(kv8=kv8)


def copy_pages(
    geo,
    src_k,
    src_v,
    src_ids,
    dst_k,
    dst_v,
    dst_ids,
    *,
    src_k_scales=None,
    src_v_scales=None,
    dst_k_scales=None,
    dst_v_scales=None,
    valid=None,
) -> None:
    """Whole-page copy between pools of the same page geometry (either pool may be pinned host memory
    when the ids are on a CUDA device). A pool in fp8_e4m3 passes its scales; float pages into an
    fp8 pool are quantized over their first ``valid[i]`` rows (int32; None: full pages)."""
    dev = _check_device(src_ids, src_k, dst_k)
    _core.copy_pages(
        geo,
        src_k,
        src_v,
        src_ids,
        dst_k,
        dst_v,
        dst_ids,
        src_k_scales=src_k_scales,
        src_v_scales=src_v_scales,
        dst_k_scales=dst_k_scales,
        dst_v_scales=dst_v_scales,
        valid=valid,
        stream=_stream(dev),
    )


def empty_kv8(geo, rows: int, device, *, pin: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``(codes, scales)`` of ``rows`` fp8_e4m3 pages: uint8 ``[rows, num_kv_heads, block_size,
    head_dim]`` and float32 ``[rows, num_kv_heads]``, uninitialised (``pin``: pinned CPU memory)."""
    g = geo
    codes = torch.empty(
        rows, g.num_kv_heads, g.block_size, g.head_dim, dtype=torch.uint8, device=device, pin_memory=pin
    )
    scales = torch.empty(rows, g.num_kv_heads, dtype=torch.float32, device=device, pin_memory=pin)
    return codes, scales


def quantize_kv8(geo, src, valid, codes, scales) -> None:
    """Quantize whole pages ``src [n, num_kv_heads, block_size, head_dim]`` (float) into fp8_e4m3
    ``codes`` (uint8, same shape) and ``scales [n, num_kv_heads]`` (float32): per (page, KV head)
    the power-of-two scale of the first ``valid[i]`` rows' largest finite magnitude over 448, each
    value rounded to the nearest E4M3 code (ties to even, NaN and inf to the NaN code), rows past
    ``valid[i]`` code 0."""
    dev = _check_device(src, codes)
    _core.quantize_kv8(geo, src, valid, codes, scales, stream=_stream(dev))


def dequantize_kv8(codes: torch.Tensor, scales: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """fp8_e4m3 pages back to ``dtype``: ``code x scale`` per (page, KV head) (exact in float32;
    torch's own E4M3 decode, the same grid as ``oasis_core``'s)."""
    vals = codes.view(torch.float8_e4m3fn).to(torch.float32)
    return (vals * scales[..., None, None]).to(dtype)


def _as_rows(t: torch.Tensor, hidden: int, name: str) -> torch.Tensor:
    """``t [..., hidden]`` as a 2-D view ``[rows, hidden]`` (2-D tensors as they are, strided or not)."""
    if t.dim() == 2:
        return t
    if t.dim() == 0 or t.shape[-1] != hidden:
        raise ShapeError(f"{name} must have shape [..., {hidden}], got {tuple(t.shape)}")
    try:
        return t.view(-1, hidden)
    except RuntimeError:
        raise ShapeError(
            f"{name} of shape {tuple(t.shape)} and strides {t.stride()} cannot be seen as rows of {hidden}; "
            f"pass {name}.contiguous()"
        ) from None


def silu_mul(gu: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """The MLP's SwiGLU activation in one kernel: ``silu(gate) * up`` over the fused gate/up
    projection ``gu [..., 2 * inter]`` (gate columns first), returned as ``[..., inter]``.

    torch's ``F.silu(g) * u`` with its rounding (the SiLU in float32, rounded to the dtype, then
    the product in float32, rounded), up to the last float32 bit of ``exp``, which the kernels
    take correctly rounded, identically on the CPU and the GPU. ``gu`` is made contiguous (a copy
    when it is not); ``out`` (contiguous, shaped ``[..., inter]``) may not overlap it. On CUDA the
    kernel is queued on the current stream (no synchronisation, no allocation but ``out`` when
    made here: CUDA-graph capturable)."""
    dev = _check_device(gu, out)
    if gu.dim() < 1 or gu.shape[-1] % 2:
        raise ShapeError(f"gu must have shape [..., 2 * inter], got {tuple(gu.shape)}")
    inter = gu.shape[-1] // 2
    gu = gu.contiguous()
    if out is None:
        out = torch.empty((*gu.shape[:-1], inter), dtype=gu.dtype, device=dev)
    elif tuple(out.shape) != (*gu.shape[:-1], inter):
        raise ShapeError(f"out must have shape {(*gu.shape[:-1], inter)}, got {tuple(out.shape)}")
    _core.silu_mul(gu.reshape(-1, 2 * inter), out.view(-1, inter), stream=_stream(dev))
    return out


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    *,
    residual: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    residual_out: torch.Tensor | None = None,
):
    """Hugging Face RMSNorm of ``x [..., hidden]`` with ``weight [hidden]``, in one kernel (issue 10).

    The same numerics as :func:`oasiskv.models.transformer.rms_norm` (normalise in float32, round to
    the dtype, scale by the weight, round again); only the order of the sum of squares is the
    kernels' own, identical on the CPU and the GPU. A 2-D ``x`` may have strided rows (each row
    contiguous); other ranks are flattened to rows (a copy when they cannot be viewed so).

    With ``residual`` (shaped like ``x``): ``h = residual + x`` (rounded to the dtype, as torch adds)
    is written to ``residual_out`` and normalised; returns ``(out, residual_out)``, else ``out``.
    ``residual_out`` defaults to a new tensor; ``residual_out=residual`` updates the residual in place
    (the only overlap allowed: ``out`` and ``residual_out`` may share memory with no other argument).
    Outputs are contiguous, shaped like ``x``. On CUDA the kernel is queued on the current stream (no
    synchronisation, no allocation but the outputs made here: CUDA-graph capturable).
    """
    dev = _check_device(x, weight, residual, out, residual_out)
    if weight.dim() != 1:
        raise ShapeError(f"weight must have shape [hidden], got {tuple(weight.shape)}")
    hidden = weight.shape[0]
    if x.dim() == 2:
        rows_x = x
    elif x.dim() >= 1 and x.shape[-1] == hidden:
        rows_x = x.reshape(-1, hidden)  # a view when the strides allow it, else a copy
    else:
        raise ShapeError(f"x must have shape [..., {hidden}] (hidden = len(weight)), got {tuple(x.shape)}")
    if out is None:
        out = torch.empty(x.shape, dtype=x.dtype, device=dev)
    rows = {"out": _as_rows(out, hidden, "out")}
    if residual is not None:
        if residual_out is None:
            residual_out = torch.empty(residual.shape, dtype=residual.dtype, device=residual.device)
        rows["residual"] = _as_rows(residual, hidden, "residual")
    if residual_out is not None:  # without residual: the native module says to pass both
        rows["residual_out"] = _as_rows(residual_out, hidden, "residual_out")
    _core.rms_norm(
        rows_x,
        weight,
        float(eps),
        rows["out"],
        rows.get("residual"),
        rows.get("residual_out"),
        stream=_stream(dev),
    )
    return out if residual is None else (out, residual_out)


def qk_norm_rope(
    qkv: torch.Tensor,
    q_size: int,
    kv_size: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
    q_norm: torch.Tensor | None = None,
    k_norm: torch.Tensor | None = None,
    eps: float = 1e-6,
    *,
    q_out: torch.Tensor | None = None,
    k_out: torch.Tensor | None = None,
    v_out: torch.Tensor | None = None,
    kv_groups: int = 1,
    rope_scale: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The attention prologue of a decoder layer, in one kernel (issue 10): from the fused QKV
    projection ``qkv [n, q_size + 2 * kv_size]`` (rows may be strided) return contiguous
    ``(q [n, num_heads, head_dim], k [n, num_kv_heads, head_dim], v [n, num_kv_heads, head_dim])``.

    Query and key heads are RMS-normalised per head with ``q_norm`` / ``k_norm`` ``[head_dim]``
    (Qwen3; pass neither for Llama), then rotated by rotate-half RoPE at ``positions [n]`` (int64 or
    int32, read by the kernel) with ``inv_freq [head_dim // 2]`` (float32); values are copied. The
    numerics are those of ``rms_norm``, ``rope_cos_sin`` and ``apply_rope`` of
    :mod:`oasiskv.models.transformer`, with cos/sin rounded correctly to float32 (torch's are within
    1 ulp of them). ``rope_scale`` multiplies cos and sin in float32 before their rounding to the
    dtype (YaRN's attention factor, as transformers applies it; 1.0 otherwise). On CUDA the kernel
    is queued on the current stream (CUDA-graph capturable).

    ``kv_groups`` = G > 1 (dividing n): the rows are n / G groups of G consecutive rows (row
    ``t = s * G + r``, a decode step's rows of request s), and row t's key and value heads go to
    row ``r * (n / G) + s`` of k and v: each row index r of every request contiguous (the engine's
    append and the attention's lookahead row read them without a copy). q keeps the token order.
    """
    dev = _check_device(qkv, positions, inv_freq, q_norm, k_norm)
    n = qkv.shape[0] if qkv.dim() >= 1 else 0
    if q_out is None:
        q_out = torch.empty(n, num_heads, head_dim, dtype=qkv.dtype, device=dev)
    if k_out is None:
        k_out = torch.empty(n, num_kv_heads, head_dim, dtype=qkv.dtype, device=dev)
    if v_out is None:
        v_out = torch.empty(n, num_kv_heads, head_dim, dtype=qkv.dtype, device=dev)
    _core.qk_norm_rope(
        qkv,
        int(q_size),
        int(kv_size),
        int(num_heads),
        int(num_kv_heads),
        int(head_dim),
        positions,
        inv_freq,
        q_norm,
        k_norm,
        float(eps),
        q_out,
        k_out,
        v_out,
        kv_groups=int(kv_groups),
        rope_scale=float(rope_scale),
        stream=_stream(dev),
    )
    return q_out, k_out, v_out
