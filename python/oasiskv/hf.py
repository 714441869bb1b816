"""Hugging Face ``transformers`` integration: ``model.generate(...)`` decoding with OasisKV.

This module owns the seam between a model that ``transformers`` loaded (a ``LlamaForCausalLM`` or
``Qwen3ForCausalLM``, its own modules and weights) and OasisKV's :class:`~oasiskv.engine.Engine`:

* :class:`OasisKVCache`, a ``transformers.Cache`` whose state is an OasisKV engine (the host pool
  with the full KV, a working set of ``KvConfig.top_k_blocks`` blocks per KV head plus the local
  block, the lookahead selection and the fetch cap) holding one engine request per batch row;
* the attention function ``"oasiskv"``, registered through transformers' ``AttentionInterface``:
  inside an OasisKV forward it hands each layer's post-RoPE ``q, k, v`` to the engine's attention
  callback (dense causal attention at prefill; append, attention over the working set and the
  lookahead selection at decode), so the arithmetic is the engine's own;
* :func:`enable`, which wraps the model's ``forward`` (a forward given an :class:`OasisKVCache`
  runs the engine's prefill or decode step instead of transformers' cache code; any other forward
  runs unchanged) and ``generate`` (checks that the generation mode is supported and gives every
  call a fresh :class:`OasisKVCache` unless one is passed).

The lookahead row: an engine decode step runs ``[x_t ; d_{t+1}]`` through the model, the draft
token ``d_{t+1}`` (the n-gram drafter's by default) at position ``p + 1``. Its query selects the
next step's blocks; its K/V is never stored and its logits are dropped, so ``generate`` sees row
0's logits only, exactly what a plain step would give.

Supported: greedy search and multinomial sampling (``do_sample=True`` with temperature, top-k,
top-p and every other logits processor), batch size 1 and larger (left padding; each row is its
own engine request), ``num_return_sequences > 1`` with sampling, stopping criteria, streamers and
``return_dict_in_generate`` (scores and logits). Refused with :class:`UnsupportedGenerateModeError`:
beam search (every variant), assisted generation and prompt lookup, contrastive search, DoLa,
``cache_implementation`` (static, offloaded, quantized), ``use_cache=False``, ``inputs_embeds``,
chunked prefill (``prefill_chunk_size``), ``output_attentions`` / ``output_hidden_states`` and
reusing a cache across calls. docs/HF.md is the reference page.
"""

from __future__ import annotations

import contextvars
import copy
import functools
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from .config import KvConfig
from .drafters import Drafter, make_drafter
from .engine import Engine, Request, RequestMetrics
from .errors import ConfigError, ContextLengthError

try:
    import transformers
    from transformers import AttentionInterface, Cache, GenerationConfig
    from transformers.generation.configuration_utils import GenerationMode
    from transformers.modeling_outputs import CausalLMOutputWithPast
except ImportError as e:  # pragma: no cover - transformers is a dependency of the test extras
    raise ImportError(
        "oasiskv.hf needs the `transformers` package (pip install 'transformers>=5'); "
        f"importing it failed: {e}"
    ) from e
if int(transformers.__version__.split(".")[0]) < 5:  # pragma: no cover - the lock pins 5.x
    raise ImportError(
        f"oasiskv.hf needs transformers>=5 (its Cache and generate API), found {transformers.__version__}; "
        "pip install -U 'transformers>=5'"
    )

# The name of the cache argument and output field: ``cache`` since transformers 5.2x, formerly
# ``past_key_values`` (still accepted, deprecated).
_CACHE_KW = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"

#: The name of OasisKV's attention in transformers' ``AttentionInterface``.
ATTN_IMPLEMENTATION = "oasiskv"
#: ``config.model_type`` values the integration is tested with (standard RoPE attention, no
#: sliding window, scaling ``head_dim ** -0.5``: the engine's attention).
SUPPORTED_MODEL_TYPES = ("llama", "qwen3")
#: The generation modes ``generate`` runs with an :class:`OasisKVCache`.
SUPPORTED_GENERATION_MODES = (GenerationMode.GREEDY_SEARCH, GenerationMode.SAMPLE)
#: Requests one cache holds at most (the engine's ``max_num_seqs``): the batch times
#: ``num_return_sequences``. Arbitrary.
MAX_BATCH = 256

