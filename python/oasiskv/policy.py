"""Selection policies: which blocks each decode step's attention reads, as a strategy the engine
calls (a public seam for evaluation and experiments; no monkey-patching).

The engine's own policy is OasisKV: the lookahead row predicts the next step's blocks and the
background chain fetches them (the drafter chooses the lookahead: ``"previous-query"`` makes it
the FreeKV-like baseline). A :class:`SelectionPolicy` may change what attention reads at each
layer of a decode step by wrapping the attention callback: :meth:`SelectionPolicy.wrap_attention`
is called once per step, after the plan, with the step's requests, and returns the callback the
model forward runs. The Quest-like ideal (every block resident, the current query's top-K read)
is such a policy over a dense engine: :class:`oasiskv.eval.policies.QuestPolicy`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

AttnFn = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class SelectionPolicy:
    """Base class: the engine as it is (no change to attention).

    Attributes:
        name: a short name for reports.
        backend: the engine backend the policy needs (``"oasis"`` or ``"dense"``), or None for any.
    """

    name = "oasis"
    backend: str | None = None

    def bind(self, engine) -> None:
        """Called once by the engine that runs the policy; raise ConfigError if it cannot."""
        from .errors import ConfigError

        if self.backend is not None and engine.backend != self.backend:
            raise ConfigError(
                f"the {self.name} policy runs on a {self.backend!r} engine, got backend={engine.backend!r}"
            )

    def wrap_attention(self, engine, reqs: list, attn: AttnFn) -> AttnFn:
        """The attention callback of one decode step over ``reqs`` (default: unchanged)."""
        return attn

    def after_step(self, engine, reqs: list) -> None:
        """Called after every decode step's forward (bookkeeping such as per-step counters)."""
