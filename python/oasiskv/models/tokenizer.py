"""Tokenizer wrapper over the ``tokenizers`` library, built from a HF ``tokenizer.json`` or GGUF metadata.

GGUF files written by llama.cpp's ``convert_hf_to_gguf.py`` store a byte-level BPE vocabulary as
``tokenizer.ggml.{model="gpt2", tokens, merges, token_type, bos_token_id, eos_token_id, ...}`` plus a
``tokenizer.ggml.pre`` name for the pre-tokenizer regex. :meth:`Tokenizer.from_gguf_metadata` rebuilds the
equivalent ``tokenizers`` pipeline (the same construction transformers uses for GGUF files, plus
llama.cpp's digit splitting for the StarCoder/SmolLM family of pre-tokenizers, which is what the
original ``tokenizer.json`` of those models does).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from functools import lru_cache
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as _HFTokenizer

from oasiskv.errors import CheckpointError, ConfigError, InvalidTextError

# llama.cpp token types (tokenizer.ggml.token_type)
_TOKEN_NORMAL, _TOKEN_CONTROL, _TOKEN_USER_DEFINED = 1, 3, 4

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# tokenizer.ggml.pre -> split regex applied before the byte-level mapping
_PRE_SPLITS = {
    "llama3": _LLAMA3_SPLIT,
    "llama-v3": _LLAMA3_SPLIT,
    "llama-bpe": _LLAMA3_SPLIT,
    "falcon3": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT,
    "dbrx": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT,
    "deepseek-r1-qwen": _QWEN2_SPLIT,
}
_IGNORE_MERGES_PRE = {"llama3", "llama-v3", "llama-bpe", "falcon3", "smaug-bpe"}
# pre-tokenizers that first split every digit on its own, then apply the GPT-2 regex (llama.cpp's
# LLAMA_VOCAB_PRE_TYPE_{STARCODER,REFACT,COMMAND_R,SMOLLM,CODESHELL,EXAONE,MINERVA})
_DIGIT_SPLIT_PRE = {"starcoder", "refact", "command-r", "smollm", "codeshell", "exaone", "minerva-7b"}

_FALLBACK_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


def check_text(text: str, what: str = "text") -> None:
    """Raise :class:`InvalidTextError` if ``text`` holds a lone UTF-16 surrogate (a string that
    has no UTF-8 encoding); ``what`` names the input in the message."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        ch = text[e.start]
        raise InvalidTextError(
            f"{what} holds a lone UTF-16 surrogate {ch.encode('unicode_escape').decode()} at character "
            f"{e.start}, which is not valid Unicode and cannot be tokenized; remove it, or send the "
            "character it was meant to be (a JSON escape \\ud83d needs its pair after it, e.g. "
            "\\ud83d\\ude00)",
            e.start,
            ch,
        ) from None


