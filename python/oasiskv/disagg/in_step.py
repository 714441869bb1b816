"""In-step reads: a decode step's remote reads start from the plans the step itself publishes, and
overlap the step (issue 37). :class:`InStepReads` owns the mailbox the step writes and the
coordinator's :class:`~oasiskv._core.StepReader` that serves it.

Per layer, on the layer's background stream (a captured CUDA graph's nodes, or the CPU path
inline), after the delta selection and before the gather (:meth:`InStepReads.publish`)::

    plan_slots, plan_blocks  --copy-->  slots[l], blocks[l]      (pinned host memory)   publish
    the step's epoch         --copy-->  ready[l]
    ops.wait_epoch(landed, l, epoch)    holds the stream until the reader writes landed[l]   wait
    gather(l)                           reads what landed

(with ``IN_STEP_TRANSFER_STREAM`` the wait and the gather run on the engine's transfer stream,
after the publish).

The reader (a Rust thread, no GIL) sees ``ready[l]``, submits the plan's block-heads to the
coordinator (the absent ones are read into the host pool, the present ones cost nothing) and
writes ``landed[l]`` once they are in the pool. So the reads of layer l overlap the compute of
the layers after it, and nothing waits on the host between steps: no plans copied back after
the step, no second gather. The host hands each step's block table over before the step
(:meth:`InStepReads.begin_step`). The waits count on the device (``waits``: gave up, the last
one's epoch, nanoseconds held, waits), read after the steps (:meth:`InStepReads.poll`): the time
the GPU waited on late blocks, and a wait that gave up (``timeout_s``: the daemon or the reader
stalled), for which the source fails the step's staged requests (they gathered stale rows).
"""

from __future__ import annotations

import torch

from .. import ops
from .._core import Coordinator, StepReader
from ..errors import ConfigError


class InStepReads:
    """The mailbox of a staged engine's steps and the reader that serves it (see the module
    docs). ``max_rows`` bounds the requests of a step's plan (the engine's padded batch)."""

    def __init__(self, engine, coord: Coordinator, max_rows: int, prefetch: int, timeout_s: float) -> None:
        kv, geo = engine.kv, engine.geo
        layers = engine.cfg.num_hidden_layers
        #: Per layer, the slots each KV head's plan has (the fetch cap of the layer's budget).
        self.caps = [kv.cap_blocks_for(kv.layer_budget(layer)) for layer in range(layers)]
        capacity = max(1, max_rows * geo.num_kv_heads * max(self.caps))
        pin = engine.device.type == "cuda"

        def host(n, dtype):
            return torch.zeros(n, dtype=dtype, pin_memory=pin)

        self.max_rows, self.timeout_s = max_rows, float(timeout_s)
        self.heads = geo.num_kv_heads
        self._rows = 0  # the begun step's plan rows
        self.slots = [host(capacity, torch.int32) for _ in range(layers)]
        self.blocks = [host(capacity, torch.int32) for _ in range(layers)]
        self.ready = host(layers, torch.int64)
        self.landed = host(layers, torch.int64)
        #: ``[waits that gave up, the last one's epoch, nanoseconds held, waits]`` on the device.
        self.waits = torch.zeros(4, dtype=torch.int64, device=engine.device)
        self._seen = (0, 0)  # (gave up, nanoseconds held) at the last poll
        self.epoch = 0  # the last begun step's; only grows (the GPU waits for landed >= epoch)
        self.reader = None
        self.restart(coord, prefetch)

    def restart(self, coord: Coordinator, prefetch: int) -> None:
        """Serve the mailbox with a new reader, for ``coord`` with ``prefetch`` (the source
        opened a new coordinator, or its prefetch changed), between steps. The mailbox stays where
        it is, so captured steps stay valid; the epochs go on from the last (the landed words
        hold the old reader's, which a new step's wait must not take for its own)."""
        if self.reader is not None:
            self.reader.stop()
        self.reader = StepReader(
            coord, self.slots, self.blocks, self.ready, self.landed, self.heads, prefetch=prefetch
        )

    def begin_step(self, host_indptr: torch.Tensor, host_indices: torch.Tensor) -> int:
        """Queue the next step's block table (CPU int32, as the step's gathers read it); returns
        the step's epoch, for the engine to write where the step reads it."""
        rows = host_indptr.numel() - 1
        if rows > self.max_rows:
            raise ConfigError(
                f"a step of {rows} staged-plan rows is past the mailbox's {self.max_rows} "
                "(LLMEngine(max_num_seqs=))"
            )
        self.epoch += 1
        self._rows = rows
        self.reader.begin_step(self.epoch, self.caps, host_indptr, host_indices)
        return self.epoch

    def publish(
        self, layer: int, plan_slots: torch.Tensor, plan_blocks: torch.Tensor, epoch: torch.Tensor
    ) -> None:
        """Queue on the current stream: layer ``layer``'s plan and the step's ``epoch`` (int64
        ``[1]`` on the device) into the mailbox (the reader then starts its reads); the wait for
        them is :meth:`wait`'s."""
        n = plan_slots.numel()
        if tuple(plan_slots.shape[1:]) != (self.heads, self.caps[layer]) or plan_slots.shape[0] != self._rows:
            raise ConfigError(
                f"layer {layer}'s plan has shape {tuple(plan_slots.shape)}; the step's table says "
                f"[{self._rows}, {self.heads}, {self.caps[layer]}]"
            )
        self.slots[layer][:n].copy_(plan_slots.reshape(-1), non_blocking=True)
        self.blocks[layer][:n].copy_(plan_blocks.reshape(-1), non_blocking=True)
        self.ready[layer : layer + 1].copy_(epoch, non_blocking=True)

    def wait(self, layer: int, epoch: torch.Tensor) -> None:
        """Queue on the current stream the wait until the reader has landed layer ``layer``'s
        reads of the step ``epoch`` (after :meth:`publish`, on its stream or one that waited on it)."""
        ops.wait_epoch(self.landed, layer, epoch, self.waits, self.timeout_s)

    def poll(self) -> tuple[int, float]:
        """Since the last call: the waits that gave up, and the seconds the layers' streams were
        held waiting for their reads (reads ``waits``: a device sync on a GPU)."""
        gave_up, _, held, _ = self.waits.tolist()
        (g0, h0), self._seen = self._seen, (gave_up, held)
        return gave_up - g0, (held - h0) / 1e9

    def stats(self) -> dict:
        """The reader's counters (``StepReader.stats``)."""
        return self.reader.stats()

    def close(self) -> None:
        """Stop the reader (a step it was serving gets every layer marked landed)."""
        self.reader.stop()
