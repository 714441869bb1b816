"""Prefill-decode disaggregation through the ``oasis-rt`` staging daemon (paper §4.4).

::

    prefill node                         oasis-rt daemon                 decode node
    PrefillWorker.prefill(prompt)        (host memory, per request)      LLMEngine(kv_source=
      dense prefill, first token           every block  [2][Hkv][b][D]     "oasis-rt://HOST:PORT")
      one extra decode step (t0's query)   every summary row [Hkv][2][D]  add_staged_request(handle)
      per layer: summaries (and, with      admission set: local block,     admission: summaries +
        "union", the top-K union)            + union + sections (meta,       the admission set ->
      stage_blocks / summaries /             query)                          host pool, working set
        admission, then free its pages  <-- read_blocks (misses, per     <-- decode: a block-head
      return StagedRequest(handle)          layer, batched)                  missing from the host
                                          release (request ends)            pool is read first

**Prefill side.** :class:`PrefillWorker` prefills densely on its own :class:`~oasiskv.engine.Engine`
(the same ``Engine.prefill`` the single-process engine runs, so the staged KV is bit-identical to
what that engine stores), takes the first token (greedy), and picks the query that selects the
first decode step's working set (``first_query``):

- ``"first_token"`` (the paper's §4.4.1, the default): one extra dense decode step runs the first
  token through the model; its own query at every layer selects. This is the query of the step
  the decode node runs first, so the initial working set is exact for that query.
- ``"prompt"``: the last prompt position's query, the one the single-process engine selects with
  when a request turns sparse right after its prefill (``Engine.make_sparse``). Greedy tokens of
  the decode node then equal the single-process OasisKV engine's token for token, whatever the
  budget (``tests/test_disagg.py``); with ``"first_token"`` they equal them (and dense) only when
  the budget holds the whole context.

Per layer it builds the block summaries (``ops.build_summaries`` on a copy of the request's
pages) and stages every block and summary row (in frames of a few MiB, over
``stage_connections`` connections from as many threads, each layer's device-to-host copy
overlapped with the other layers' frames). The admission set (``admission``) holds the
partial last block (the decode side's local block) and, with ``"union"``, the union of the
per-head top-K sets (``score_blocks`` / ``topk_blocks``) as whole blocks; with ``"heads"`` (the
default) nothing more: the decode side reads exactly each KV head's top-K block-heads when it
selects its first working set, which with GQA is up to Hkv x fewer bytes than the union (random
weights, 8 KV heads, 16K: 1.6 GB of 2.4 GB for the union). It has two sections: ``oasis/meta``
(JSON: geometry, first token, draft) and ``oasis/query`` (the selecting
query, ``[num_layers, num_qo_heads, head_dim]`` in the KV dtype: the decode side recomputes the
same per-head top-K from it and the summaries, so the head-wise mapping needs no index transfer).
Then it frees its pages: the daemon holds the KV until the decode side releases it.

**Decode side.** :class:`RemoteKvSource` (built by ``LLMEngine(kv_source=...)``) admits a staged
request directly as a sparse request: the runtime reserves and hands out its K working-set pages,
local page and host blocks and never the prompt's dense pages (``Engine.admit_sparse``, so it
reserves K + 1 GPU pages, not the prompt's), the admission's summary
rows and blocks are written into the host pool and summaries, the partial last block into the local
page, and the initial working set is selected with the staged query (``Engine.select_initial``,
as ``Engine.make_sparse`` does). Then it is an ordinary sparse request. ``kv_transfer``:

- ``"full"`` (the baseline): the admission reads every block (and the sections), so the host pool
  holds the whole context before the first step; the summaries are built locally from it, as a
  local transition to sparse builds them, and the daemon's copy is released at once.
- ``"partial"``: only the summaries and the admission set cross at admission. The host pool is a
  cache of the staged blocks: during decode, the engine calls :meth:`RemoteKvSource.before_gather`
  between each layer's delta selection and its gather, and the block-heads that selection brings
  into the working set and that are not in the host pool yet are read from the daemon, batched per
  layer across requests, into the host pool. A block-head crosses the network at most once per
  request. Blocks the request writes itself (the local block, the blocks decode completes) are
  local.

**Transports.** The URL names one: ``oasis-rt://HOST:PORT`` (or a bare ``HOST:PORT``) is plain TCP,
``oasis-rt+ucx://HOST:PORT`` is UCX, for a daemon started with ``oasis-rt serve --transport ucx``
(same frames as active messages; UCX picks shared memory, TCP or RDMA itself, ``UCX_TLS`` to
choose). The extension loads libucp only when a UCX client connects; where it is missing that
raises ``ConfigError`` (``.code == "ucx_unavailable"``) saying what to install.

The fetch runs on the host, layer by layer before each gather, once the whole step's compute is
queued (``Engine._flush_deferred``): a host sync per layer that has misses, while the GPU computes
the step. On a GPU it belongs in the background chain (docs/ARCHITECTURE.md, "Disaggregated
prefill and decode"). A daemon that dies or stalls fails the requests whose blocks it holds (``finish_reason=
"error"``, within the client's timeout); the engine and its other requests go on.
"""

from __future__ import annotations

import json
import logging
import math
import secrets
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field

import torch

from .. import ops
from ..config import KvConfig
from ..drafters import Drafter, make_drafter
from ..engine import Engine, Request
from ..errors import ConfigError, InvalidArgumentError, OutOfBlocksError, RemoteError
from ..policy import BlockSource

log = logging.getLogger("oasiskv.disagg")

#: The URL schemes of ``LLMEngine(kv_source=...)`` and ``PrefillWorker(addr=...)``: the daemon over
#: TCP (``oasis-rt serve``; a bare ``HOST:PORT`` means the same), and over UCX (``oasis-rt serve
#: --transport ucx``; libucp is loaded when such a client connects).
SCHEME = "oasis-rt://"
UCX_SCHEME = "oasis-rt+ucx://"
#: Transport name per scheme (``RtClient.transport``).
TRANSPORTS = {SCHEME: "tcp", UCX_SCHEME: "ucx"}
#: The values of ``PrefillWorker(first_query=...)``.
FIRST_QUERIES = ("first_token", "prompt")
#: The values of ``LLMEngine(kv_transfer=...)``.
KV_TRANSFERS = ("full", "partial")
#: What a :class:`PrefillWorker` puts in the admission set besides the local block:
#: ``"heads"`` nothing (the decode side reads exactly each KV head's top-K block-heads when it
#: selects its first working set), ``"union"`` every layer's union of the per-head top-K blocks,
#: whole (fewer frames; with GQA the heads' sets differ and the union moves up to Hkv x the bytes).
ADMISSIONS = ("heads", "union")
#: Section names of the admission set (the protocol allows ``[a-z0-9_.:/-]``).
META_SECTION = "oasis/meta"
QUERY_SECTION = "oasis/query"
#: Version of the ``oasis/meta`` layout.
META_FORMAT = 1
#: Bytes of a frame besides its entries (length prefix, header, counts), rounded up; per-entry
#: wire overheads of ``ReadBlocks``: the key (16) and the reply's code and length (6).
FRAME_OVERHEAD = 64
READ_KEY_BYTES = 16
READ_REPLY_ENTRY_BYTES = 6
#: Fraction of the frame limit a batch aims for (arbitrary margin under the hard limit).
FRAME_FILL = 0.9
#: Bulk reads aim for frames this large even when the limit allows more: buffers of a few MiB
#: are reused by the allocator, 64 MiB ones are fresh mappings whose page faults cost more than
#: the copy (the Rust client stages in frames of the same size).
BULK_FRAME_BYTES = 4 << 20
#: Staged requests whose admission data a :class:`RemoteKvSource` reads ahead in the background
#: (``RemoteKvSource.prefetch_depth``): each holds its reply bytes in host memory until admitted.
PREFETCH_DEPTH = 2
#: Connections the read ahead of one staged request spreads over (each with its own thread).
PREFETCH_CONNECTIONS = 2
#: Connections a large read in the decode loop (a step's misses, a full transfer's blocks)
#: spreads its frames over, each with its own thread (``RemoteKvSource.read_connections``). One
#: until measured on a many-core machine: on the 2-core build machine, with the daemon on the
#: same cores, 2 and 3 connections read no faster than one (1.26-1.35 GB/s).
READ_CONNECTIONS = 1
#: A read is split across connections only into frames of at least this many entries.
READ_SPLIT_MIN_ENTRIES = 256

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def split_kv_source(src: str) -> tuple[str, str]:
    """``"oasis-rt://HOST:PORT"`` (or a bare ``"HOST:PORT"``) -> ``("tcp", "HOST:PORT")``;
    ``"oasis-rt+ucx://HOST:PORT"`` -> ``("ucx", "HOST:PORT")``."""
    if not isinstance(src, str):
        raise ConfigError(f"kv_source must be a str like 'oasis-rt://127.0.0.1:7470', got {src!r}")
    transport, addr = "tcp", src
    for scheme, name in TRANSPORTS.items():
        if src.startswith(scheme):
            transport, addr = name, src[len(scheme) :]
    host, sep, port = addr.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536 or "/" in addr:
        raise ConfigError(
            f"kv_source {src!r} is not {SCHEME}HOST:PORT or {UCX_SCHEME}HOST:PORT; pass e.g. "
            "'oasis-rt://127.0.0.1:7470' (the --listen address of `oasis-rt serve`; "
            "'oasis-rt+ucx://...' when it runs --transport ucx)"
        )
    return transport, addr


def parse_kv_source(src: str) -> str:
    """The daemon's ``"HOST:PORT"`` in a ``kv_source`` (see :func:`split_kv_source`)."""
    return split_kv_source(src)[1]