# The engine's attention callback of the forward running now (None outside an OasisKV forward).
_ACTIVE: contextvars.ContextVar[Callable | None] = contextvars.ContextVar("oasiskv_hf_attn", default=None)


class UnsupportedGenerateModeError(ConfigError):
    """A ``generate`` call (or a cache operation) that OasisKV's transformers integration does not
    run: beam search, assisted generation, a static cache, ... The message names the mode and what
    to pass instead."""


# --------------------------------------------------------------------------- attention function
def oasiskv_attention(
    module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs
):
    """transformers' attention interface for ``attn_implementation="oasiskv"``: hand the layer's
    ``query [b, num_heads, t, head_dim]`` and ``key``/``value [b, num_kv_heads, t, head_dim]``
    (after RoPE) to the engine's attention callback as flat rows ``[b * t, heads, head_dim]``, and
    return its output as ``[b, t, num_heads, head_dim]`` (no attention weights). The mask is not
    read: the engine knows each row's context. Only runs inside a forward that
    :class:`OasisKVCache` drives."""
    fn = _ACTIVE.get()
    if fn is None:
        raise ConfigError(
            f"attn_implementation={ATTN_IMPLEMENTATION!r} runs only inside a forward driven by an "
            "OasisKVCache; call model.generate(...) or model(..., cache=OasisKVCache(model, kv=...)) on a "
            "model passed to oasiskv.hf.enable, and leave config._attn_implementation as it was"
        )
    b, hq, t, d = query.shape
    hk = key.shape[1]
    q = query.transpose(1, 2).reshape(b * t, hq, d)
    k = key.transpose(1, 2).reshape(b * t, hk, d)
    v = value.transpose(1, 2).reshape(b * t, hk, d)
    o = fn(module.layer_idx, q, k, v)
    return o.view(b, t, hq, d), None


AttentionInterface.register(ATTN_IMPLEMENTATION, oasiskv_attention)


# --------------------------------------------------------------------------- the engine's model
@dataclass(frozen=True)
class _EngineModelConfig:
    """What the engine reads of a model's config."""

    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    num_hidden_layers: int
    vocab_size: int
    max_position_embeddings: int


class _HFModel:
    """A transformers causal LM seen through the engine's model interface: ``forward(input_ids
    [n], positions [n], attn, logits_rows, capture_layers) -> (float32 logits, captured)``, every
    row one token of a flat batch. The decoder runs once over the ``n`` tokens as one sequence of
    batch 1 with explicit positions; attention goes to ``attn`` through :func:`oasiskv_attention`,
    which is what makes the flat batch correct (the engine attends each row over its own
    request's KV)."""

    #: oasiskv.engine.EngineModel: no score reduction; the K/V come in token order.
    score_reduce = None
    groups_kv = False

    def __init__(self, hf) -> None:
        self.hf = hf
        c = hf.config.get_text_config(decoder=True)
        self.config = _EngineModelConfig(
            num_attention_heads=c.num_attention_heads,
            num_key_value_heads=c.num_key_value_heads,
            head_dim=getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads,
            num_hidden_layers=c.num_hidden_layers,
            vocab_size=c.vocab_size,
            max_position_embeddings=c.max_position_embeddings,
        )
        self._decoder = hf.get_decoder()
        self._head = hf.get_output_embeddings()

    def parameters(self):
        return self.hf.parameters()

    def forward(self, input_ids, positions, attn, logits_rows=None, capture_layers=()):
        if capture_layers:
            raise ConfigError(
                "oasiskv.hf runs drafters that need no hidden states ('ngram', 'previous-query'); "
                f"this drafter captures layers {tuple(capture_layers)} (EAGLE-3), pass drafter='ngram'"
            )
        cfg = self.hf.config
        before = cfg._attn_implementation
        token = _ACTIVE.set(attn)
        cfg._attn_implementation = ATTN_IMPLEMENTATION
        try:
            out = self._decoder(input_ids=input_ids[None], position_ids=positions[None], use_cache=False)
        finally:
            cfg._attn_implementation = before
            _ACTIVE.reset(token)
        h = out.last_hidden_state[0]  # [n, hidden], after the final norm
        if logits_rows is not None:
            h = h[logits_rows]
        return self._head(h).float(), {}


