"""The roofline: the bytes one decode step must read and fetch, and the least time they take.

Pure arithmetic: the caller hands in the model's weight bytes, one request's reservation (the
``need`` of :mod:`.budget`), the bytes a row fetched and the bandwidths it measured in the same
run (``ceilings``: ``hbm_read_Bps``, a read-only reduction, :func:`~.model.hbm_read_Bps`;
``h2d_pinned_Bps``, :func:`oasiskv.bench.kernels.ceilings`); nothing here touches a device.

A step reads the weights once (:func:`weights_read_bytes`; in a mixture of experts, only the
experts some row chose, :func:`moe_weights_read_bytes`) and per request what its attention reads
(:func:`kv_read_bytes`): dense, the whole context's K and V; oasis and oracle, ``K + 1`` pages
per KV head and layer plus the summaries scored. Its bound (:func:`step_bound`) is the larger of
two times: those bytes over the HBM read bandwidth, and the bytes fetched from a pinned host pool
over the pinned host-to-device bandwidth (0 for dense and for the oracle, whose pool is on the
GPU). The two overlap at best, so the larger is the least a step can take.
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
    blocks) plus the summaries of every full block (``need["score_bytes"]``)."""
    per = need["block_bytes"]
    if mode == "dense":
        return tokens * (per // block_size)
    pages = min(need["steady_pages"], math.ceil(tokens / block_size))
    return pages * per + (tokens // block_size) * need["score_bytes"]


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
    """The read columns of a row: ``step_read_bytes``, the bytes one decode step of ``conc``
    requests must read at the middle of the decode phase (``weights_read``: the weight bytes at
    this concurrency), and ``roofline_tpot_s``, that over ``bandwidth_Bps`` (None without one).
    :func:`roofline_columns` puts the PCIe bytes beside it."""
    tokens = ctx + max_tokens // 2
    total = weights_read + conc * kv_read_bytes(mode, tokens, need, block_size)
    bw = bandwidth_Bps
    return {"step_read_bytes": total, "roofline_tpot_s": total / bw if bw else None}


def pcie_bytes_per_step(host_pool: str, conc: int, fetched_bytes_per_step: float | None) -> float:
    """Bytes one decode step of ``conc`` requests moves over PCIe: each request's
    ``fetched_bytes_per_step`` (``RequestMetrics``: K and V of the block-heads gathered, every
    layer) from a ``"pinned"`` host pool; 0 for dense (None fetched) and for a ``"device"`` pool
    (the oracle's gather copies device to device)."""
    if host_pool != "pinned" or not fetched_bytes_per_step:
        return 0.0
    return conc * float(fetched_bytes_per_step)


def step_bound(
    read_bytes: int, pcie_bytes: float, *, hbm_read_Bps: float | None, h2d_Bps: float | None
) -> dict:
    """The least time of a step, in seconds: ``hbm_s`` (``read_bytes`` over the HBM read
    bandwidth), ``pcie_s`` (``pcie_bytes`` over the pinned host-to-device bandwidth; 0 when nothing
    is fetched), their max ``bound_s`` and which one ``binds`` (``"hbm"`` or ``"pcie"``; ``"hbm"``
    on a tie). Every value is None without ``hbm_read_Bps`` (no GPU), and ``pcie_s`` (so the
    bound) is None when bytes are fetched and ``h2d_Bps`` is missing."""
    none = {"hbm_s": None, "pcie_s": None, "bound_s": None, "binds": None}
    if not hbm_read_Bps:
        return none
    hbm = read_bytes / hbm_read_Bps
    if not pcie_bytes:
        pcie = 0.0
    elif h2d_Bps:
        pcie = pcie_bytes / h2d_Bps
    else:
        return {**none, "hbm_s": hbm}
    return {"hbm_s": hbm, "pcie_s": pcie, "bound_s": max(hbm, pcie), "binds": "pcie" if pcie > hbm else "hbm"}


def fraction(bound_s: float | None, measured_s: float | None) -> float | None:
    """``bound_s / measured_s``: the share of its least time the measured step reached (1 at the
    bound; 0 for a zero time); None when either is missing, or ``measured_s`` is zero."""
    return None if bound_s is None or not measured_s else bound_s / measured_s


def roofline_columns(
    step_read_bytes: int,
    pcie_bytes: float,
    step_s: float | None,
    ceilings: dict | None,
) -> dict:
    """A row's roofline columns from its bytes (:func:`step_roofline`'s ``step_read_bytes``,
    :func:`pcie_bytes_per_step`), its measured step time ``step_s`` and the run's ``ceilings``
    (None or without a key: that column None):

    * ``roofline_tpot_s`` / ``roofline_fraction``: the bound (:func:`step_bound`) and
      bound / ``step_s``; ``roofline_binds``: ``"hbm"`` or ``"pcie"``;
    * ``hbm_tpot_s`` / ``hbm_fraction``, ``pcie_tpot_s`` / ``pcie_fraction``: each time alone;
    * ``pcie_bytes_per_step``;
    * ``roofline_tpot_d2d_s`` / ``roofline_fraction_d2d``: the reads over the device-to-device
      copy bandwidth (read plus write), the bound reported before issue 35, for comparison;
    * ``pcie_sm_tpot_s`` / ``pcie_sm_fraction``: the fetched bytes over ``h2d_sm_Bps``, what an
      SM kernel reads of pinned host memory (the gathers' path; on some hosts well below the copy
      engines' ``h2d_pinned_Bps``), and ``roofline_sm_fraction``: the bound with that PCIe time,
      the least a step that gathers with SM loads can take. The bound above stays the hardware's.
    """
    c = ceilings or {}
    b = step_bound(
        step_read_bytes, pcie_bytes, hbm_read_Bps=c.get("hbm_read_Bps"), h2d_Bps=c.get("h2d_pinned_Bps")
    )
    d2d = c.get("d2d_copy_Bps")
    d2d_s = step_read_bytes / d2d if d2d else None
    sm = step_bound(
        step_read_bytes, pcie_bytes, hbm_read_Bps=c.get("hbm_read_Bps"), h2d_Bps=c.get("h2d_sm_Bps")
    )
    return {
        "roofline_tpot_s": b["bound_s"],
        "roofline_fraction": fraction(b["bound_s"], step_s),
        "roofline_binds": b["binds"],
        "hbm_tpot_s": b["hbm_s"],
        "hbm_fraction": fraction(b["hbm_s"], step_s),
        "pcie_tpot_s": b["pcie_s"],
        "pcie_fraction": fraction(b["pcie_s"], step_s),
        "pcie_bytes_per_step": pcie_bytes,
        "roofline_tpot_d2d_s": d2d_s,
        "roofline_fraction_d2d": fraction(d2d_s, step_s),
        "pcie_sm_tpot_s": sm["pcie_s"],
        "pcie_sm_fraction": fraction(sm["pcie_s"], step_s),
        "roofline_sm_fraction": fraction(sm["bound_s"], step_s),
    }
