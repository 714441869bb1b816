"""The shared vocabulary of both sides of disaggregation: the ``kv_source`` URL and its schemes
(:func:`split_kv_source`), the handle a prefill worker hands the decode side
(:class:`StagedRequest`), the sections and the meta format of an admission set, the frame
arithmetic of the daemon's protocol (:func:`admission_chunks`), the admission reads both the
decode loop and the read ahead make (:func:`admission_replies`),
the first selection both sides compute from the same bytes (:func:`first_top_k`), the block
formats of the daemon geometry's ``kv_format`` (:data:`KV_FORMATS`; fp8 blocks are each head's
E4M3 codes then its float32 scale: :func:`pack_kv8`, :func:`unpack_kv8`), and a client of the
daemon (:func:`connect`).

The numbers here (frame sizes, connections, read-ahead depth) are read at call time as
``wire.NAME`` by the other rooms, so a test may patch them (``oasiskv.disagg`` forwards a write
of one of them here).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass

import torch

from .. import ops
from ..errors import ConfigError, InvalidArgumentError

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
#: Section names of the admission set (the protocol allows ``[a-z0-9_.:/-]``). ``LOCAL_SECTION``:
#: the partial last block's K and V unquantized, ``[num_layers, 2, num_kv_heads, block_size,
#: head_dim]`` in the model dtype, staged with fp8 blocks over float GPU pages only (the local
#: page holds them as the prompt computed them, as the single-process engine's does).
META_SECTION = "oasis/meta"
QUERY_SECTION = "oasis/query"
LOCAL_SECTION = "oasis/local_kv"
#: The daemon geometry's ``kv_format`` (its last field): blocks of model-dtype elements, or of
#: fp8_e4m3 codes with each head's float32 scale after its rows (the fp8 host pool's bytes).
KV_FORMAT_PLAIN = 0
KV_FORMAT_FP8 = 1
#: ``kv_format`` by name (``KvConfig``'s spelling of the fp8 one).
KV_FORMATS = {"plain": KV_FORMAT_PLAIN, "fp8_e4m3": KV_FORMAT_FP8}
#: Bytes of the float32 scale ending an fp8 head segment.
KV8_SCALE_BYTES = 4
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
#: Connections the Rust coordinator spreads the decode side's reads over (a step's misses, a full
#: transfer's blocks; ``RemoteKvSource.read_connections``), each a tokio task with its own queue.
#: One until measured on a many-core machine: on the 2-core build machine, with the daemon on the
#: same cores, 2 and 3 connections read no faster than one (1.26-1.35 GB/s, the Python threads).
READ_CONNECTIONS = 1
#: Most threads of the coordinator's runtime (one per connection up to this; arbitrary: the
#: copies into the pool are memory-bound, a few threads saturate a socket's worth).
COORD_THREADS = 4
#: A layer's entries are split across connections only into frames of at least this many.
READ_SPLIT_MIN_ENTRIES = 256
#: Block-heads the coordinator prefetches per decode step, and in flight at once, after the step's
#: own reads (``RemoteKvSource.decode_prefetch``; 0: none): the successors of the planned blocks
#: and each request's most recent staged blocks (``oasis_coord::prefetch``). As the crate's
#: ``DEFAULT_PREFETCH_ENTRIES`` (arbitrary: 512 bf16 block-heads of 16 x 128 are 4 MiB a step).
DECODE_PREFETCH = 512


#: The KV dtypes of the ``oasis/meta`` section, by name (:func:`dtype_name`).
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


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


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float16`` -> ``"float16"`` (a key of :data:`DTYPES`)."""
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
    layer: what a full transfer moves), ``geometry`` the daemon's 7-tuple
    ``(num_layers, num_kv_heads, block_size, head_dim, dtype_bytes, num_blocks, kv_format)``
    (``dtype_bytes``: the model dtype's, of the summaries and the query; ``kv_format``: one of
    :data:`KV_FORMATS`, how the blocks are stored).
    """

    request_id: int
    prompt: tuple[int, ...]
    first_token: int
    draft: int | None
    first_query: str
    geometry: tuple[int, int, int, int, int, int, int]
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


def connect(src: str, token, timeout_s: float):
    """A blocking client (``oasiskv._core.RtClient``) of the daemon at ``src`` (any ``kv_source`` form)."""
    from .._core import RtClient

    return RtClient(kv_source_url(src), token=token, timeout_s=float(timeout_s))


def head_segment_bytes(geometry) -> int:
    """Bytes of one KV head's K (or V) segment of a block of a daemon ``geometry``: its rows, and
    with ``kv_format`` fp8 the codes' scale after them (``Geometry::head_bytes`` of oasis-rt)."""
    _, _, b, d, elem, _, fmt = geometry
    if fmt == KV_FORMAT_FP8:
        return b * d + KV8_SCALE_BYTES
    return b * d * elem


