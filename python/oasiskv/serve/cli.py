"""``oasis serve``'s flags and entry point. Imports no FastAPI at module level, so ``oasis``'s
parser builds without it installed; the binding check runs before the model loads."""

from __future__ import annotations

import argparse
import ipaddress
import os
import sys

from ..config import BLOCK_SCORES, FAST_SELECTION, FP8_KV_NAMES, SELECTIONS
from .config import DEFAULT_MAX_BODY_BYTES, DEFAULT_MAX_QUEUE, DEFAULT_MAX_TOKENS, ServeConfig


def is_loopback(host: str) -> bool:
    """Whether ``host`` names only this machine (``localhost``, 127.0.0.0/8, ``::1``)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # another host name: it may resolve to any interface


def _fetch_cap(s: str) -> float | int:
    return float(s) if "." in s else int(s)


def _layer_blocks(s: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in s.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--layer-blocks takes one budget per layer, comma-separated ints (e.g. 96,128,64), got {s!r}"
        ) from None


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of ``oasis serve``."""
    p.add_argument(
        "model",
        help="'smollm2', a .gguf file, a Hugging Face directory, or a model-shaped preset "
        "(qwen3-8b, ...: random weights and no tokenizer, for benchmarks; prompts as token ids)",
    )
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default loopback only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' (default: $OASIS_API_KEY); needed to bind a "
        "non-loopback address",
    )
    p.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        metavar="NAME",
        help="the model ids clients may pass (default MODEL); responses name the id the request used",
    )
    p.add_argument(
        "--max-tokens-default",
        type=int,
        default=DEFAULT_MAX_TOKENS,
        help="new tokens of a request that sets no max_tokens (chat) or sends null, capped by the "
        f"context left (default {DEFAULT_MAX_TOKENS})",
    )
    add_engine_arguments(p)
    p.add_argument(
        "--max-queue",
        type=int,
        default=DEFAULT_MAX_QUEUE,
        help="requests that may wait beyond the running ones; past that, 429 with Retry-After",
    )
    p.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES)
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])


def add_selection_arguments(p: argparse.ArgumentParser) -> None:
    """How the working set is chosen (``KvConfig.block_score``, ``score_candidates``,
    ``sticky_candidates``, ``candidate_bound``, ``lookahead_min_confidence``, ``sink_blocks``, ``pin_blocks``,
    ``successor_blocks``, ``layer_blocks``): shared by ``oasis serve``, ``oasis generate``,
    ``oasis demo`` and the serving benchmark."""
    p.add_argument(
        "--selection",
        default="fidelity",
        choices=list(SELECTIONS),
        help="a preset of the flags below: 'fidelity' (the default: --block-score codes "
        "--score-candidates 1.25 --sticky-candidates --successor-blocks 8 (fewer below 32 blocks), "
        "and --lookahead-min-confidence 0.5 with --drafter eagle3: retrieval and exact copies as "
        "dense on SmolLM2) or 'fast' (the Quest bound alone, KvConfig.fast(): up to 5 %% more "
        "throughput, loses retrievals; 'quest' is its old name); flags given as well override it",
    )
    p.add_argument(
        "--block-score",
        default=None,
        choices=list(BLOCK_SCORES),
        help="how blocks are ranked: 2-bit key codes (the default: closer to the true attention, "
        "more scoring work), or the Quest min/max bound",
    )
    p.add_argument(
        "--score-candidates",
        type=float,
        default=None,
        metavar="F",
        help="with --block-score codes: rank only the Quest bound's best F x top-k blocks by "
        "their codes (3 keeps nearly all of the codes' gain)",
    )
    p.add_argument(
        "--sticky-candidates",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="with --score-candidates: each request's previous selection stays among the "
        "candidates (its first ranks every block by the codes)",
    )
    p.add_argument(
        "--candidate-bound",
        default=None,
        choices=["fp8", "summaries"],
        help="with --score-candidates: the first stage's Quest bound over each block's summary in "
        "FP8 rounded outward (the default: half the bytes) or over the 16-bit summaries",
    )
    p.add_argument(
        "--lookahead-min-confidence",
        type=float,
        default=None,
        metavar="P",
        help="with the eagle3 drafter: a draft whose probability is below P lets the step's own "
        "query choose the next working set (better exact copies)",
    )
    p.add_argument(
        "--sink-blocks", type=int, default=0, help="the first N blocks of every request are always selected"
    )
    p.add_argument(
        "--pin-blocks",
        type=int,
        default=0,
        help="per layer and KV head, the N best blocks for the prompt's last token stay selected",
    )
    p.add_argument(
        "--successor-blocks",
        type=int,
        default=None,
        help="per KV head, the next block of each of the N best blocks is selected too (a span "
        "across a block boundary stays whole)",
    )
    p.add_argument(
        "--layer-blocks",
        type=_layer_blocks,
        default=None,
        metavar="K0,K1,...",
        help="per-layer budgets, one per model layer, each at most --top-k-blocks "
        "(oasiskv.layer_budget.fit_layer_blocks fits them; default: --top-k-blocks in every layer)",
    )


