"""Disaggregated decode on a GPU (``oasiskv.disagg``): a prefill worker and a decode engine on
the device, the staging daemon (the cargo-built binary, ``$OASIS_RT_BIN`` on the GPU machine) in
its own process. With ``first_query="prompt"`` the decode engine's greedy tokens equal the
single-process OasisKV engine's on the same device, whichever transfer; with partial fetching the
misses are read after each step's compute is queued (``Engine._flush_deferred``), on the
background streams."""

from __future__ import annotations

import pytest
import torch

from oasiskv import KvConfig, LLMEngine, SamplingParams
from oasiskv.disagg import PrefillWorker
from oasiskv.errors import ConfigError
from oasiskv.models.transformer import CausalLM
from support.engines import gpu_model
from support.rtd import Daemon
from support.staged import all_released

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

#: 4 blocks of 16 per KV head on a 600-token prompt: the selection drifts to blocks not yet sent.
SMALL = KvConfig.fast(block_size=16, top_k_blocks=4, sparse_threshold=64)


def _model() -> CausalLM:
    return gpu_model("cuda", torch.bfloat16)


def _prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    base = torch.randint(0, 301, (41,), generator=g).tolist()
    return (base * (n // 41 + 1))[:n]


def _decode_staged(d: Daemon, **engine_kw) -> LLMEngine:
    """Two 600-token prompts prefilled into daemon ``d`` (``first_query="prompt"``) and decoded
    by an ``LLMEngine(kv_source=d, **engine_kw)``: greedy tokens equal the eager single-process
    OasisKV engine's on the same device. Returns the decode engine."""
    model = _model()
    prompts = [_prompt(600, s) for s in (3, 5)]
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    worker = PrefillWorker(model, SMALL, d.url, first_query="prompt")
    handles = [worker.prefill(p) for p in prompts]
    worker.close()
    eng = LLMEngine(model, kv=SMALL, drafter="ngram", kv_source=d.url, **engine_kw)
    ids = [eng.add_staged_request(h, params) for h in handles]
    outs = eng.run_to_completion(ids)
    ref = LLMEngine(model, kv=SMALL, backend="oasis", drafter="ngram", enforce_eager=True)
    rids = [ref.add_request(p, params) for p in prompts]
    refs = ref.run_to_completion(rids)
    for i, r in zip(ids, rids, strict=True):
        assert outs[i].finish_reason == "length", outs[i].error
        assert outs[i].token_ids == refs[r].token_ids
    return eng


@pytest.mark.parametrize(
    "transfer, cache_blocks",
    [("partial", None), ("full", None), ("partial", 10)],
    ids=["partial", "full", "partial-bounded"],
)
def test_staged_requests_decode_as_the_single_process_engine(transfer, cache_blocks):
    """Eager steps (a bounded cache refuses CUDA graphs: ``test_a_bounded_cache_refuses_cuda_graphs``).
    ``cache_blocks``: a bounded host cache (``kv_cache_blocks``), small enough to evict, so
    the deferred fetches wait for the previous layer's gather before a row changes hands."""
    with Daemon(memory="1GiB") as d:
        eng = _decode_staged(d, kv_transfer=transfer, kv_cache_blocks=cache_blocks, enforce_eager=True)
        st = eng.kv_source.stats
        assert st.failures == 0 and st.cached_bytes == 0
        if transfer == "partial":
            assert st.fetched_entries > 0  # misses came over the network during decode
        if cache_blocks is not None:
            assert st.evicted_blocks > 0
        assert all_released(eng.kv_source.client)


def test_a_full_transfer_decodes_in_cuda_graphs():
    """After a full transfer's admission the source has nothing left to read (``idle``), so the
    engine replays captured CUDA graphs: the same tokens as the eager single-process engine's."""
    with Daemon(memory="1GiB") as d:
        eng = _decode_staged(d, kv_transfer="full")
        assert eng.kv_source.idle and eng.engine.graph_stats["replays"] > 0


def test_a_partial_transfer_decodes_in_cuda_graphs_fixed_up_after_each_step():
    """``kv_transfer="partial"`` with CUDA graphs (the default): each step replays a graph whose gathers
    copy whatever the host rows hold; then the engine hands every layer's plan to the source,
    which reads the missing block-heads, and gathers those layers again before the next step.
    The tokens are the eager single-process engine's, and misses did come over the network."""
    with Daemon(memory="1GiB") as d:
        eng = _decode_staged(d, kv_transfer="partial")
        st = eng.kv_source.stats
        assert st.failures == 0 and st.fetched_entries > 0
        assert eng.engine.graph_stats["replays"] > 0


@pytest.mark.parametrize("transfer_stream", [False, True], ids=["on-its-stream", "transfer-stream"])
@pytest.mark.parametrize("eager", [False, True], ids=["graphs", "eager"])
def test_in_step_reads_decode_as_the_single_process_engine(eager, transfer_stream, monkeypatch):
    """``kv_in_step_reads=True``: each layer's plan goes to the coordinator's step reader while
    the step runs, and the layer's gather waits (the ``wait_epoch`` kernel) for its reads, on
    its background stream or on the transfer stream (``IN_STEP_TRANSFER_STREAM``): the tokens
    are the eager single-process engine's, in captured graphs and eagerly, misses came over the
    network, no wait gave up and no graph step was fixed up."""
    from oasiskv.engine import core

    monkeypatch.setattr(core, "IN_STEP_TRANSFER_STREAM", transfer_stream)
    with Daemon(memory="1GiB") as d:
        eng = _decode_staged(d, kv_transfer="partial", kv_in_step_reads=True, enforce_eager=eager)
        src = eng.kv_source
        st, reader = src.stats, src._in_step.stats()
        assert st.failures == 0 and st.fetched_entries > 0
        assert reader["steps"] > 0 and reader["stale_steps"] == reader["refused"] == 0, reader
        assert int(src._in_step.waits[0]) == 0 and int(src._in_step.waits[3]) > 0
        if not eager:
            assert eng.engine.graph_stats["replays"] > 0
        assert (eng.engine._transfer is not None) == transfer_stream


def test_a_bounded_cache_refuses_cuda_graphs():
    """A bounded host cache moves rows between a step's layers, which a replayed graph cannot
    follow: with graphs on (the GPU default) the engine refuses it and names both ways out."""
    with Daemon(memory="1GiB") as d:
        with pytest.raises(ConfigError, match="enforce_eager=True or kv_cache_blocks=None"):
            LLMEngine(
                _model(),
                kv=SMALL,
                drafter="ngram",
                kv_source=d.url,
                kv_transfer="partial",
                kv_cache_blocks=10,
            )
