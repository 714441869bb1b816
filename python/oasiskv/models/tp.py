"""Tensor-parallel Llama / Qwen3: one rank's shard of a :class:`~oasiskv.models.CausalLM`.

Megatron's split, as vLLM does it, over a :class:`~oasiskv.parallel.TPGroup` of ``tp`` ranks:

==============================  ===============================  ================================
weight                          shard of rank ``r``              after it
==============================  ===============================  ================================
``embed_tokens`` [V, h]         vocabulary rows ``r*Vs ..``      masked lookup, all-reduce
fused QKV [(Hq + 2 Hkv) D, h]   its ``Hq/tp`` query heads and    attention over its own heads
                                ``Hkv/tp`` KV heads (column)
``o_proj`` [h, Hq D]            its query heads' columns (row)   all-reduce
``gate_up`` [2 I, h]            ``I/tp`` rows of each half       SwiGLU on its own columns
``down_proj`` [h, I]            its ``I/tp`` columns (row)       all-reduce
MoE router ``gate`` [E, h]      replicated                       the same routing on every rank
expert ``e``'s gate/up [I', h]  ``I'/tp`` rows of each           SwiGLU on its own columns
expert ``e``'s down [h, I']     its ``I'/tp`` columns (row)      all-reduce (one for all experts)
``lm_head`` [V, h]              vocabulary rows ``r*Vs ..``      all-gather of the logits
norms, RoPE                     replicated                       -
==============================  ===============================  ================================

``Vs = ceil(V / tp)``; the last shard is padded with zero rows, whose logits are dropped after
the gather. Query head ``g`` of a rank uses its KV head ``g // (Hq / Hkv)``, as in one process,
because each rank holds whole GQA groups.

**KV-head replication** (``tp > Hkv``, ``tp`` a multiple of ``Hkv``; Qwen3-235B-A22B's 4 KV heads
at TP8), as vLLM does it: each KV head lives on ``R = tp / Hkv`` consecutive ranks (its
*replicas*), rank ``r`` holding KV head ``r // R`` (the K and V rows of that head, copied) and its
own ``Hq / tp`` query heads, a different slice of that head's GQA group on each replica. The dense
attention needs nothing more. OasisKV scores each block per KV head as a sum over the group's
query heads (``ops.score_blocks``, ``score_blocks_codes``), so a replica's score is a partial sum:
:attr:`TPCausalLM.score_reduce` sums the ``[nnz, 1]`` scores over the replicas (an all-gather on
a process group of the replicas, added in rank order, so that every replica gets the same bits)
and the engine applies it before top-K (:attr:`oasiskv.engine.Engine.score_reduce`): the replicas
select the same blocks, the ones one process selects.

Every rank holds the full residual stream [n, h] (replicated) and the K/V of only its KV heads
(a replicated head's in full on each of its replicas): the engine of a rank
(:class:`~oasiskv.parallel.TPLLMEngine`) sees a model whose ``config`` has ``Hq/tp`` query
heads, ``Hkv/tp`` KV heads (1 under replication) and ``I/tp`` MLP columns (``I'/tp`` per
expert), and sizes its pools, summaries and selection by that. ``config.vocab_size`` stays the
full vocabulary (logits are gathered); ``full_config`` is the model's own.

**Mixture of experts** (Qwen3-MoE, ``I' = moe_intermediate_size``): the experts are
tensor-parallel, every rank holding a slice of every expert, not expert-parallel (whole experts
per rank). The residual stream is replicated, so each rank routes its rows itself (the same
experts everywhere, with no all-to-all) and sums its slices' partial products into the MLP's one
all-reduce, as a dense MLP does; every rank reads ``1/tp`` of each expert a step chose, so the
ranks stay balanced whatever the routing.

Two all-reduces per layer and one all-gather per forward; numerics: a row-parallel projection
sums ``tp`` partial products, so hidden states differ from one process in the last bits (greedy
tokens agree except at near ties); the embedding sum and the logit gather are exact.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from oasiskv.errors import ConfigError, ShapeError
from oasiskv.models.config import ModelConfig
from oasiskv.models.transformer import CausalLM


def _split_sizes(cfg: ModelConfig) -> dict[str, int]:
    """The sizes ``tp`` must divide: the query heads and the MLP widths (the dense one only where
    a dense layer exists)."""
    sizes = {"num_attention_heads": cfg.num_attention_heads}
    if not all(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers)):
        sizes["intermediate_size"] = cfg.intermediate_size
    if cfg.is_moe:
        sizes["moe_intermediate_size"] = cfg.moe_intermediate_size
    return sizes


def _kv_heads_split(hkv: int, tp: int) -> bool:
    """Whether ``tp`` ranks can share ``hkv`` KV heads: whole heads each (``tp`` divides ``hkv``)
    or each head on ``tp / hkv`` replicas (``hkv`` divides ``tp``)."""
    return hkv % tp == 0 or tp % hkv == 0


def valid_tp_sizes(cfg: ModelConfig) -> list[int]:
    """Every ``tp`` :func:`tp_config` accepts for ``cfg``, ascending."""
    g = math.gcd(*_split_sizes(cfg).values())
    return [t for t in range(1, g + 1) if g % t == 0 and _kv_heads_split(cfg.num_key_value_heads, t)]


def kv_replicas(cfg: ModelConfig, tp: int) -> int:
    """How many ranks hold each KV head at ``tp``: ``tp / num_key_value_heads`` when ``tp`` exceeds
    the KV heads (replication), else 1."""
    return max(1, tp // cfg.num_key_value_heads)


def tp_config(cfg: ModelConfig, tp: int) -> ModelConfig:
    """The config one rank's shard runs with: ``num_attention_heads``, ``intermediate_size`` and
    (mixture of experts) ``moe_intermediate_size`` divided by ``tp``, ``num_key_value_heads`` by
    ``tp`` too, or 1 when ``tp`` exceeds it (each KV head then on ``tp / num_key_value_heads``
    ranks, :func:`kv_replicas`); the vocabulary, head_dim, the number of experts and the rest
    unchanged.

    Raises :class:`ConfigError` when ``tp`` does not divide the query heads and the MLP widths, or
    neither divides nor is a multiple of the KV heads, naming the sizes that work. A model whose
    every layer is a mixture of experts has no dense MLP: its ``intermediate_size`` is not
    checked (and kept when ``tp`` does not divide it).
    """
    if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
        raise ConfigError(f"tp must be an int >= 1, got {tp!r}")
    hkv = cfg.num_key_value_heads
    bad = [f"{k}={v}" for k, v in _split_sizes(cfg).items() if v % tp]
    if not _kv_heads_split(hkv, tp):
        bad.append(f"num_key_value_heads={hkv}")
    if bad:
        raise ConfigError(
            f"tensor parallelism gives each rank its query heads, whole KV heads (or one KV head shared "
            f"by tp / num_key_value_heads ranks) and a slice of the MLP: {', '.join(bad)} not divisible "
            f"by tp={tp} (nor the KV heads a divisor of it); use tp in {valid_tp_sizes(cfg)}"
        )
    if tp == 1:
        return cfg
    inter = cfg.intermediate_size
    return cfg.replace(
        num_attention_heads=cfg.num_attention_heads // tp,
        num_key_value_heads=max(1, hkv // tp),
        intermediate_size=inter // tp if inter % tp == 0 else inter,
        moe_intermediate_size=cfg.moe_intermediate_size // tp,
        head_dim=cfg.head_dim,
    )


def vocab_shard(vocab_size: int, tp: int, rank: int) -> tuple[int, int, int]:
    """``(start, end, rows)``: rank ``rank`` holds vocabulary ids ``start .. end - 1`` in a shard of
    ``rows = ceil(vocab_size / tp)`` rows (the last shard padded with zero rows)."""
    rows = -(-vocab_size // tp)
    start = min(vocab_size, rank * rows)
    return start, min(vocab_size, start + rows), rows


#: How each Hugging Face tensor is split: by rows (dim 0, column-parallel), by columns (dim 1,
#: row-parallel), by vocabulary rows (padded), or replicated (every name not listed: the norms and
#: the MoE router ``mlp.gate.weight``). The MLP suffixes match the dense MLP's
#: ``mlp.gate_proj.weight`` and every expert's ``mlp.experts.E.gate_proj.weight`` alike.
_ROWS = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight")
_ROWS += (".gate_proj.weight", ".up_proj.weight")
_COLS = ("self_attn.o_proj.weight", ".down_proj.weight")
_VOCAB = ("model.embed_tokens.weight", "lm_head.weight")
#: The key and value projections: whole KV heads per rank, replicated when tp exceeds them.
_KV_ROWS = ("self_attn.k_proj.weight", "self_attn.v_proj.weight")


def is_replicated(name: str) -> bool:
    """Whether every rank holds the whole Hugging Face tensor ``name`` (norms, the MoE router)."""
    return name not in _VOCAB and not name.endswith(_ROWS + _COLS)


def shard_hf_tensor(name: str, full: Tensor, tp: int, rank: int, num_kv_heads: int | None = None) -> Tensor:
    """Rank ``rank``'s part of the full Hugging Face tensor ``name`` (a view where it can be one; the
    vocabulary shards of the last rank are a padded copy). Query, key and value rows are
    head-major, so a row range is a range of heads.

    ``num_kv_heads`` (the model's) is needed for the key and value projections when ``tp``
    exceeds it: rank ``r`` then gets the whole KV head ``r // (tp / num_kv_heads)``."""
    if tp == 1:
        return full
    if num_kv_heads is not None and tp > num_kv_heads and name.endswith(_KV_ROWS):
        n = full.shape[0]
        if tp % num_kv_heads or n % num_kv_heads:
            raise ShapeError(
                f"tensor {name} has {n} rows: cannot give its {num_kv_heads} KV heads to tp={tp} ranks"
            )
        rows = n // num_kv_heads
        return full.narrow(0, (rank // (tp // num_kv_heads)) * rows, rows)
    if name in _VOCAB:
        start, end, rows = vocab_shard(full.shape[0], tp, rank)
        part = full[start:end]
        if end - start < rows:
            part = torch.cat([part, part.new_zeros(rows - (end - start), *part.shape[1:])])
        return part
    dim = 0 if name.endswith(_ROWS) else 1 if name.endswith(_COLS) else None
    if dim is None:
        return full
    n = full.shape[dim]
    if n % tp:
        raise ShapeError(f"tensor {name} has {n} rows/columns along dim {dim}, not divisible by tp={tp}")
    return full.narrow(dim, rank * (n // tp), n // tp)


class TPCausalLM(CausalLM):
    """One rank's shard of a Llama / Qwen3 model (see the module docstring), with the collectives
    of its :class:`~oasiskv.parallel.TPGroup`. ``forward``, ``rope`` and the layer code are
    :class:`CausalLM`'s; the layers sum their row-parallel outputs over the group, :meth:`embed`
    and :meth:`logits` are the vocabulary-parallel ones. With ``group=None`` (one process) it
    is a plain :class:`CausalLM`.

    ``TPCausalLM(cfg, ...)`` allocates UNINITIALISED weights; build one with :meth:`from_full`
    (shard a full model), :meth:`random` (the same seed on every rank gives the shards of one
    model) or :meth:`load_hf_state_dict` with full-size Hugging Face tensors.
    """

    def __init__(
        self,
        cfg: ModelConfig,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device | None = None,
        group=None,
    ) -> None:
        if group is None:
            from oasiskv.parallel import TPGroup

            group = TPGroup.single(device or "cpu")
        if device is None:
            device = group.device
        local = tp_config(cfg, group.size)
        # NOTE: CausalLM allocates a full-vocabulary embedding (and LM head), replaced by the shards
        # right below; torch.empty, so it costs an allocation, not a fill.
        super().__init__(local, dtype=dtype, device=device)
        self.full_config = cfg
        self.group = group
        self.tp_rank, self.tp_size = group.rank, group.size
        #: Ranks holding each of this rank's KV heads (> 1: KV-head replication, tp > Hkv).
        self.kv_replicas = kv_replicas(cfg, group.size)
        #: Sums this rank's partial block scores ``[nnz, num_kv_heads]`` over the replicas of its KV
        #: head (None without replication); the engine applies it before top-K.
        #: NOTE: made here because it creates process groups, a collective of every rank.
        self.score_reduce = group.replica_sum(self.kv_replicas) if self.kv_replicas > 1 else None
        self.vocab_start, self.vocab_end, rows = vocab_shard(cfg.vocab_size, group.size, group.rank)
        if group.size > 1:
            kw = {"dtype": dtype, "device": device}
            self.embed_tokens = nn.Embedding(
                rows, cfg.hidden_size, _weight=torch.zeros(rows, cfg.hidden_size, **kw)
            )
            if cfg.tie_word_embeddings:
                self.lm_head = self.embed_tokens.weight
            else:
                self.lm_head = nn.Parameter(torch.zeros(rows, cfg.hidden_size, **kw))
            for layer in self.layers:
                layer.all_reduce = group.all_reduce
        self.requires_grad_(False)

    # ------------------------------------------------------------------ vocabulary-parallel ends
    def embed(self, ids: Tensor) -> Tensor:
        """Token embeddings [n, hidden]: each rank looks up the ids in its vocabulary rows (zeros
        elsewhere) and the group sums them, exactly (one nonzero term per row)."""
        if self.tp_size == 1:
            return super().embed(ids)
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= self.vocab_end - self.vocab_start)
        out = F.embedding(local.masked_fill(outside, 0), self.embed_tokens.weight)
        out = out.masked_fill(outside.unsqueeze(-1), 0)
        return self.group.all_reduce(out)

    def logits(self, hidden: Tensor) -> Tensor:
        """Final norm + this rank's LM-head rows, gathered over the group: float32 [n, vocab],
        the same on every rank."""
        local = F.linear(self.norm(hidden), self.lm_head).float()
        if self.tp_size == 1:
            return local
        return self.group.all_gather(local.contiguous(), dim=-1)[..., : self.full_config.vocab_size]

    # ------------------------------------------------------------------ weights
    def load_hf_state_dict(self, tensors: dict[str, Tensor], strict: bool = True) -> None:
        """Copy this rank's shard of FULL-size Hugging Face-named tensors into the model (the names
        of :meth:`CausalLM.hf_tensor_slots`, whose views here are the shard's)."""
        slots = self.hf_tensor_slots()
        missing = [n for n in slots if n not in tensors]
        if strict and missing:
            raise ShapeError(f"missing tensors: {missing[:5]}{' ...' if len(missing) > 5 else ''}")
        with torch.no_grad():
            for name, dst in slots.items():
                t = tensors.get(name)
                if t is None:
                    continue
                part = shard_hf_tensor(
                    name, t, self.tp_size, self.tp_rank, self.full_config.num_key_value_heads
                )
                if tuple(part.shape) != tuple(dst.shape):
                    raise ShapeError(
                        f"tensor {name} has shape {tuple(t.shape)}: its shard {tuple(part.shape)} does not "
                        f"fit rank {self.tp_rank}'s {tuple(dst.shape)} (tp={self.tp_size})"
                    )
                dst.copy_(part)

    @classmethod
    def from_full(cls, model: CausalLM, group=None, device: str | torch.device | None = None) -> TPCausalLM:
        """This rank's shard of ``model`` (a full :class:`CausalLM`, e.g. from the loaders), on
        ``device`` (default: the group's). RoPE frequencies (GGUF ``rope_freqs`` too) are copied."""
        out = cls(model.config, dtype=model.dtype, device=device, group=group)
        out.load_hf_state_dict(model.hf_tensor_slots())
        out.inv_freq = model.inv_freq.to(out.device)
        return out

    @classmethod
    def random(
        cls,
        cfg: ModelConfig,
        seed: int = 0,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device | None = None,
        std: float = 0.02,
        group=None,
    ) -> TPCausalLM:
        """This rank's shard of ``CausalLM.random(cfg, seed, dtype, std=std)``: the same draws, one
        full tensor at a time on the CPU (never the whole model), each cut to this rank's shard.

        NOTE: every rank draws every tensor (the generator's sequence runs over all of them), so
        the time is that of the whole model's draws; memory is the largest tensor's."""
        model = cls(cfg, dtype=dtype, device=device, group=group)
        shapes = {n: t.shape for n, t in CausalLM(cfg, dtype=dtype, device="meta").hf_tensor_slots().items()}
        slots = model.hf_tensor_slots()
        gen = torch.Generator().manual_seed(seed)
        hkv = cfg.num_key_value_heads
        with torch.no_grad():
            for name in sorted(shapes):  # CausalLM.random's order
                if name.endswith("norm.weight"):
                    vals = 1.0 + 0.1 * torch.randn(shapes[name], generator=gen)
                else:
                    vals = std * torch.randn(shapes[name], generator=gen)
                slots[name].copy_(shard_hf_tensor(name, vals, model.tp_size, model.tp_rank, hkv))
        return model

    @classmethod
    def random_shards(
        cls,
        cfg: ModelConfig,
        seed: int = 0,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device | None = None,
        std: float = 0.02,
        group=None,
    ) -> TPCausalLM:
        """Random weights of ``cfg``'s shape drawn by each rank for its own shards, on its device:
        matrices ~ N(0, std), norm weights 1 (``models.random_weights.random_model``, sharded).

        For benchmarks of large shapes: seconds for Qwen3-235B-A22B over 8 GPUs, where
        :meth:`random` draws every full tensor on the CPU on every rank (hours). The sharded
        tensors come from a generator of this rank's own; the replicated ones (norms, the MoE
        router) from one seeded alike on every rank, so that they agree, and a replicated KV head's
        key and value rows from one seeded by the head, alike on its replicas. The model is NOT
        ``CausalLM.random``'s, nor the same at another ``tp``: use :meth:`random` or
        :meth:`from_full` where tokens are compared."""
        model = cls(cfg, dtype=dtype, device=device, group=group)
        dev = model.device
        shared = torch.Generator(device=dev).manual_seed(seed)
        own = torch.Generator(device=dev).manual_seed(seed + 7919 * (model.tp_rank + 1))
        rep = model.kv_replicas
        head = torch.Generator(device=dev).manual_seed(seed + 104729 * (model.tp_rank // rep + 1))
        with torch.no_grad():
            for name, t in sorted(model.hf_tensor_slots().items()):
                if name.endswith("norm.weight"):
                    t.fill_(1.0)
                elif rep > 1 and name.endswith(_KV_ROWS):
                    t.normal_(0.0, std, generator=head)
                else:
                    t.normal_(0.0, std, generator=shared if is_replicated(name) else own)
        return model

    def extra_repr(self) -> str:
        rep = f"kv_replicas={self.kv_replicas}, " if self.kv_replicas > 1 else ""
        return (
            f"tp_rank={self.tp_rank}/{self.tp_size}, {rep}vocab=[{self.vocab_start}, {self.vocab_end}), "
            + (super().extra_repr())
        )
