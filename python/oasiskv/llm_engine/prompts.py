"""Tokens in and text out: :func:`prompt_token_ids` turns a prompt (text or token ids) into checked
ids, :func:`output_text` is the one detokenisation of generated ids (``LLM.generate``'s ``.text``
and the HTTP server's responses).
"""

from __future__ import annotations

from collections.abc import Sequence

from ..errors import ConfigError
from .params import is_int


def output_text(tokenizer, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
    """The text of generated ``token_ids``: special tokens (end of turn, ...) left out unless
    ``skip_special_tokens`` is False, as vLLM's ``skip_special_tokens=True``. The one
    detokenisation of :attr:`GenerationResult.text` and of the HTTP server's responses."""
    return tokenizer.decode(list(token_ids), skip_special_tokens=skip_special_tokens)


def prompt_token_ids(prompt, tokenizer, vocab_size: int, what: str = "prompt") -> list[int]:
    """A prompt (text, or token ids as a list, tuple, 1-D integer tensor or array) as a list of
    ints, checked against the vocabulary."""
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ConfigError(f"{what} is text but there is no tokenizer; pass token ids or a tokenizer")
        ids = list(tokenizer.encode(prompt))
    else:
        if hasattr(prompt, "tolist") and hasattr(prompt, "dtype"):  # torch tensor / numpy array
            kind = str(prompt.dtype)
            if "int" not in kind or "bool" in kind:
                raise ConfigError(f"{what} must hold integer token ids, got dtype {kind}")
            if getattr(prompt, "ndim", 1) != 1:
                raise ConfigError(f"{what} must be 1-D, got shape {tuple(prompt.shape)}")
            prompt = prompt.tolist()
        if not isinstance(prompt, Sequence) or isinstance(prompt, bytes):
            raise ConfigError(f"{what} must be text or a sequence of token ids, got {type(prompt).__name__}")
        bad = [t for t in prompt if not is_int(t)]
        if bad:
            raise ConfigError(f"{what} has token ids that are not ints: {bad[:5]!r}")
        ids = list(prompt)
    if not ids:
        raise ConfigError(f"{what} is empty; pass at least one token")
    out = [t for t in ids if not 0 <= t < vocab_size]
    if out:
        raise ConfigError(f"{what} has token ids outside the vocabulary 0..{vocab_size}: {out[:5]}")
    return ids