def selection_kwargs(args) -> dict:
    """The :class:`~oasiskv.KvConfig` keyword arguments of :func:`add_selection_arguments`:
    ``--selection``'s preset (``fidelity``: KvConfig's own defaults, whose ``"auto"`` fields the
    engine resolves for its drafter, so the EAGLE-3 confidence fallback is on exactly where that
    drafter runs; ``fast``/``quest``: :data:`~oasiskv.config.FAST_SELECTION`), then every flag
    given explicitly over it."""
    names = (
        "block_score",
        "score_candidates",
        "sticky_candidates",
        "lookahead_min_confidence",
        "successor_blocks",
        "candidate_bound",
    )
    kw = dict(FAST_SELECTION) if getattr(args, "selection", "fidelity") in ("fast", "quest") else {}
    for name in names:
        given = getattr(args, name, None)
        if given is not None:
            kw[name] = given
    return dict(kw, sink_blocks=args.sink_blocks, pin_blocks=args.pin_blocks, layer_blocks=args.layer_blocks)


def add_engine_arguments(p: argparse.ArgumentParser) -> None:
    """The engine's flags (KvConfig, drafter, backend, device, dtype, batch and budgets): shared by
    ``oasis serve`` and ``python -m oasiskv.bench.serve --in-process`` so both build one engine."""
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--top-k-blocks", type=int, default=128, help="working-set budget in blocks per KV head")
    p.add_argument(
        "--fetch-cap",
        type=_fetch_cap,
        default=0.05,
        help="new blocks per KV head and step: a fraction of the budget (0.05) or a count (4)",
    )
    p.add_argument(
        "--sparse-threshold", type=int, default=None, help="tokens after which a request turns sparse"
    )
    add_selection_arguments(p)
    p.add_argument("--drafter", default="ngram", choices=["ngram", "eagle3", "previous-query"])
    p.add_argument("--backend", default="oasis", choices=["oasis", "dense"])
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    add_kv_dtype_arguments(p)
    p.add_argument(
        "--kv8-attention-kernel",
        default=None,
        choices=["tile", "registers", "registers-deep"],
        help="the tensor-core kernel that reads fp8_e4m3 pages on a GPU (oasiskv.ops."
        "set_kv8_attention_kernel): 'registers' (the default) feeds the MMA from the codes, 'tile' "
        "dequantizes each chunk into a bf16 tile first (1.26x slower on an H100), 'registers-deep' "
        "is 'registers' with twice the pipeline depth (not yet measured)",
    )
    p.add_argument(
        "--bound8-score-kernel",
        default=None,
        choices=["fma", "mma"],
        help="the kernel that scores the 8-bit bound (the default selection's first stage) on a GPU "
        "(oasiskv.ops.set_bound8_score_kernel): 'mma' (the default) takes eight blocks per "
        "tensor-core MMA, 'fma' converts each code to f32",
    )
    p.add_argument("--max-num-seqs", type=int, default=64, help="most requests decoded together")
    p.add_argument("--gpu-kv-budget-bytes", type=int, default=None)
    p.add_argument("--host-kv-budget-bytes", type=int, default=None)
    add_graph_arguments(p)
    p.add_argument(
        "--speculative",
        action="store_true",
        help="verify and accept the lookahead draft (speculative decoding; --drafter ngram or eagle3, "
        "also with --backend dense)",
    )


