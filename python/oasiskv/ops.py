"""Tensor-level entry points of the OasisKV kernels.

Each function takes torch tensors laid out as in ``docs/CORE_CONTRACT.md`` and dispatches on the
tensors' device: CPU tensors run the Rust CPU twins in ``oasiskv._core``. Validation (shape,
dtype, device, contiguity, aliasing, table ranges) happens in the native module, which raises the
classes of :mod:`oasiskv.errors`; the GIL is released while a kernel runs.
"""

from __future__ import annotations

import torch

from . import _core
from .errors import DeviceError

KvGeometry = _core.KvGeometry
BlockPool = _core.BlockPool


def _check_device(*tensors: torch.Tensor | None) -> None:
    devs = {t.device.type for t in tensors if t is not None}
    if devs - {"cpu"}:
        raise DeviceError(
            f"tensors on {sorted(devs)}: this build runs the CPU kernels only; move every tensor "
            "to the CPU (tensor.cpu()) or install a build with the GPU backend"
        )


def append_kv(geo, k_new, v_new, page_ids, page_offsets, host_block_ids, k_pages, v_pages, host_k, host_v,
              summaries) -> None:
    """Append one token per sequence (write-through + summary update for sparse sequences)."""
    _check_device(k_new, k_pages, host_k)
    _core.append_kv(geo, k_new, v_new, page_ids, page_offsets, host_block_ids, k_pages, v_pages, host_k,
                    host_v, summaries)


def decode_attention(geo, q, k_pages, v_pages, kv_indptr, kv_indices, kv_last_page_len, *, page_map=None,
                     extra_k=None, extra_v=None, sm_scale: float | None = None,
                     out: torch.Tensor | None = None, max_pages_per_seq: int = 0) -> torch.Tensor:
    """Attention of stacked query rows ``q [num_seqs, num_rows, num_qo_heads, head_dim]``.

    ``max_pages_per_seq`` (a bound on any sequence's page count) lets the GPU path plan its split
    of long contexts without reading the tables back; the CPU ignores it."""
    _check_device(q, k_pages, out)
    if out is None:
        out = torch.empty_like(q)
    if sm_scale is None:
        sm_scale = geo.head_dim ** -0.5
    _core.decode_attention(geo, q, k_pages, v_pages, kv_indptr, kv_indices, kv_last_page_len, page_map,
                           extra_k, extra_v, float(sm_scale), out)
    return out


def build_summaries(geo, host_k, block_ids, block_lens, summaries) -> None:
    _check_device(host_k, summaries)
    _core.build_summaries(geo, host_k, block_ids, block_lens, summaries)


def score_blocks(geo, q, summaries, blk_indptr, blk_indices, scores: torch.Tensor | None = None) -> torch.Tensor:
    """Quest scores ``[nnz, num_kv_heads]`` (f32) of lookahead queries ``[num_seqs, num_qo_heads, head_dim]``."""
    _check_device(q, summaries)
    if scores is None:
        scores = torch.empty(blk_indices.shape[0], geo.num_kv_heads, dtype=torch.float32)
    _core.score_blocks(geo, q, summaries, blk_indptr, blk_indices, scores)
    return scores


def topk_blocks(num_kv_heads: int, scores, blk_indptr, k: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """Top-k logical blocks per (seq, kv head), best first, -1 padded: ``[num_seqs, num_kv_heads, k]``."""
    _check_device(scores)
    if out is None:
        out = torch.empty(blk_indptr.shape[0] - 1, num_kv_heads, k, dtype=torch.int32)
    _core.topk_blocks(num_kv_heads, scores, blk_indptr, k, out)
    return out


def delta_select(num_kv_heads: int, predicted, slot_pages, page_map, page_last_selected, step: int,
                 fetch_cap: int, plan_slots=None, plan_blocks=None):
    """Delta selection with capped eviction. Returns ``(plan_slots, plan_blocks, (pairs, kept, missing))``."""
    _check_device(predicted, page_map)
    n = predicted.shape[0]
    if plan_slots is None:
        plan_slots = torch.empty(n, num_kv_heads, fetch_cap, dtype=torch.int32)
    if plan_blocks is None:
        plan_blocks = torch.empty(n, num_kv_heads, fetch_cap, dtype=torch.int32)
    stats = _core.delta_select(num_kv_heads, predicted, slot_pages, page_map, page_last_selected, int(step),
                               int(fetch_cap), plan_slots, plan_blocks)
    return plan_slots, plan_blocks, stats


def gather_blocks(geo, plan_slots, plan_blocks, slot_pages, host_indptr, host_indices, host_k, host_v, k_pages,
                  v_pages) -> int:
    """Copy the planned block-head entries from the host pool into GPU slots; returns entries copied."""
    _check_device(plan_slots, host_k, k_pages)
    return _core.gather_blocks(geo, plan_slots, plan_blocks, slot_pages, host_indptr, host_indices, host_k,
                               host_v, k_pages, v_pages)


def copy_pages(geo, src_k, src_v, src_ids, dst_k, dst_v, dst_ids) -> None:
    """Whole-page copy between pools of the same page geometry."""
    _check_device(src_k, dst_k)
    _core.copy_pages(geo, src_k, src_v, src_ids, dst_k, dst_v, dst_ids)
