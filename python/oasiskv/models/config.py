"""Model hyper-parameters shared by the Llama and Qwen3 implementations.

:class:`ModelConfig` is the one description of a target model that the rest of OasisKV reads
(layer count, head geometry, RoPE). It is built from a Hugging Face ``config.json`` dict
(:meth:`ModelConfig.from_hf_dict`, both the transformers 4.x ``rope_theta``/``rope_scaling`` and the
5.x ``rope_parameters`` spellings) or from GGUF metadata (see :mod:`oasiskv.models.loader`), and
written back with :meth:`ModelConfig.to_hf_dict`, which ``transformers.LlamaConfig`` /
``Qwen3Config`` / ``Qwen3MoeConfig`` accept.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Mapping
from typing import Any

import torch

from oasiskv.errors import ConfigError

#: ``config.json`` ``model_type`` values this package implements, mapped to :attr:`ModelConfig.family`.
SUPPORTED_MODEL_TYPES: dict[str, str] = {"llama": "llama", "qwen3": "qwen3", "qwen3_moe": "qwen3"}
#: RoPE scaling kinds implemented (``None`` = plain RoPE), with transformers' semantics
#: (``transformers.modeling_rope_utils``): ``linear`` divides every frequency by ``factor``,
#: ``llama3`` the low ones only, ``yarn`` interpolates the low ones and scales cos/sin by an
#: attention factor (:func:`yarn_attention_factor`).
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")

#: Upper bounds on the sizes a config may give. Arbitrary: 8x to 64x past the largest released
#: dense models, so that a typo (an extra zero, 10**11) fails here, naming its field, instead of in the
#: allocator. Positions are i32 on the GPU, hence the context bound.
SIZE_BOUNDS: dict[str, int] = {
    "vocab_size": 1 << 24,
    "hidden_size": 1 << 17,
    "intermediate_size": 1 << 20,
    "num_hidden_layers": 1024,
    "num_attention_heads": 1024,
    "num_key_value_heads": 1024,
    "head_dim": 1024,
    "max_position_embeddings": (1 << 31) - 1,
}
#: The same for a mixture-of-experts config (checked when ``num_experts > 0``). Arbitrary too:
#: Qwen3-235B-A22B has 128 experts of 1536 columns, DeepSeek-V3 256 of 2048.
MOE_SIZE_BOUNDS: dict[str, int] = {"num_experts": 1 << 12, "moe_intermediate_size": 1 << 20}

_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
#: YaRN's optional keys (transformers' ``_validate_yarn_rope_parameters``); the numbers default as
#: there: beta_fast 32, beta_slow 1, truncate true, attention_factor from factor and the mscales.
_YARN_NUMBERS = ("attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim")


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's Eq. 21, ``0.1 * mscale * ln(scale) + 1`` (1 for scale <= 1): transformers'
    ``yarn_get_mscale``."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def yarn_attention_factor(rs: Mapping[str, Any]) -> float:
    """The factor YaRN multiplies cos and sin by (so every q.k by its square), from a normalised
    ``yarn`` ``rope_scaling``: its ``attention_factor`` when given, else
    ``mscale(factor, mscale) / mscale(factor, mscale_all_dim)`` when both mscales are given and
    non-zero, else ``mscale(factor)`` (transformers' ``_compute_yarn_parameters``; Qwen3's 4x
    over 32768: 0.1 ln 4 + 1 = 1.1386)."""
    if rs.get("attention_factor") is not None:
        return float(rs["attention_factor"])
    factor, mscale, mscale_all_dim = rs["factor"], rs.get("mscale"), rs.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
    return _yarn_mscale(factor)


def _normalize_yarn(rs: Mapping[str, Any], max_position_embeddings: int | None) -> dict[str, Any]:
    """The ``yarn`` branch of :func:`_normalize_rope_scaling`: the keys transformers reads, typed;
    optional ones only when given (so :meth:`ModelConfig.to_hf_dict` writes back what was read)."""
    example = "e.g. {'rope_type': 'yarn', 'factor': 4.0, 'original_max_position_embeddings': 32768}"
    orig = rs.get("original_max_position_embeddings")
    if not isinstance(orig, int) or isinstance(orig, bool) or orig <= 0:
        raise ConfigError(
            f"yarn rope_scaling needs original_max_position_embeddings, the pre-training context, as "
            f"a positive int, got {orig!r} ({example})"
        )
    factor = rs.get("factor")
    if factor is None and max_position_embeddings is not None:
        factor = max_position_embeddings / orig  # transformers' rule for a null factor
    if not _is_number(factor) or not math.isfinite(factor) or factor < 1:
        raise ConfigError(
            f"yarn rope_scaling needs a 'factor' >= 1 (the context it extends to over "
            f"original_max_position_embeddings), got {factor!r} ({example})"
        )
    out: dict[str, Any] = {"rope_type": "yarn", "factor": float(factor)}
    out["original_max_position_embeddings"] = orig
    for key in _YARN_NUMBERS:
        v = rs.get(key)
        if v is None:
            continue
        ok = _is_number(v) and math.isfinite(v) and (v >= 0 if key.startswith("mscale") else v > 0)
        if not ok:
            sign = ">= 0" if key.startswith("mscale") else "> 0"
            raise ConfigError(
                f"yarn rope_scaling's {key} must be a finite number {sign} or absent, got {v!r}"
            )
        out[key] = float(v)
    if out.get("beta_fast", 32.0) < out.get("beta_slow", 1.0):
        raise ConfigError(
            f"yarn rope_scaling needs beta_fast >= beta_slow (defaults 32 and 1), got "
            f"beta_fast={out.get('beta_fast', 32.0)}, beta_slow={out.get('beta_slow', 1.0)}"
        )
    if rs.get("truncate") is not None:
        if not isinstance(rs["truncate"], bool):
            raise ConfigError(f"yarn rope_scaling's truncate must be true or false, got {rs['truncate']!r}")
        out["truncate"] = rs["truncate"]
    return out


def _normalize_rope_scaling(rs: Any, max_position_embeddings: int | None = None) -> dict[str, Any] | None:
    """Canonical form: ``None`` or ``{"rope_type": "linear"|"llama3"|"yarn", ...numbers}``.
    ``max_position_embeddings`` stands in for a yarn ``factor`` of null, as in transformers."""
    if rs is None:
        return None
    if not isinstance(rs, Mapping):
        raise ConfigError(
            f"rope_scaling must be None or a dict like {{'rope_type': 'llama3', 'factor': 8.0, ...}}, "
            f"got {type(rs).__name__}"
        )
    rope_type = rs.get("rope_type", rs.get("type", "default"))
    if rope_type in (None, "default"):
        return None
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ConfigError(
            f"rope_scaling type {rope_type!r} is not supported; supported: 'llama3', 'linear', 'yarn' "
            "or none. Use a checkpoint with one of those, or remove "
            "rope_scaling from config.json to run with plain RoPE."
        )
    partial = rs.get("partial_rotary_factor")
    if partial is not None and partial != 1:
        raise ConfigError(
            f"rope_scaling sets partial_rotary_factor={partial!r}; only full-width RoPE (1.0) is "
            "implemented: remove it, or use a model that rotates every dimension"
        )
    if rope_type == "yarn":
        return _normalize_yarn(rs, max_position_embeddings)
    out: dict[str, Any] = {"rope_type": rope_type}
    if rope_type == "linear":
        factor = rs.get("factor")
        if not isinstance(factor, (int, float)) or isinstance(factor, bool) or not factor > 0:
            raise ConfigError(f"linear rope_scaling needs a positive 'factor', got {factor!r}")
        out["factor"] = float(factor)
        return out
    missing = [k for k in _LLAMA3_KEYS if k not in rs]
    if missing:
        raise ConfigError(
            f"llama3 rope_scaling is missing {missing}; it needs all of {list(_LLAMA3_KEYS)} "
            "(e.g. factor=8.0, low_freq_factor=1.0, "
            "high_freq_factor=4.0, original_max_position_embeddings=8192)"
        )
    out["factor"] = float(rs["factor"])
    out["low_freq_factor"] = float(rs["low_freq_factor"])
    out["high_freq_factor"] = float(rs["high_freq_factor"])
    out["original_max_position_embeddings"] = int(rs["original_max_position_embeddings"])
    if not out["factor"] > 0 or not out["original_max_position_embeddings"] > 0:
        raise ConfigError(
            f"llama3 rope_scaling needs factor > 0 and original_max_position_embeddings > 0: {out}"
        )
    if not out["high_freq_factor"] > out["low_freq_factor"] > 0:
        raise ConfigError(
            f"llama3 rope_scaling needs high_freq_factor > low_freq_factor > 0, got "
            f"high={out['high_freq_factor']}, low={out['low_freq_factor']}"
        )
    return out


def _is_number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def _check_size(name: str, v: Any) -> None:
    # bool is an int subclass: `true` in a config.json would otherwise be a size of 1
    if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
        raise ConfigError(f"{name} must be a positive int, got {v!r}; fix it in config.json")
    bound = SIZE_BOUNDS[name] if name in SIZE_BOUNDS else MOE_SIZE_BOUNDS[name]
    if v > bound:
        raise ConfigError(
            f"{name}={v} is larger than {bound}, the most OasisKV accepts (no released model comes "
            f"close); fix {name} in config.json"
        )


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Hyper-parameters of a decoder-only Llama or Qwen3 model.

    ``head_dim`` defaults to ``hidden_size // num_attention_heads``. ``rope_scaling`` is ``None`` or a
    dict in Hugging Face's format, ``{"rope_type": "llama3"|"linear"|"yarn", ...}`` (normalised on
    construction; :data:`SUPPORTED_ROPE_TYPES`). ``eos_token_ids`` lists
    every id that ends generation. Construction validates everything and raises
    :class:`~oasiskv.errors.ConfigError` with a fix-it message.

    **Mixture of experts** (Qwen3-MoE, ``model_type`` ``qwen3_moe``; family ``qwen3``): with
    ``num_experts > 0`` a layer's MLP is a router (a linear map to ``num_experts`` logits,
    softmax, top ``num_experts_per_tok``, renormalised when ``norm_topk_prob``) over
    ``num_experts`` SwiGLU experts of width ``moe_intermediate_size``, on every layer ``i`` with
    ``(i + 1) % decoder_sparse_step == 0`` that is not in ``mlp_only_layers``
    (:meth:`is_moe_layer`); the other layers keep a dense MLP of ``intermediate_size``. With
    ``num_experts = 0`` (the default) the model is dense and the other MoE fields are unused.
    """

    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int | None = None
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: list[int] = dataclasses.field(default_factory=list)
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.family not in SUPPORTED_MODEL_TYPES.values():
            raise ConfigError(
                f"family must be one of {sorted(set(SUPPORTED_MODEL_TYPES.values()))}, got {self.family!r}"
            )
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "max_position_embeddings",
        ):
            _check_size(name, getattr(self, name))
        head_dim = self.head_dim
        if head_dim is None:
            if self.hidden_size % self.num_attention_heads:
                raise ConfigError(
                    f"hidden_size {self.hidden_size} is not divisible by num_attention_heads "
                    f"{self.num_attention_heads}; pass head_dim explicitly"
                )
            head_dim = self.hidden_size // self.num_attention_heads
            object.__setattr__(self, "head_dim", head_dim)
        _check_size("head_dim", head_dim)
        if head_dim % 2:
            raise ConfigError(f"head_dim must be a positive even int (RoPE rotates pairs), got {head_dim!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of num_key_value_heads "
                f"({self.num_key_value_heads}) for grouped-query attention"
            )
        if not (_is_number(self.rms_norm_eps) and 0 < self.rms_norm_eps < 1):
            raise ConfigError(
                f"rms_norm_eps must be a number in (0, 1) (e.g. 1e-6), got {self.rms_norm_eps!r}"
            )
        if not (_is_number(self.rope_theta) and self.rope_theta > 0 and math.isfinite(self.rope_theta)):
            raise ConfigError(f"rope_theta must be a positive finite number, got {self.rope_theta!r}")
        object.__setattr__(self, "rms_norm_eps", float(self.rms_norm_eps))
        object.__setattr__(self, "rope_theta", float(self.rope_theta))
        object.__setattr__(
            self, "rope_scaling", _normalize_rope_scaling(self.rope_scaling, self.max_position_embeddings)
        )
        object.__setattr__(self, "tie_word_embeddings", bool(self.tie_word_embeddings))
        eos = self.eos_token_ids
        if eos is None:
            eos = []
        elif isinstance(eos, int):
            eos = [eos]
        for tid in list(eos) + ([] if self.bos_token_id is None else [self.bos_token_id]):
            if not isinstance(tid, numbers.Integral) or isinstance(tid, bool):
                raise ConfigError(f"special token ids (bos_token_id, eos_token_id) must be ints, got {tid!r}")
            if not 0 <= tid < self.vocab_size:
                raise ConfigError(f"special token id {tid} is outside the vocabulary [0, {self.vocab_size})")
        object.__setattr__(self, "eos_token_ids", [int(e) for e in eos])
        self._check_moe()

    def _check_moe(self) -> None:
        e = self.num_experts
        if not isinstance(e, int) or isinstance(e, bool) or e < 0:
            raise ConfigError(f"num_experts must be an int >= 0 (0: a dense model), got {e!r}")
        if e == 0:
            return
        _check_size("num_experts", e)
        if self.family != "qwen3":
            raise ConfigError(
                f"mixture-of-experts layers are implemented for the qwen3 family (Qwen3-MoE) only, "
                f"got family={self.family!r} with num_experts={self.num_experts}"
            )
        _check_size("moe_intermediate_size", self.moe_intermediate_size)
        k = self.num_experts_per_tok
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= self.num_experts:
            raise ConfigError(
                f"num_experts_per_tok must be an int in 1..={self.num_experts} (num_experts), got {k!r}"
            )
        step = self.decoder_sparse_step
        if not isinstance(step, int) or isinstance(step, bool) or step < 1:
            raise ConfigError(f"decoder_sparse_step must be an int >= 1, got {step!r}")
        only = self.mlp_only_layers
        if only is None:
            only = ()
        if isinstance(only, (str, bytes)) or not all(
            isinstance(i, int) and not isinstance(i, bool) for i in only
        ):
            raise ConfigError(f"mlp_only_layers must be a list of layer indices, got {only!r}")
        bad = [i for i in only if not 0 <= i < self.num_hidden_layers]
        if bad:
            raise ConfigError(
                f"mlp_only_layers {bad} are outside the model's layers [0, {self.num_hidden_layers})"
            )
        object.__setattr__(self, "mlp_only_layers", tuple(sorted(set(only))))
        object.__setattr__(self, "norm_topk_prob", bool(self.norm_topk_prob))

    # ------------------------------------------------------------------ mixture of experts
    @property
    def is_moe(self) -> bool:
        """Whether any layer is a mixture of experts."""
        return any(self.is_moe_layer(i) for i in range(self.num_hidden_layers))

    def is_moe_layer(self, layer: int) -> bool:
        """Whether layer ``layer``'s MLP is the sparse mixture of experts (Hugging Face's rule:
        ``num_experts > 0``, ``(layer + 1) % decoder_sparse_step == 0``, not in
        ``mlp_only_layers``)."""
        return (
            self.num_experts > 0
            and (layer + 1) % self.decoder_sparse_step == 0
            and layer not in self.mlp_only_layers
        )

    # ------------------------------------------------------------------ derived values
    @property
    def num_kv_groups(self) -> int:
        """Query heads per KV head."""
        return self.num_attention_heads // self.num_key_value_heads

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim  # type: ignore[operator]

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim  # type: ignore[operator]

    @property
    def model_type(self) -> str:
        return "qwen3_moe" if self.num_experts else self.family

    @property
    def embedding_parameters(self) -> int:
        """Parameters of the token embeddings plus the LM head (counted once when tied)."""
        return self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)

    @property
    def layer_parameters(self) -> int:
        """Parameters of one dense decoder layer (:class:`~oasiskv.models.transformer.DecoderLayer`
        with the SwiGLU MLP of ``intermediate_size``); :meth:`layer_parameters_of` counts a
        mixture-of-experts layer's router and experts instead."""
        return self._attention_parameters + 3 * self.intermediate_size * self.hidden_size

    @property
    def _attention_parameters(self) -> int:
        """A layer's two norms, QKV, q/k norms (Qwen3) and o_proj."""
        h = self.hidden_size
        qk_norm = 2 * self.head_dim if self.family == "qwen3" else 0  # type: ignore[operator]
        return 2 * h + (2 * self.q_size + 2 * self.kv_size) * h + qk_norm

    def layer_parameters_of(self, layer: int) -> int:
        """Parameters of decoder layer ``layer``: a dense one's, or (:meth:`is_moe_layer`) the
        attention's plus the router [num_experts, h] and every expert's gate, up and down."""
        if not self.is_moe_layer(layer):
            return self.layer_parameters
        h = self.hidden_size
        return self._attention_parameters + self.num_experts * (h + 3 * self.moe_intermediate_size * h)

    @property
    def decoder_parameters(self) -> int:
        """Parameters of all decoder layers."""
        return sum(self.layer_parameters_of(i) for i in range(self.num_hidden_layers))

    @property
    def active_parameters(self) -> int:
        """Parameters one token reads: the experts it is routed to (``num_experts_per_tok`` of
        them) instead of all (Qwen3-235B-A22B: 22e9 of 235e9); ``num_parameters`` when dense."""
        unused = self.num_experts - self.num_experts_per_tok
        moe_layers = sum(self.is_moe_layer(i) for i in range(self.num_hidden_layers))
        return self.num_parameters - moe_layers * unused * 3 * self.moe_intermediate_size * self.hidden_size

    @property
    def num_parameters(self) -> int:
        """Parameters of the whole model: embeddings, LM head, layers and the final norm."""
        return self.embedding_parameters + self.decoder_parameters + self.hidden_size

    def replace(self, **changes: Any) -> ModelConfig:
        """A copy with ``changes`` applied (validated again)."""
        return dataclasses.replace(self, **changes)

    # ------------------------------------------------------------------ HF conversion
    @classmethod
    def from_hf_dict(cls, d: Mapping[str, Any]) -> ModelConfig:
        """Build from a Hugging Face ``config.json`` dict (model_type ``llama`` or ``qwen3``)."""
        if not isinstance(d, Mapping):
            raise ConfigError(f"expected a config.json dict, got {type(d).__name__}")
        model_type = d.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ConfigError(
                f"model_type {model_type!r} is not supported; supported model types: "
                f"{sorted(SUPPORTED_MODEL_TYPES)}. Use a Llama or Qwen3 checkpoint."
            )
        family = SUPPORTED_MODEL_TYPES[model_type]
        act = d.get("hidden_act", "silu")
        if act != "silu":
            raise ConfigError(
                f"hidden_act {act!r} is not supported (only 'silu' SwiGLU MLPs are implemented)"
            )
        for flag in ("attention_bias", "mlp_bias", "use_sliding_window"):
            if d.get(flag):
                raise ConfigError(
                    f"config.json sets {flag}=true, which this implementation does not support; "
                    f"only bias-free full-attention Llama/Qwen3 models can be loaded"
                )
        required = (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
        )
        missing = [k for k in required if k not in d]
        if missing:
            raise ConfigError(f"config.json is missing required keys {missing}")

        # RoPE: transformers 5 writes rope_parameters = {rope_type, rope_theta, ...}; 4.x writes
        # rope_theta + rope_scaling.
        rope_params = d.get("rope_parameters")
        if (
            isinstance(rope_params, Mapping)
            and rope_params
            and all(isinstance(v, Mapping) for v in rope_params.values())
        ):
            raise ConfigError(
                "per-layer-type rope_parameters are not supported (only one RoPE setting for all layers)"
            )
        rope_theta = d.get("rope_theta")
        rope_scaling = d.get("rope_scaling")
        if isinstance(rope_params, Mapping) and rope_params:
            if rope_params.get("rope_theta") is not None:
                rope_theta = rope_params["rope_theta"]
            if rope_scaling is None:
                rope_scaling = dict(rope_params)
        if rope_theta is None:
            rope_theta = 1e6 if family == "qwen3" else 10000.0
        if isinstance(rope_scaling, Mapping):
            rope_scaling = {k: v for k, v in rope_scaling.items() if k != "rope_theta"}
            # transformers' standardize_rope_params: the pre-training context defaults to this one
            if (
                rope_scaling.get("rope_type", rope_scaling.get("type")) in ("llama3", "yarn")
                and "original_max_position_embeddings" not in rope_scaling
                and "max_position_embeddings" in d
            ):
                rope_scaling["original_max_position_embeddings"] = d["max_position_embeddings"]

        eos = d.get("eos_token_id")
        eos_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        moe = {}
        if model_type == "qwen3_moe":
            # transformers 5 writes num_local_experts; released config.json files num_experts
            experts = d.get("num_experts", d.get("num_local_experts"))
            missing = [k for k in ("num_experts_per_tok", "moe_intermediate_size") if k not in d]
            if experts is None or missing:
                missing = (["num_experts"] if experts is None else []) + missing
                raise ConfigError(f"config.json of a qwen3_moe model is missing keys {missing}")
            moe = dict(
                num_experts=experts,
                num_experts_per_tok=d["num_experts_per_tok"],
                moe_intermediate_size=d["moe_intermediate_size"],
                norm_topk_prob=bool(d.get("norm_topk_prob", False)),
                decoder_sparse_step=d.get("decoder_sparse_step", 1),
                mlp_only_layers=tuple(d.get("mlp_only_layers") or ()),
            )
            if experts == 0:
                raise ConfigError("config.json of a qwen3_moe model has num_experts=0; use model_type qwen3")
        return cls(
            family=family,
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_hidden_layers=d["num_hidden_layers"],
            num_attention_heads=d["num_attention_heads"],
            # an explicit 0 must fail validation, not fall back to multi-head attention
            num_key_value_heads=d["num_attention_heads"]
            if d.get("num_key_value_heads") is None
            else d["num_key_value_heads"],
            head_dim=d.get("head_dim"),
            rms_norm_eps=d.get("rms_norm_eps", 1e-6),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=d.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=eos_ids,
            **moe,
        )

    def to_hf_dict(self) -> dict[str, Any]:
        """A ``config.json`` dict that ``transformers.LlamaConfig``/``Qwen3Config`` (4.x and 5.x) load."""
        rope_parameters: dict[str, Any] = {"rope_type": "default", "rope_theta": self.rope_theta}
        if self.rope_scaling is not None:
            rope_parameters.update(self.rope_scaling)
        arch = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}
        d: dict[str, Any] = {
            "architectures": [arch[self.model_type]],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": None if self.rope_scaling is None else dict(self.rope_scaling),
            "rope_parameters": rope_parameters,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": False,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": (
                None
                if not self.eos_token_ids
                else self.eos_token_ids[0]
                if len(self.eos_token_ids) == 1
                else list(self.eos_token_ids)
            ),
        }
        if self.family == "llama":
            d["mlp_bias"] = False
        else:
            d["use_sliding_window"] = False
        if self.num_experts:
            d.update(
                num_experts=self.num_experts,
                num_experts_per_tok=self.num_experts_per_tok,
                moe_intermediate_size=self.moe_intermediate_size,
                norm_topk_prob=self.norm_topk_prob,
                decoder_sparse_step=self.decoder_sparse_step,
                mlp_only_layers=list(self.mlp_only_layers),
            )
        return d


