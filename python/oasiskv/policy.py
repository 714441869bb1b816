"""Selection policies: which blocks each decode step's attention reads, as a strategy the engine
calls (a public seam for evaluation and experiments; no monkey-patching).

The engine's own policy is OasisKV: the lookahead row predicts the next step's blocks and the
background chain fetches them (the drafter chooses the lookahead: ``"previous-query"`` makes it
the FreeKV-like baseline). A :class:`SelectionPolicy` may change what attention reads at each
layer of a decode step by wrapping the attention callback: :meth:`SelectionPolicy.wrap_attention`
is called once per step, after the plan, with the step's requests, and returns the callback the
model forward runs. The Quest-like ideal (every block resident, the current query's top-K read)
is such a policy over a dense engine: :class:`oasiskv.eval.policies.QuestPolicy`.

Beside it, :class:`BlockSource`: where the host pool's blocks come from (the local host pool, or a
remote source that fills it on demand), the other seam the engine calls at each step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

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


class BlockSource(Protocol):
    """Where the host pool's blocks come from: the engine's own host pool (:class:`LocalHostPool`,
    every block written there by prefill and the decode steps) or a remote source that fills it
    on demand (:class:`oasiskv.disagg.RemoteKvSource`, blocks staged in a daemon). The engine calls
    these without probing (``Engine.block_source``); a source inherits the defaults it does not
    override, which describe a source with blocks left to read that does not evict.

    Attributes:
        local: every block is in the host pool already: the engine neither defers its gathers nor
            keeps a captured step's plans for the source (the local host pool's behaviour).
        idle: nothing to read right now: the engine runs its steps as it would without a source
            (captured CUDA graphs included).
        fixes_up_graph_steps: the engine may replay captured CUDA graphs while blocks are left to
            read, handing each layer's plan to :meth:`before_gathers` after the step and gathering
            again where it read anything.
        may_evict: :meth:`before_gather` may give a host row to another block: the engine lets the
            previous layer's gather finish before calling it, layer by layer.
        reads_in_step: the source reads each layer's plan as the step publishes it
            (:meth:`publish`, the step's table handed over first by :meth:`begin_step`) and the
            layer's gather waits, on its stream, for that layer's reads alone: the engine neither
            defers its gathers nor fixes up graph steps (``oasiskv.disagg.in_step``).
    """

    local: bool = False
    idle: bool = False
    fixes_up_graph_steps: bool = False
    may_evict: bool = True
    reads_in_step: bool = False

    def before_gather(self, layer: int, plan_slots, plan_blocks, host_indptr, host_indices) -> bool:
        """Between a layer's delta selection and its gather: bring the planned blocks the host pool
        lacks. Returns whether the gather's inputs changed (a graph step gathers the layer again)."""
        return False

    def before_gathers(self, plans: list) -> list[bool]:
        """:meth:`before_gather` for a step's layers at once, ``plans`` a list of ``(layer,
        plan_slots, plan_blocks, host_indptr, host_indices)`` in layer order; per plan, whether
        its gather's inputs change (default: one :meth:`before_gather` per plan). The reads may
        still be in flight when it returns: the engine calls :meth:`wait_for_layer_load` before
        each layer's gather."""
        return [self.before_gather(*p) for p in plans]

    def begin_step(self, host_indptr, host_indices) -> int:
        """Before a step of a source that :attr:`reads_in_step`: its host block table (CPU int32,
        as the gathers read it); returns the step's epoch, which the engine writes where the
        step reads it (:meth:`publish`'s ``epoch``)."""
        raise NotImplementedError("a source that reads in the step implements begin_step")

    def publish(self, layer: int, plan_slots, plan_blocks, epoch) -> None:
        """Inside a step of a source that :attr:`reads_in_step`, on the layer's stream right
        after its delta selection: hand the layer's plan over, so that its reads start
        (``epoch``: the step's, int64 ``[1]`` on the device)."""
        raise NotImplementedError("a source that reads in the step implements publish")

    def wait_published(self, layer: int, epoch) -> None:
        """Queue on the current stream, before layer ``layer``'s gather, the wait for the reads
        :meth:`publish` started (the same stream, or a transfer stream that waited for it)."""
        raise NotImplementedError("a source that reads in the step implements wait_published")

    def wait_for_layer_load(self, layer: int) -> float:
        """Block until the blocks :meth:`before_gathers` brings for ``layer`` are in the host pool
        (the one place the decode loop waits for them); the seconds waited (default: nothing is
        in flight)."""
        return 0.0


class LocalHostPool(BlockSource):
    """The engine's own host pool as a :class:`BlockSource` (the default ``Engine.block_source``):
    every block is there already, so there is never anything to read."""

    local = True
    idle = True
    fixes_up_graph_steps = True
    may_evict = False
