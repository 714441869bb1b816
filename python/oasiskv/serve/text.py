"""Token ids -> response text: incremental detokenisation and stop strings.

The streamed deltas and the non-streamed text come from the same :class:`TextAssembler`, so the
two agree by construction for the same tokens. A stop string ends the text before it (it is not
part of the output); while streaming, the last ``len(longest stop) - 1`` characters are held back
until it is known they do not start a stop string, so no delta ever has to be taken back.
"""

from __future__ import annotations

from collections.abc import Sequence

#: Decoding an incomplete UTF-8 sequence yields this; such text waits for the next token.
_REPLACEMENT = "\ufffd"


def token_text(tokenizer, ids: Sequence[int]) -> str:
    """The text of token ids as responses show it: special tokens skipped; with no tokenizer
    (``oasis serve`` of a random-weight preset), each id in decimal followed by a space, so
    streams still carry one piece per token."""
    if tokenizer is None:
        return "".join(f"{i} " for i in ids)
    from ..llm_engine import output_text  # the one detokenisation, shared with LLM.generate's .text

    return output_text(tokenizer, ids)


class TextAssembler:
    """The text of one request's generated tokens (special tokens skipped; with no tokenizer, the
    ids in decimal, each followed by a space), cut at the first stop string. ``push`` the new
    token ids of every step; ``delta`` hands out what can be sent."""

    def __init__(self, tokenizer, stops: Sequence[str] = ()) -> None:
        self.tok = tokenizer
        self.stops = list(stops)
        self.holdback = max((len(s) for s in self.stops), default=1) - 1
        self.ids: list[int] = []
        self.text = ""
        self.stopped = False  # a stop string was found: ``text`` ends before it, and is final
        self._prefix = 0  # ids[_prefix:_read] decode to the tail of ``text``
        self._read = 0
        self._sent = 0

    def _decode(self, ids: Sequence[int]) -> str:
        return token_text(self.tok, ids)

    def push(self, new_ids: Sequence[int]) -> None:
        if self.stopped or not new_ids:
            return
        self.ids.extend(new_ids)
        # vLLM's incremental detokenisation: decode a short window and keep only complete text.
        before = self._decode(self.ids[self._prefix : self._read])
        after = self._decode(self.ids[self._prefix :])
        if len(after) > len(before) and not after.endswith(_REPLACEMENT):
            self._append(after[len(before) :])
            self._prefix, self._read = self._read, len(self.ids)

    def finish(self) -> None:
        """The request ended: flush what the window held back (an incomplete last character)."""
        if self.stopped:
            return
        full = self._decode(self.ids)
        if len(full) > len(self.text) and full.startswith(self.text):
            self._append(full[len(self.text) :])

    def _append(self, piece: str) -> None:
        start = max(0, len(self.text) - self.holdback)
        self.text += piece
        if not self.stops:
            return
        hits = [i for i in (self.text.find(s, start) for s in self.stops) if i >= 0]
        if hits:
            self.text = self.text[: min(hits)]
            self.stopped = True

    def delta(self, final: bool = False) -> str:
        """Text not handed out yet that can be sent now (all of it once ``final`` or stopped)."""
        end = len(self.text) if final or self.stopped else max(self._sent, len(self.text) - self.holdback)
        piece = self.text[self._sent : end]
        self._sent = end
        return piece


class StopChecker:
    """The engine-side test for stop strings (``LLMEngine.add_request(stop=...)``): called on the
    engine thread after every token, it decodes only the tail that could hold a new match. The
    :class:`TextAssembler` on the HTTP side stays the authority on where the text ends."""

    def __init__(self, tokenizer, stops: Sequence[str]) -> None:
        self.tok = tokenizer
        self.stops = list(stops)
        # A character is at most 4 byte-level tokens; a few more for a leading partial character.
        self.window = 4 * max(len(s) for s in self.stops) + 8

    def __call__(self, generated: list[int]) -> bool:
        tail = self.tok.decode(generated[-self.window :], skip_special_tokens=True)
        return any(s in tail for s in self.stops)


class TokenPieces:
    """Token ids -> the text and UTF-8 bytes each one stands for (the ``logprobs`` entries).

    A byte-level BPE token (GPT-2, Llama 3, Qwen, SmolLM) is a run of bytes, spelled in the
    vocabulary through GPT-2's byte-to-character map; its bytes come from inverting that map, so
    a token holding part of a character still has its exact bytes (its text then carries U+FFFD,
    as OpenAI's does). Other tokenizers: the token's decoded text. With no tokenizer, each token
    reads as its id and a space (as :class:`TextAssembler`'s text)."""

    def __init__(self, tokenizer) -> None:
        self.tok = tokenizer
        self._byte_of: dict[str, int] | None = None
        # OasisKV's Tokenizer wraps a `tokenizers` backend; another tokenizer object (one passed
        # as LLMEngine(tokenizer=...)) is read through its decode() alone.
        self._backend = getattr(tokenizer, "backend", None)
        if self._backend is not None and hasattr(self._backend, "to_str"):
            import json

            from ..models.tokenizer import bytes_to_unicode

            decoder = json.loads(self._backend.to_str()).get("decoder") or {}
            kinds = {decoder.get("type")} | {d.get("type") for d in decoder.get("decoders", [])}
            if "ByteLevel" in kinds:
                self._byte_of = {c: b for b, c in bytes_to_unicode().items()}
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def __call__(self, token_id: int) -> tuple[str, list[int]]:
        """``(text, bytes)`` of one token."""
        got = self._cache.get(token_id)
        if got is not None:
            return got
        if self.tok is None:
            raw = f"{token_id} ".encode()
        else:
            spelled = ""
            if self._byte_of is not None:
                spelled = self._backend.id_to_token(token_id) or ""
            if spelled and all(c in self._byte_of for c in spelled):
                raw = bytes(self._byte_of[c] for c in spelled)
            else:
                raw = self.tok.decode([token_id]).encode("utf-8")
        got = (raw.decode("utf-8", errors="replace"), list(raw))
        if len(self._cache) < 1 << 16:
            self._cache[token_id] = got
        return got

    def is_special(self, token_id: int) -> bool:
        """Whether the token is skipped in the response text (a special token: EOS, ...)."""
        return self.tok is not None and self.tok.decode([token_id], skip_special_tokens=True) == ""