def estimate_model_bytes(cfg: ModelConfig, dtype: torch.dtype = torch.float32) -> int:
    """Bytes the weights of ``cfg`` take in ``dtype`` (parameters x element size), computed before
    allocating anything; :class:`~oasiskv.models.transformer.CausalLM` checks it against the free
    memory of its device (:func:`oasiskv.memory.ensure_fits`)."""
    return cfg.num_parameters * dtype.itemsize


# Qwen/Qwen3-8B config.json (36 layers, 32 query / 8 KV heads of 128, untied embeddings).
_QWEN3_8B = ModelConfig(
    family="qwen3",
    vocab_size=151936,
    hidden_size=4096,
    intermediate_size=12288,
    num_hidden_layers=36,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    rms_norm_eps=1e-6,
    rope_theta=1000000.0,
    max_position_embeddings=40960,
    eos_token_ids=[151645, 151643],
)

#: Model-shaped configurations with no checkpoint behind them (benchmarks run them with random
#: weights): the published shapes of released models, and ``tiny`` for a CPU smoke run.
PRESETS: dict[str, ModelConfig] = {
    "qwen3-8b": _QWEN3_8B,
    # Qwen3-8B as its model card runs 131,072 tokens: YaRN, factor 4 over the 32,768 positions it
    # was trained on (cos/sin scaled by 0.1 ln 4 + 1 = 1.1386).
    "qwen3-8b-128k": _QWEN3_8B.replace(
        rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768},
        max_position_embeddings=131072,
    ),
    # meta-llama/Llama-3.1-8B-Instruct config.json (llama3 RoPE scaling to 128K).
    "llama3.1-8b": ModelConfig(
        family="llama",
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        max_position_embeddings=131072,
        bos_token_id=128000,
        eos_token_ids=[128001, 128008, 128009],
    ),
    # Qwen/Qwen3-32B config.json (64 layers, 64 query / 8 KV heads of 128, untied embeddings).
    "qwen3-32b": ModelConfig(
        family="qwen3",
        vocab_size=151936,
        hidden_size=5120,
        intermediate_size=25600,
        num_hidden_layers=64,
        num_attention_heads=64,
        num_key_value_heads=8,
        head_dim=128,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        max_position_embeddings=40960,
        eos_token_ids=[151645, 151643],
    ),
    # Qwen/Qwen3-235B-A22B config.json: 94 MoE layers, 64 query / 4 KV heads of 128, 128 experts
    # of 1536 columns, 8 per token (renormalised); 235e9 parameters, 22e9 active.
    "qwen3-235b-a22b": ModelConfig(
        family="qwen3",
        vocab_size=151936,
        hidden_size=4096,
        intermediate_size=12288,
        num_hidden_layers=94,
        num_attention_heads=64,
        num_key_value_heads=4,
        head_dim=128,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        max_position_embeddings=40960,
        eos_token_ids=[151645, 151643],
        num_experts=128,
        num_experts_per_tok=8,
        moe_intermediate_size=1536,
        norm_topk_prob=True,
    ),
    # Qwen/Qwen3-30B-A3B config.json: 48 MoE layers, 32 query / 4 KV heads of 128, 128 experts of
    # 768 columns, 8 per token; 30.5e9 parameters, 3.3e9 active.
    "qwen3-30b-a3b": ModelConfig(
        family="qwen3",
        vocab_size=151936,
        hidden_size=2048,
        intermediate_size=6144,
        num_hidden_layers=48,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=128,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        max_position_embeddings=40960,
        eos_token_ids=[151645, 151643],
        num_experts=128,
        num_experts_per_tok=8,
        moe_intermediate_size=768,
        norm_topk_prob=True,
    ),
    # Arbitrary: two layers of Qwen3 shape (GQA 4/2, q/k norm), seconds on 2 CPU cores.
    "tiny": ModelConfig(
        family="qwen3",
        vocab_size=301,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=32768,
    ),
    # Arbitrary: "tiny" with eight layers, the fewest an EAGLE-3 head's three capture layers
    # (2, L // 2, L - 3) need to be distinct with room: for CPU tests of EAGLE-3 shaped costs.
    "tiny-deep": ModelConfig(
        family="qwen3",
        vocab_size=301,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=8,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=32768,
    ),
    # Arbitrary: "tiny" with Qwen3-MoE layers: 8 experts of 32 columns, 2 per token
    # (renormalised); layer 1 dense (mlp_only_layers) so both MLP kinds run.
    "tiny-moe": ModelConfig(
        family="qwen3",
        vocab_size=301,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=32768,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        norm_topk_prob=True,
        mlp_only_layers=(1,),
    ),
}


def preset_unless_path(name: str) -> ModelConfig | None:
    """The :data:`PRESETS` entry ``name`` (a copy) when no file or directory of that name exists,
    else None: where a model argument may be a checkpoint path or a preset, a path wins."""
    import os

    return preset_config(name) if name in PRESETS and not os.path.exists(name) else None


def preset_config(name: str) -> ModelConfig:
    """The :data:`PRESETS` entry ``name`` (a copy)."""
    if name not in PRESETS:
        raise ConfigError(f"unknown model preset {name!r}; choose one of {sorted(PRESETS)}")
    return PRESETS[name].replace()
