"""The prefill side of disaggregation: :class:`PrefillWorker` prefills a prompt on its own dense
engine and stages its KV, summaries and admission set in the ``oasis-rt`` daemon, returning the
:class:`~oasiskv.disagg.wire.StagedRequest` handle for the decode side.

:class:`PrefillWorker` prefills densely on its own :class:`~oasiskv.engine.Engine`
(the same ``Engine.prefill`` the single-process engine runs, so the staged KV is bit-identical to
what that engine stores), takes the first token (greedy), and picks the query that selects the
first decode step's working set (``first_query``):

- ``"first_token"`` (the paper's §4.4.1, the default): one extra dense decode step runs the first
  token through the model; its own query at every layer selects. This is the query of the step
  the decode node runs first, so the initial working set is exact for that query.
- ``"prompt"``: the last prompt position's query, the one the single-process engine selects with
  when a request turns sparse right after its prefill (``Engine.make_sparse``). Greedy tokens of
  the decode node then equal the single-process OasisKV engine's token for token, whatever the
  budget (``tests/disagg/test_disagg.py``), for a prompt longer than ``sparse_threshold``. A
  staged request decodes sparsely from its first step, while the single-process engine decodes
  a shorter prompt densely until its context passes the threshold: the same attention over float
  tiers (the budget holds such a context), but with an fp8 tier the two read differently rounded
  KV (the staged blocks come from the fp8 host pool). With ``"first_token"`` they equal them (and
  dense) only when the budget holds the whole context.

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

**fp8.** The blocks are staged in the format of the worker's own host tier: with
``KvConfig(kv_dtype="fp8_e4m3")`` or ``KvConfig(host_kv_dtype="fp8_e4m3")`` as fp8_e4m3 codes with a
float32 scale per (block, KV head) (the daemon geometry's ``kv_format`` 1: each head's codes, then
its scale), byte for byte what the single-process engine with that ``KvConfig`` holds in its host
pool after the request turns sparse: the fp8 pages' own codes and scales, or float pages quantized
block by block over the prompt's rows (``ops.quantize_kv8``, the rule of the engine's dense-to-sparse
copy). About half the bytes of bf16 blocks: ``(b*d + 4) / (2*b*d)`` per head segment. The
summaries and the query stay in the model dtype and bound the keys the engine's do (the unquantized
keys over float pages, the stored values over fp8 pages). Over float pages, the partial last block
also goes unquantized in an ``oasis/local_kv`` section: the decode side's local page holds it as the
prompt computed it. The decode side must use the same ``kv_dtype`` and ``host_kv_dtype``; it
refuses a staged format that is not its host pool's.
"""

from __future__ import annotations

import json
import math
import secrets
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager

import torch

from .. import ops
from ..config import FP8_KV, KvConfig
from ..drafters import Drafter, make_drafter
from ..engine import Engine, Request
from ..errors import ConfigError, RemoteError
from .wire import (
    ADMISSIONS,
    FIRST_QUERIES,
    KV_FORMAT_FP8,
    KV_FORMAT_PLAIN,
    LOCAL_SECTION,
    META_FORMAT,
    META_SECTION,
    QUERY_SECTION,
    StagedRequest,
    block_bytes,
    connect,
    dtype_name,
    first_top_k,
    kv_format_name,
    pack_kv8,
)