def _check_model(model) -> None:
    """Raise :class:`ConfigError` unless ``model`` is a transformers causal LM whose attention the
    engine computes exactly (see :data:`SUPPORTED_MODEL_TYPES`)."""
    if not isinstance(model, transformers.PreTrainedModel) or not hasattr(model, "generate"):
        raise ConfigError(
            f"oasiskv.hf needs a transformers causal LM (AutoModelForCausalLM.from_pretrained(...)), "
            f"got {type(model).__name__}; for a path or a GGUF use oasiskv.LLM instead"
        )
    cfg = model.config.get_text_config(decoder=True)
    if cfg.model_type not in SUPPORTED_MODEL_TYPES:
        raise ConfigError(
            f"oasiskv.hf supports model types {SUPPORTED_MODEL_TYPES}, got {cfg.model_type!r} "
            f"({type(model).__name__}); use one of those architectures or oasiskv.LLM"
        )
    if getattr(cfg, "use_sliding_window", False) or "sliding_attention" in (
        getattr(cfg, "layer_types", None) or ()
    ):
        raise ConfigError(
            "this model uses sliding-window attention, which the OasisKV engine does not compute; "
            "set config.use_sliding_window=False (and layer_types to full attention) or use dense decoding"
        )
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    attn = model.get_decoder().layers[0].self_attn
    scaling = getattr(attn, "scaling", head_dim**-0.5)
    if not math.isclose(scaling, head_dim**-0.5, rel_tol=1e-6):
        raise ConfigError(
            f"the model scales attention by {scaling}, but the OasisKV engine uses head_dim ** -0.5 = "
            f"{head_dim**-0.5}; this architecture is not supported"
        )


