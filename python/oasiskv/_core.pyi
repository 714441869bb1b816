"""Type stub of the native module ``oasiskv._core`` (crates/oasis-py). Checked against the built module by
tests/runtime/test_stub.py: every public name, and every function's parameters, must match.

Kernel functions dispatch on their tensors' device: all on the CPU runs the CPU twins; all on one
``cuda:N`` (the host pool may be pinned CPU memory) queues the CUDA kernels on ``stream`` (the raw
``cudaStream_t`` of a live stream of that device, ``torch.cuda.current_stream(device).cuda_stream``;
0 = the legacy default stream) and returns without synchronising.
"""

import torch

__version__: str

# The shared limits, one source each (oasis_core::limits; the kernels are compiled with them).
#: Largest ``block_size`` (tokens per page).
MAX_BLOCK_SIZE: int
#: Largest ``top_k_blocks``: the most blocks the GPU top-K selects per KV head (topk_blocks' k).
MAX_TOP_K_BLOCKS: int
#: Largest ``m + successors`` of the GPU topk_candidates.
MAX_CANDIDATES: int
#: Largest budget (slots per sequence) of the GPU delta_select.
MAX_SELECT_BUDGET: int
#: Largest pool (GPU pages, host blocks): ids are int32 on the GPU (2**31 - 1).
MAX_POOL_BLOCKS: int
#: Largest token count of a sequence: positions are int32 on the GPU (2**31 - 1).
MAX_TOKENS: int
#: Largest ``head_dim`` the kernels support.
MAX_HEAD_DIM: int

class KvGeometry:
    """The KV shape of a model: query heads, KV heads, head_dim, tokens per block."""

    def __new__(cls, num_qo_heads: int, num_kv_heads: int, head_dim: int, block_size: int) -> KvGeometry: ...
    @property
    def num_qo_heads(self) -> int:
        """Query (output) heads."""
    @property
    def num_kv_heads(self) -> int:
        """KV heads; num_qo_heads is a multiple of it."""
    @property
    def head_dim(self) -> int:
        """Elements per head vector."""
    @property
    def block_size(self) -> int:
        """Tokens per block (page)."""

class BlockPool:
    """Free list of fixed-size blocks: the GPU page pool or the host pool of one engine."""

    def __new__(cls, tier: str, num_blocks: int) -> BlockPool: ...
    @property
    def num_blocks(self) -> int:
        """Blocks in the pool."""
    @property
    def num_free(self) -> int:
        """Blocks free now."""
    def allocate(self, n: int) -> list[int]:
        """Allocate ``n`` blocks, all or nothing (OutOfBlocksError otherwise)."""
    def free(self, ids: list[int]) -> None:
        """Return blocks to the pool; raises on a double free or an unknown id."""

