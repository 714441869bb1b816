"""The model seam: what an :class:`~oasiskv.engine.Engine` calls on the model it runs.

:class:`EngineModel` is the whole of it. :class:`~oasiskv.models.CausalLM` (and its tensor-parallel
shard, :class:`~oasiskv.models.tp.TPCausalLM`) implement it; so does ``oasiskv.hf``'s view of a
transformers model, and any wrapper a test or a user writes (:func:`check_engine_model` says what
is missing). The engine reads these attributes; it never probes a model for others.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Protocol, runtime_checkable

import torch

from ..errors import ConfigError

#: The attributes :func:`check_engine_model` requires, in the order it names them.
REQUIRED = ("config", "parameters", "forward", "score_reduce", "groups_kv")


@runtime_checkable
class EngineModel(Protocol):
    """A decoder the engine runs over a flat batch of token rows.

    Attributes:
        config: the model's shape (``num_attention_heads``, ``num_key_value_heads``, ``head_dim``,
            ``num_hidden_layers``, ``vocab_size``, ``max_position_embeddings``).
        score_reduce: None, or (KV heads replicated across tensor-parallel ranks) the sum of each
            block's partial score ``[nnz, num_kv_heads]`` over the ranks that share the head,
            applied before every top-K so that they select the same blocks.
        groups_kv: True when :meth:`forward` takes ``kv_groups=G`` and then hands a decode step's
            K/V grouped by row (each request's token row, then each lookahead row), so that the
            engine appends and attends them without a copy; False: the engine regroups them.
    """

    config: object
    score_reduce: Callable[[torch.Tensor], torch.Tensor] | None
    groups_kv: bool

    def parameters(self) -> Iterator[torch.Tensor]:
        """The weights (their dtype and device are the model's)."""
        ...

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn: Callable,
        logits_rows: torch.Tensor | None = None,
        capture_layers: Sequence[int] = (),
    ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """``(float32 logits [rows, vocab], {layer: residual stream entering it})`` over the flat
        batch; ``attn(i, q, k, v)`` computes layer ``i``'s attention."""
        ...


def check_engine_model(model) -> None:
    """Raise :class:`~oasiskv.errors.ConfigError` naming what ``model`` lacks of
    :class:`EngineModel`; a speculative engine also calls its ``logits(hidden)``."""
    missing = [name for name in REQUIRED if not hasattr(model, name)]
    if missing:
        raise ConfigError(
            f"the model ({type(model).__name__}) lacks {', '.join(missing)} of oasiskv.engine.EngineModel; "
            "pass a CausalLM (oasiskv.models), or give a wrapper those attributes (score_reduce = None "
            "and groups_kv = False for a plain forward)"
        )
