"""What ``oasis serve`` is configured with beyond the engine: :class:`ServeConfig` and the defaults
its flags share with it.

Its own module, free of FastAPI, so that :mod:`~oasiskv.serve.cli` (the flags) and
:mod:`~oasiskv.serve.app` (the server) both import it and neither imports the other's module
for it: the flags build a ``ServeConfig`` and the app reads one.
"""

from __future__ import annotations

from dataclasses import dataclass

#: Default cap on a request body. Arbitrary: a 128K-token prompt is well under 1 MiB of text.
DEFAULT_MAX_BODY_BYTES = 8 << 20
DEFAULT_MAX_QUEUE = 128
#: New tokens of a request that names no budget (chat without max_tokens, or "max_tokens": null),
#: capped by what is left of the context. Arbitrary, but bounded: admission reserves a request's
#: peak KV, so "the rest of the context" would make every such request reserve the whole window.
DEFAULT_MAX_TOKENS = 2048


@dataclass
class ServeConfig:
    """What the server needs beyond the engine.

    Attributes:
        model_name: the id clients pass as ``model`` (and ``/v1/models`` lists).
        api_key: when set, every endpoint but ``/health`` needs ``Authorization: Bearer KEY``.
        max_queue: requests that may wait beyond the ``max_num_seqs`` running ones; past that,
            429 with ``Retry-After``.
        max_body_bytes: the largest request body accepted (413 past it).
        model_aliases: more ids the model answers to (``--served-model-name A B``: A is
            ``model_name``, B an alias); a response names the id its request used.
        max_tokens_default: the new-token budget of a request that gives none (chat without
            ``max_tokens``, or ``"max_tokens": null``), capped by what is left of the context.
    """

    model_name: str
    api_key: str | None = None
    max_queue: int = DEFAULT_MAX_QUEUE
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    model_aliases: tuple[str, ...] = ()
    max_tokens_default: int = DEFAULT_MAX_TOKENS

    @property
    def model_names(self) -> tuple[str, ...]:
        return (self.model_name, *self.model_aliases)
