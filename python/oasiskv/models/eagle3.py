"""EAGLE-3 draft head in the public checkpoint format (EAGLE-3 reference / SpecForge).

Checkpoint layout (a directory)
-------------------------------
``config.json``: a Llama config of the one draft layer (``hidden_size``, ``intermediate_size``,
``num_attention_heads``, ``num_key_value_heads``, ``rms_norm_eps``, ``rope_theta``/``rope_scaling``,
``vocab_size`` = the target vocabulary, ``num_hidden_layers`` = 1) plus ``draft_vocab_size`` and
optionally ``target_hidden_size``. Weights in ``model.safetensors`` (or ``pytorch_model.bin``)::

    fc.weight                                  [H, 3*Ht]   fuses the three target hidden states
    midlayer.input_layernorm.weight            [H]         norm of the token embedding
    midlayer.hidden_norm.weight                [H]         norm of the fused feature
    midlayer.self_attn.{q,k,v}_proj.weight     [*, 2H]     input = [input_layernorm(emb); hidden_norm(fc_out)]
    midlayer.self_attn.o_proj.weight           [H, Hq*D]
    midlayer.post_attention_layernorm.weight   [H]
    midlayer.mlp.{gate,up}_proj.weight         [I, H];  midlayer.mlp.down_proj.weight [H, I]
    norm.weight                                [H]
    lm_head.weight                             [draft_vocab, H]
    d2t                                        [draft_vocab] int64: target_id = draft_id + d2t[draft_id]
    t2d                                        [vocab] bool: target token present in the draft vocab
    embed_tokens.weight                        [vocab, H]  OPTIONAL; otherwise the target's embedding

Capture convention
------------------
The three target features are the residual stream ENTERING target layers
``(2, L // 2, L - 3)`` (= the outputs of layers 1, L//2 - 1, L - 4), concatenated in that order into
``[3 * Ht]`` -- for SmolLM2's 30 layers: 2, 15, 27. This is what the EAGLE-3 reference records
(``hidden_states`` before running layers 2, L//2 and L-3) and what SpecForge's
``aux_hidden_state_layers = (1, L//2 - 1, L - 4)`` means. Use ``CausalLM.forward(...,
capture_layers=Eagle3Head.capture_layers(L))`` and :meth:`Eagle3Head.gather_features`.

Input convention
----------------
Row t of a draft call pairs the target feature of position ``p - 1`` with the token AT position ``p``
(RoPE position ``p``) and predicts the token at ``p + 1``: EAGLE's "feature of the previous position +
embedding of the current token". :meth:`Eagle3Head.step` may also be given the draft's own output
hidden state ``[n, H]`` instead of a target feature (multi-step drafting); ``fc`` is then skipped.
Training (:mod:`oasiskv.train.eagle3`) feeds a sequence of T tokens as the rows ``p = 1 .. T - 1``
(there is no row for position 0); :class:`oasiskv.drafters.Eagle3Drafter` feeds a prompt of P tokens
the same way (rows ``1 .. P - 1`` at admission, :meth:`Eagle3Head.extend`) before its first draft.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from oasiskv.errors import CheckpointError, ConfigError, ShapeError
from oasiskv.models.config import ModelConfig
from oasiskv.models.transformer import (
    RMSNorm,
    apply_rope,
    causal_attention,
    rope_attention_factor,
    rope_cos_sin,
    rope_inv_freq,
)


def eagle3_capture_layers(num_layers: int) -> tuple[int, int, int]:
    """Target layers whose ENTERING residual stream EAGLE-3 uses: (2, L // 2, L - 3)."""
    layers = (2, num_layers // 2, num_layers - 3)
    if not layers[0] < layers[1] < layers[2]:
        raise ConfigError(
            "EAGLE-3 needs three distinct capture layers (2, "
            f"L//2, L-3) but a {num_layers}-layer target gives "
            f"{layers}; use a target with at least 7 layers"
        )
    return layers


class Eagle3State:
    """Per-request KV cache of the head's single decoder layer (grows as tokens are stepped).

    ``Eagle3State()`` needs no arguments: storage is allocated on the first :meth:`Eagle3Head.step`
    with that call's dtype and device. ``Eagle3State(paged=pool)`` keeps its rows in the pages
    of an :class:`Eagle3PagedKV` shared by many requests instead, so that a batched step attends
    over all of them in one kernel call (:meth:`Eagle3Head.step_batch`); :meth:`release` gives
    its pages back.
    """

    def __init__(self, capacity: int = 256, *, paged: Eagle3PagedKV | None = None) -> None:
        self.k: Tensor | None = None  # [capacity, Hkv, D]
        self.v: Tensor | None = None
        self.length = 0
        self._initial_capacity = max(1, int(capacity))
        self.paged = paged
        #: The pool pages holding rows ``i * block_size ..`` (paged states only).
        self.pages: list[int] = []

    def append(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Store n new rows; return ALL cached K and V ([length, Hkv, D]): views, or for a paged
        state a copy gathered from its pages."""
        if self.paged is not None:
            self.paged.write(self, k, v)
            return self.paged.gather(self)
        n = k.shape[0]
        need = self.length + n
        if (
            self.k is None
            or self.k.shape[1:] != k.shape[1:]
            or self.k.dtype != k.dtype
            or self.k.device != k.device
        ):
            if self.k is not None and self.length:
                raise ShapeError(
                    "Eagle3State was filled by a head with another geometry/dtype/device; use one state per "
                    "(request, head)"
                )
            cap = max(self._initial_capacity, need)
            self.k = k.new_empty((cap, *k.shape[1:]))
            self.v = v.new_empty((cap, *v.shape[1:]))
        elif need > self.k.shape[0]:
            cap = max(need, 2 * self.k.shape[0])
            nk, nv = self.k.new_empty((cap, *k.shape[1:])), self.v.new_empty((cap, *v.shape[1:]))  # type: ignore[union-attr]
            nk[: self.length] = self.k[: self.length]
            nv[: self.length] = self.v[: self.length]  # type: ignore[index]
            self.k, self.v = nk, nv
        assert self.v is not None
        self.k[self.length : need] = k
        self.v[self.length : need] = v
        self.length = need
        return self.k[:need], self.v[:need]

    def truncate(self, length: int) -> None:
        """Forget everything after the first ``length`` cached positions (e.g. after a rejected draft)."""
        if not 0 <= length <= self.length:
            raise ShapeError(f"cannot truncate an Eagle3State of length {self.length} to {length}")
        self.length = length

    def reset(self) -> None:
        self.length = 0

    def release(self) -> None:
        """Empty the state; a paged one gives its pages back to the pool."""
        if self.paged is not None:
            self.paged.free(self.pages)
            self.pages = []
        self.k = self.v = None
        self.length = 0

    def __repr__(self) -> str:
        return f"Eagle3State(length={self.length}{', paged' if self.paged is not None else ''})"


#: Rows per page of :class:`Eagle3PagedKV` (the engine's block size for the paper's models).
HEAD_PAGE_ROWS = 16


class Eagle3PagedKV:
    """The head KV of many requests in one paged pool, ``[num_pages, Hkv, block_size, D]`` for K
    and for V, the engine's page layout.

    Why: a batched head step (:meth:`Eagle3Head.step_batch`) over contiguous per-request caches
    attends with one SDPA call per request (16 calls and 32 slices a step at 16 requests; on the
    H200 the head of a Qwen3-8B-shaped target cost 5.4 ms per step, docs/PERF.md). Over pages it
    is one :func:`oasiskv.ops.decode_attention` call, the engine's split-KV decode kernel (its CPU
    twin on the CPU), with the step's page tables built on the host and copied once.

    Pages are taken as states grow and given back by :meth:`Eagle3State.release`; the pool
    doubles when it runs out (a copy of the pool, as a contiguous cache's growth copies it), or
    grows once to what :meth:`reserve_pages` asks (``Eagle3Drafter.reserve``, from
    ``LLMEngine.reserve_pools``), so that a batch's admission takes its pages without a doubling.
    """

    def __init__(
        self,
        num_qo_heads: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        dtype: torch.dtype,
        device: str | torch.device,
        block_size: int = HEAD_PAGE_ROWS,
        num_pages: int = 64,
    ) -> None:
        from oasiskv import ops  # local: the native module loads with the first pool

        self.geo = ops.KvGeometry(num_qo_heads, num_kv_heads, head_dim, block_size)
        self.block_size = block_size
        shape = (max(1, int(num_pages)), num_kv_heads, block_size, head_dim)
        self.k_pages = torch.zeros(shape, dtype=dtype, device=device)
        self.v_pages = torch.zeros(shape, dtype=dtype, device=device)
        self._free = list(range(shape[0] - 1, -1, -1))  # popped from the end: low ids first

    @property
    def num_pages(self) -> int:
        return self.k_pages.shape[0]

    @property
    def pages_in_use(self) -> int:
        return self.num_pages - len(self._free)

    def free(self, pages: Sequence[int]) -> None:
        self._free.extend(reversed(pages))

    def reserve_pages(self, pages: int) -> None:
        """Grow the pool to at least ``pages`` pages now, in one allocation (a batch's admission
        then takes pages without a doubling, whose copy holds the old pool and the new at once)."""
        if pages > self.num_pages:
            self._grow(pages)

    def _grow(self, new: int) -> None:
        """The pool at ``new`` pages: a new pair of tensors, the pages in use copied over."""
        old, shape = self.num_pages, (new, *self.k_pages.shape[1:])
        k = self.k_pages
        self.k_pages = k.new_zeros(shape)
        self.k_pages[:old].copy_(k)
        del k  # the old K pool goes before the V pool grows
        v = self.v_pages
        self.v_pages = v.new_zeros(shape)
        self.v_pages[:old].copy_(v)
        del v
        self._free[:0] = range(new - 1, old - 1, -1)

    def _reserve(self, state: Eagle3State, length: int) -> None:
        """Give ``state`` pages for ``length`` rows."""
        need = -(-length // self.block_size) - len(state.pages)
        if need <= 0:
            return
        if need > len(self._free):
            old = self.num_pages
            self._grow(max(2 * old, old + need - len(self._free)))
        state.pages.extend(self._free.pop() for _ in range(need))

    def _check(self, k: Tensor, v: Tensor) -> None:
        g = self.geo
        if k.dim() != 3 or k.shape[1:] != (g.num_kv_heads, g.head_dim) or v.shape != k.shape:
            raise ShapeError(
                f"Eagle3PagedKV stores k, v [n, {g.num_kv_heads}, {g.head_dim}]; got {tuple(k.shape)}, "
                f"{tuple(v.shape)}"
            )

    def write(self, state: Eagle3State, k: Tensor, v: Tensor) -> None:
        """Append n rows of one state (positions ``state.length ..``)."""
        self._check(k, v)
        n, start = k.shape[0], state.length
        self._reserve(state, start + n)
        pos = torch.arange(start, start + n)
        pages = torch.tensor(state.pages, dtype=torch.long)[pos // self.block_size]
        idx = torch.stack((pages, pos % self.block_size)).to(self.k_pages.device, non_blocking=True)
        self.k_pages[idx[0], :, idx[1]] = k.to(self.k_pages.dtype)
        self.v_pages[idx[0], :, idx[1]] = v.to(self.v_pages.dtype)
        state.length = start + n

    def write_rows(self, states: Sequence[Eagle3State], k: Tensor, v: Tensor) -> None:
        """Append one row to each state: row i of k, v [B, Hkv, D] to ``states[i]``."""
        self._check(k, v)
        if k.shape[0] != len(states):
            raise ShapeError(f"write_rows got {k.shape[0]} rows for {len(states)} states")
        bs, pages, slots = self.block_size, [], []
        for st in states:
            self._reserve(st, st.length + 1)
            pages.append(st.pages[st.length // bs])
            slots.append(st.length % bs)
            st.length += 1
        idx = torch.tensor([pages, slots], dtype=torch.long).to(self.k_pages.device, non_blocking=True)
        self.k_pages[idx[0], :, idx[1]] = k.to(self.k_pages.dtype)
        self.v_pages[idx[0], :, idx[1]] = v.to(self.v_pages.dtype)

    def gather(self, state: Eagle3State) -> tuple[Tensor, Tensor]:
        """A state's K and V, contiguous copies ``[length, Hkv, D]`` (for a prompt chunk's causal
        attention)."""
        ids = torch.tensor(state.pages, dtype=torch.long, device=self.k_pages.device)
        n = state.length

        def flat(pool: Tensor) -> Tensor:
            x = pool.index_select(0, ids)  # [pages, Hkv, bs, D]
            return x.transpose(1, 2).reshape(-1, x.shape[1], x.shape[3])[:n]

        return flat(self.k_pages), flat(self.v_pages)

    def attend(self, states: Sequence[Eagle3State], q: Tensor, scale: float) -> Tensor:
        """Row i of q [B, Hq, D] over everything in ``states[i]`` (each state's rows 0 ..
        length - 1), in one decode-attention call; [B, Hq, D]."""
        from oasiskv import ops

        b, bs = len(states), self.block_size
        if any(st.length < 1 for st in states):
            raise ShapeError("Eagle3PagedKV.attend needs at least one cached row per state")
        counts = [-(-st.length // bs) for st in states]
        indptr = [0]
        for c in counts:
            indptr.append(indptr[-1] + c)
        indices = [p for st, c in zip(states, counts, strict=True) for p in st.pages[:c]]
        last = [st.length - (c - 1) * bs for st, c in zip(states, counts, strict=True)]
        # One host-to-device copy for the three tables.
        tables = torch.tensor(indptr + indices + last, dtype=torch.int32).to(q.device, non_blocking=True)
        kv_indptr, kv_indices, kv_last = tables.split([b + 1, len(indices), b])
        out = ops.decode_attention(
            self.geo,
            q.to(self.k_pages.dtype).reshape(b, 1, *q.shape[1:]).contiguous(),
            self.k_pages,
            self.v_pages,
            kv_indptr,
            kv_indices,
            kv_last,
            sm_scale=scale,
            max_pages_per_seq=max(counts),
        )
        return out.reshape(b, *q.shape[1:]).to(q.dtype)


class _Attention(nn.Module):
    def __init__(self, in_dim: int, hidden: int, heads: int, kv_heads: int, head_dim: int, **kw: Any) -> None:
        super().__init__()
        self.q_proj = nn.Linear(in_dim, heads * head_dim, bias=False, **kw)
        self.k_proj = nn.Linear(in_dim, kv_heads * head_dim, bias=False, **kw)
        self.v_proj = nn.Linear(in_dim, kv_heads * head_dim, bias=False, **kw)
        self.o_proj = nn.Linear(heads * head_dim, hidden, bias=False, **kw)


class _MLP(nn.Module):
    def __init__(self, hidden: int, inter: int, **kw: Any) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False, **kw)
        self.up_proj = nn.Linear(hidden, inter, bias=False, **kw)
        self.down_proj = nn.Linear(inter, hidden, bias=False, **kw)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class _MidLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, **kw: Any) -> None:
        super().__init__()
        h = cfg.hidden_size
        self.input_layernorm = RMSNorm(h, cfg.rms_norm_eps, **kw)
        self.hidden_norm = RMSNorm(h, cfg.rms_norm_eps, **kw)
        self.self_attn = _Attention(
            2 * h,
            h,
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim,
            **kw,  # type: ignore[arg-type]
        )
        self.post_attention_layernorm = RMSNorm(h, cfg.rms_norm_eps, **kw)
        self.mlp = _MLP(h, cfg.intermediate_size, **kw)


class Eagle3Head(nn.Module):
    """One-layer EAGLE-3 draft model. See the module docstring for format and conventions."""

    def __init__(
        self,
        cfg: ModelConfig,
        draft_vocab_size: int,
        target_hidden_size: int | None = None,
        has_embedding: bool = False,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
    ) -> None:
        super().__init__()
        if cfg.num_hidden_layers != 1:
            raise ConfigError(
                f"an EAGLE-3 head has exactly one decoder layer, config says {cfg.num_hidden_layers}"
            )
        if not 0 < draft_vocab_size <= cfg.vocab_size:
            raise ConfigError(
                f"draft_vocab_size must be in [1, vocab_size={cfg.vocab_size}], got {draft_vocab_size}"
            )
        self.config = cfg
        self.draft_vocab_size = int(draft_vocab_size)
        self.target_hidden_size = int(target_hidden_size or cfg.hidden_size)
        kw = {"dtype": dtype, "device": device}
        h = cfg.hidden_size
        self.fc = nn.Linear(3 * self.target_hidden_size, h, bias=False, **kw)
        self.midlayer = _MidLayer(cfg, **kw)
        self.norm = RMSNorm(h, cfg.rms_norm_eps, **kw)
        self.lm_head = nn.Linear(h, self.draft_vocab_size, bias=False, **kw)
        self.register_buffer("d2t", torch.zeros(self.draft_vocab_size, dtype=torch.long, device=device))
        self.register_buffer("t2d", torch.zeros(cfg.vocab_size, dtype=torch.bool, device=device))
        self.register_buffer("inv_freq", rope_inv_freq(cfg).to(device), persistent=False)
        self.rope_attention_factor = rope_attention_factor(cfg)  # YaRN's cos/sin scale, else 1.0
        self.embed_tokens: nn.Embedding | None = (
            nn.Embedding(cfg.vocab_size, h, **kw) if has_embedding else None  # type: ignore[arg-type]
        )
        self._target_embed: Tensor | None = None

    # ------------------------------------------------------------------ conventions
    @staticmethod
    def capture_layers(num_layers: int) -> tuple[int, int, int]:
        """(2, L // 2, L - 3): target layers whose ENTERING residual stream forms the feature."""
        return eagle3_capture_layers(num_layers)

    @staticmethod
    def gather_features(captured: Mapping[int, Tensor], num_layers: int) -> Tensor:
        """Concatenate ``CausalLM.forward``'s captured states into the [n, 3 * Ht] feature rows."""
        try:
            return torch.cat([captured[i] for i in eagle3_capture_layers(num_layers)], dim=-1)
        except KeyError as e:
            raise ShapeError(
                f"captured states lack layer {e.args[0]}; run the target with "
                f"capture_layers=Eagle3Head.capture_layers({num_layers})"
            ) from None

    @property
    def hidden_size(self) -> int:
        return self.config.hidden_size

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    def attach_target(self, target: nn.Module | Tensor) -> Eagle3Head:
        """Use the target model's token embedding (a ``CausalLM`` or an embedding matrix [vocab, H])."""
        w = target if isinstance(target, Tensor) else target.embed_tokens.weight  # type: ignore[union-attr]
        if tuple(w.shape) != (self.vocab_size, self.hidden_size):
            raise ShapeError(
                f"target embedding has shape {tuple(w.shape)}, the "
                f"head needs [{self.vocab_size}, {self.hidden_size}]"
            )
        # a plain attribute, not a registered Parameter: the head must not own (or train, or save) it
        object.__setattr__(self, "_target_embed", w)
        return self

    def embed(self, token_ids: Tensor) -> Tensor:
        if self.embed_tokens is not None:
            w = self.embed_tokens.weight
        elif self._target_embed is not None:
            w = self._target_embed
        else:
            raise ConfigError(
                "this EAGLE-3 head has no embed_tokens.weight; call head.attach_target(target_model) first"
            )
        return F.embedding(token_ids.to(w.device), w).to(
            device=self.fc.weight.device, dtype=self.fc.weight.dtype
        )

    # ------------------------------------------------------------------ compute
    def _layer(
        self, features: Tensor, token_ids: Tensor, positions: Tensor, state: Eagle3State | None
    ) -> Tensor:
        h, q, k, v = self._qkv(features, token_ids, positions)
        scale = self.config.head_dim**-0.5
        if state is not None and state.paged is not None and token_ids.shape[0] == 1:
            state.paged.write_rows([state], k, v)  # one row: attend over the pages, no gather
            return self._out(h, state.paged.attend([state], q, scale))
        if state is not None:
            k, v = state.append(k, v)
        o = causal_attention(q, k, v, scale)
        return self._out(h, o)

    def _qkv(self, features: Tensor, token_ids: Tensor, positions: Tensor) -> tuple[Tensor, ...]:
        """The layer up to attention: (residual h [n, H], q [n, Hq, D], k, v [n, Hkv, D]), RoPE'd."""
        n = token_ids.shape[0]
        if (
            token_ids.dim() != 1
            or positions.shape != token_ids.shape
            or features.dim() != 2
            or features.shape[0] != n
        ):
            raise ShapeError(
                f"expected features [n, 3*{self.target_hidden_size}] "
                f"(or [n, {self.hidden_size}]), token_ids [n] and "
                f"positions [n]; got {tuple(features.shape)}, "
                f"{tuple(token_ids.shape)}, {tuple(positions.shape)}"
            )
        dt = self.fc.weight.dtype
        features = features.to(device=self.fc.weight.device, dtype=dt)
        if features.shape[-1] == 3 * self.target_hidden_size:
            h = self.fc(features)
        elif features.shape[-1] == self.hidden_size:
            h = features  # the draft's own previous hidden state
        else:
            raise ShapeError(
                f"features have width {features.shape[-1]}; expected 3*{self.target_hidden_size} (target) or "
                f"{self.hidden_size} (draft hidden)"
            )
        ml = self.midlayer
        cfg = self.config
        x = torch.cat([ml.input_layernorm(self.embed(token_ids)), ml.hidden_norm(h)], dim=-1)
        at = ml.self_attn
        d = cfg.head_dim
        q = at.q_proj(x).view(n, cfg.num_attention_heads, d)  # type: ignore[arg-type]
        k = at.k_proj(x).view(n, cfg.num_key_value_heads, d)  # type: ignore[arg-type]
        v = at.v_proj(x).view(n, cfg.num_key_value_heads, d)  # type: ignore[arg-type]
        pos = positions.to(self.inv_freq.device)
        cos, sin = rope_cos_sin(self.inv_freq, pos, dt, self.rope_attention_factor)
        return h, apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def _out(self, h: Tensor, o: Tensor) -> Tensor:
        """The layer after attention: o_proj of the attention output o [n, Hq, D], residual, MLP."""
        ml = self.midlayer
        h = h + ml.self_attn.o_proj(o.reshape(o.shape[0], -1))
        return h + ml.mlp(ml.post_attention_layernorm(h))

    def draft_logits(self, hidden: Tensor) -> Tensor:
        """Draft-vocabulary logits (float32) of the head's output hidden states."""
        return self.lm_head(self.norm(hidden)).float()

    def to_target_ids(self, draft_ids: Tensor) -> Tensor:
        """Map draft-vocabulary ids to target-vocabulary ids: ``d + d2t[d]``."""
        return draft_ids + self.d2t[draft_ids]

    @torch.no_grad()
    def extend(self, state: Eagle3State, features: Tensor, token_ids: Tensor, positions: Tensor) -> Tensor:
        """Run the decoder layer over n consecutive positions of ONE request, extending its state's
        KV cache, without the draft logits (e.g. over the prompt at admission).

        Same inputs as :meth:`step`; returns the draft hidden states [n, H].
        """
        return self._layer(features, token_ids, positions, state)

    @torch.no_grad()
    def step(
        self, state: Eagle3State, features: Tensor, token_ids: Tensor, positions: Tensor
    ) -> tuple[Tensor, Tensor]:
        """Draft for n consecutive positions of ONE request, extending its state's KV cache.

        features [n, 3*Ht]: the target's captured states of positions p-1 (or the draft's own hidden
        [n, H]); token_ids [n]: the tokens at positions p; positions [n]: p. Row t attends causally to
        everything already in ``state`` and to rows <= t. Returns (draft token ids [n] in the TARGET
        vocabulary -- the greedy guess for position p+1 --, draft hidden [n, H]).
        """
        h = self.extend(state, features, token_ids, positions)
        draft = self.draft_logits(h).argmax(dim=-1)
        return self.to_target_ids(draft), h

    @torch.no_grad()
    def step_batch(
        self, states: Sequence[Eagle3State], features: Tensor, token_ids: Tensor, positions: Tensor
    ) -> tuple[Tensor, Tensor, Tensor]:
        """Draft ONE position for each of B requests in one pass over the head's weights.

        Row i is request i's :meth:`step` of one row: features [B, 3*Ht] (or [B, H]), token_ids
        [B], positions [B]; row i's K/V are appended to ``states[i]`` exactly as :meth:`step`
        appends them, and row i attends to everything in ``states[i]`` (its own head KV, of its
        own length). The projections, MLP and LM head run batched (the head's weights are read
        once, not B times). The attention is one decode-attention call when the states share an
        :class:`Eagle3PagedKV` (what :class:`~oasiskv.drafters.Eagle3Drafter` makes on a GPU),
        else one SDPA call per request over its own cache, in place. Returns
        (draft token ids [B] in the TARGET vocabulary, draft hidden [B, H], draft logits [B,
        draft_vocab] float32).

        Not one SDPA call over the caches padded to the longest: the padded copy read and wrote
        every cache once more per step, 1 GiB per step at 16 requests x 16K positions of a
        Qwen3-8B-shaped head (H200: the head cost 3.7 ms per step, docs/PERF.md), against 16
        launches of a few microseconds.
        """
        b = len(states)
        if token_ids.dim() != 1 or token_ids.shape[0] != b:
            raise ShapeError(
                f"step_batch takes one row per state: {b} states but token_ids {tuple(token_ids.shape)}"
            )
        if len(set(map(id, states))) != b:
            raise ShapeError("step_batch got the same Eagle3State twice; pass one state per request")
        h, q, k, v = self._qkv(features, token_ids, positions)
        scale = self.config.head_dim**-0.5
        paged = states[0].paged
        if paged is not None and all(st.paged is paged for st in states):
            paged.write_rows(states, k, v)
            o = paged.attend(states, q, scale)
        elif b == 1:
            kk, vv = states[0].append(k, v)
            o = causal_attention(q, kk, vv, scale)
        else:
            outs = []
            for i, st in enumerate(states):
                kk, vv = st.append(k[i : i + 1], v[i : i + 1])
                outs.append(causal_attention(q[i : i + 1], kk, vv, scale))
            o = torch.cat(outs)
        hidden = self._out(h, o)
        logits = self.draft_logits(hidden)
        return self.to_target_ids(logits.argmax(dim=-1)), hidden, logits

    def forward_train(self, features: Tensor, tokens: Tensor, positions: Tensor | None = None) -> Tensor:
        """Teacher-forced draft logits [T, draft_vocab] (float32) over one sequence, causal.

        Row t pairs ``features[t]`` with ``tokens[t]`` exactly like :meth:`step` (the caller aligns
        feature of p-1 with token p). ``positions`` defaults to 0..T-1.
        """
        if positions is None:
            positions = torch.arange(tokens.shape[0], device=tokens.device)
        return self.draft_logits(self._layer(features, tokens, positions, None))

    def forward(self, features: Tensor, tokens: Tensor, positions: Tensor | None = None) -> Tensor:
        return self.forward_train(features, tokens, positions)

    # ------------------------------------------------------------------ construction / IO
    @staticmethod
    def _draft_config(target_cfg: ModelConfig) -> ModelConfig:
        return target_cfg.replace(num_hidden_layers=1)

    @classmethod
    def random(
        cls,
        target_cfg: ModelConfig,
        draft_vocab_size: int,
        seed: int = 0,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        with_embedding: bool = False,
        std: float = 0.02,
    ) -> Eagle3Head:
        """A deterministic random head for ``target_cfg`` (same geometry as one target layer).

        The draft vocabulary is a seeded random sorted subset of the target vocabulary (d2t/t2d set
        accordingly). Without ``with_embedding`` call :meth:`attach_target` before drafting.
        """
        head = cls(
            cls._draft_config(target_cfg),
            draft_vocab_size,
            has_embedding=with_embedding,
            dtype=dtype,
            device=device,
        )
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in sorted(head.named_parameters()):
                vals = (
                    1.0 + 0.1 * torch.randn(p.shape, generator=gen)
                    if name.endswith("norm.weight")
                    else (std * torch.randn(p.shape, generator=gen))
                )
                p.copy_(vals)
            V = target_cfg.vocab_size
            sel = torch.randperm(V, generator=gen)[:draft_vocab_size].sort().values
            head.d2t.copy_(sel - torch.arange(draft_vocab_size))
            head.t2d.zero_()
            head.t2d[sel] = True
        return head

    def hf_config(self) -> dict[str, Any]:
        d = self.config.to_hf_dict()
        d.update(
            architectures=["LlamaForCausalLMEagle3"],
            num_hidden_layers=1,
            draft_vocab_size=self.draft_vocab_size,
            target_hidden_size=self.target_hidden_size,
            # The head's lm_head is over the draft vocabulary: never tied to the token embedding
            # (the target's config may say otherwise; loaders that honour it would fail).
            tie_word_embeddings=False,
        )
        return d

    def save(self, path: str | Path) -> None:
        """Write ``config.json`` + ``model.safetensors`` in the EAGLE-3 / SpecForge layout."""
        from safetensors.torch import save_file

        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        (path / "config.json").write_text(json.dumps(self.hf_config(), indent=2) + "\n", encoding="utf-8")
        sd = {k: v.detach().contiguous().cpu() for k, v in self.state_dict().items()}
        save_file(sd, str(path / "model.safetensors"), metadata={"format": "pt"})

    @classmethod
    def load(
        cls,
        path: str | Path,
        target_cfg: ModelConfig,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
    ) -> Eagle3Head:
        """Load an EAGLE-3 checkpoint directory for a target described by ``target_cfg``."""
        path = Path(path)
        if not path.is_dir():
            raise CheckpointError(
                f"EAGLE-3 head directory {path} does not exist; pass the directory holding config.json"
            )
        cfg_file = path / "config.json"
        if not cfg_file.is_file():
            raise CheckpointError(f"{cfg_file} not found; an EAGLE-3 head directory needs config.json")
        try:
            raw = json.loads(cfg_file.read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            raise CheckpointError(f"{cfg_file} is not valid JSON ({e})") from e
        raw = dict(raw)
        raw.setdefault("model_type", "llama")
        raw.setdefault("vocab_size", target_cfg.vocab_size)
        raw["num_hidden_layers"] = 1
        raw.setdefault("intermediate_size", target_cfg.intermediate_size)
        cfg = ModelConfig.from_hf_dict(raw).replace(family="llama", eos_token_ids=[], bos_token_id=None)
        dvs = int(raw.get("draft_vocab_size") or cfg.vocab_size)
        ths = int(raw.get("target_hidden_size") or cfg.hidden_size)
        if cfg.vocab_size != target_cfg.vocab_size:
            raise CheckpointError(
                f"the EAGLE-3 head in {path} was trained for a "
                f"vocabulary of {cfg.vocab_size} tokens, the target has "
                f"{target_cfg.vocab_size}; use the head trained for this target model"
            )
        if ths != target_cfg.hidden_size:
            raise CheckpointError(
                f"the EAGLE-3 head in {path} expects target hidden size "
                f"{ths}, the target has {target_cfg.hidden_size}; "
                "use the head trained for this target model"
            )
        tensors = _read_weights(path)
        head = cls(
            cfg,
            dvs,
            target_hidden_size=ths,
            has_embedding="embed_tokens.weight" in tensors,
            dtype=dtype,
            device=device,
        )
        expected = head.state_dict()
        optional = {"d2t", "t2d"} if dvs == cfg.vocab_size else set()
        missing = [k for k in expected if k not in tensors and k not in optional]
        if missing:
            shapes = ", ".join(f"{k} {tuple(expected[k].shape)}" for k in missing[:4])
            raise CheckpointError(
                f"EAGLE-3 checkpoint {path} lacks tensor(s) {shapes}; the checkpoint is incomplete"
            )
        with torch.no_grad():
            for k, dst in expected.items():
                if k not in tensors:
                    continue
                src = tensors[k]
                if tuple(src.shape) != tuple(dst.shape):
                    raise CheckpointError(
                        f"EAGLE-3 tensor {k} in {path} has shape "
                        f"{tuple(src.shape)}, expected {tuple(dst.shape)} "
                        "from its config.json and the target config"
                    )
                dst.copy_(src.to(dst.dtype))
                if dst.is_floating_point():
                    # NaN/inf weights make NaN drafts without a word: refuse them, as the target
                    # model's loader does.
                    from oasiskv.models.loader import _check_finite

                    _check_finite(f"{k} (EAGLE-3 head)", dst, src, str(path))
            if "t2d" not in tensors:
                head.t2d.fill_(True)
        return head


def _read_weights(path: Path) -> dict[str, Tensor]:
    st, pt = path / "model.safetensors", path / "pytorch_model.bin"
    if st.is_file():
        from safetensors.torch import load_file

        try:
            tensors = load_file(str(st))
        except Exception as e:
            raise CheckpointError(f"{st} is truncated or corrupt ({e}); re-download or re-save it") from e
    elif pt.is_file():
        try:
            tensors = torch.load(pt, map_location="cpu", weights_only=True)
        except Exception as e:
            raise CheckpointError(f"{pt} is truncated or corrupt ({e}); re-download or re-save it") from e
    else:
        raise CheckpointError(f"no weights in {path}: expected model.safetensors or pytorch_model.bin")
    out = {}
    for k, v in tensors.items():
        out[k[len("model.") :] if k.startswith("model.") and k[len("model.") :] not in tensors else k] = v
    return out


def head_from_target(target: nn.Module, draft_vocab_size: int, seed: int = 0) -> Eagle3Head:
    """A random head attached to ``target`` (a ``CausalLM``), same dtype/device as its weights."""
    w = target.embed_tokens.weight  # type: ignore[union-attr]
    return Eagle3Head.random(
        target.config, draft_vocab_size, seed=seed, dtype=w.dtype, device=w.device
    ).attach_target(
        target  # type: ignore[arg-type]
    )


__all__: Sequence[str] = ["Eagle3Head", "Eagle3State", "eagle3_capture_layers", "head_from_target"]
