"""The roofline: the bytes one decode step must read, and the time they take at a bandwidth.

Pure arithmetic: the caller hands in the model's weight bytes, one request's reservation (the
``need`` of :mod:`.budget`) and the bandwidth it measured in the same run
(:func:`oasiskv.bench.kernels.ceilings`' device-to-device copy); nothing here touches a device.

A step reads the weights once (:func:`weights_read_bytes`; in a mixture of experts, only the
experts some row chose, :func:`moe_weights_read_bytes`) and per request what its attention reads
(:func:`kv_read_bytes`): dense, the whole context's K and V; oasis and oracle, ``K + 1`` pages
per KV head and layer plus the summaries scored.
"""

from __future__ import annotations

import math


def weights_read_bytes(weights_bytes: int, embed_bytes: int, tied: bool) -> int:
    """Weight bytes one decode step reads: every weight once, but only the batch's rows of the
    embedding table (``embed_bytes``) when the LM head is a separate matrix (not ``tied``)."""
    return weights_bytes - (0 if tied else embed_bytes)


def moe_weights_read_bytes(
    weights_read: int, conc: int, num_experts: int, experts_per_tok: int, moe_layers: int, expert_bytes: int
) -> int:
    """:func:`weights_read_bytes` of a mixture of experts at ``conc`` requests, less the experts no
    row chose: ``E (1 - (1 - k/E)^conc)`` of the ``E`` are chosen per layer in expectation, for one
    row per request routed uniformly (an estimate: real routers are not uniform, and lookahead
    rows route too). ``expert_bytes``: one expert's three matrices."""
    e, k = num_experts, experts_per_tok
    unused = e * (1 - k / e) ** conc
    return int(weights_read - moe_layers * unused * expert_bytes)


def kv_read_bytes(mode: str, tokens: int, need: dict, block_size: int) -> int:
    """KV bytes one request's attention reads in a step at ``tokens`` of context: dense (``mode``
    ``"dense"``), every token's K and V; otherwise its working set (at most ``steady_pages``
    blocks) plus the summaries of every full block."""
    per = need["block_bytes"]
    if mode == "dense":
        return tokens * (per // block_size)
    pages = min(need["steady_pages"], math.ceil(tokens / block_size))
    return pages * per + (tokens // block_size) * need["summary_bytes"]


def step_roofline(
    mode: str,
    ctx: int,
    conc: int,
    need: dict,
    *,
    block_size: int,
    max_tokens: int,
    weights_read: int,
    bandwidth_Bps: float | None,
) -> dict:
    """The roofline columns of a row: ``step_read_bytes``, the bytes one decode step of ``conc``
    requests must read at the middle of the decode phase (``weights_read``: the weight bytes at
    this concurrency), and ``roofline_tpot_s``, that over ``bandwidth_Bps`` (None without one)."""
    tokens = ctx + max_tokens // 2
    total = weights_read + conc * kv_read_bytes(mode, tokens, need, block_size)
    bw = bandwidth_Bps
    return {"step_read_bytes": total, "roofline_tpot_s": total / bw if bw else None}