def kv_source_url(src: str) -> str:
    """The canonical URL of a ``kv_source``: ``oasis-rt://HOST:PORT`` or ``oasis-rt+ucx://HOST:PORT``."""
    transport, addr = split_kv_source(src)
    return (UCX_SCHEME if transport == "ucx" else SCHEME) + addr


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class StagedRequest:
    """What a :class:`PrefillWorker` hands the decode side for one prompt (JSON-able: pass it
    between processes with :meth:`to_json` / :meth:`from_json`).

    ``request_id`` is the daemon's id of the staged KV; ``prompt`` the prompt's token ids (the
    decode engine's drafter and outputs need them); ``first_token`` the token sampled from the
    prefill's logits (greedy); ``draft`` what the worker's drafter proposes after it (None without
    a drafter; informational: the decode engine's own drafter proposes the first draft from the
    same tokens). ``admission_blocks`` counts the admission set's blocks over all layers,
    ``staged_bytes`` what the daemon stored, ``kv_bytes`` the request's KV (every block, every
    layer: what a full transfer moves), ``geometry`` the daemon's 6-tuple
    ``(num_layers, num_kv_heads, block_size, head_dim, dtype_bytes, num_blocks)``.
    """

    request_id: int
    prompt: tuple[int, ...]
    first_token: int
    draft: int | None
    first_query: str
    geometry: tuple[int, int, int, int, int, int]
    admission_blocks: int
    staged_bytes: int
    kv_bytes: int
    #: Seconds of the worker's prefill (with the extra decode step) and of the staging after it.
    prefill_s: float = 0.0
    stage_s: float = 0.0

    @property
    def prompt_len(self) -> int:
        return len(self.prompt)

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @staticmethod
    def from_json(text: str | bytes | dict) -> StagedRequest:
        d = text if isinstance(text, dict) else json.loads(text)
        try:
            return StagedRequest(
                request_id=int(d["request_id"]),
                prompt=tuple(int(t) for t in d["prompt"]),
                first_token=int(d["first_token"]),
                draft=None if d.get("draft") is None else int(d["draft"]),
                first_query=str(d["first_query"]),
                geometry=tuple(int(x) for x in d["geometry"]),  # type: ignore[arg-type]
                admission_blocks=int(d["admission_blocks"]),
                staged_bytes=int(d["staged_bytes"]),
                kv_bytes=int(d["kv_bytes"]),
                prefill_s=float(d.get("prefill_s", 0.0)),
                stage_s=float(d.get("stage_s", 0.0)),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise ConfigError(
                f"not a StagedRequest: {e!r}; pass what StagedRequest.to_json() wrote"
            ) from None


def _client(src: str, token, timeout_s: float):
    from .._core import RtClient

    return RtClient(kv_source_url(src), token=token, timeout_s=float(timeout_s))


class PrefillWorker:
    """The prefill side of disaggregation: prefill a prompt, stage its KV in the daemon.

    Args:
        model: a ``CausalLM`` (the decode side must run the same weights).
        kv: the cache configuration; ``block_size`` and ``top_k_blocks`` shape what is staged and
            selected (use the decode engine's). ``block_score="codes"`` is not supported.
        addr: the daemon, ``"HOST:PORT"`` or ``"oasis-rt://HOST:PORT"`` (TCP), or
            ``"oasis-rt+ucx://HOST:PORT"`` (UCX: a daemon on ``--transport ucx``; where libucp is
            missing this raises ``ConfigError``).
        token: the daemon's shared token (its ``--token-file`` contents), if it has one.
        timeout_s: the deadline of every daemon call.
        drafter: proposes :attr:`StagedRequest.draft` (``"ngram"``, None, or a Drafter without
            prompt features).
        first_query: which query selects the admission set, one of :data:`FIRST_QUERIES`.
        admission: what the admission set holds besides the summaries, the sections and the
            local block, one of :data:`ADMISSIONS` (default ``"heads"``: the decode side reads
            the first step's block-heads itself, per head).
        stage_connections: connections to the daemon that send the layers in parallel (each
            from its own thread; copies and socket work spread over cores on both sides).
        max_num_batched_tokens: prompt tokens per prefill chunk (the ``LLMEngine`` default, so
            the staged KV equals what a single-process engine with that default computes).
    """

    def __init__(
        self,
        model,
        kv: KvConfig,
        addr: str,
        *,
        token: str | bytes | None = None,
        timeout_s: float = 30.0,
        drafter: str | Drafter | None = "ngram",
        first_query: str = "first_token",
        admission: str = "heads",
        stage_connections: int = 2,
        max_num_batched_tokens: int = 8192,
        gpu_kv_budget_bytes: int | None = None,
    ) -> None:
        if not isinstance(kv, KvConfig):
            raise ConfigError(f"kv must be a KvConfig, got {type(kv).__name__}")
        if kv.block_score != "quest":
            raise ConfigError(
                "PrefillWorker stages min/max summaries only; pass KvConfig(block_score='quest') "
                "(key codes are not transferred yet)"
            )
        if first_query not in FIRST_QUERIES:
            raise ConfigError(f"first_query must be one of {FIRST_QUERIES}, got {first_query!r}")
        if admission not in ADMISSIONS:
            raise ConfigError(f"admission must be one of {ADMISSIONS}, got {admission!r}")
        self.admission = admission
        if (
            not isinstance(stage_connections, int)
            or isinstance(stage_connections, bool)
            or stage_connections < 1
        ):
            raise ConfigError(f"stage_connections must be an int >= 1, got {stage_connections!r}")
        self.stage_connections = stage_connections
        self.drafter = make_drafter(drafter, model=model)
        if self.drafter is not None and self.drafter.wants_prompt_features:
            raise ConfigError(
                "the worker's drafter would need the prompt's features (EAGLE-3); pass drafter='ngram' "
                "or None (the draft model's state is not transferred yet)"
            )
        self.model = model.eval()
        self.kv = kv
        self.first_query = first_query
        self.max_num_batched_tokens = int(max_num_batched_tokens)
        # A dense engine with one row per request: its decode step's query is the token's own.
        self.engine = Engine(
            self.model, kv, "dense", None, max_num_seqs=1, gpu_kv_budget_bytes=gpu_kv_budget_bytes
        )
        self.client = _client(addr, token, timeout_s)
        self.url, self._token, self._timeout_s = self.client.url, token, timeout_s
        self._extra_clients: list = []
        self._stage_pool: ThreadPoolExecutor | None = None
        self._next = 0
        #: Two host buffers of one layer's blocks and summaries (pinned on a GPU): the next
        #: layer's device-to-host copy runs while this one's frames are sent.
        self._bufs: list[tuple[torch.Tensor, torch.Tensor]] = []

    def close(self) -> None:
        if self._stage_pool is not None:
            self._stage_pool.shutdown(wait=True)
            self._stage_pool = None
        for c in self._extra_clients:
            c.close()
        self._extra_clients = []
        self.client.close()

    def release(self, request_id: int) -> int:
        """Release a staged request in the daemon (when no decode engine will): bytes freed."""
        return self.client.release(int(request_id))

    @torch.no_grad()
    def prefill(
        self, prompt: Sequence[int], request_id: int | None = None, first_token: int | None = None
    ) -> StagedRequest:
        """Prefill ``prompt`` (token ids), stage its KV, summaries and admission set in the
        daemon, free the pages, and return the handle for the decode side.

        ``request_id``: the daemon's id (default: a random 63-bit id); ``first_token``: the first
        generated token if the caller sampled it (default: greedy from the prefill's logits).

        Raises :class:`~oasiskv.errors.RemoteError` subclasses when the daemon refuses or fails
        (nothing of the request stays staged then), ``ConfigError`` for a bad prompt.
        """
        eng = self.engine
        ids = [int(t) for t in prompt]
        vocab = self.model.config.vocab_size
        if not ids or any(not 0 <= t < vocab for t in ids):
            raise ConfigError(f"prompt must be non-empty token ids in 0..{vocab}")
        n = len(ids)
        if n + 1 > self.model.config.max_position_embeddings:
            raise ConfigError(
                f"a {n}-token prompt and its first token pass the model's context of "
                f"{self.model.config.max_position_embeddings}; shorten the prompt"
            )
        rid = secrets.randbits(63) if request_id is None else int(request_id)
        if not 0 <= rid < 1 << 64:
            raise ConfigError(f"request_id must be an int in [0, 2**64), got {request_id!r}")
        self._next += 1
        r = Request(id=self._next, prompt=ids, max_new_tokens=2)
        if self.drafter is not None:
            self.drafter.begin(r.id, ids)
        t_start = time.perf_counter()
        staged = False
        try:
            logits = None
            step = self.max_num_batched_tokens
            for start in range(0, n, step):
                logits = eng.prefill_chunk(r, start, min(n, start + step))
            t0 = int(logits.argmax()) if first_token is None else int(first_token)
            if not 0 <= t0 < vocab:
                raise ConfigError(f"first_token must be a token id in 0..{vocab}, got {first_token!r}")
            r.tokens = ids + [t0]
            draft = None
            if self.drafter is not None and self.drafter.uses_lookahead_row:
                draft = int(self.drafter.propose(r.id, r.tokens, None))
            if self.first_query == "first_token":
                # The paper's extra decode step: t0 through the model, densely; its query (the
                # engine keeps each layer's last query row) selects the first step's blocks.
                eng.decode_step([r])
            query = torch.stack([q[0] for q in eng._last_q]).to(eng.dtype)  # [layers, Hq, D]
            t_stage = time.perf_counter()
            prefill_s = t_stage - t_start
            geometry, admission, staged_bytes = self._stage(rid, r, n, query)
            staged = True
            stage_s = time.perf_counter() - t_stage
            return StagedRequest(
                request_id=rid,
                prompt=tuple(ids),
                first_token=t0,
                draft=draft,
                first_query=self.first_query,
                geometry=geometry,
                admission_blocks=admission,
                staged_bytes=staged_bytes,
                kv_bytes=geometry[0] * geometry[5] * _block_bytes(geometry),
                prefill_s=prefill_s,
                stage_s=stage_s,
            )
        finally:
            eng.release(r)
            if self.drafter is not None:
                self.drafter.end(r.id)
            if not staged:
                try:
                    self.client.release(rid)
                except RemoteError:
                    pass  # the daemon is gone or never had it

    def _buffers(self, nb: int, block_shape: tuple, summary_shape: tuple, count: int):
        """``count`` (blocks, summaries) host buffers of at least ``nb`` blocks, kept between calls
        (pinned on a GPU, so that the device-to-host copies are asynchronous)."""
        eng = self.engine
        b = self._bufs
        if len(b) != count or b[0][0].shape[0] < nb or b[0][0].shape[1:] != block_shape:
            pin = eng.device.type == "cuda"
            self._bufs = [
                (
                    torch.empty((nb, *block_shape), dtype=eng.dtype, pin_memory=pin),
                    torch.empty((nb, *summary_shape), dtype=eng.dtype, pin_memory=pin),
                )
                for _ in range(count)
            ]
        return self._bufs

    def _stage_clients(self) -> list:
        """The staging connections: the worker's own and ``stage_connections - 1`` more (opened
        on first use), each sending a share of the layers from its own thread."""
        while len(self._extra_clients) < self.stage_connections - 1:
            self._extra_clients.append(_client(self.url, self._token, self._timeout_s))
        if self._stage_pool is None:
            self._stage_pool = ThreadPoolExecutor(
                max_workers=self.stage_connections, thread_name_prefix="oasis-stage"
            )
        return [self.client, *self._extra_clients]

    def _stage(self, rid: int, r: Request, n: int, query: torch.Tensor):
        eng, kv, g = self.engine, self.kv, self.engine.geo
        p, dev = eng.pools, eng.device
        b, hk, d = g.block_size, g.num_kv_heads, g.head_dim
        layers = self.model.config.num_hidden_layers
        nb = math.ceil(n / b)
        n_complete = n // b
        geometry = (layers, hk, b, d, eng.dtype.itemsize, nb)
        pages = torch.tensor(r.pages[:nb], dtype=torch.long, device=dev)
        lens = [b] * nb
        lens[-1] = n - (nb - 1) * b
        lens_t = torch.tensor(lens, dtype=torch.int32, device=dev)
        all_blocks = torch.arange(nb, dtype=torch.int32, device=dev)
        blk_indptr = torch.tensor([0, n_complete], dtype=torch.int32, device=dev)
        blk_indices = torch.arange(n_complete, dtype=torch.int32, device=dev)
        selected: list[tuple[int, int]] = []
        union_sizes = []
        stored = 0
        clients = self._stage_clients()
        # One buffer more than connections: the next layer's copy lands while the others send.
        bufs = self._buffers(nb, (2, hk, b, d), (hk, 2, d), len(clients) + 1)
        cuda = dev.type == "cuda"
        inflight: list[Future | None] = [None] * len(bufs)
        failed: list[BaseException] = []

        def send(client, layer, blocks, summaries, event) -> int:
            if event is not None:
                event.synchronize()
            n_stored = client.stage_blocks(rid, geometry, [(layer, i) for i in range(nb)], blocks)[0]
            return n_stored + client.stage_summaries(rid, geometry, [(layer, 0, nb)], summaries)[0]

        def drain(i: int) -> None:
            nonlocal stored
            f, inflight[i] = inflight[i], None
            if f is not None:
                try:
                    stored += f.result()
                except BaseException as e:  # noqa: BLE001  re-raised once every send is done
                    failed.append(e)

        try:
            for layer in range(layers):
                k = p.k_pages[layer].index_select(0, pages)  # [nb, Hkv, b, D]
                v = p.v_pages[layer].index_select(0, pages)
                if lens[-1] < b:
                    # Positions past the prompt (stale pool memory, or the extra step's token).
                    k[-1, :, lens[-1] :] = 0
                    v[-1, :, lens[-1] :] = 0
                summaries = torch.empty(nb, hk, 2, d, dtype=eng.dtype, device=dev)
                ops.build_summaries(g, k, all_blocks, lens_t, summaries)
                union: set[int] = set()
                if n_complete and self.admission == "union":
                    pred = _first_top_k(g, query[layer], summaries, blk_indptr, blk_indices, kv.top_k_blocks)
                    union = set(pred[pred >= 0].tolist())
                if lens[-1] < b:
                    union.add(nb - 1)  # the decode side's local block
                union_sizes.append(len(union))
                selected.extend((layer, blk) for blk in sorted(union))
                i = layer % len(bufs)
                drain(i)  # the send that last read this buffer
                if failed:
                    raise failed[0]
                host_blocks, host_summaries = bufs[i]
                # [nb, 2, Hkv, b, D]: the wire's block layout.
                host_blocks[:nb].copy_(torch.stack([k, v], dim=1), non_blocking=cuda)
                host_summaries[:nb].copy_(summaries, non_blocking=cuda)
                event = torch.cuda.Event() if cuda else None
                if event is not None:
                    event.record()
                client = clients[layer % len(clients)]
                inflight[i] = self._stage_pool.submit(
                    send, client, layer, host_blocks[:nb], host_summaries[:nb], event
                )
        finally:
            for i in range(len(inflight)):
                drain(i)
        if failed:
            raise failed[0]
        meta = {
            "format": META_FORMAT,
            "prompt_len": n,
            "first_token": r.tokens[n],
            "first_query": self.first_query,
            "num_layers": layers,
            "num_qo_heads": g.num_qo_heads,
            "num_kv_heads": hk,
            "head_dim": d,
            "block_size": b,
            "top_k_blocks": kv.top_k_blocks,
            "dtype": _dtype_name(eng.dtype),
            "admission": self.admission,
            "union_blocks": union_sizes,
        }
        sections = {
            META_SECTION: json.dumps(meta).encode(),
            QUERY_SECTION: query.contiguous().cpu(),
        }
        stored += self.client.stage_admission(rid, selected, sections)[0]
        return geometry, len(selected), stored


def _block_bytes(geometry) -> int:
    _, hk, b, d, elem, _ = geometry
    return 2 * hk * b * d * elem


@dataclass
class TransferStats:
    """Network traffic of a decode engine's staged requests (all of them, since it started)."""

    requests: int = 0
    #: Wire bytes of the admissions (sent + received frames).
    admission_bytes: int = 0
    #: Wire bytes of the decode-time reads of missing block-heads.
    fetched_bytes: int = 0
    #: Block-heads read during decode.
    fetched_entries: int = 0
    #: Bytes of every staged request's whole KV (what a full transfer moves, payload only).
    kv_bytes: int = 0
    #: Block-heads in the host pool that came from the daemon, now and at most.
    cached_bytes: int = 0
    peak_cached_bytes: int = 0
    #: Cached blocks evicted from a bounded host pool (``kv_cache_blocks``): their rows went to
    #: other blocks, so a later read of them crosses the network again.
    evicted_blocks: int = 0
    failures: int = 0
    #: Seconds the decode loop spent in decode-time reads (``before_gather[s]``: the plans'
    #: copies to the host, the daemon calls and the host pool stores).
    read_seconds: float = 0.0


@dataclass
class _Remote:
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


@dataclass
class _Prefetched:
    """What the background read brought for a staged request before its admission: the sections,
    the admission replies (``"partial"``: summaries and the admission set, per layer range) or
    every block (``"full"``: ``(layer, logical blocks, their bytes)`` per frame), and the wire
    bytes it took."""

    sections: dict = field(default_factory=dict)
    adms: list = field(default_factory=list)
    frames: list = field(default_factory=list)
    #: ``"partial"``: each KV head's first-step blocks, ``(layer, [(logical, head)], bytes)``
    #: per frame, selected on the CPU from the staged summaries and query.
    heads: list = field(default_factory=list)
    wire_bytes: int = 0


def _admission_chunks(layers: int, layer_bytes: int) -> list[tuple[int, int]]:
    """Layer ranges ``(first, count)`` whose summaries (``layer_bytes`` a layer) fill about one
    bulk frame."""
    per_call = max(1, BULK_FRAME_BYTES // max(1, layer_bytes))
    return [(lo, min(per_call, layers - lo)) for lo in range(0, layers, per_call)]


def _admission_replies(
    call: Callable, daemon_id: int, chunks: list[tuple[int, int]], sections: bool = True
) -> Iterator[dict]:
    """``fetch_admission`` replies covering the layer ranges ``chunks``, the sections in the
    first (``sections``); a range is split again when the admission blocks push its reply past
    the frame limit. ``call(fn)`` runs ``fn(client)``."""
    pending = list(chunks)
    first = sections
    while pending:
        lo, cnt = pending.pop(0)
        try:
            adm = call(lambda c, lo=lo, cnt=cnt, s=first: c.fetch_admission(daemon_id, lo, cnt, s))
        except InvalidArgumentError as e:
            if getattr(e, "code", None) != "too_large" or cnt == 1:
                raise
            half = cnt // 2
            pending[:0] = [(lo, half), (lo + half, cnt - half)]
            continue
        first = False
        yield adm


def _first_top_k(geo, q: torch.Tensor, summaries: torch.Tensor, indptr, indices, k: int) -> torch.Tensor:
    """Each KV head's top-``k`` blocks of one request under the query ``q`` (``[num_qo_heads,
    head_dim]``): the admission's first selection, ``[num_kv_heads, k]``, -1 padded."""
    q = q.view(1, geo.num_qo_heads, geo.head_dim).contiguous()
    scores = ops.score_blocks(geo, q, summaries, indptr, indices)
    return ops.topk_blocks(geo.num_kv_heads, scores, indptr, k)[0]


def _entries_per_frame(entry_bytes: int, frame_bytes: float | None = None) -> int:
    """Read entries of ``entry_bytes`` that fill a reply frame of ``frame_bytes`` (default:
    :data:`BULK_FRAME_BYTES`), at least one."""
    frame = BULK_FRAME_BYTES if frame_bytes is None else frame_bytes
    return max(1, int((frame - FRAME_OVERHEAD) // (entry_bytes + READ_REPLY_ENTRY_BYTES)))


def _read_all(client, keys: list, what: str):
    """``client.read_blocks(keys)``'s bytes, every entry present (a read ahead takes all of its
    frame or nothing); ``RemoteError`` naming ``what`` otherwise."""
    data, _, errors = client.read_blocks(keys)
    bad = next((e for e in errors if e is not None), None)
    if bad is not None:
        raise RemoteError(f"{what}: {bad}")
    return data


class RemoteKvSource(BlockSource):
    """The decode side of disaggregation for one :class:`~oasiskv.engine.Engine` (built by
    ``LLMEngine(kv_source=...)``; see the module docs). Installs itself as the engine's
    ``block_source``.

    ``transfer`` is one of :data:`KV_TRANSFERS`; ``retries``: how many times a read that failed
    in transport (daemon gone or stalled) reconnects and tries again before the requests whose
    blocks it carried fail.

    ``cache_blocks=C`` bounds the host pool of each staged request (the bounded decode-side host
    pool): host rows only for the blocks it writes itself plus ``C`` cache rows; before each
    layer's gather the planned blocks without a row get one (``Runtime.cache_blocks``, evicting
    the least recently used cached blocks the layer does not read), and a block evicted is read
    again if it is planned later. ``None``: a row for every block (the whole context).
    """

    def __init__(
        self,
        engine: Engine,
        addr: str,
        transfer: str = "partial",
        *,
        token: str | bytes | None = None,
        timeout_s: float = 30.0,
        retries: int = 0,
        cache_blocks: int | None = None,
    ) -> None:
        if transfer not in KV_TRANSFERS:
            raise ConfigError(
                f"kv_transfer must be one of {KV_TRANSFERS}, got {transfer!r}: 'partial' fetches the "
                "summaries and the first step's blocks, then misses on demand; 'full' fetches every block"
            )
        if engine.backend != "oasis":
            raise ConfigError("kv_source needs backend='oasis' (a staged request decodes sparsely)")
        if engine.key_codes:
            raise ConfigError(
                "kv_source stages min/max summaries only; pass KvConfig(block_score='quest') "
                "(key codes are not transferred yet)"
            )
        if not isinstance(retries, int) or isinstance(retries, bool) or retries < 0:
            raise ConfigError(f"kv_retries must be an int >= 0, got {retries!r}")
        if cache_blocks is not None:
            floor = engine.geo.num_kv_heads * engine.kv.top_k_blocks
            if not isinstance(cache_blocks, int) or isinstance(cache_blocks, bool) or cache_blocks < floor:
                raise ConfigError(
                    f"kv_cache_blocks must be an int >= num_kv_heads * top_k_blocks = {floor} (the "
                    f"first selection may plan that many distinct blocks in one layer), got {cache_blocks!r}"
                )
            if transfer == "full":
                raise ConfigError(
                    "kv_cache_blocks bounds the host pool of a partial transfer; kv_transfer='full' "
                    "brings every block: pass kv_transfer='partial' or kv_cache_blocks=None"
                )
        #: Host rows per staged request's cache (None: a row for every block).
        self.cache_blocks = cache_blocks
        self.engine = engine
        #: The daemon's ``HOST:PORT``, its URL (the scheme names the transport) and transport.
        self.url = kv_source_url(addr)
        self.transport, self.addr = split_kv_source(self.url)
        self.transfer = transfer
        self.retries = retries
        self._token, self._timeout_s = token, float(timeout_s)
        self.client = _client(self.url, token, timeout_s)
        self.stats = TransferStats()
        self._by_req: dict[int, _Remote] = {}  # engine request id -> its staged state
        # Per host row: the owning staged request (engine request id, -1: local) and the logical
        # block it holds; which (layer, host row, KV head) entries hold their bytes (a row
        # holding no staged block counts as present: nothing to read), [layers, rows, heads].
        self._owner = torch.full((0,), -1, dtype=torch.long)
        self._logical = torch.zeros(0, dtype=torch.long)
        self._present = torch.ones(0, 0, 0, dtype=torch.bool)
        self._missing = 0  # entries of rows holding a staged block, not read yet, all layers
        self._bounded = 0  # live staged requests with a bounded cache
        self._admitting = False  # reads now are an admission's (its first working set)
        self._failed: dict[int, str] = {}
        self._wire_base = 0  # wire bytes of the connections before the current one
        #: How many waiting staged requests :meth:`prefetch` reads ahead (0: none; each admission
        #: then reads in the decode loop).
        self.prefetch_depth = PREFETCH_DEPTH
        self._prefetch: dict[int, Future] = {}  # daemon id -> the background read of its data
        #: Connections (and threads) the read ahead spreads one request's reads over.
        self.prefetch_connections = PREFETCH_CONNECTIONS
        self._prefetcher: ThreadPoolExecutor | None = None
        self._ahead_helpers: ThreadPoolExecutor | None = None
        self._prefetch_clients: list = []  # the background reads' own connections
        #: Connections a large read in the decode loop spreads its frames over (1: the loop's
        #: own connection alone).
        self.read_connections = READ_CONNECTIONS
        self._read_helpers: ThreadPoolExecutor | None = None
        self._read_clients: list = []  # the extra connections of those reads
        engine.block_source = self

    # ---------------------------------------------------------------- maps
    def _grow_maps(self) -> None:
        n = self.engine.pools.num_host_rows
        old = self._owner.shape[0]
        if n <= old and self._present.numel():
            return
        hk = self.engine.geo.num_kv_heads
        extra = max(0, n - old)
        self._owner = torch.cat([self._owner, torch.full((extra,), -1, dtype=torch.long)])
        self._logical = torch.cat([self._logical, torch.zeros(extra, dtype=torch.long)])
        layers = self.engine.cfg.num_hidden_layers
        if not self._present.numel():
            self._present = torch.ones(layers, n, hk, dtype=torch.bool)
        else:
            self._present = torch.cat([self._present, torch.ones(layers, extra, hk, dtype=torch.bool)], dim=1)

    def _entry_bytes(self) -> int:
        """Bytes of one block-head, K and V."""
        g = self.engine.geo
        return 2 * g.block_size * g.head_dim * self.engine.dtype.itemsize

    def _wire(self) -> int:
        """Bytes of every frame sent and received so far, over every connection."""
        sent, received = self.client.wire_bytes
        return self._wire_base + sent + received

    def _reconnect(self) -> bool:
        try:
            fresh = _client(self.url, self._token, self._timeout_s)
        except RemoteError as e:
            log.warning("reconnecting to the staging daemon %s failed: %s", self.url, e)
            return False
        self._wire_base += sum(self.client.wire_bytes)
        self.client.close()
        self.client = fresh
        return True

    def _call(self, fn, *args):
        """A client call, retried after a reconnect on a transport failure (``retries`` times)."""
        from ..errors import RemoteTimeoutError, RemoteUnavailableError

        for attempt in range(self.retries + 1):
            try:
                return fn(self.client, *args)
            except (RemoteUnavailableError, RemoteTimeoutError):
                if attempt == self.retries or not self._reconnect():
                    raise
        raise AssertionError("unreachable")  # pragma: no cover

    # ---------------------------------------------------------------- admission
    @torch.no_grad()
    def admit(self, r: Request, handle: StagedRequest) -> None:
        """Admit ``r`` (its prompt already set) from the daemon's staged KV of ``handle``: reserve,
        turn it sparse, fill the host pool with the admission (or everything, ``transfer="full"``)
        and select the initial working set. On failure everything it took goes back and the error
        propagates (a :class:`~oasiskv.errors.RemoteError`, or ``ConfigError`` when the staged
        geometry does not match this engine)."""
        try:
            self._admit(r, handle)
        except BaseException:
            # A staged request handed to the engine is the engine's: it ends here, so does the
            # daemon's copy (best effort), however the admission failed.
            self.end(r)
            self._release_daemon_copy(handle.request_id)
            raise

    def _geometry(self, prompt_len: int) -> tuple[int, int, int, int, int, int]:
        """The daemon geometry a staged ``prompt_len``-token request must have for this engine."""
        eng, g = self.engine, self.engine.geo
        nb = math.ceil(prompt_len / g.block_size)
        return (eng.cfg.num_hidden_layers, g.num_kv_heads, g.block_size, g.head_dim, eng.dtype.itemsize, nb)

    def _admit(self, r: Request, handle: StagedRequest) -> None:
        eng = self.engine
        n = len(r.prompt)
        expect = self._geometry(n)
        if tuple(handle.geometry) != expect:
            raise ConfigError(
                f"the staged request has geometry {tuple(handle.geometry)} (layers, kv heads, block "
                f"size, head dim, dtype bytes, blocks) but this engine needs {expect}; prefill with the "
                "same model, KvConfig.block_size and kv dtype"
            )
        if not eng.runtime.reservation(n, r.max_new_tokens)[2]:
            raise ConfigError(
                f"a staged request decodes sparsely from its first step, but a {n}-token prompt with "
                f"max_tokens={r.max_new_tokens} never passes sparse_threshold={eng.kv.threshold_tokens}; "
                "lower KvConfig.sparse_threshold or raise max_tokens"
            )
        wire0 = self._wire()
        self._admitting = True
        try:
            self._admit_staged(r, handle, wire0)
        finally:
            self._admitting = False

    def _admit_staged(self, r: Request, handle: StagedRequest, wire0: int) -> None:
        eng = self.engine
        g = eng.geo
        layers = eng.cfg.num_hidden_layers
        n, b = len(r.prompt), eng.geo.block_size
        nb = math.ceil(n / b)
        tr = eng.admit_sparse(r, self.cache_blocks)
        st = None
        try:
            p = eng.pools
            host_rows = list(tr["host_rows"])
            bounded = self.cache_blocks is not None
            st = _Remote(handle.request_id, r, list(tr["host_blocks"]), host_rows, bounded, set(host_rows))
            self._by_req[r.id] = st
            self._bounded += bounded
            self._grow_maps()
            # The rows that hold a staged block now: every block's, or (bounded) the partial last
            # block's alone (the cache rows are empty; the filler only names the owner).
            first = n // b if bounded else 0
            if bounded:
                self._owner[host_rows[0]] = r.id
            for logical in range(first, nb):
                self._take_row(st, host_rows[logical], logical)
            pf = self._take_prefetch(handle.request_id)
            if self.transfer == "full":
                # The baseline: every block crosses; the summaries are built here, as a local
                # transition to sparse builds them.
                if pf is not None:
                    sections = self._checked_sections(st, pf.sections)
                    for layer, logicals, data in pf.frames:
                        self._install(st, layer, logicals, None, data)
                else:
                    sections = self._fetch_sections(st)
                self._fetch_rest(st, layers)  # whatever the read ahead did not bring
                self._build_summaries(tr)
            else:
                sections = self._fetch_admission(st, layers, pf)
                if pf is not None:
                    for layer, pairs, data in pf.heads:
                        blocks, heads = zip(*pairs, strict=True)
                        self._install(st, layer, blocks, heads, data)
            try:
                meta = json.loads(sections[META_SECTION])
            except (ValueError, UnicodeDecodeError):
                meta = None
            if not isinstance(meta, dict) or meta.get("format") != META_FORMAT or meta.get("prompt_len") != n:
                raise ConfigError(
                    f"the staged request's meta {meta!r} does not match a {n}-token prompt; pass the "
                    "handle its PrefillWorker returned"
                )
            if _DTYPES.get(meta.get("dtype")) != eng.dtype:
                raise ConfigError(
                    f"staged KV dtype {meta.get('dtype')!r} differs from this engine's {eng.dtype}"
                )
            raw = sections[QUERY_SECTION]
            want = layers * g.num_qo_heads * g.head_dim * eng.dtype.itemsize
            if len(raw) != want:
                raise ConfigError(
                    f"the staged query section holds {len(raw)} bytes, this engine needs {want} "
                    "(layers x query heads x head dim); prefill with the same model"
                )
            query = torch.frombuffer(bytearray(raw), dtype=eng.dtype)
            query = query.view(layers, g.num_qo_heads, g.head_dim)
            if n % b:
                # The partial last block is the local block: its tokens go to the local page.
                last = torch.tensor([host_rows[-1]], dtype=torch.long)
                heads = torch.arange(g.num_kv_heads)
                for layer in range(layers):
                    self._ensure(layer, last.expand(g.num_kv_heads), heads)
                    p.k_pages[layer][tr["local_page"]] = p.host_k[layer][host_rows[-1]].to(p.k_pages[layer])
                    p.v_pages[layer][tr["local_page"]] = p.host_v[layer][host_rows[-1]].to(p.v_pages[layer])
            r.sparse = True
            r.metrics.sparse_since_token = r.kv_len
            self._select_initial(r, tr, query)
            if self._failed.pop(r.id, None) is not None:
                raise RemoteError(st.errors[-1] if st.errors else "admission fetch failed")
            st.admission_bytes = self._wire() - wire0 + (pf.wire_bytes if pf is not None else 0)
            r.metrics.network_admission_bytes = st.admission_bytes
            self.stats.requests += 1
            self.stats.admission_bytes += st.admission_bytes
            self.stats.kv_bytes += handle.kv_bytes
            if self.transfer == "full":
                # Everything is local now: the daemon's copy is not needed any more.
                self._release_remote(st)
        except BaseException:
            self.end(r)
            eng.release(r)
            raise

    def _release_daemon_copy(self, daemon_id: int) -> None:
        try:
            self.client.release(daemon_id)
        except RemoteError as e:
            log.warning("releasing staged request %s in the daemon failed: %s", daemon_id, e)

    # ---------------------------------------------------------------- reading ahead
    def prefetch(self, handle: StagedRequest) -> None:
        """Start reading ``handle``'s admission data in a background thread, on a connection of
        its own: the summaries and admission set (``"partial"``), or every block (``"full"``).
        Its admission then copies from host memory instead of stalling the decode loop on the
        network. At most :attr:`prefetch_depth` requests are read ahead (``LLMEngine`` asks for
        the first waiting ones every step); a failed read only means the admission reads in the
        loop, as without it (and reports the error there)."""
        rid = handle.request_id
        if rid in self._prefetch or len(self._prefetch) >= self.prefetch_depth:
            return
        if tuple(handle.geometry) != self._geometry(len(handle.prompt)):
            return  # the admission refuses it, with the reason
        if self._prefetcher is None:
            self._prefetcher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="oasis-prefetch")
        self._prefetch[rid] = self._prefetcher.submit(self._read_ahead, handle)

    def ready(self, handle: StagedRequest) -> bool:
        """Whether admitting ``handle`` now would not wait for its read ahead."""
        f = self._prefetch.get(handle.request_id)
        return f is None or f.done()

    def drop_prefetch(self, daemon_id: int) -> None:
        """Forget a read ahead (its request ended before admission)."""
        f = self._prefetch.pop(daemon_id, None)
        if f is not None:
            f.cancel()

    def _take_prefetch(self, daemon_id: int) -> _Prefetched | None:
        f = self._prefetch.pop(daemon_id, None)
        if f is None:
            return None
        try:
            return f.result()
        except Exception as e:  # noqa: BLE001  the admission reads in the loop and reports it
            log.info("reading staged request %s ahead failed (%s); reading it at admission", daemon_id, e)
            return None

    def _read_ahead(self, h: StagedRequest) -> _Prefetched:
        """The background read (nothing of the engine is touched): its units of work (a layer's
        blocks; a layer range's admission reply and first working set) spread round-robin over
        :attr:`prefetch_connections` connections of its own, one thread each, merged in layer
        order (so the frames are those the loop would read)."""
        layers, hk, b, d, elem, nb = h.geometry
        rid = h.request_id
        try:
            clients = self._ahead_clients()
            wire0 = [sum(c.wire_bytes) for c in clients]
            pf = _Prefetched()
            if self.transfer == "full":
                pf.sections = dict(clients[0].fetch_admission(rid, 0, 0, True)["sections"])
                units: list = list(range(layers))

                def work(c, layer):
                    return [], self._read_whole_ahead(c, h, layer), []

            else:
                chunks = _admission_chunks(layers, nb * hk * 2 * d * elem)
                first = list(_admission_replies(lambda fn: fn(clients[0]), rid, chunks[:1]))
                pf.sections = dict(first[0]["sections"])
                query = torch.frombuffer(bytearray(pf.sections[QUERY_SECTION]), dtype=self.engine.dtype)
                query = query.view(layers, -1, d)
                pf.adms = first
                pf.heads = self._read_first_heads_ahead(clients[0], h, first, query)
                units = chunks[1:]

                def work(c, chunk):
                    adms = list(_admission_replies(lambda fn: fn(c), rid, [chunk], sections=False))
                    return adms, [], self._read_first_heads_ahead(c, h, adms, query)

            # Unit i goes to connection (i + skew) % n: the first connection already read the
            # first admission chunk.
            n, skew = len(clients), 0 if self.transfer == "full" else 1
            owner = [(i + skew) % n for i in range(len(units))]
            helpers = {
                j: self._ahead_helpers.submit(
                    lambda j=j: [work(clients[j], u) for u, o in zip(units, owner, strict=True) if o == j]
                )
                for j in set(owner) - {0}
            }
            results = {0: [work(clients[0], u) for u, o in zip(units, owner, strict=True) if o == 0]}
            results.update({j: f.result() for j, f in helpers.items()})
            taken = dict.fromkeys(results, 0)
            for o in owner:  # merged in unit (layer) order
                adms, frames, heads = results[o][taken[o]]
                taken[o] += 1
                pf.adms += adms
                pf.frames += frames
                pf.heads += heads
            pf.wire_bytes = sum(sum(c.wire_bytes) - w for c, w in zip(clients, wire0, strict=True))
            return pf
        except BaseException:
            for c in self._prefetch_clients:
                c.close()
            self._prefetch_clients = []  # fresh connections for the next read
            raise

    def _ahead_clients(self) -> list:
        """The read ahead's connections (opened on first use), and the threads of all but the
        first."""
        while len(self._prefetch_clients) < self.prefetch_connections:
            self._prefetch_clients.append(_client(self.url, self._token, self._timeout_s))
        if self._ahead_helpers is None and self.prefetch_connections > 1:
            self._ahead_helpers = ThreadPoolExecutor(
                max_workers=self.prefetch_connections - 1, thread_name_prefix="oasis-prefetch"
            )
        return self._prefetch_clients

    def _read_whole_ahead(self, c, h: StagedRequest, layer: int) -> list:
        """Every block of ``layer``, whole: ``(layer, logicals, bytes)`` per frame."""
        _, hk, _, _, _, nb = h.geometry
        per_frame = _entries_per_frame(self._entry_bytes() * hk)
        frames = []
        for lo in range(0, nb, per_frame):
            logicals = list(range(lo, min(nb, lo + per_frame)))
            keys = [(h.request_id, layer, i, -1) for i in logicals]
            frames.append((layer, logicals, _read_all(c, keys, f"block of layer {layer}")))
        return frames

    def _read_first_heads_ahead(self, c, h: StagedRequest, adms: list, query: torch.Tensor) -> list:
        """The block-heads the admission's first selection will read for the layers of ``adms``
        (each KV head's top-K from the staged query, scored here by the CPU twins), as
        ``(layer, [(logical, head)], bytes)`` per frame. A GPU's scores may break a near-tie
        otherwise: the admission reads what this missed, in the loop. Nothing with a bounded
        cache (its rows are handed out at admission)."""
        eng, g = self.engine, self.engine.geo
        _, hk, b, d, _, nb = h.geometry
        n_complete = len(h.prompt) // b
        if n_complete == 0 or self.cache_blocks is not None:
            return []
        dt = eng.dtype
        summaries: dict[int, torch.Tensor] = {}
        for adm in adms:
            rows = torch.frombuffer(bytearray(adm["summaries"]), dtype=dt).view(-1, hk, 2, d)
            at = 0
            for layer, first, num in adm["summary_runs"]:
                if layer not in summaries:
                    summaries[layer] = torch.zeros(nb, hk, 2, d, dtype=dt)
                summaries[layer][first : first + num] = rows[at : at + num]
                at += num
        # Whole blocks of the admission set ("union") come with it.
        whole = {(layer, blk) for adm in adms for layer, blk in adm["block_keys"]}
        indptr = torch.tensor([0, n_complete], dtype=torch.int32)
        indices = torch.arange(n_complete, dtype=torch.int32)
        k = eng.kv.top_k_blocks
        sinks = min(getattr(eng.kv, "sink_blocks", 0), n_complete)
        per_frame = _entries_per_frame(self._entry_bytes())
        out = []
        for layer in sorted(summaries):
            pred = _first_top_k(g, query[layer], summaries[layer], indptr, indices, k)  # [hk, k]
            pairs = sorted(
                (blk, head)
                for blk, head in {(int(x), hd) for hd in range(hk) for x in pred[hd].tolist() if x >= 0}
                | {(x, hd) for hd in range(hk) for x in range(sinks)}
                if (layer, blk) not in whole
            )
            for lo in range(0, len(pairs), per_frame):
                part = pairs[lo : lo + per_frame]
                keys = [(h.request_id, layer, blk, head) for blk, head in part]
                out.append((layer, part, _read_all(c, keys, f"block-head of layer {layer}")))
        return out

    def _install(self, st: _Remote, layer: int, logicals, heads, data) -> None:
        """Blocks (``heads`` None) or block-heads read ahead, ``logicals`` of ``st`` in order, into
        their host rows."""
        rows = torch.tensor([st.host_rows[i] for i in logicals], dtype=torch.long)
        heads_t = None if heads is None else torch.tensor(heads, dtype=torch.long)
        self._count_cached(st, int(self._store(layer, rows, heads_t, data).sum()))

    def _store(self, layer: int, rows: torch.Tensor, heads: torch.Tensor | None, data) -> torch.Tensor:
        """Write read bytes into the host pool: block-heads ``(rows[i], heads[i])``, or with
        ``heads`` None every head of ``rows[i]``; mark them present. Returns how many of each
        entry's block-heads were absent before."""
        eng = self.engine
        p, g = eng.pools, eng.geo
        dev = p.host_device
        x = torch.frombuffer(data, dtype=eng.dtype)
        if heads is None:
            x = x.view(len(rows), 2, g.num_kv_heads, g.block_size, g.head_dim)
            at = (rows.to(dev),)
        else:
            x = x.view(len(rows), 2, g.block_size, g.head_dim)
            at = (rows.to(dev), heads.to(dev))
        p.host_k[layer][at] = x[:, 0].to(dev)
        p.host_v[layer][at] = x[:, 1].to(dev)
        return self._mark_present(torch.full_like(rows, layer), rows, heads)

    def _fetch_admission(self, st: _Remote, layers: int, pf: _Prefetched | None = None) -> dict:
        """Read the admission set of every layer (in as many calls as the frame limit needs), or
        take what ``pf`` read ahead, into the host pool and summaries; returns the sections."""
        g = self.engine.geo
        row = g.num_kv_heads * 2 * g.head_dim * self.engine.dtype.itemsize
        replies = (
            pf.adms
            if pf is not None
            else _admission_replies(
                self._call, st.daemon_id, _admission_chunks(layers, len(st.host_blocks) * row)
            )
        )
        sections: dict = {}
        for i, adm in enumerate(replies):
            if i == 0:
                sections = dict(adm["sections"])
            self._write_admission(st, adm)
        return self._checked_sections(st, sections)

    def _fetch_sections(self, st: _Remote) -> dict:
        """The admission's sections alone (no layers)."""
        adm = self._call(lambda c: c.fetch_admission(st.daemon_id, 0, 0, True))
        return self._checked_sections(st, dict(adm["sections"]))

    def _checked_sections(self, st: _Remote, sections: dict) -> dict:
        missing = [s for s in (META_SECTION, QUERY_SECTION) if s not in sections]
        if missing:
            raise ConfigError(
                f"staged request {st.daemon_id} has no {missing} section(s); stage it with "
                "oasiskv.disagg.PrefillWorker"
            )
        return sections

    def _build_summaries(self, tr: dict) -> None:
        """Summaries of every block from the host pool (``transfer="full"``)."""
        from ..engine import i32

        eng = self.engine
        p, dev = eng.pools, eng.device
        dst, lens = i32(tr["host_blocks"], dev), i32(tr["lens"], dev)
        rows = i32(tr["host_rows"], dev)
        for layer in range(eng.cfg.num_hidden_layers):
            ops.build_summaries(eng.geo, p.host_k[layer], dst, lens, p.summaries[layer], block_rows=rows)

    def _write_admission(self, st: _Remote, adm: dict) -> None:
        eng = self.engine
        p, g, dt = eng.pools, eng.geo, eng.dtype
        hk, b, d = g.num_kv_heads, g.block_size, g.head_dim
        hb = st.host_blocks
        if adm["summary_runs"]:
            rows = torch.frombuffer(adm["summaries"], dtype=dt).view(-1, hk, 2, d)
            at = 0
            for layer, first, num in adm["summary_runs"]:
                idx = torch.tensor(hb[first : first + num], dtype=torch.long, device=eng.device)
                p.summaries[layer][idx] = rows[at : at + num].to(eng.device)
                at += num
        if adm["block_keys"]:
            blocks = torch.frombuffer(adm["blocks"], dtype=dt).view(-1, 2, hk, b, d)
            by_layer: dict[int, list[int]] = {}
            for i, (layer, _) in enumerate(adm["block_keys"]):
                by_layer.setdefault(layer, []).append(i)
            for layer, rows_i in by_layer.items():
                logicals = [adm["block_keys"][i][1] for i in rows_i]
                if st.bounded:
                    # A layer's admission set gets cache rows (evicting other layers' blocks
                    # if it must); past C blocks (a worker with a larger K) the rest is read
                    # on demand.
                    keep = list(dict.fromkeys(logicals))[: self.cache_blocks]
                    rows_i = [i for i, lg in zip(rows_i, logicals, strict=True) if lg in set(keep)]
                    logicals = [adm["block_keys"][i][1] for i in rows_i]
                rows = self._rows_for(st, logicals, logicals)
                sel = torch.tensor(rows_i, dtype=torch.long)
                self._store_blocks(
                    st, layer, torch.tensor(rows, dtype=torch.long), blocks.index_select(0, sel)
                )

    def _take_row(self, st: _Remote, row: int, logical: int) -> None:
        """Host row ``row`` now holds staged block ``logical`` of ``st``: nothing of it read yet."""
        self._owner[row] = st.req.id
        self._logical[row] = logical
        st.rows.add(row)
        self._present[:, row] = False
        self._missing += len(self._present) * self.engine.geo.num_kv_heads

    def _forget_row(self, st: _Remote, row: int) -> None:
        """The block cached in ``row`` was evicted: its bytes are gone (read again if planned)."""
        hk = self.engine.geo.num_kv_heads
        had = int(self._present[:, row].sum())
        st.cached_entries -= had
        self.stats.cached_bytes -= had * self._entry_bytes()
        self._missing -= len(self._present) * hk - had
        self.stats.evicted_blocks += 1
        self._present[:, row] = True

    def _rows_for(self, st: _Remote, logicals: list[int], pinned: list[int]) -> list[int]:
        """The host rows of ``st``'s logical blocks ``logicals``: with a bounded cache the
        uncached ones get rows (``Runtime.cache_blocks``; evicting the least recently used blocks
        outside ``pinned``), the evicted rows' bytes are forgotten and the new ones are absent
        until read."""
        rows, given, evicted = self.engine.runtime.cache_blocks(st.req.id, logicals, pinned)
        if not st.bounded:
            return rows
        for _, row in evicted:
            self._forget_row(st, row)
        row_of = dict(zip(logicals, rows, strict=True))
        for logical in given:
            self._take_row(st, row_of[logical], logical)
        return rows

    def _store_blocks(self, st: _Remote, layer: int, hb: torch.Tensor, blocks: torch.Tensor) -> None:
        """Whole blocks ``[n, 2, Hkv, b, D]`` into host rows ``hb``; marks every head present."""
        p = self.engine.pools
        dev = p.host_device
        idx = hb.to(dev)
        p.host_k[layer][idx] = blocks[:, 0].to(dev)
        p.host_v[layer][idx] = blocks[:, 1].to(dev)
        present = self._present[layer]
        new = int((~present[hb]).sum())
        present[hb] = True
        self._count_cached(st, new)

    def _count_cached(self, st: _Remote, entries: int) -> None:
        st.cached_entries += entries
        self._missing -= entries
        s = self.stats
        s.cached_bytes += entries * self._entry_bytes()
        s.peak_cached_bytes = max(s.peak_cached_bytes, s.cached_bytes)

    def _fetch_rest(self, st: _Remote, layers: int) -> None:
        """``transfer="full"``: read every block the admission did not bring, whole."""
        hb = torch.tensor(st.host_rows, dtype=torch.long)
        for layer in range(layers):
            absent = hb[~self._present[layer][hb].all(dim=1)]
            if absent.numel():
                heads = torch.full((absent.numel(),), -1, dtype=torch.long)
                self._read(torch.full_like(absent, layer), absent, heads, whole=True)

    def _select_initial(self, r: Request, tr: dict, query: torch.Tensor) -> None:
        """The initial working set, selected with the staged query without the cap (as
        ``Engine.make_sparse`` does with the latest lookahead query)."""
        from ..engine import csr_tables, i32

        eng = self.engine
        g, dev = eng.geo, eng.device
        n_complete = tr["n_complete"]
        slot_pages = i32([tr["slot_pages"]], dev)
        blk = csr_tables([tr["host_blocks"][:n_complete]], dev)
        host = csr_tables([tr["host_rows"]], dev)  # patched by before_gather (bounded cache)
        for layer in range(eng.cfg.num_hidden_layers):
            q = query[layer].view(1, g.num_qo_heads, g.head_dim).to(dev).contiguous()
            k = eng.kv.layer_budget(layer)  # KvConfig.layer_blocks: the layer's first k slots
            slots = slot_pages if k == slot_pages.shape[1] else slot_pages[:, :k].contiguous()
            eng.select_initial(r, layer, q, slots, blk, host, k)

    # ---------------------------------------------------------------- decode-time misses
    @property
    def idle(self) -> bool:
        """Whether :meth:`before_gather` has nothing to do: every staged block-head of the live
        requests is in the host pool and none has a bounded cache (a full transfer after its
        admission). The engine then runs its steps as it would without a source (captured
        CUDA graphs included)."""
        return self._missing == 0 and self._bounded == 0

    @property
    def fixes_up_graph_steps(self) -> bool:
        """Whether the engine may replay captured CUDA graphs while blocks are left to read: the
        graph's gathers copy whatever the host rows hold, then the engine calls
        :meth:`before_gather` for each layer's plan and gathers again where it read anything,
        before the next step reads those slots. Not with a bounded cache, whose rows change
        hands between the layers of a step."""
        return self._bounded == 0

    @property
    def may_evict(self) -> bool:
        """Whether :meth:`before_gather` may give a cached block's host row to another block (a
        staged request with a bounded cache is running): the engine then lets the previous
        layer's gather finish before calling it."""
        return self._bounded > 0

    def before_gather(self, layer: int, plan_slots, plan_blocks, host_indptr, host_indices) -> bool:
        """Called by the engine between a layer's delta selection and its gather: read the
        planned block-heads that are still only in the daemon into the host pool (one batched
        read per layer, across requests). A failed read marks the requests it carried failed
        (:meth:`take_failed`); the gather then copies stale bytes for them, and their step's
        output is discarded.

        With a bounded cache the layer's planned blocks of each such request first get host rows
        (``Runtime.cache_blocks``, pinned = this layer's planned blocks of the request: an
        eviction never takes a row this gather reads; earlier layers' gathers are done: the
        engine waits for them while :attr:`may_evict`), and ``host_indices`` (the
        step's, on the device) is patched at ``indptr[seq] + logical`` with them; the next plan
        reads the runtime's rows.

        Returns whether the gather's inputs changed (block-heads read, rows patched): a CUDA-graph
        step, whose gather ran before this, gathers the layer again then."""
        t0 = time.perf_counter()
        try:
            return self._before_gather(layer, plan_slots, plan_blocks, host_indptr, host_indices)
        finally:
            self.stats.read_seconds += time.perf_counter() - t0

    def _before_gather(self, layer: int, plan_slots, plan_blocks, host_indptr, host_indices) -> bool:
        if self._missing == 0 and self._bounded == 0:
            return False
        ps, pb = plan_slots.cpu(), plan_blocks.cpu()
        sel = ps >= 0
        if not bool(sel.any()):
            return False
        seq, head, _ = sel.nonzero(as_tuple=True)
        logical = pb[sel].long()
        indptr, indices = host_indptr.cpu().long(), host_indices.cpu().long()
        pos = indptr[seq] + logical
        hb = indices[pos]
        patched = False
        if self._bounded:
            # A request's first row (logical block 0's: the filler or its own) names its owner.
            owner = self._owner[indices[indptr[seq]]]
            for o in torch.unique(owner).tolist():
                st = self._by_req.get(o)
                if st is None or not st.bounded or o in self._failed:
                    continue
                mine = owner == o
                wanted = torch.unique(logical[mine]).tolist()
                try:
                    rows = self._rows_for(st, wanted, wanted)
                except OutOfBlocksError as e:
                    self._fail(o, f"its bounded host pool cannot hold one layer's planned blocks: {e}")
                    continue
                row_of = torch.full((max(wanted) + 1,), -1, dtype=torch.long)
                row_of[torch.tensor(wanted, dtype=torch.long)] = torch.tensor(rows, dtype=torch.long)
                new = row_of[logical[mine]]
                hb[mine] = new
                dev = host_indices.device
                host_indices[pos[mine].to(dev)] = new.to(dev, host_indices.dtype)
                patched = True
        return self._ensure(layer, hb, head) or patched

    def before_gathers(self, plans: list) -> list[bool]:
        """:meth:`before_gather` for every layer of a step at once, ``plans`` a list of
        ``(layer, plan_slots, plan_blocks, host_indptr, host_indices)`` in layer order: the
        absent block-heads of all the layers go to the daemon in one batched read (frames carry
        entries of several layers), not one round trip per layer. Returns, per plan, whether
        its gather's inputs changed. With a bounded cache, layer by layer (rows change hands
        between the layers of a step)."""
        t0 = time.perf_counter()
        try:
            return self._before_gathers(plans)
        finally:
            self.stats.read_seconds += time.perf_counter() - t0

    def _before_gathers(self, plans: list) -> list[bool]:
        if self._missing == 0 and self._bounded == 0 or not plans:
            return [False] * len(plans)
        shared = len({(id(p[3]), id(p[4])) for p in plans}) == 1 and len({p[1].shape for p in plans}) == 1
        if self._bounded or not shared:
            # Layer by layer: a bounded cache's rows change hands between layers; plans of
            # other tables or shapes than one step's.
            return [self._before_gather(*p) for p in plans]
        self._grow_maps()
        # Every layer's plan in one copy to the host (a copy per layer and tensor is a device
        # sync each); the step's host tables are shared by its layers.
        ps = torch.stack([p[1] for p in plans]).cpu()  # [layers, seqs, heads, cap]
        pb = torch.stack([p[2] for p in plans]).cpu()
        indptr, indices = plans[0][3].cpu().long(), plans[0][4].cpu().long()
        sel = ps >= 0
        li, seq, head, _ = sel.nonzero(as_tuple=True)
        if not li.numel():
            return [False] * len(plans)
        layer_of = torch.tensor([p[0] for p in plans], dtype=torch.long)
        got = self._absent(layer_of[li], indices[indptr[seq] + pb[sel].long()], head)
        if got is None:
            return [False] * len(plans)
        self._read(*got, whole=False)
        read = set(got[0].unique().tolist())
        return [p[0] in read for p in plans]

    def _absent(self, layers: torch.Tensor, hb: torch.Tensor, head: torch.Tensor):
        """The block-heads ``(layers[i], hb[i], head[i])`` not in the host pool, each once and
        none of a failed request, as ``(layers, hb, head)`` ordered by (layer, row, head), as
        :meth:`_read` wants them; None when there are none."""
        absent = ~self._present[layers, hb, head]
        if not bool(absent.any()):
            return None
        layers, hb, head = layers[absent], hb[absent], head[absent]
        if self._failed:
            ok = ~torch.isin(self._owner[hb], torch.tensor(list(self._failed), dtype=torch.long))
            layers, hb, head = layers[ok], hb[ok], head[ok]
            if not hb.numel():
                return None
        rows, hk = self._present.shape[1], self.engine.geo.num_kv_heads
        key = torch.unique((layers * rows + hb) * hk + head)  # one key per (layer, row, head), sorted
        layers, rest = key // (rows * hk), key % (rows * hk)
        return layers, rest // hk, rest % hk

    def _ensure(self, layer: int, hb: torch.Tensor, head: torch.Tensor) -> bool:
        """Make the block-heads ``(hb[i], head[i])`` present, reading the absent ones; whether
        any was read."""
        self._grow_maps()  # the pools may have grown for other requests (theirs are local)
        got = self._absent(torch.full_like(hb, layer), hb, head)
        if got is None:
            return False
        self._read(*got, whole=False)
        return True

    def _read(self, layers: torch.Tensor, hb: torch.Tensor, head: torch.Tensor, whole: bool) -> None:
        """Read ``(layers[i], hb[i], head[i])`` (``whole``: every head of ``hb[i]``) from the
        daemon into the host pool, in frames under the limit. A pool in CPU memory (pinned with
        a GPU) is written by the client itself (``RtClient.read_blocks_into``: one copy per entry
        from the received frame); another (``host_pool="device"``) through :meth:`_store`."""
        p = self.engine.pools
        into = p.host_device.type == "cpu"
        entry = self._entry_bytes() * (self.engine.geo.num_kv_heads if whole else 1)
        per_frame = _entries_per_frame(entry, min(self.client.max_frame * FRAME_FILL, BULK_FRAME_BYTES))
        owners = self._owner[hb].tolist()
        logical = self._logical[hb].tolist()
        heads = [-1] * len(owners) if whole else head.tolist()
        lay = layers.tolist()
        rows = hb.tolist()
        n = len(owners)
        conns = self.read_connections if into and n >= 2 * READ_SPLIT_MIN_ENTRIES else 1
        count = max(math.ceil(n / per_frame), min(conns, n // READ_SPLIT_MIN_ENTRIES))
        size = math.ceil(n / count) if n else 1
        bounds = [(lo, min(n, lo + size)) for lo in range(0, n, size)]

        def keys_of(lo: int, hi: int) -> list:
            return [(self._by_req[owners[i]].daemon_id, lay[i], logical[i], heads[i]) for i in range(lo, hi)]

        def read_into(c, lo: int, hi: int) -> list:
            """One frame's entries written into the pool by ``c``; their errors."""
            return c.read_blocks_into(keys_of(lo, hi), rows[lo:hi], p.host_k, p.host_v)[1]

        k, wait = (
            self._start_parallel_reads(bounds, read_into) if conns > 1 and len(bounds) > 1 else (1, None)
        )
        try:
            for j, (lo, hi) in enumerate(bounds):
                data = None
                got = wait(j) if j % k else None
                try:
                    if got is not None:
                        errors, wire = got
                    else:
                        wire0 = self._wire()
                        if into:
                            errors = self._call(read_into, lo, hi)
                        else:
                            keys = keys_of(lo, hi)
                            data, _, errors = self._call(lambda c, keys=keys: c.read_blocks(keys))
                        wire = self._wire() - wire0
                except RemoteError as e:
                    for i in range(lo, hi):
                        self._fail(owners[i], f"reading KV from the staging daemon failed: {e}")
                    continue
                good = [i for i, err in enumerate(errors) if err is None]
                for i, err in enumerate(errors):
                    if err is not None:
                        self._fail(
                            owners[lo + i],
                            f"reading block {logical[lo + i]} of layer {lay[lo + i]} from the staging daemon "
                            f"failed ({err}); was the request released or evicted after its lease "
                            "(oasis-rt serve --lease)?",
                        )
                if good:
                    sel = torch.tensor(good, dtype=torch.long) + lo
                    if into:
                        new = self._mark_present(layers[sel], hb[sel], None if whole else head[sel])
                    else:
                        new = self._store_frame(data, entry, lay, good, lo, hb, None if whole else head)
                    per_owner: dict[int, int] = {}
                    for i, cnt in zip(good, new.tolist(), strict=True):
                        per_owner[owners[lo + i]] = per_owner.get(owners[lo + i], 0) + int(cnt)
                    for owner, cnt in per_owner.items():
                        self._count_cached(self._by_req[owner], cnt)
                if not whole and not self._admitting:
                    # Decode-time traffic (reads while a request is admitted count as its admission:
                    # the first working set's block-heads); shared among a frame's requests by entries.
                    self.stats.fetched_bytes += wire
                    self.stats.fetched_entries += len(good)
                    share = wire / (hi - lo)
                    for i in range(lo, hi):
                        self._by_req[owners[i]].fetched_bytes += share
                    for i in set(owners[lo:hi]):
                        st = self._by_req[i]
                        st.req.metrics.network_fetched_bytes = round(st.fetched_bytes)
        finally:
            for j in range(1, min(k, len(bounds))):  # no thread writes into the pool after this
                try:
                    wait(j)
                except Exception:  # noqa: BLE001, S110  the loop's own error is on its way out
                    pass

    def _start_parallel_reads(self, bounds: list, read_into):
        """Read the frames ``bounds[j] = (lo, hi)`` with ``j % k != 0`` into the host pool
        (``read_into(client, lo, hi)``, returning the entries' errors) on ``k - 1`` extra
        connections, one thread each (``k = read_connections``); the caller reads
        the others on the loop's own connection meanwhile. Returns ``(k, wait)``: ``wait(j)``
        blocks until frame ``j``'s connection is done and gives ``(errors, wire bytes)``, or None
        when that connection failed first (the caller reads the frame again on its own
        connection, with retries; the failed connection is dropped, a fresh one opened next
        time)."""
        k = min(self.read_connections, len(bounds))
        while len(self._read_clients) < k - 1:
            self._read_clients.append(_client(self.url, self._token, self._timeout_s))
        if self._read_helpers is None:
            self._read_helpers = ThreadPoolExecutor(
                max_workers=self.read_connections - 1, thread_name_prefix="oasis-read"
            )

        def work(c, mine: list) -> dict:
            out = {}
            for lo, hi in mine:
                w0 = sum(c.wire_bytes)
                try:
                    errors = read_into(c, lo, hi)
                except RemoteError as e:
                    log.warning("a parallel read from the staging daemon failed: %s", e)
                    break  # the caller reads the rest of this connection's frames
                out[lo] = (errors, sum(c.wire_bytes) - w0)
            return out

        clients = self._read_clients[: k - 1]
        futures = [self._read_helpers.submit(work, c, bounds[j::k]) for j, c in enumerate(clients, start=1)]
        results: dict = {}

        def wait(j: int):
            i = j % k - 1
            f, futures[i] = futures[i], None
            if f is not None:
                got = f.result()
                results.update(got)
                # Their traffic counts in _wire (every connection), as the loop connection's does.
                self._wire_base += sum(w for _, w in got.values())
                c = clients[i]
                if not c.connected:
                    self._read_clients.remove(c)
                    c.close()
            return results.get(bounds[j][0])

        return k, wait

    def _mark_present(self, layers: torch.Tensor, rows: torch.Tensor, heads: torch.Tensor | None):
        """Entries now in the host pool: block-heads ``(layers[i], rows[i], heads[i])``, or with
        ``heads`` None every head of the row. How many of each entry's were absent before."""
        if heads is None:
            new = (~self._present[layers, rows]).sum(dim=1)
            self._present[layers, rows] = True
        else:
            new = (~self._present[layers, rows, heads]).long()
            self._present[layers, rows, heads] = True
        return new

    def _store_frame(self, data, entry: int, lay: list, good: list, lo: int, hb, head) -> torch.Tensor:
        """:meth:`_store` for one frame's good entries (``lo + good[j]``), one layer at a time:
        ``data`` holds them back to back."""
        view = memoryview(data)
        out = []
        a = 0
        while a < len(good):
            b = a
            while b < len(good) and lay[lo + good[b]] == lay[lo + good[a]]:
                b += 1
            sel = torch.tensor(good[a:b], dtype=torch.long) + lo
            part = view[a * entry : b * entry]
            out.append(self._store(lay[lo + good[a]], hb[sel], None if head is None else head[sel], part))
            a = b
        return torch.cat(out)

    def _fail(self, owner: int, message: str) -> None:
        st = self._by_req.get(owner)
        if owner not in self._failed:
            self._failed[owner] = message
            self.stats.failures += 1
            log.warning("request %s: %s", owner, message)
        if st is not None:
            st.errors.append(message)

    def take_failed(self) -> dict[int, str]:
        """Engine request ids whose KV could not be read since the last call -> why; the engine
        finishes them with ``finish_reason="error"``."""
        out, self._failed = self._failed, {}
        return out

    # ---------------------------------------------------------------- end
    def _release_remote(self, st: _Remote) -> None:
        if st.alive:
            st.alive = False
            self._release_daemon_copy(st.daemon_id)

    def end(self, r: Request) -> None:
        """``r`` ends (finished, aborted, failed): forget its staged blocks and release the
        daemon's copy (best effort). Call before the engine frees its host blocks."""
        st = self._by_req.pop(r.id, None)
        if st is None:
            return
        self._bounded -= st.bounded
        hb = torch.tensor(sorted(st.rows), dtype=torch.long)
        if hb.numel() and self._present.numel():
            self._missing -= int((~self._present[:, hb]).sum())
            self._present[:, hb] = True
            self._owner[hb] = -1
        self.stats.cached_bytes -= st.cached_entries * self._entry_bytes()
        self._failed.pop(r.id, None)
        self._release_remote(st)

    def close(self) -> None:
        if self._prefetcher is not None:
            self._prefetcher.shutdown(wait=True, cancel_futures=True)
            self._prefetcher = None
        if self._ahead_helpers is not None:
            self._ahead_helpers.shutdown(wait=True)
            self._ahead_helpers = None
        self._prefetch.clear()
        for c in self._prefetch_clients:
            c.close()
        self._prefetch_clients = []
        if self._read_helpers is not None:
            self._read_helpers.shutdown(wait=True)
            self._read_helpers = None
        for c in self._read_clients:
            c.close()
        self._read_clients = []
        self.client.close()