def add_graph_arguments(p: argparse.ArgumentParser, cuda_graph_help: str | None = None) -> None:
    """``--enforce-eager`` (no CUDA graphs; they are on by default on a GPU, as in vLLM) and the
    old ``--cuda-graph`` (now the default; kept so old command lines run)."""
    p.add_argument(
        "--enforce-eager",
        action="store_true",
        help="decode eagerly: no CUDA graphs (by default a GPU replays decode steps as CUDA graphs)",
    )
    p.add_argument(
        "--cuda-graph",
        action="store_true",
        help=cuda_graph_help or "the default on a GPU now (kept for old command lines); see --enforce-eager",
    )


def add_kv_dtype_arguments(p, whose: str = "the") -> None:
    """``--kv-dtype`` and ``--host-kv-dtype`` (read back by :func:`kv_dtype` and
    :func:`host_kv_dtype`): shared by ``oasis serve``, ``oasis generate``, ``oasis demo``, the
    serving benchmark and ``bench.disagg`` (``whose="both nodes'"``: the prefill worker's and
    the decode engine's)."""
    choices = ["auto", *FP8_KV_NAMES]
    p.add_argument(
        "--kv-dtype",
        default="auto",
        choices=choices,
        help=f"{whose} KV pages' storage: the model's dtype ('auto') or fp8_e4m3 (E4M3 with a scale per "
        "page and KV head, the host pool too unless --host-kv-dtype says otherwise; KvConfig.kv_dtype)",
    )
    p.add_argument(
        "--host-kv-dtype",
        default="auto",
        choices=choices,
        help=f"{whose} host KV pool's storage: as the pages ('auto') or fp8_e4m3 (E4M3 with a scale per "
        "block and KV head: half the host RAM and PCIe bytes of bf16; KvConfig.host_kv_dtype)",
    )


def host_kv_dtype(args) -> str | None:
    """``--host-kv-dtype`` as ``KvConfig.host_kv_dtype`` (None: the pages' dtype)."""
    value = getattr(args, "host_kv_dtype", "auto")
    return None if value == "auto" else value


def kv_dtype(args) -> str | None:
    """``--kv-dtype`` as ``KvConfig.kv_dtype`` (None: the model's dtype)."""
    value = getattr(args, "kv_dtype", "auto")
    return None if value == "auto" else value


def apply_kernel_flags(args) -> None:
    """Set the process-wide kernel choices the flags name (``--kv8-attention-kernel``,
    ``--bound8-score-kernel``): every engine of this process reads them at its launches. A flag
    left out (None) leaves the process's choice, whose default is the Rust core's
    (:func:`oasiskv.ops.kv8_attention_kernel`, :func:`oasiskv.ops.bound8_score_kernel`)."""
    from .. import ops

    if getattr(args, "kv8_attention_kernel", None) is not None:
        ops.set_kv8_attention_kernel(args.kv8_attention_kernel)
    if getattr(args, "bound8_score_kernel", None) is not None:
        ops.set_bound8_score_kernel(args.bound8_score_kernel)


def enforce_eager(args) -> bool:
    """``--enforce-eager``, checked against the old ``--cuda-graph``."""
    from ..errors import ConfigError

    eager = bool(getattr(args, "enforce_eager", False))
    if eager and getattr(args, "cuda_graph", False):
        raise ConfigError("--cuda-graph contradicts --enforce-eager; pass one (graphs are the default)")
    return eager


