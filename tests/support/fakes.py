"""Stand-ins shared by the tests: tokenizers over the tiny models' vocabulary of 301 ids, a tiny
random Qwen3-family model, repetitive prompts, and the engine's "pools are full again" check."""

from __future__ import annotations

import torch

from oasiskv.models.transformer import CausalLM
from support.configs import TINY_QWEN3


class ByteTokenizer:
    """UTF-8 bytes as token ids; no special tokens."""

    eos_token_ids: list[int] = []

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return bytes(int(i) % 256 for i in ids).decode("utf-8", errors="replace")

    def token_to_id(self, token: str):
        return None


class AsciiTokenizer(ByteTokenizer):
    """Prompts as UTF-8 bytes; every generated id decodes to one printable ASCII character, so
    retrieval answers are decided (and generation stops) early."""

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return "".join(chr(32 + int(i) % 95) for i in ids)


def tiny(seed: int = 1, layers: int = 2, vocab: int = 301, hidden: int = 64) -> CausalLM:
    """A random Qwen3-family model small enough for many engine runs on 2 cores."""
    cfg = TINY_QWEN3.replace(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers)
    return CausalLM.random(cfg, seed=seed)


def prompt(n: int, seed: int, vocab: int = 301) -> list[int]:
    """``n`` token ids repeating a random 29-token phrase, so the n-gram drafter finds matches."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randint(0, vocab, (29,), generator=g).tolist()
    return (base * (n // 29 + 1))[:n]


def drain(eng) -> dict:
    """Step an ``LLMEngine`` until every request finished, checking the runtime's invariants after
    every step; returns each request's final output by request id."""
    final = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                final[out.request_id] = out
        eng.engine.runtime.check_invariants()
    return final


def pools_are_full(eng) -> bool:
    """Every block of an ``LLMEngine``'s pools is free again and nothing is reserved."""
    rt = eng.engine.runtime
    return rt.num_requests == 0 and rt.num_free == rt.pool_sizes and rt.reserved == (0, 0, 0)