# --------------------------------------------------------------------------- the cache
def _prompts(input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> list[list[int]]:
    """Each row's prompt tokens: those the 2-D ``attention_mask`` keeps (all without a mask)."""
    if attention_mask is None:
        return input_ids.tolist()
    if attention_mask.shape != input_ids.shape:
        raise ConfigError(
            f"attention_mask must be 2-D and shaped like input_ids {tuple(input_ids.shape)}, got "
            f"{tuple(attention_mask.shape)}"
        )
    keep = attention_mask.bool().tolist()
    return [
        [t for t, k in zip(ids, m, strict=True) if k] for ids, m in zip(input_ids.tolist(), keep, strict=True)
    ]


class OasisKVCache(Cache):
    """A ``transformers`` cache backed by an OasisKV :class:`~oasiskv.engine.Engine`.

    Pass it to ``generate`` (``model.generate(ids, cache=OasisKVCache(model, kv=...))``) or to the
    model's forward; constructing one calls :func:`enable` on ``model``. The first forward is the
    prefill: one engine request per batch row (its prompt is what ``attention_mask`` keeps),
    prefilled densely and turned sparse at once when it passes ``kv.sparse_threshold``; every
    later forward is one engine decode step with the lookahead row. The forward returns the logits
    of each row's last position only (``[batch, 1, vocab]``, float32), which is what ``generate``
    reads.

    A cache serves one generation: ``generate`` releases its requests when it returns (their
    :attr:`metrics` stay readable); a second generation with it raises
    :class:`UnsupportedGenerateModeError`. Beam reordering, cropping and batch reshuffling are
    refused the same way.

    Args:
        model: a transformers ``LlamaForCausalLM`` or ``Qwen3ForCausalLM`` (any device and dtype).
        kv: the cache configuration; ``None`` takes the one given to :func:`enable`, else
            ``KvConfig()``. Every field is honoured as :class:`oasiskv.LLM` honours it.
        drafter: the lookahead source: ``"ngram"`` (default), ``"previous-query"`` or a
            :class:`~oasiskv.Drafter` that captures no hidden states; ``None`` takes
            :func:`enable`'s.
        max_new_tokens: the most tokens a row will generate (the engine reserves pool space for
            it); ``generate`` sets it from its own length arguments. ``None`` for direct forward
            calls: the rest of the model's context.
    """

    def __init__(
        self,
        model,
        kv: KvConfig | None = None,
        *,
        drafter: str | Drafter | None = None,
        max_new_tokens: int | None = None,
    ) -> None:
        super().__init__(layers=[])
        state = _state_of(model)
        kv = kv if kv is not None else state.kv
        if not isinstance(kv, KvConfig):
            raise ConfigError(f"kv must be a KvConfig, got {type(kv).__name__}")
        spec = drafter if drafter is not None else state.drafter
        drafter_obj = make_drafter(spec)
        if drafter_obj is None:  # the engine's oasis backend needs a query for the first selection
            drafter_obj = make_drafter("previous-query")
        layers = model.config.get_text_config(decoder=True).num_hidden_layers
        if tuple(drafter_obj.capture_layers(layers)):
            raise ConfigError(
                f"drafter {drafter_obj.name!r} reads the model's "
                "hidden states (EAGLE-3), which oasiskv.hf does not capture from a transformers model; "
                "pass drafter='ngram' or 'previous-query'"
            )
        self.model = model
        self.kv = kv
        self.drafter = drafter_obj
        self.engine_model = _HFModel(model)
        eos = model.generation_config.eos_token_id if model.generation_config is not None else None
        eos = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
        #: The engine: pools, runtime, selection (measurement code reads it).
        # Eager steps: transformers' decoder is not captured into CUDA graphs.
        self.engine = Engine(
            self.engine_model, kv, "oasis", drafter_obj, eos, max_num_seqs=MAX_BATCH, cuda_graph=False
        )
        self.max_new_tokens = max_new_tokens
        self._reqs: list[Request] = []
        self._seen = 0  # positions fed so far (padded prompt length + decode steps)
        self._closed = False

    # ------------------------------------------------------------------ transformers' Cache API
    @property
    def is_compileable(self) -> bool:
        return False

    @property
    def is_croppable(self) -> bool:
        return False

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Positions seen so far in the batch's padded layout (0 before the prefill)."""
        return self._seen

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return -1  # grows with the requests

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        raise ConfigError(
            "an OasisKVCache is filled by the forward that oasiskv.hf.enable installs, not by the "
            "model's attention layers; call oasiskv.hf.enable(model) (or build the cache with this "
            "model) and do not call the base model directly"
        )

    def reorder_cache(self, beam_idx) -> None:
        raise UnsupportedGenerateModeError(
            "an OasisKVCache cannot reorder its requests (beam search); use greedy search or sampling "
            "(num_beams=1), or a DynamicCache for beam search"
        )

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove == 0:
            return
        raise UnsupportedGenerateModeError(
            "an OasisKVCache cannot drop stored tokens (assisted generation, contrastive search); "
            "generate without assistant_model / prompt_lookup_num_tokens"
        )

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise UnsupportedGenerateModeError(
            "an OasisKVCache cannot duplicate its requests; pass the prompts already repeated"
        )

    def batch_select_indices(self, indices) -> None:
        raise UnsupportedGenerateModeError("an OasisKVCache cannot drop requests from its batch")

    def reset(self) -> None:
        raise UnsupportedGenerateModeError("an OasisKVCache serves one generation; make a new one")

    def activate_past_recording(self, **kwargs) -> None:
        raise UnsupportedGenerateModeError(
            "an OasisKVCache cannot record or roll back steps (assisted generation, deferred stop "
            "checks on MPS); use the CPU or a CUDA device"
        )

    @property
    def batch_size(self) -> int:
        return len(self._reqs) if self._reqs else -1

    # ------------------------------------------------------------------ OasisKV
    @property
    def metrics(self) -> list[RequestMetrics]:
        """Each batch row's :class:`~oasiskv.RequestMetrics` (fetched bytes, resident vs full KV,
        sparse steps, lookahead recall), complete once the generation is over."""
        if not self._closed:
            for r in self._reqs:
                if r.runtime is not None:
                    self.engine.finalize_metrics(r)
        return [r.metrics for r in self._reqs]

    @property
    def requests(self) -> list[Request]:
        """The engine requests, one per batch row (their ``tokens``, ``sparse`` flag, tables)."""
        return list(self._reqs)

    def close(self) -> None:
        """Finish the generation: final metrics, and every block back to the engine's pools (safe to
        call twice; ``generate`` calls it)."""
        if self._closed:
            return
        self._closed = True
        for r in self._reqs:
            if r.runtime is not None:
                self.engine.finalize_metrics(r)
                r.finish_reason = r.finish_reason or "length"
            self.engine.release(r)

    @torch.no_grad()
    def forward(self, input_ids, attention_mask=None, inputs_embeds=None) -> torch.Tensor:
        """One model forward through the engine: the prefill (first call) or a decode step.
        Returns ``[batch, 1, vocab]`` float32 logits of each row's last position."""
        if self._closed:
            raise UnsupportedGenerateModeError(
                "this OasisKVCache's generation is over (its requests were released); pass a new "
                "OasisKVCache(model, kv=...) to each generate call"
            )
        if inputs_embeds is not None:
            raise UnsupportedGenerateModeError(
                "inputs_embeds are not supported with an OasisKVCache (the engine embeds token ids); "
                "pass input_ids"
            )
        if input_ids is None or input_ids.dim() != 2:
            shape = None if input_ids is None else tuple(input_ids.shape)
            raise ConfigError(f"input_ids must be [batch, tokens] token ids, got {shape}")
        if not self._reqs:
            return self._prefill(input_ids, attention_mask)
        return self._decode(input_ids)

    def _prefill(self, input_ids, attention_mask) -> torch.Tensor:
        eng, cfg = self.engine, self.engine_model.config
        prompts = _prompts(input_ids, attention_mask)
        if len(prompts) > MAX_BATCH:
            raise ConfigError(f"a batch of {len(prompts)} rows; an OasisKVCache holds at most {MAX_BATCH}")
        ctx = cfg.max_position_embeddings
        logits = []
        for i, prompt in enumerate(prompts):
            n = len(prompt)
            if n == 0:
                raise ConfigError(f"row {i} has no prompt token (its attention_mask is all zeros)")
            m = self.max_new_tokens if self.max_new_tokens is not None else max(1, ctx - n + 1)
            if n + m - 1 > ctx:
                raise ContextLengthError(
                    f"row {i}: the prompt has {n} tokens and max_new_tokens={m}: {n + m - 1} positions "
                    f"exceeds the model's context of {ctx} tokens; shorten the prompt or lower max_new_tokens"
                )
            eng.check_fits(n, m, sparse=eng.prefills_sparse(n))  # prefilled in one piece
            r = Request(id=i, prompt=list(prompt), max_new_tokens=m)
            self._reqs.append(r)
            if self.drafter is not None:
                self.drafter.begin(r.id, r.prompt)
            r.tokens = list(r.prompt)
            logits.append(eng.prefill(r))
            r.metrics.prompt_tokens = n
            # Turn sparse now, while the engine's last queries are this prompt's (the next
            # prefill replaces them); LLMEngine does it after sampling the first token, which the
            # selection does not read.
            if not r.sparse and eng.runtime.wants_sparse(r.id):
                eng.make_sparse(r)
                r.metrics.sparse_since_token = n
        self._seen = input_ids.shape[1]
        return torch.stack(logits)[:, None, :]

    def _decode(self, input_ids) -> torch.Tensor:
        eng, reqs = self.engine, self._reqs
        b, t = input_ids.shape
        if b != len(reqs) or t != 1:
            raise UnsupportedGenerateModeError(
                f"an OasisKVCache decodes one new token per row of its {len(reqs)}-row batch, got input "
                f"shape {(b, t)}; continuing a finished generation, assisted generation and chunked "
                "prefill are not supported (pass a new cache with the whole prompt)"
            )
        for r, tok in zip(reqs, input_ids[:, 0].tolist(), strict=True):
            r.tokens.append(int(tok))
            r.metrics.generated_tokens += 1
        if eng.rows == 2:
            drafts = self.drafter.propose_batch([r.id for r in reqs], [r.tokens for r in reqs], [None] * b)
            for r, d in zip(reqs, drafts, strict=True):
                r.draft = d
        for r in reqs:
            if not r.sparse and eng.runtime.wants_sparse(r.id):
                eng.make_sparse(r)
        logits = eng.decode_step(reqs)
        self._seen += 1
        return logits[:, None, :]


# --------------------------------------------------------------------------- enable
@dataclass
class _State:
    """What :func:`enable` installed on a model: the defaults of its caches and the original
    ``forward`` / ``generate`` bound methods (restored by :func:`disable`)."""

    kv: KvConfig
    drafter: str | Drafter | None
    forward: Callable
    generate: Callable
    last_cache: OasisKVCache | None = field(default=None, repr=False)


_STATE_ATTR = "_oasiskv_hf_state"


def enable(model, kv: KvConfig | None = None, *, drafter: str | Drafter | None = None):
    """Make ``model.generate(...)`` decode with OasisKV; returns ``model``.

    Wraps the model's ``forward`` (a forward whose ``cache`` is an :class:`OasisKVCache` runs the
    engine; any other runs as before) and ``generate`` (a call without a cache gets a fresh
    :class:`OasisKVCache` with ``kv`` and ``drafter``; a call with an :class:`OasisKVCache` uses
    it; a call with another ``Cache`` runs as transformers does). Unsupported generation modes
    raise :class:`UnsupportedGenerateModeError` before anything runs. Calling it again updates
    ``kv`` / ``drafter`` (when given); :func:`disable` undoes it.

    Raises:
        ConfigError: ``model`` is not a supported transformers causal LM (:data:`SUPPORTED_MODEL_TYPES`),
            or ``kv`` is not a :class:`KvConfig`.
    """
    if kv is not None and not isinstance(kv, KvConfig):
        raise ConfigError(f"kv must be a KvConfig, got {type(kv).__name__}")
    state = getattr(model, _STATE_ATTR, None)
    if state is not None:
        if kv is not None:
            state.kv = kv
        if drafter is not None:
            state.drafter = drafter
        return model
    _check_model(model)
    state = _State(kv or KvConfig(), drafter or "ngram", model.forward, model.generate)
    object.__setattr__(model, _STATE_ATTR, state)
    model.forward = _wrap_forward(model, state)
    model.generate = _wrap_generate(model, state)
    return model


def _state_of(model) -> _State:
    enable(model)
    return getattr(model, _STATE_ATTR)


def disable(model) -> None:
    """Undo :func:`enable`: the model's own ``forward`` and ``generate`` again (no-op when not
    enabled)."""
    state = getattr(model, _STATE_ATTR, None)
    if state is None:
        return
    for name in ("forward", "generate"):
        if name in model.__dict__:
            del model.__dict__[name]
    object.__delattr__(model, _STATE_ATTR)


def last_cache(model) -> OasisKVCache | None:
    """The :class:`OasisKVCache` of the model's latest ``generate`` (its metrics), or None."""
    state = getattr(model, _STATE_ATTR, None)
    return None if state is None else state.last_cache


def _wrap_forward(model, state: _State):
    orig = state.forward

    @functools.wraps(orig)
    def forward(*args, **kwargs):
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        if not isinstance(cache, OasisKVCache):
            return orig(*args, **kwargs)
        names = ("input_ids", "attention_mask", "position_ids")
        given = dict(zip(names, args, strict=False))
        for k in names[len(args) :]:
            if k in kwargs:
                given[k] = kwargs[k]
        if cache.model is not model:
            raise ConfigError("this OasisKVCache was made for another model; make one with this model")
        if kwargs.get("output_attentions") or kwargs.get("output_hidden_states"):
            raise UnsupportedGenerateModeError(
                "output_attentions / output_hidden_states are not available with an OasisKVCache "
                "(the engine computes attention over its working set); drop them"
            )
        if kwargs.get("labels") is not None:
            raise UnsupportedGenerateModeError("an OasisKVCache forward computes no loss; drop labels")
        logits = cache.forward(
            given.get("input_ids"),
            attention_mask=given.get("attention_mask"),
            inputs_embeds=kwargs.get("inputs_embeds"),
        )
        return CausalLMOutputWithPast(logits=logits, **{_CACHE_KW: cache})

    return forward


def _generation_config(model, generation_config, kwargs) -> GenerationConfig:
    """The generation config a ``generate`` call runs with (the model's or the one passed, updated
    by the call's keyword arguments), for the checks; ``generate`` builds its own."""
    base = generation_config if generation_config is not None else model.generation_config
    gc = copy.deepcopy(base) if base is not None else GenerationConfig()
    gc.update(**{k: v for k, v in kwargs.items() if hasattr(gc, k)})
    return gc


def check_generate(model, inputs=None, generation_config=None, **kwargs) -> GenerationConfig:
    """Raise :class:`UnsupportedGenerateModeError` for a ``generate`` call OasisKV does not run
    (docs/HF.md lists them); returns the call's generation config. :func:`enable`'s ``generate``
    calls it first."""
    gc = _generation_config(model, generation_config, kwargs)
    assistant = kwargs.get("assistant_model")
    mode = gc.get_generation_mode(assistant)
    if mode not in SUPPORTED_GENERATION_MODES:
        hint = {
            GenerationMode.BEAM_SEARCH: "beam search reorders the cache every step",
            GenerationMode.BEAM_SAMPLE: "beam search reorders the cache every step",
            GenerationMode.GROUP_BEAM_SEARCH: "beam search reorders the cache every step",
            GenerationMode.CONSTRAINED_BEAM_SEARCH: "beam search reorders the cache every step",
            GenerationMode.ASSISTED_GENERATION: "assisted generation rolls rejected tokens back out "
            "of the cache (OasisKV's own lookahead already runs a draft token every step)",
            GenerationMode.CONTRASTIVE_SEARCH: "contrastive search rolls the cache back",
            GenerationMode.DOLA_GENERATION: "DoLa reads every layer's hidden states",
        }.get(mode, "it is not one of greedy search and sampling")
        raise UnsupportedGenerateModeError(
            f"generate mode {mode.value!r} is not supported with OasisKV ({hint}); use greedy search "
            "(do_sample=False, num_beams=1) or sampling (do_sample=True, num_beams=1), or call "
            "oasiskv.hf.disable(model) for transformers' own cache"
        )
    if gc.cache_implementation is not None:
        raise UnsupportedGenerateModeError(
            f"cache_implementation={gc.cache_implementation!r} asks for transformers' own cache; "
            "OasisKV brings its own (drop cache_implementation, or call oasiskv.hf.disable(model))"
        )
    if gc.use_cache is False:
        raise UnsupportedGenerateModeError(
            "use_cache=False decodes without a cache; OasisKV is a cache, drop it"
        )
    if getattr(gc, "prefill_chunk_size", None):
        raise UnsupportedGenerateModeError(
            "prefill_chunk_size (chunked prefill) is not supported with an OasisKVCache; drop it "
            "(the engine prefills the whole prompt in one forward)"
        )
    if gc.output_attentions or gc.output_hidden_states:
        raise UnsupportedGenerateModeError(
            "output_attentions / output_hidden_states are not available with OasisKV (the engine "
            "attends over its working set); drop them"
        )
    if kwargs.get("inputs_embeds") is not None:
        raise UnsupportedGenerateModeError("inputs_embeds are not supported with OasisKV; pass input_ids")
    if kwargs.get("custom_generate") is not None:
        raise UnsupportedGenerateModeError("custom_generate is not supported with OasisKV")
    return gc


def _max_new_tokens(gc: GenerationConfig, inputs, kwargs) -> int | None:
    """The most tokens a row generates in this call, from the length arguments (None: unknown)."""
    if gc.max_new_tokens is not None:
        return int(gc.max_new_tokens)
    ids = inputs if inputs is not None else kwargs.get("input_ids")
    if gc.max_length is not None and ids is not None and hasattr(ids, "shape"):
        return max(1, int(gc.max_length) - int(ids.shape[-1]))
    return None


def _wrap_generate(model, state: _State):
    orig = state.generate

    @functools.wraps(orig)
    def generate(inputs=None, generation_config=None, **kwargs):
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        if cache is not None and not isinstance(cache, OasisKVCache):
            return orig(inputs, generation_config, **kwargs)  # transformers' own cache
        gc = check_generate(model, inputs, generation_config, **kwargs)
        if cache is None:
            cache = OasisKVCache(model, state.kv, drafter=state.drafter)
        elif cache._reqs or cache._closed:
            raise UnsupportedGenerateModeError(
                "this OasisKVCache already served a generation; pass a new OasisKVCache(model, kv=...) "
                "to each generate call (continuing a conversation re-prefills the whole text)"
            )
        cache.max_new_tokens = _max_new_tokens(gc, inputs, kwargs)
        kwargs.pop("past_key_values", None)
        kwargs.pop("cache", None)
        kwargs[_CACHE_KW] = cache
        state.last_cache = cache
        try:
            return orig(inputs, generation_config, **kwargs)
        finally:
            cache.close()

    return generate


def generate(model, input_ids, kv: KvConfig | None = None, *, drafter: str | Drafter | None = None, **kwargs):
    """``model.generate(input_ids, **kwargs)`` with an :class:`OasisKVCache` of ``kv`` (enabling
    the model first). Returns what ``generate`` returns; the cache is :func:`last_cache`."""
    enable(model)
    cache = OasisKVCache(model, kv, drafter=drafter)
    return model.generate(input_ids, cache=cache, **kwargs)


__all__ = [
    "ATTN_IMPLEMENTATION",
    "SUPPORTED_GENERATION_MODES",
    "SUPPORTED_MODEL_TYPES",
    "OasisKVCache",
    "UnsupportedGenerateModeError",
    "check_generate",
    "disable",
    "enable",
    "generate",
    "last_cache",
    "oasiskv_attention",
]
