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

The package's rooms:

- :mod:`.wire`: the vocabulary of both sides: the ``kv_source`` URL (:func:`split_kv_source`),
  the :class:`StagedRequest` handle, the admission set's sections, the frame arithmetic, the
  reads both the loop and the read ahead make, and the tunable sizes (:data:`BULK_FRAME_BYTES`,
  :data:`READ_CONNECTIONS`, ...).
- :mod:`.prefill`: the prefill side, :class:`PrefillWorker` (prefill, first token, summaries,
  admission set, staging over several connections).
- :mod:`.remote`: the decode side, :class:`RemoteKvSource`, the engine's
  :class:`~oasiskv.policy.BlockSource` (``LLMEngine(kv_source=...)``): each step's plans handed to
  the Rust coordinator (``oasiskv._core.Coordinator``, crate ``oasis-coord``: the presence map,
  the reads of missing block-heads straight into the host pool on threads and connections of its
  own, failed requests), the per-layer waits, the bounded cache's rows, failures. Its parts:
  :mod:`.admission` (admitting a staged request), :mod:`.read_ahead` (reading waiting requests'
  admission data in the background), :mod:`.connections` (the admission's daemon client and its
  retries), :mod:`.state` (per-request state, :class:`TransferStats`).

**Transports.** The URL names one: ``oasis-rt://HOST:PORT`` (or a bare ``HOST:PORT``) is plain TCP,
``oasis-rt+ucx://HOST:PORT`` is UCX, for a daemon started with ``oasis-rt serve --transport ucx``
(same frames as active messages; UCX picks shared memory, TCP or RDMA itself, ``UCX_TLS`` to
choose). The extension loads libucp only when a UCX client connects; where it is missing that
raises ``ConfigError`` (``.code == "ucx_unavailable"``) saying what to install.

Every name above is importable from ``oasiskv.disagg``. The tunable sizes belong to
:mod:`.wire`, whose readers look them up there at call time; writing one through this package
(``monkeypatch.setattr(oasiskv.disagg, "BULK_FRAME_BYTES", 1)``, as the tests do) writes it there
too.
"""

from __future__ import annotations

import logging

from . import wire
from .admission import AdmissionMixin
from .connections import Connections
from .prefill import PrefillWorker
from .read_ahead import Prefetched, ReadAhead
from .remote import RemoteKvSource
from .state import StagedState, TransferStats
from .wire import (
    ADMISSIONS,
    BULK_FRAME_BYTES,
    COORD_THREADS,
    DTYPES,
    FIRST_QUERIES,
    FRAME_FILL,
    FRAME_OVERHEAD,
    KV8_SCALE_BYTES,
    KV_FORMAT_FP8,
    KV_FORMAT_PLAIN,
    KV_FORMATS,
    KV_TRANSFERS,
    LOCAL_SECTION,
    META_FORMAT,
    META_SECTION,
    PREFETCH_CONNECTIONS,
    PREFETCH_DEPTH,
    QUERY_SECTION,
    READ_CONNECTIONS,
    READ_KEY_BYTES,
    READ_REPLY_ENTRY_BYTES,
    READ_SPLIT_MIN_ENTRIES,
    SCHEME,
    TRANSPORTS,
    UCX_SCHEME,
    StagedRequest,
    admission_chunks,
    admission_replies,
    block_bytes,
    block_head_bytes,
    connect,
    dtype_name,
    first_top_k,
    head_segment_bytes,
    kv_format_name,
    kv_source_url,
    pack_kv8,
    parse_kv_source,
    split_kv_source,
    unpack_kv8,
)

log = logging.getLogger("oasiskv.disagg")

__all__ = [
    "ADMISSIONS",
    "BULK_FRAME_BYTES",
    "DTYPES",
    "FIRST_QUERIES",
    "FRAME_FILL",
    "FRAME_OVERHEAD",
    "KV8_SCALE_BYTES",
    "KV_FORMAT_FP8",
    "KV_FORMAT_PLAIN",
    "KV_FORMATS",
    "KV_TRANSFERS",
    "LOCAL_SECTION",
    "META_FORMAT",
    "META_SECTION",
    "PREFETCH_CONNECTIONS",
    "PREFETCH_DEPTH",
    "QUERY_SECTION",
    "COORD_THREADS",
    "READ_CONNECTIONS",
    "READ_KEY_BYTES",
    "READ_REPLY_ENTRY_BYTES",
    "READ_SPLIT_MIN_ENTRIES",
    "SCHEME",
    "TRANSPORTS",
    "UCX_SCHEME",
    "AdmissionMixin",
    "Connections",
    "PrefillWorker",
    "Prefetched",
    "ReadAhead",
    "RemoteKvSource",
    "StagedRequest",
    "StagedState",
    "TransferStats",
    "admission_chunks",
    "admission_replies",
    "block_bytes",
    "block_head_bytes",
    "connect",
    "dtype_name",
    "first_top_k",
    "head_segment_bytes",
    "kv_format_name",
    "kv_source_url",
    "pack_kv8",
    "parse_kv_source",
    "split_kv_source",
    "unpack_kv8",
    "wire",
]