class Runtime:
    """Pools, block tables, admission and the step plan of one engine (``oasis-runtime``)."""

    def __new__(
        cls,
        *,
        block_size: int,
        top_k_blocks: int,
        sparse_threshold: int,
        sparse: bool,
        rows: int,
        measure_recall: bool,
        plan_blk_seq: bool,
        max_num_seqs: int,
        gpu_pages: int,
        host_blocks: int,
        gpu_cap: int,
        host_cap: int,
    ) -> Runtime: ...
    def reservation(
        self, prompt_len: int, max_new_tokens: int, *, sparse: bool = False, cache_blocks: int | None = None
    ) -> tuple[int, int, bool]:
        """``(gpu_pages, host_rows, turns_sparse)``: the peak a request of this size reserves
        (``sparse=True``: admitted with :meth:`admit_sparse`, ``cache_blocks`` as there). A local
        request takes one host row with every host block id."""
    def fits_ever(
        self, prompt_len: int, max_new_tokens: int, *, sparse: bool = False, cache_blocks: int | None = None
    ) -> bool:
        """Whether such a request fits the caps at all (alone)."""
    def can_admit(
        self, prompt_len: int, max_new_tokens: int, *, sparse: bool = False, cache_blocks: int | None = None
    ) -> bool:
        """Whether such a request can be admitted now."""
    def pool_sizes_needed(
        self, prompt_len: int, max_new_tokens: int, *, sparse: bool = False, cache_blocks: int | None = None
    ) -> tuple[int, int, int]:
        """``(gpu_pages, host_blocks, host_rows)`` the pools must hold to admit such a request now."""
    def grow(self, gpu_pages: int, host_blocks: int, host_rows: int) -> None:
        """Grow the pools' id ranges (after the engine grew its tensors): pages, host block ids
        (summaries, codes), host rows (``host_k``/``host_v``)."""
    def admit(self, id: int, prompt_len: int, max_new_tokens: int) -> tuple[int, list[int]]:
        """Admit a request about to be prefilled: ``(slot, pages)``."""
    def admit_sparse(
        self, id: int, prompt_len: int, max_new_tokens: int, cache_blocks: int | None = None
    ) -> dict:
        """Admit a request whose prompt's KV is stored elsewhere (staged) directly sparse: only
        the working set and the prompt's host blocks. ``slot`` plus :meth:`make_sparse`'s keys
        (``src_pages`` empty). ``cache_blocks=C``: host rows only for the blocks it writes plus
        ``C`` cache rows (:meth:`cache_blocks`)."""
    def cache_blocks(
        self, id: int, logicals: list[int], pinned: list[int]
    ) -> tuple[list[int], list[int], list[tuple[int, int]]]:
        """Give host rows to the request's logical blocks before a gather reads them: ``(rows,
        given, evicted)`` (the LRU cached blocks outside ``pinned`` and ``logicals`` evicted);
        OutOfBlocksError, nothing changed, when every cache row is pinned."""
    def wants_sparse(self, id: int) -> bool:
        """Whether the request should turn sparse now."""
    def can_append(self, id: int) -> bool:
        """Whether the request's draft may take the position after its last planned token."""
    def pending_drafts(self) -> list[int]:
        """The requests whose drafts hold a tentative slot (the last speculative plan)."""
    def commit_drafts(self, accepted: list[int]) -> None:
        """Store the drafts of ``accepted`` (tentative slots kept), give every other slot back."""
    def make_sparse(self, id: int) -> dict:
        """Turn a request sparse; what the engine copies and selects on the device."""
    def release(self, id: int) -> None:
        """Free everything the request holds."""
    def kv_len(self, id: int) -> int:
        """Tokens stored for the request."""
    def table(self, id: int) -> dict:
        """The request's tables."""
    def take_map_updates(self) -> tuple[list[int], list[int]]:
        """Drain the pending head-wise mapping updates."""
    def plan(
        self,
        ids: list[int],
        input_ids: list[int],
        pad: tuple[int, int, int, int] | None = None,
        tries: list[bool] | None = None,
    ) -> tuple[int, dict[str, tuple[int, int]], int, int]:
        """Plan one decode step: ``(arena_len, layout, num_sparse, max_pages)``; ``pad = (rows,
        pages, blocks, dummy_slot)`` lays it out at fixed capacities (mapping updates stay pending);
        ``tries`` (per request) reserves tentative draft slots (``spec_*`` fields, ``commit_drafts``)."""
    def step_needs(self, ids: list[int]) -> tuple[int, int]:
        """``(pages, blocks)`` a padded plan of ``ids`` must allow per request."""
    def write_plan(self, out: torch.Tensor) -> None:
        """Copy the last plan's arena into ``out`` (int32, CPU, contiguous)."""
    def check_invariants(self) -> None:
        """Check every table invariant against the pools."""
    @property
    def pool_sizes(self) -> tuple[int, int, int]:
        """``(gpu_pages, host_blocks, host_rows)`` in the pools now."""
    @property
    def num_free(self) -> tuple[int, int, int]:
        """Free entries per pool."""
    @property
    def reserved(self) -> tuple[int, int, int]:
        """Entries reserved by the admitted requests, per pool."""
    @property
    def caps(self) -> tuple[int, int, int]:
        """The pools' caps (budgets) in blocks."""
    @property
    def num_requests(self) -> int:
        """Admitted requests."""

