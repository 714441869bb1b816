"""What the decode side keeps of its staged requests: each one's state (:class:`StagedState`: its
daemon id, host blocks and rows, its bytes and errors; while its admission runs,
:class:`Admitting`) and the totals of the engine's traffic (:class:`TransferStats`,
``RemoteKvSource.stats``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..engine import Request


@dataclass
class TransferStats:
    """Network traffic of a decode engine's staged requests (all of them, since it started)."""

    requests: int = 0
    #: Wire bytes of the admissions (sent + received frames).
    admission_bytes: int = 0
    #: Wire bytes of the decode-time reads of missing block-heads.
    fetched_bytes: int = 0
    #: Block-heads read during decode (prefetches included).
    fetched_entries: int = 0
    #: Block-heads the decode steps read for themselves and waited for: their own misses (the
    #: coordinator's ``step_entries``).
    miss_entries: int = 0
    #: Block-heads prefetched during decode (landed), and the ones a later step planned
    #: (``RemoteKvSource.decode_prefetch``; the coordinator's ``prefetched_entries`` /
    #: ``prefetch_hits``).
    prefetched_entries: int = 0
    prefetch_hits: int = 0
    #: Bytes of every staged request's whole KV (what a full transfer moves, payload only).
    kv_bytes: int = 0
    #: Block-heads in the host pool that came from the daemon, now and at most.
    cached_bytes: int = 0
    peak_cached_bytes: int = 0
    #: Cached blocks evicted from a bounded host pool (``kv_cache_blocks``): their rows went to
    #: other blocks, so a later read of them crosses the network again.
    evicted_blocks: int = 0
    failures: int = 0
    #: Seconds the decode loop spent handing decode-time reads to the coordinator
    #: (``before_gather[s]``: the plans' copies to the host, the submission, and the waits of
    #: the reads it makes layer by layer: a bounded cache, an admission's first working set).
    read_seconds: float = 0.0
    #: Seconds the decode loop spent blocked on the coordinator's reads (``wait_for_layer_load``
    #: of late layers, the layer-by-layer reads' waits, an admission's per-layer waits for its
    #: own blocks: none once they landed in the background). The reads themselves run on the
    #: coordinator's threads (``RemoteKvSource.coordinator_stats``).
    wait_seconds: float = 0.0


@dataclass
class Admitting:
    """A staged request between ``start_admission`` and ``finish_admission``: its blocks stream
    into its host rows (the coordinator's background reads) while others decode. ``tr``: the
    runtime's admission (``Engine.admit_sparse``); ``query``: the staged query ``[layers,
    num_qo_heads, head_dim]``; ``local``: the unquantized partial last block (float pages over an
    fp8 host pool) or None; ``wire_bytes``: the admission's own reads so far (read ahead, the
    loop's connection); ``coord_bytes``: the coordinator's reads of it so far; ``stream``: the
    entries handed to the coordinator in the background, ``(layers, rows, heads)`` lists (read
    again if the pools move meanwhile), or None."""

    tr: dict
    kv_bytes: int = 0
    query: torch.Tensor | None = None
    local: torch.Tensor | None = None
    wire_bytes: int = 0
    coord_bytes: float = 0.0
    stream: tuple[list[int], list[int], list[int]] | None = None


@dataclass
class StagedState:
    """A staged request on the decode side: its host block ids (summaries), the row of each
    logical block at admission (``host_rows``; with a bounded cache, a filler for the blocks not
    cached), every host row it ever held (``rows``: cleared at its end) and whether its rows are a
    bounded cache (``Runtime.cache_blocks`` hands them out)."""

    daemon_id: int
    req: Request
    host_blocks: list[int]
    host_rows: list[int]
    bounded: bool = False
    rows: set[int] = field(default_factory=set)
    admission_bytes: int = 0
    fetched_bytes: int = 0
    cached_entries: int = 0
    alive: bool = True
    errors: list[str] = field(default_factory=list)
    #: Set while its admission runs (not decoding yet), None after.
    admitting: Admitting | None = None