class PrefillWorker:
    """The prefill side of disaggregation: prefill a prompt, stage its KV in the daemon.

    Args:
        model: a ``CausalLM`` (the decode side must run the same weights).
        kv: the cache configuration; ``block_size`` and ``top_k_blocks`` shape what is staged and
            selected, ``kv_dtype``/``host_kv_dtype`` the blocks' format (fp8 host tier: fp8
            blocks; use the decode engine's). ``block_score="codes"`` is not supported.
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
        self.client = connect(addr, token, timeout_s)
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
                with self._prompt_pages_kept(r, n):
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
                kv_bytes=geometry[0] * geometry[5] * block_bytes(geometry),
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

    @contextmanager
    def _prompt_pages_kept(self, r: Request, n: int):
        """Run the body (the extra decode step) and put the prompt's partial last fp8 page back as
        it was: appending the first token requantizes that page (its scale may grow), while the
        host pool of a single-process engine, and so the staged block, holds the prompt's own
        quantization. Nothing to keep over float pages or a full last block."""
        eng = self.engine
        p, b = eng.pools, eng.geo.block_size
        if not (eng.page_kv8 and n % b):
            yield
            return
        last = r.pages[n // b]
        tensors = (p.k_pages, p.v_pages, p.k_scales, p.v_scales)
        saved = [tuple(t[layer][last].clone() for t in tensors) for layer in range(p.num_layers)]
        try:
            yield
        finally:
            for layer, kept in enumerate(saved):
                for t, x in zip(tensors, kept, strict=True):
                    t[layer][last] = x

    def _buffers(self, nb: int, block_shape: tuple, block_dtype, summary_shape: tuple, count: int):
        """``count`` (blocks, summaries) host buffers of at least ``nb`` blocks, kept between calls
        (pinned on a GPU, so that the device-to-host copies are asynchronous)."""
        eng = self.engine
        b = self._bufs
        if (
            len(b) != count
            or b[0][0].shape[0] < nb
            or b[0][0].shape[1:] != block_shape
            or b[0][0].dtype != block_dtype
        ):
            pin = eng.device.type == "cuda"
            self._bufs = [
                (
                    torch.empty((nb, *block_shape), dtype=block_dtype, pin_memory=pin),
                    torch.empty((nb, *summary_shape), dtype=eng.dtype, pin_memory=pin),
                )
                for _ in range(count)
            ]
        return self._bufs

    def _stage_clients(self) -> list:
        """The staging connections: the worker's own and ``stage_connections - 1`` more (opened
        on first use), each sending a share of the layers from its own thread."""
        while len(self._extra_clients) < self.stage_connections - 1:
            self._extra_clients.append(connect(self.url, self._token, self._timeout_s))
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
        # The staged format is the host tier's (the module docs): fp8 blocks over an fp8 host tier.
        kv8 = eng.host_kv8
        fmt = KV_FORMAT_FP8 if kv8 else KV_FORMAT_PLAIN
        geometry = (layers, hk, b, d, eng.dtype.itemsize, nb, fmt)
        # Over float pages, the partial last block unquantized for the decode side's local page.
        local = [] if kv8 and not eng.page_kv8 and n % b else None
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
        block_shape, block_dtype = ((2, hk, b * d + 4), torch.uint8) if kv8 else ((2, hk, b, d), eng.dtype)
        bufs = self._buffers(nb, block_shape, block_dtype, (hk, 2, d), len(clients) + 1)
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
                k, v = p.pages_kv(layer, pages)  # [nb, Hkv, b, D] (fp8 pages: their values)
                if lens[-1] < b:
                    # Positions past the prompt (stale pool memory, or the extra step's token).
                    k[-1, :, lens[-1] :] = 0
                    v[-1, :, lens[-1] :] = 0
                summaries = torch.empty(nb, hk, 2, d, dtype=eng.dtype, device=dev)
                ops.build_summaries(g, k, all_blocks, lens_t, summaries)
                union: set[int] = set()
                if n_complete and self.admission == "union":
                    pred = first_top_k(g, query[layer], summaries, blk_indptr, blk_indices, kv.top_k_blocks)
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
                # [nb, 2, Hkv, b, D]: the wire's block layout (fp8: [nb, 2, Hkv, b*D codes + scale]).
                host_blocks[:nb].copy_(self._wire_blocks(layer, pages, k, v, lens_t), non_blocking=cuda)
                if local is not None:
                    local.append(torch.stack([k[-1], v[-1]]))
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
            "dtype": dtype_name(eng.dtype),
            "kv_format": kv_format_name(fmt),
            "kv_dtype": FP8_KV if eng.page_kv8 else dtype_name(eng.dtype),
            "admission": self.admission,
            "union_blocks": union_sizes,
        }
        sections = {
            META_SECTION: json.dumps(meta).encode(),
            QUERY_SECTION: query.contiguous().cpu(),
        }
        if local is not None:
            sections[LOCAL_SECTION] = torch.stack(local).contiguous().cpu()  # [layers, 2, Hkv, b, D]
        stored += self.client.stage_admission(rid, selected, sections)[0]
        return geometry, len(selected), stored

    def _wire_blocks(self, layer: int, pages, k: torch.Tensor, v: torch.Tensor, lens) -> torch.Tensor:
        """``layer``'s blocks as the wire carries them: ``[nb, 2, Hkv, b, D]`` of the K and V values
        ``k``, ``v`` (positions past the prompt zeroed); over an fp8 host tier ``[nb, 2, Hkv, b*D +
        4]`` codes and scales (:func:`~oasiskv.disagg.wire.pack_kv8`): the fp8 pages' own, or
        ``k``, ``v`` quantized over each block's ``lens`` rows, as the engine's dense-to-sparse
        copy quantizes them into its host pool."""
        eng = self.engine
        if not eng.host_kv8:
            return torch.stack([k, v], dim=1)
        p = eng.pools
        if eng.page_kv8:
            return pack_kv8(
                p.k_pages[layer][pages],
                p.k_scales[layer][pages],
                p.v_pages[layer][pages],
                p.v_scales[layer][pages],
            )
        g, nb = eng.geo, k.shape[0]
        (kc, ks), (vc, vs) = ops.empty_kv8(g, nb, eng.device), ops.empty_kv8(g, nb, eng.device)
        ops.quantize_kv8(g, k.contiguous(), lens, kc, ks)
        ops.quantize_kv8(g, v.contiguous(), lens, vc, vs)
        return pack_kv8(kc, ks, vc, vs)