class RtClient:
    """A blocking client of one ``oasis-rt`` staging daemon: its own connection and tokio
    runtime; every call releases the GIL and finishes within ``timeout_s``; errors are the
    ``oasiskv.errors.Remote*`` classes (with ``.code``). Staging takes CPU tensors or bytes-like
    objects (one copy into the frame); replies come back as bytearrays (``torch.frombuffer``).
    ``addr``: ``HOST:PORT`` or ``oasis-rt://HOST:PORT`` (TCP), ``oasis-rt+ucx://HOST:PORT`` (UCX;
    ``ConfigError`` with ``.code == "ucx_unavailable"`` where libucp cannot be loaded). Over UCX
    ``read_blocks`` reads the block bytes from the daemon's registered memory by RMA (``rma``)."""

    def __new__(
        cls,
        addr: str,
        token: str | bytes | None = None,
        timeout_s: float = 30.0,
        connect_timeout_s: float = 5.0,
        max_frame: int | None = None,
        rma: bool = True,
    ) -> RtClient: ...
    def stage_blocks(
        self,
        request: int,
        geometry: tuple[int, int, int, int, int, int, int],
        keys: list[tuple[int, int]],
        data: torch.Tensor | bytes | bytearray | memoryview,
    ) -> tuple[int, int]:
        """Stage whole blocks ``(layer, block)``, ``geometry.block_bytes`` of ``data`` each:
        ``(stored_bytes, used_bytes)``. ``geometry = (num_layers, num_kv_heads, block_size,
        head_dim, dtype_bytes, num_blocks, kv_format)``, ``kv_format`` 0 (plain) or 1 (fp8_e4m3:
        each head's codes, then its float32 scale)."""
    def stage_summaries(
        self,
        request: int,
        geometry: tuple[int, int, int, int, int, int, int],
        runs: list[tuple[int, int, int]],
        data: torch.Tensor | bytes | bytearray | memoryview,
    ) -> tuple[int, int]:
        """Stage summary rows, runs of ``(layer, first_block, num_blocks)``: ``(stored_bytes,
        used_bytes)``."""
    def stage_admission(
        self,
        request: int,
        selected: list[tuple[int, int]],
        sections: dict[str, torch.Tensor | bytes | bytearray | memoryview] | None = None,
    ) -> tuple[int, int]:
        """Set the admission set: selected ``(layer, block)`` and named sections."""
    def fetch_admission(
        self, request: int, first_layer: int, num_layers: int, include_sections: bool = True
    ) -> dict:
        """The admission set of a layer range: ``geometry``, ``summary_runs``, ``summaries``,
        ``block_keys``, ``blocks``, ``sections``, ``wire_bytes``."""
    def read_blocks(
        self, keys: list[tuple[int, int, int, int]]
    ) -> tuple[bytearray, list[int], list[str | None]]:
        """Read ``(request, layer, block, head)`` entries (head -1: the whole block): ``(data, lens,
        errors)``."""
    def read_blocks_into(
        self,
        keys: list[tuple[int, int, int, int]],
        rows: list[int],
        host_k: list[torch.Tensor],
        host_v: list[torch.Tensor],
        host_k_scales: list[torch.Tensor] | None = None,
        host_v_scales: list[torch.Tensor] | None = None,
    ) -> tuple[list[int], list[str | None]]:
        """``read_blocks`` written straight into row ``rows[i]`` (that head, or every head) of the
        key's layer's pools ``[rows, num_kv_heads, block_size, head_dim]`` (CPU, contiguous):
        ``(lens, errors)``; an entry of another size fails with ``"size_mismatch"``. fp8 pools
        (uint8 codes; ``kv_format`` 1) pass their float32 ``[rows, num_kv_heads]`` scales too."""
    def release(self, request: int) -> int:
        """Release a request in the daemon; the bytes freed."""
    def stats(self) -> dict[str, int]:
        """The daemon's counters and gauges."""
    def close(self) -> None:
        """Drop the connection (idempotent)."""
    @property
    def connected(self) -> bool:
        """Whether the connection is still usable."""
    @property
    def wire_bytes(self) -> tuple[int, int]:
        """``(sent, received)`` bytes of every frame exchanged."""
    @property
    def max_frame(self) -> int:
        """The largest frame this client sends."""
    @property
    def addr(self) -> str:
        """The daemon's ``HOST:PORT``."""
    @property
    def url(self) -> str:
        """The daemon's URL, ``oasis-rt://HOST:PORT`` or ``oasis-rt+ucx://HOST:PORT``."""
    @property
    def transport(self) -> str:
        """``"tcp"`` or ``"ucx"``."""
    @property
    def rma(self) -> bool:
        """Whether ``read_blocks`` reads the bytes by RMA (UCX, and ``rma=True``)."""
    @property
    def timeout_s(self) -> float:
        """The deadline of every call, in seconds."""