def block_bytes(geometry) -> int:
    """Bytes of one whole block (K and V, every KV head) of a daemon ``geometry``."""
    return 2 * geometry[1] * head_segment_bytes(geometry)


def kv_format_name(fmt: int) -> str:
    """``1`` -> ``"fp8_e4m3"`` (a key of :data:`KV_FORMATS`); unknown values as ``"kv_format N"``."""
    return next((k for k, v in KV_FORMATS.items() if v == fmt), f"kv_format {fmt}")


def pack_kv8(k_codes, k_scales, v_codes, v_scales) -> torch.Tensor:
    """fp8 blocks in the wire's layout: codes ``[n, num_kv_heads, block_size, head_dim]`` (uint8)
    and scales ``[n, num_kv_heads]`` (float32) of K and V -> uint8 ``[n, 2, num_kv_heads,
    block_size * head_dim + 4]``, each head's codes followed by its scale (little-endian)."""
    n, hk, b, d = k_codes.shape
    out = torch.empty(n, 2, hk, b * d + KV8_SCALE_BYTES, dtype=torch.uint8, device=k_codes.device)
    for side, (codes, scales) in enumerate(((k_codes, k_scales), (v_codes, v_scales))):
        out[:, side, :, : b * d] = codes.reshape(n, hk, b * d)
        out[:, side, :, b * d :] = scales.to(torch.float32).contiguous().view(torch.uint8).view(n, hk, 4)
    return out


def unpack_kv8(data, n: int, heads: int, b: int, d: int):
    """The inverse of :func:`pack_kv8` for ``n`` entries of ``heads`` heads each (a whole block:
    every head; a block-head read: one): ``(k_codes, v_codes)`` uint8 ``[n, heads, b, d]`` and
    ``(k_scales, v_scales)`` float32 ``[n, heads]``."""
    x = torch.frombuffer(data, dtype=torch.uint8).view(n, 2, heads, b * d + KV8_SCALE_BYTES)
    codes = x[..., : b * d].reshape(n, 2, heads, b, d)
    scales = x[..., b * d :].contiguous().view(torch.float32).view(n, 2, heads)
    return codes[:, 0], codes[:, 1], scales[:, 0], scales[:, 1]


def admission_chunks(layers: int, layer_bytes: int) -> list[tuple[int, int]]:
    """Layer ranges ``(first, count)`` whose summaries (``layer_bytes`` a layer) fill about one
    bulk frame."""
    per_call = max(1, BULK_FRAME_BYTES // max(1, layer_bytes))
    return [(lo, min(per_call, layers - lo)) for lo in range(0, layers, per_call)]


def admission_replies(
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


def first_top_k(geo, q: torch.Tensor, summaries: torch.Tensor, indptr, indices, k: int) -> torch.Tensor:
    """Each KV head's top-``k`` blocks of one request under the query ``q`` (``[num_qo_heads,
    head_dim]``): the admission's first selection, ``[num_kv_heads, k]``, -1 padded."""
    q = q.view(1, geo.num_qo_heads, geo.head_dim).contiguous()
    scores = ops.score_blocks(geo, q, summaries, indptr, indices)
    return ops.topk_blocks(geo.num_kv_heads, scores, indptr, k)[0]


def block_head_bytes(geo, dtype: torch.dtype, kv8: bool = False) -> int:
    """Bytes of one block-head (one KV head of one block), K and V, under the engine geometry
    ``geo``: the unit of a decode-time read. ``kv8``: fp8 blocks (codes and a scale per side)."""
    if kv8:
        return 2 * (geo.block_size * geo.head_dim + KV8_SCALE_BYTES)
    return 2 * geo.block_size * geo.head_dim * dtype.itemsize
