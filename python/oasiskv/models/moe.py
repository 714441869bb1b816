"""Qwen3-MoE's sparse MLP: a top-k router over SwiGLU experts (issue 14).

A mixture-of-experts layer (:meth:`~oasiskv.models.config.ModelConfig.is_moe_layer`) replaces the
dense SwiGLU MLP of :class:`~oasiskv.models.transformer.DecoderLayer` by :class:`SparseMoE`:

1. the router, ``gate`` [E, h]: logits [n, E] = x @ gate.T, softmax in float32 (or wider), the top
   ``num_experts_per_tok`` (k) experts of each row and their probabilities, divided by their sum
   when ``norm_topk_prob``, cast to x's dtype (Hugging Face's ``Qwen3MoeTopKRouter``);
2. each expert ``e`` a SwiGLU MLP, ``down[e] @ (silu(gate[e] @ x) * (up[e] @ x))``, run on the
   rows routed to it only, its output scaled by the row's routing weight and summed into the
   output with ``index_add_``.

The experts are stacked, as transformers 5 stores them: ``experts_gate_up`` [E, 2 I, h] (gate rows
then up rows of each expert) and ``experts_down`` [E, h, I]; Hugging Face checkpoints name them
``mlp.experts.{e}.{gate,up,down}_proj.weight`` (:meth:`SparseMoE.hf_tensor_slots`) and the
router ``mlp.gate.weight``.

Work: one [n, E] router product, then per expert that got rows two matmuls over those rows only,
so a step reads the experts its tokens chose, never all of them (decode reads k experts a row).
NOTE: the loop asks the host which experts got rows (one device-to-host copy of E counts per
layer): on CUDA a synchronisation per MoE layer. A CUDA-graph capture of such a step raises
before that copy (the engine then runs the step eagerly and says why in ``graph_error``; not
run on a GPU yet).

Tensor parallelism (:mod:`oasiskv.models.tp`) splits every expert like the dense MLP:
``I / tp`` rows of each expert's gate and up, those columns of its down projection; the router is
replicated, so every rank routes the (replicated) rows identically and the partial outputs are
summed by the layer's one all-reduce.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn


def route(x: Tensor, gate: Tensor, top_k: int, norm_topk_prob: bool) -> tuple[Tensor, Tensor]:
    """The router: ``(weights [n, k] in x's dtype, experts [n, k] int64)`` of rows ``x`` [n, h]
    under router weight ``gate`` [E, h] (softmax in float32 over all E logits, then the top k,
    renormalised to sum 1 when ``norm_topk_prob``). Float64 rows keep float64 throughout."""
    probs = F.softmax(F.linear(x, gate), dim=-1, dtype=torch.promote_types(x.dtype, torch.float32))
    weights, experts = torch.topk(probs, top_k, dim=-1)
    if norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(x.dtype), experts


def run_experts(x: Tensor, weights: Tensor, experts: Tensor, gate_up: Tensor, down: Tensor) -> Tensor:
    """``sum_j weights[:, j] * expert[experts[:, j]](x)`` for rows ``x`` [n, h]: each expert with
    rows runs once, over its rows (gathered with ``index_select``, scattered back with
    ``index_add_``). ``gate_up`` [E, 2 I, h], ``down`` [E, h, I]; returns [n, h] in x's dtype."""
    n, k = experts.shape
    if x.is_cuda and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            "a mixture-of-experts layer cannot be captured in a CUDA graph (its expert loop reads "
            "the routing on the host); run it eagerly (enforce_eager=True)"
        )
    inter = down.shape[-1]
    out = torch.zeros_like(x)
    if n == 0:
        return out
    flat = experts.reshape(-1)  # [n k]: row r's j-th choice at r * k + j
    order = torch.argsort(flat, stable=True)  # grouped by expert, rows ascending inside a group
    counts = torch.bincount(flat, minlength=gate_up.shape[0]).tolist()  # NOTE: host sync
    rows_of = order // k
    w_of = weights.reshape(-1).index_select(0, order)
    start = 0
    for e, c in enumerate(counts):
        if c == 0:
            continue
        rows = rows_of[start : start + c]
        xe = x.index_select(0, rows)
        gu = F.linear(xe, gate_up[e])
        y = F.linear(F.silu(gu[:, :inter]) * gu[:, inter:], down[e])
        out.index_add_(0, rows, y * w_of[start : start + c, None])
        start += c
    return out


class SparseMoE(nn.Module):
    """One layer's mixture of experts: router ``gate`` [E, h], experts ``experts_gate_up``
    [E, 2 I, h] and ``experts_down`` [E, h, I] (``I`` = ``moe_intermediate_size``, or this
    rank's share of it under tensor parallelism). Weights UNINITIALISED."""

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        intermediate_size: int,
        top_k: int,
        norm_topk_prob: bool,
        dtype: torch.dtype | None = None,
        device=None,
    ) -> None:
        super().__init__()
        kw = {"dtype": dtype, "device": device}
        self.num_experts, self.intermediate_size = num_experts, intermediate_size
        self.top_k, self.norm_topk_prob = top_k, norm_topk_prob
        self.gate = nn.Parameter(torch.empty(num_experts, hidden_size, **kw))
        self.experts_gate_up = nn.Parameter(
            torch.empty(num_experts, 2 * intermediate_size, hidden_size, **kw)
        )
        self.experts_down = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size, **kw))

    def forward(self, x: Tensor) -> Tensor:
        """The experts' weighted sum for rows ``x`` [n, h] -> [n, h] (under tensor parallelism
        this rank's partial sum; the layer all-reduces it)."""
        weights, experts = route(x, self.gate, self.top_k, self.norm_topk_prob)
        return run_experts(x, weights, experts, self.experts_gate_up, self.experts_down)

    def hf_tensor_slots(self, prefix: str) -> dict[str, Tensor]:
        """Hugging Face name -> view of our stacked parameter, for ``prefix`` = ``model.layers.N.``."""
        inter = self.intermediate_size
        gu, down = self.experts_gate_up.data, self.experts_down.data
        slots = {prefix + "mlp.gate.weight": self.gate.data}
        for e in range(self.num_experts):
            p = f"{prefix}mlp.experts.{e}."
            slots[p + "gate_proj.weight"] = gu[e, :inter]
            slots[p + "up_proj.weight"] = gu[e, inter:]
            slots[p + "down_proj.weight"] = down[e]
        return slots

    def extra_repr(self) -> str:
        return (
            f"experts={self.num_experts}, top_k={self.top_k}, intermediate={self.intermediate_size}, "
            f"norm_topk_prob={self.norm_topk_prob}"
        )