class Coordinator:
    """The decode side's remote reads (crate ``oasis-coord``): the presence map of the staged
    block-heads in the host pool, the staged requests, N connections of its own to the daemon at
    ``addr`` (TCP or UCX, as ``RtClient``) and tokio threads that write each read entry straight
    into the registered pinned pools. ``submit`` returns at once; ``wait_layer`` blocks (the GIL
    released) until that layer's entries landed or failed. An entry is marked present only once
    its bytes are written; a failed read fails the requests of its entries (``take_failed``).
    A frame that fails in transport reconnects and is sent again ``retries`` times; every call
    of a connection finishes within ``timeout_s``."""

    def __new__(
        cls,
        addr: str,
        num_layers: int,
        num_kv_heads: int,
        *,
        token: str | bytes | None = None,
        timeout_s: float = 30.0,
        connect_timeout_s: float = 5.0,
        retries: int = 0,
        connections: int = 1,
        threads: int = 1,
        rma: bool = True,
        split_min_entries: int = 256,
        frame_bytes: int = 4194304,
    ) -> Coordinator: ...
    def register_pools(
        self,
        host_k: list[torch.Tensor],
        host_v: list[torch.Tensor],
        host_k_scales: list[torch.Tensor] | None = None,
        host_v_scales: list[torch.Tensor] | None = None,
    ) -> dict[int, int]:
        """The pools the reads write into, one contiguous CPU ``[rows, num_kv_heads, block_size,
        head_dim]`` tensor per layer (fp8: uint8 codes and float32 ``[rows, num_kv_heads]``
        scales); again whenever they grow or are replaced (after the reads in flight land). The
        coordinator keeps the tensors alive until the next registration or ``close``. Returns,
        when they moved, per request how many prefetched block-heads are absent again (landed
        since the last step's submission: they may have missed the copy)."""
    @property
    def rows(self) -> int:
        """Host rows of the registered pools (0: none)."""
    def stage(self, request: int, daemon_id: int) -> None:
        """Engine request ``request`` reads from the daemon's staged request ``daemon_id``."""
    def end(self, request: int, rows: list[int]) -> int:
        """``request`` ends: wait for its reads, forget it, give its ``rows`` back; how many of
        their entries held their bytes."""
    def take_row(self, row: int, request: int, logical: int) -> None:
        """Host row ``row`` now holds staged block ``logical`` of ``request``: every entry absent."""
    def set_owner(self, row: int, request: int) -> None:
        """``row`` names ``request`` without holding a staged block (a bounded cache's filler)."""
    def forget_row(self, row: int) -> int:
        """The block in ``row`` was evicted; how many of its entries held their bytes."""
    def mark_present(self, layers: list[int], rows: list[int], heads: list[int]) -> list[int]:
        """Entries the caller wrote itself (head -1: every head); per entry how many were absent."""
    def absent_blocks(self, layer: int, rows: list[int]) -> list[int]:
        """The ``rows`` of ``layer`` with some head absent."""
    def is_present(self, layer: int, row: int, head: int) -> bool:
        """Whether that entry holds its bytes."""
    def owners(self, rows: list[int]) -> list[tuple[int, int]]:
        """Per row ``(request, logical block)``; request -1 for a row no staged request holds."""
    @property
    def missing(self) -> int:
        """Absent entries, all layers."""
    def submit(
        self,
        layers: list[int],
        rows: list[int],
        heads: list[int],
        *,
        background: bool = False,
        prefetch: int = 0,
    ) -> list[int]:
        """Read the absent entries among ``(layers[i], rows[i], heads[i])`` (head -1: every head)
        of no failed request (a step takes over background reads of them); returns at once, per
        layer how many its ``wait_layer`` waits for. ``background``: no step waits for them
        (``wait_layer`` skips them; ``wait_request``). ``prefetch=N`` (a step's): then up to N
        background reads of the blocks the next steps likely plan, at most N in flight."""
    def wait_layer(self, layer: int) -> float:
        """Block until ``layer``'s entries submitted for a step landed or failed; the seconds
        waited."""
    def drain(self) -> float:
        """Block until every read in flight landed or failed; the seconds waited."""
    def pending(self, layer: int) -> int:
        """Entries of ``layer`` in flight."""
    def in_flight(self, request: int, layer: int | None = None) -> int:
        """Entries of ``request`` in flight (of ``layer`` only, when given); 0: all landed or failed."""
    def wait_request(self, request: int, layer: int | None = None) -> float:
        """Block until ``request``'s submitted entries (of ``layer`` only, when given) landed or
        failed; the seconds waited."""
    def release(self, daemon_id: int) -> None:
        """Release the daemon's staged request from a connection's thread (best effort, after
        the frames queued on it); returns at once."""
    def fail(self, request: int, message: str) -> None:
        """Fail ``request`` for the caller's own reason (nothing of it is read until it ends)."""
    def take_failed(self) -> dict[int, str]:
        """Requests whose reads failed since the last call -> why."""
    def take_landed(self) -> dict[int, tuple[int, int]]:
        """Per request since the last call: ``(block-heads landed, wire bytes)``."""
    def stats(self) -> dict[str, float]:
        """``read_seconds``, ``wait_seconds``, ``wire_bytes``, ``sent_entries``, ``entries``,
        ``failed_entries``, ``frames``, ``reconnects``, ``releases``, ``failed_releases``,
        ``step_entries``, ``prefetch_entries``, ``prefetched_entries``, ``prefetch_hits``,
        ``prefetch_taken``, ``prefetch_cancelled``, ``prefetch_dropped``."""
    def close(self) -> None:
        """Let the reads in flight land, stop the connections and threads (idempotent)."""