@lru_cache(maxsize=1)
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable unicode character map."""
    bs = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, (chr(c) for c in cs), strict=True))


class Tokenizer:
    """Text <-> token ids, special-token ids and the chat template of one model."""

    def __init__(
        self,
        backend: _HFTokenizer,
        bos_token_id: int | None = None,
        eos_token_ids: Sequence[int] = (),
        chat_template: str | None = None,
        add_bos_token: bool = False,
    ) -> None:
        self.backend = backend
        self.bos_token_id = bos_token_id
        self.eos_token_ids = [int(e) for e in eos_token_ids]
        self.chat_template = chat_template
        self.add_bos_token = add_bos_token

    # ------------------------------------------------------------------ basic API
    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    @property
    def bos_token(self) -> str | None:
        return None if self.bos_token_id is None else self.backend.id_to_token(self.bos_token_id)

    @property
    def eos_token(self) -> str | None:
        return None if not self.eos_token_ids else self.backend.id_to_token(self.eos_token_ids[0])

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of ``text``; special tokens written in the text (e.g. ``<|im_start|>``) map to
        their ids. With ``add_special_tokens`` the BOS id is prepended when the model uses one.

        Raises :class:`InvalidTextError` when ``text`` holds a lone surrogate (not valid Unicode).
        """
        try:
            ids = self.backend.encode(text, add_special_tokens=False).ids
        except TypeError:
            # `tokenizers` refuses a str that has no UTF-8 form with a bare TypeError
            # ("TextInputSequence must be str"); say which character and how to fix it.
            if isinstance(text, str):
                check_text(text)
            raise
        if add_special_tokens and self.add_bos_token and self.bos_token_id is not None:
            ids = [self.bos_token_id, *ids]
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kwargs: Any
    ) -> str:
        """Render ``messages`` ([{"role": ..., "content": ...}]) with the model's jinja chat template
        (or a plain ``role: content`` fallback when the model has none). Encode the result with
        ``encode(text)`` -- the template already writes any BOS/role tokens."""
        template = self.chat_template or _FALLBACK_TEMPLATE
        try:
            from jinja2.exceptions import TemplateError
            from jinja2.sandbox import ImmutableSandboxedEnvironment
        except ImportError as e:  # pragma: no cover - jinja2 ships with transformers
            raise ConfigError("apply_chat_template needs jinja2: pip install jinja2") from e

        def raise_exception(msg: str) -> None:
            raise TemplateError(msg)

        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
        )
        env.globals["raise_exception"] = raise_exception
        env.filters["tojson"] = lambda x, indent=None, **_: json.dumps(x, ensure_ascii=False, indent=indent)
        try:
            return env.from_string(template).render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
                **kwargs,
            )
        except TemplateError as e:
            raise ConfigError(f"the chat template failed to render these messages: {e}") from e

    # ------------------------------------------------------------------ constructors
    @classmethod
    def from_gguf_metadata(cls, meta: Mapping[str, Any]) -> Tokenizer:
        """Build from GGUF metadata (a ``key -> value`` dict; arrays as lists)."""
        kind = meta.get("tokenizer.ggml.model")
        if kind != "gpt2":
            raise ConfigError(
                f"GGUF tokenizer model {kind!r} is not supported "
                "(only byte-level BPE, tokenizer.ggml.model='gpt2'); "
                "load the weights with load_gguf(..., with_tokenizer=False) and a tokenizer.json via "
                "Tokenizer.from_hf_dir()"
            )
        tokens = meta.get("tokenizer.ggml.tokens")
        merges = meta.get("tokenizer.ggml.merges")
        if not tokens or merges is None:
            raise CheckpointError(
                "GGUF tokenizer metadata lacks tokenizer.ggml.tokens or tokenizer.ggml.merges"
            )
        token_types = meta.get("tokenizer.ggml.token_type") or [_TOKEN_NORMAL] * len(tokens)
        pre = meta.get("tokenizer.ggml.pre")

        spelling = bytes_to_unicode()
        alphabet = set(spelling.values())
        vocab: dict[str, int] = {}
        for i, tok in enumerate(tokens):
            if not set(tok) <= alphabet:
                tok = "".join(spelling[b] for b in tok.encode("utf-8"))
            vocab[tok] = i
        merge_pairs = []
        for m in merges:
            parts = m.split(" ")
            if len(parts) != 2:
                raise CheckpointError(f"GGUF merge {m!r} is not two space-separated tokens")
            merge_pairs.append((parts[0], parts[1]))
        bpe = models.BPE(
            vocab=vocab,
            merges=merge_pairs,
            fuse_unk=False,
            byte_fallback=False,
            ignore_merges=pre in _IGNORE_MERGES_PRE,
        )
        backend = _HFTokenizer(bpe)
        add_prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", False))
        if pre in _PRE_SPLITS:
            backend.pre_tokenizer = pre_tokenizers.Sequence(
                [
                    pre_tokenizers.Split(Regex(_PRE_SPLITS[pre]), behavior="isolated"),
                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
                ]
            )
        elif pre in _DIGIT_SPLIT_PRE:
            backend.pre_tokenizer = pre_tokenizers.Sequence(
                [
                    pre_tokenizers.Digits(individual_digits=True),
                    pre_tokenizers.ByteLevel(add_prefix_space=add_prefix, use_regex=True),
                ]
            )
        else:
            backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=add_prefix, use_regex=True)
        backend.decoder = decoders.ByteLevel()
        specials = [
            AddedToken(tok, normalized=False, special=True)
            for tok, tt in zip(tokens, token_types, strict=False)
            if tt == _TOKEN_CONTROL and set(tok) <= alphabet
        ]
        if specials:
            backend.add_special_tokens(specials)
        user = [
            AddedToken(tok, normalized=False, special=False)
            for tok, tt in zip(tokens, token_types, strict=False)
            if tt == _TOKEN_USER_DEFINED and tok in vocab
        ]
        if user:
            backend.add_tokens(user)

        bos = meta.get("tokenizer.ggml.bos_token_id")
        eos_ids: list[int] = []
        for key in (
            "tokenizer.ggml.eos_token_id",
            "tokenizer.ggml.eot_token_id",
            "tokenizer.ggml.eom_token_id",
        ):
            v = meta.get(key)
            if v is not None and int(v) not in eos_ids:
                eos_ids.append(int(v))
        return cls(
            backend,
            bos_token_id=None if bos is None else int(bos),
            eos_token_ids=eos_ids,
            chat_template=meta.get("tokenizer.chat_template"),
            add_bos_token=bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        )

    @classmethod
    def from_hf_dir(cls, path: str | Path) -> Tokenizer:
        """Build from a Hugging Face model directory (``tokenizer.json`` required; ``tokenizer_config.json``,
        ``chat_template.jinja``, ``generation_config.json`` and ``config.json`` consulted if present)."""
        path = Path(path)
        tj = path / "tokenizer.json"
        if not tj.is_file():
            raise CheckpointError(
                f"{tj} not found; a Hugging Face model directory needs tokenizer.json "
                "(save it with tokenizer.save_pretrained(dir))"
            )
        try:
            backend = _HFTokenizer.from_file(str(tj))
        except Exception as e:
            raise CheckpointError(f"{tj} could not be parsed ({e}); re-save or re-download it") from e

        def read_json(name: str) -> dict[str, Any]:
            f = path / name
            if not f.is_file():
                return {}
            try:
                return json.loads(f.read_text(encoding="utf-8"))
            except (OSError, ValueError) as e:
                raise CheckpointError(f"{f} is not valid JSON ({e}); re-save or re-download it") from e

        tcfg = read_json("tokenizer_config.json")
        gen = read_json("generation_config.json")
        mcfg = read_json("config.json")

        def token_id(tok: Any) -> int | None:
            if isinstance(tok, Mapping):
                tok = tok.get("content")
            return None if not isinstance(tok, str) else backend.token_to_id(tok)

        bos = token_id(tcfg.get("bos_token"))
        if bos is None:
            bos = gen.get("bos_token_id", mcfg.get("bos_token_id"))
        eos_ids: list[int] = []
        for src in (token_id(tcfg.get("eos_token")), gen.get("eos_token_id"), mcfg.get("eos_token_id")):
            for e in [src] if isinstance(src, int) or src is None else list(src):
                if e is not None and int(e) not in eos_ids:
                    eos_ids.append(int(e))
        template = tcfg.get("chat_template")
        if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, Mapping)}
            template = named.get("default") or next(iter(named.values()), None)
        jinja = path / "chat_template.jinja"
        if template is None and jinja.is_file():
            template = jinja.read_text(encoding="utf-8")
        # tokenizer.json post-processors (e.g. Llama-3's TemplateProcessing) add BOS themselves; we add
        # it by hand in encode(add_special_tokens=True), so only trust add_bos_token.
        add_bos = bool(tcfg.get("add_bos_token", False))
        return cls(
            backend, bos_token_id=bos, eos_token_ids=eos_ids, chat_template=template, add_bos_token=add_bos
        )

    def __repr__(self) -> str:
        return f"Tokenizer(vocab={self.vocab_size}, bos={self.bos_token_id}, eos={self.eos_token_ids})"