def engine_kwargs(args, device: str | None = None) -> dict:
    """The :class:`~oasiskv.LLMEngine` keyword arguments the engine flags describe (``device``:
    this one instead of ``--device``, e.g. a tensor-parallel rank's GPU)."""
    import torch

    from ..config import KvConfig
    from ..devices import compute_dtype, resolve_device

    apply_kernel_flags(args)
    kv = KvConfig(
        block_size=args.block_size,
        top_k_blocks=args.top_k_blocks,
        fetch_cap=args.fetch_cap,
        sparse_threshold=args.sparse_threshold,
        kv_dtype=kv_dtype(args),
        host_kv_dtype=host_kv_dtype(args),
        **selection_kwargs(args),
    )
    device = resolve_device(args.device) if device is None else str(device)
    dtype = compute_dtype(device) if args.dtype == "auto" else getattr(torch, args.dtype)
    spec = bool(getattr(args, "speculative", False))
    return dict(
        kv=kv,
        backend=args.backend,
        # The dense backend has no lookahead row unless it speculates (then it verifies the draft).
        drafter=None if args.backend == "dense" and not spec else args.drafter,
        device=device,
        dtype=dtype,
        max_num_seqs=args.max_num_seqs,
        gpu_kv_budget_bytes=args.gpu_kv_budget_bytes,
        host_kv_budget_bytes=args.host_kv_budget_bytes,
        enforce_eager=enforce_eager(args),
        speculative=spec,
    )


def engine_from_args(model, args):
    """The :class:`~oasiskv.LLMEngine` the engine flags describe, over ``model`` (a name or path
    as :class:`~oasiskv.LLMEngine` takes it, or a loaded model). Raises ``OasisError`` (bad
    flags, a missing checkpoint), ``MemoryError`` (too little memory)."""
    from ..llm_engine import LLMEngine

    return LLMEngine(model, **engine_kwargs(args))


def served_model(args):
    """What ``oasis serve`` loads: ``args.model`` itself (a name or path the engine loads), or,
    for the name of a model-shaped preset with no file of that name, that preset with random
    weights on the engine's device (benchmarks: the server then has no tokenizer)."""
    from ..models.config import preset_unless_path

    cfg = preset_unless_path(args.model)
    if cfg is None:
        return args.model
    from ..models.random_weights import random_model

    kw = engine_kwargs(args)
    print(
        f"oasis serve: {args.model} is a preset: random weights, no tokenizer (send token ids)",
        file=sys.stderr,
    )
    return random_model(cfg, kw["dtype"], kw["device"])


def cmd_serve(args) -> int:
    """``oasis serve``: check the flags, load the model, serve until interrupted."""

    def fail(msg: str) -> int:
        print(f"oasis serve: error: {' '.join(msg.split())}", file=sys.stderr)
        return 2

    key = args.api_key or os.environ.get("OASIS_API_KEY") or None
    if not is_loopback(args.host) and key is None:
        return fail(
            f"binding {args.host} exposes the server beyond this machine: pass --api-key KEY "
            "(or set OASIS_API_KEY), or bind 127.0.0.1"
        )
    if not 0 <= args.port <= 65535:
        return fail(f"--port must be in 0..65535, got {args.port}")
    if args.max_queue < 0 or args.max_body_bytes < 1 or args.max_tokens_default < 1:
        return fail("--max-queue must be >= 0, --max-body-bytes and --max-tokens-default >= 1")
    try:
        import uvicorn

        from .app import build_app
    except ImportError as e:
        return fail(f"{e}; install the server's dependencies: pip install 'oasiskv[serve]'")
    import torch

    from ..errors import OasisError

    try:
        eng = engine_from_args(served_model(args), args)
    except (OasisError, MemoryError, torch.OutOfMemoryError) as e:
        return fail(str(e) or type(e).__name__)
    names = args.served_model_name or [args.model]
    config = ServeConfig(
        model_name=names[0],
        api_key=key,
        max_queue=args.max_queue,
        max_body_bytes=args.max_body_bytes,
        model_aliases=tuple(names[1:]),
        max_tokens_default=args.max_tokens_default,
    )
    app = build_app(eng, config)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, timeout_graceful_shutdown=5)
    return 0