class StepReader:
    """The step reader of a ``Coordinator`` (crate ``oasis-coord``, its own thread): each layer of
    a decode step writes its plan into ``slots[l]`` / ``blocks[l]`` and the step's epoch into
    ``ready[l]``; the reader submits the plan's block-heads to the coordinator and writes
    ``landed[l]`` once they are in the pool (``wait_epoch`` holds the layer's stream until then).
    The mailbox is CPU tensors (pinned for a CUDA step), kept alive until ``stop``."""

    def __new__(
        cls,
        coordinator: Coordinator,
        slots: list[torch.Tensor],
        blocks: list[torch.Tensor],
        ready: torch.Tensor,
        landed: torch.Tensor,
        num_kv_heads: int,
        *,
        prefetch: int = 0,
    ) -> StepReader: ...
    def begin_step(
        self, epoch: int, caps: list[int], host_indptr: torch.Tensor, host_indices: torch.Tensor
    ) -> None:
        """Queue a step's tables before it runs: its epoch (above the last), each layer's plan
        slots per KV head, its host block table (CPU int32)."""
    @property
    def queued(self) -> int:
        """Steps begun and not yet fully landed."""
    def stats(self) -> dict[str, float]:
        """``steps``, ``layers``, ``entries``, ``bad_entries``, ``refused``, ``stale_steps``,
        ``read_seconds``, ``last_error``."""
    def stop(self) -> None:
        """Stop the thread (the step being served gets every layer marked landed; idempotent)."""

def ucx_version() -> tuple[int, int, int]:
    """The loaded libucp's ``(major, minor, release)``; ``ConfigError`` (``.code ==
    "ucx_unavailable"``) when it cannot be loaded."""

def append_kv(
    geo: KvGeometry,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    page_ids: torch.Tensor,
    page_offsets: torch.Tensor,
    host_block_ids: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    host_k: torch.Tensor,
    host_v: torch.Tensor,
    summaries: torch.Tensor,
    *,
    host_rows: torch.Tensor | None = None,
    k_scales: torch.Tensor | None = None,
    v_scales: torch.Tensor | None = None,
    host_k_scales: torch.Tensor | None = None,
    host_v_scales: torch.Tensor | None = None,
    stream: int = 0,
) -> None:
    """Append one token per sequence, with write-through and summary update for sparse sequences;
    a tier of uint8 (fp8_e4m3) pages passes its scales."""

def decode_attention(
    geo: KvGeometry,
    q: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    kv_last_page_len: torch.Tensor,
    page_map: torch.Tensor | None,
    extra_k: torch.Tensor | None,
    extra_v: torch.Tensor | None,
    sm_scale: float,
    out: torch.Tensor,
    *,
    num_splits: int = 0,
    max_pages_per_seq: int = 0,
    workspace: torch.Tensor | None = None,
    k_scales: torch.Tensor | None = None,
    v_scales: torch.Tensor | None = None,
    stream: int = 0,
) -> None:
    """Decode attention of stacked query rows over paged, head-wise working sets (split-KV on the GPU)."""

