"""Stand-ins shared by the tests: tokenizers over the tiny models' vocabulary of 301 ids."""

from __future__ import annotations


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