def build_summaries(
    geo: KvGeometry,
    host_k: torch.Tensor,
    block_ids: torch.Tensor,
    block_lens: torch.Tensor,
    summaries: torch.Tensor,
    *,
    block_rows: torch.Tensor | None = None,
    stream: int = 0,
) -> None:
    """Recompute the min/max summaries of host blocks over their first ``block_lens`` tokens (keys
    in host rows ``block_rows``; ``None``: the row is the block id)."""

def score_blocks(
    geo: KvGeometry,
    q: torch.Tensor,
    summaries: torch.Tensor,
    blk_indptr: torch.Tensor,
    blk_indices: torch.Tensor,
    scores: torch.Tensor,
    *,
    stream: int = 0,
) -> None:
    """Quest block scores of the lookahead queries, summed over each GQA group, into ``scores``."""

def build_key_codes(
    geo: KvGeometry,
    host_k: torch.Tensor,
    bounds8: torch.Tensor,
    scales: torch.Tensor,
    block_ids: torch.Tensor,
    codes: torch.Tensor,
    *,
    block_rows: torch.Tensor | None = None,
    stream: int = 0,
) -> None:
    """Encode every key of complete host blocks to 2 bits per channel inside the block's decoded
    8-bit bound (``codes [num_host_blocks, num_kv_heads, block_size, head_dim // 4]`` uint8)."""

def encode_blocks(
    geo: KvGeometry,
    host_k: torch.Tensor,
    summaries: torch.Tensor,
    block_ids: torch.Tensor,
    codes: torch.Tensor,
    bounds8: torch.Tensor,
    scales: torch.Tensor,
    *,
    block_rows: torch.Tensor | None = None,
    stream: int = 0,
) -> None:
    """``build_bounds8`` then ``build_key_codes`` (inside that bound) of the same complete host
    blocks in one launch."""

def build_bounds8(
    geo: KvGeometry,
    summaries: torch.Tensor,
    block_ids: torch.Tensor,
    bounds8: torch.Tensor,
    scales: torch.Tensor,
    *,
    stream: int = 0,
) -> None:
    """The 8-bit (E4M3, outward-rounded) Quest bounds and power-of-two scales of complete host blocks."""

def score_blocks_bound8(
    geo: KvGeometry,
    q: torch.Tensor,
    bounds8: torch.Tensor,
    scales: torch.Tensor,
    blk_indptr: torch.Tensor,
    blk_indices: torch.Tensor,
    scores: torch.Tensor,
    *,
    stream: int = 0,
) -> None:
    """Quest block scores over the 8-bit bounds (an upper bound, at least score_blocks'), into ``scores``."""

def score_blocks_codes(
    geo: KvGeometry,
    q: torch.Tensor,
    bounds8: torch.Tensor,
    scales: torch.Tensor,
    codes: torch.Tensor,
    blk_indptr: torch.Tensor,
    blk_indices: torch.Tensor,
    scores: torch.Tensor,
    *,
    stream: int = 0,
) -> None:
    """Block scores from the 2-bit key codes inside the 8-bit bounds (the group sum of each block's
    largest approximate logit; NaN for a NaN scale) into ``scores``."""

def rescore_blocks_codes(
    geo: KvGeometry,
    q: torch.Tensor,
    bounds8: torch.Tensor,
    scales: torch.Tensor,
    codes: torch.Tensor,
    blk_indptr: torch.Tensor,
    blk_indices: torch.Tensor,
    cand: torch.Tensor,
    scores: torch.Tensor,
    *,
    stream: int = 0,
) -> None:
    """The codes score of the candidate logical blocks ``cand [num_seqs, num_kv_heads, m]`` into
    ``scores [num_seqs * m, num_kv_heads]`` (-inf for a negative candidate)."""

def rescore_topk_codes(
    geo: KvGeometry,
    q: torch.Tensor,
    bounds8: torch.Tensor,
    scales: torch.Tensor,
    codes: torch.Tensor,
    blk_indptr: torch.Tensor,
    blk_indices: torch.Tensor,
    cand: torch.Tensor,
    k: int,
    out: torch.Tensor,
    scratch: torch.Tensor,
    counters: torch.Tensor,
    *,
    successors: int = 0,
    forced: torch.Tensor | None = None,
    stream: int = 0,
) -> None:
    """``rescore_blocks_codes`` then ``topk_candidates`` in one launch: the ``k`` best candidates
    as logical blocks into ``out [num_seqs, num_kv_heads, k]``."""

def topk_blocks(
    num_kv_heads: int,
    scores: torch.Tensor,
    blk_indptr: torch.Tensor,
    k: int,
    out: torch.Tensor,
    *,
    index_map: torch.Tensor | None = None,
    forced: torch.Tensor | None = None,
    stream: int = 0,
) -> None:
    """Per (seq, kv head) top-k logical blocks, best first, ties to the lower index, -1 padded;
    with index_map [num_seqs, num_kv_heads, m], each chosen position i as index_map[s, h, i];
    with forced [num_seqs, num_kv_heads, F], force_scores first (scores written), not with
    index_map."""

def force_scores(
    num_kv_heads: int,
    scores: torch.Tensor,
    blk_indptr: torch.Tensor,
    forced: torch.Tensor,
    *,
    stream: int = 0,
) -> None:
    """Set the forced entries of scores [nnz, num_kv_heads] to +inf in place: forced [num_seqs,
    num_kv_heads, F] holds logical blocks of each row (-1 and positions past the row ignored)."""

def topk_candidates(
    num_kv_heads: int,
    scores: torch.Tensor,
    cand: torch.Tensor,
    blk_indptr: torch.Tensor,
    k: int,
    out: torch.Tensor,
    *,
    successors: int = 0,
    forced: torch.Tensor | None = None,
    stream: int = 0,
) -> None:
    """The two-stage score's last top-k over candidates cand [num_seqs, num_kv_heads, m] scored
    [num_seqs * m, num_kv_heads]: the next blocks of the `successors` best and the forced blocks
    first (a successor that is no candidate appended), the k best written as blocks, -1 padded."""

def delta_select(
    num_kv_heads: int,
    predicted: torch.Tensor,
    slot_pages: torch.Tensor,
    page_map: torch.Tensor,
    page_last_selected: torch.Tensor,
    step: int,
    fetch_cap: int,
    plan_slots: torch.Tensor,
    plan_blocks: torch.Tensor,
    *,
    stats: torch.Tensor | None = None,
    step_now: torch.Tensor | None = None,
    stream: int = 0,
) -> tuple[int, int, int] | None:
    """Delta selection with capped eviction; (pairs, kept, missing) on the CPU, None on the GPU.
    ``step_now`` (GPU only, int32 [1]): the step, read by the kernel when it runs."""

def gather_blocks(
    geo: KvGeometry,
    plan_slots: torch.Tensor,
    plan_blocks: torch.Tensor,
    slot_pages: torch.Tensor,
    host_indptr: torch.Tensor,
    host_indices: torch.Tensor,
    host_k: torch.Tensor,
    host_v: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    *,
    host_k_scales: torch.Tensor | None = None,
    host_v_scales: torch.Tensor | None = None,
    k_scales: torch.Tensor | None = None,
    v_scales: torch.Tensor | None = None,
    stream: int = 0,
) -> int | None:
    """Execute a selection plan (host pool -> GPU slots); entries copied on the CPU, None on the GPU."""

def wait_stamp(stamps: torch.Tensor, mode: int, *, stream: int = 0) -> None:
    """Time a wait: stamps int64 [3] = (start, total waited, waits) in ns; mode 0 starts, else ends."""

def wait_epoch(
    landed: torch.Tensor,
    layer: int,
    epoch: torch.Tensor,
    stats: torch.Tensor,
    timeout_s: float,
    *,
    stream: int = 0,
) -> None:
    """Hold a stream until landed[layer] (int64, CPU/pinned) reaches epoch[0] (int64 [1], device),
    or give up after timeout_s; stats int64 [4]: gave up, last epoch, ns held, waits."""

def set_bound8_score_kernel(kernel: str) -> None:
    """``"fma"`` or ``"mma"``: the kernel that scores the 8-bit bound."""

def bound8_score_kernel() -> str:
    """The kernel ``set_bound8_score_kernel`` chose."""

def set_kv8_attention_kernel(kernel: str) -> None:
    """``"tile"``, ``"registers"`` or ``"registers-deep"``: the tensor-core kernel over fp8_e4m3
    pages."""

def kv8_attention_kernel() -> str:
    """The kernel ``set_kv8_attention_kernel`` chose."""

def set_gather_launch(
    max_blocks: int | None = None,
    warps_per_block: int | None = None,
    entries_per_warp: int | None = None,
    stage_entries: int | None = None,
    *,
    kv8: bool = False,
) -> None:
    """Launch shape of the GPU gather (process-wide; ``kv8``: of gathers from fp8_e4m3 host pools;
    a captured graph keeps its own; None: that launch's default field). ValueError
    unless 1 <= warps_per_block <= 4, 1 <= entries_per_warp <= 32 and 0 <= stage_entries <= 32."""

def gather_launch(*, kv8: bool = False) -> tuple[int, int, int, int]:
    """``(max_blocks, warps_per_block, entries_per_warp, stage_entries)`` of
    :func:`set_gather_launch`."""

def copy_pages(
    geo: KvGeometry,
    src_k: torch.Tensor,
    src_v: torch.Tensor,
    src_ids: torch.Tensor,
    dst_k: torch.Tensor,
    dst_v: torch.Tensor,
    dst_ids: torch.Tensor,
    *,
    src_k_scales: torch.Tensor | None = None,
    src_v_scales: torch.Tensor | None = None,
    dst_k_scales: torch.Tensor | None = None,
    dst_v_scales: torch.Tensor | None = None,
    valid: torch.Tensor | None = None,
    stream: int = 0,
) -> None:
    """Whole-page copy between two pools of the same page geometry: src_ids[i] -> dst_ids[i]."""

def quantize_kv8(
    geo: KvGeometry,
    src: torch.Tensor,
    valid: torch.Tensor,
    codes: torch.Tensor,
    scales: torch.Tensor,
    *,
    stream: int = 0,
) -> None:
    """Quantize whole pages to fp8_e4m3 KV (uint8 codes, float32 power-of-two scales)."""

def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    out: torch.Tensor,
    residual: torch.Tensor | None = None,
    residual_out: torch.Tensor | None = None,
    *,
    stream: int = 0,
) -> None:
    """HF RMSNorm of rows ``x [n, hidden]`` (rows may be strided) into ``out``; with ``residual`` and
    ``residual_out`` (which may be ``residual`` itself), ``h = x + residual`` is stored and normalised."""

def silu_mul(gu: torch.Tensor, out: torch.Tensor, *, stream: int = 0) -> None:
    """``out [n, inter] = silu(gate) * up`` over ``gu [n, 2 * inter]`` (gate columns first), both
    contiguous, in one dtype."""

def qk_norm_rope(
    qkv: torch.Tensor,
    q_size: int,
    kv_size: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
    q_norm: torch.Tensor | None,
    k_norm: torch.Tensor | None,
    eps: float,
    q_out: torch.Tensor,
    k_out: torch.Tensor,
    v_out: torch.Tensor,
    *,
    kv_groups: int = 1,
    rope_scale: float = 1.0,
    stream: int = 0,
) -> None:
    """q, k, v from the fused QKV projection: optional per-head q/k RMSNorm, rotate-half RoPE at
    ``positions`` (cos and sin times ``rope_scale``), the V copy; ``kv_groups`` > 1 orders the k
    and v rows by row within groups."""

def decode_attn_workspace_len(
    num_seqs: int, num_rows: int, num_qo_heads: int, head_dim: int, num_splits: int
) -> int:
    """float32 elements of the split-KV workspace of decode_attention."""

def plan_num_splits(num_sms: int, num_seqs: int, num_kv_heads: int, max_pages: int) -> int:
    """The split count decode_attention plans for a GPU with ``num_sms`` SMs (1 = no split)."""

def cuda_status() -> str | None:
    """None when the CUDA path can run here, else why not and what to install or set; never raises."""

def compile_kernels(arch: str = "sm_90") -> list[tuple[str, int]]:
    """Compile every kernel source with NVRTC for ``arch``; (source name, image bytes) per source."""

def nvrtc_version() -> tuple[int, int]:
    """(major, minor) of the NVRTC in use; CudaUnavailableError when libnvrtc is not found."""
