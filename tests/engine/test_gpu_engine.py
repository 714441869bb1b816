"""The engine on a GPU: pools on the device, pinned host pool, background stream, against the CPU."""

from __future__ import annotations

import pytest
import torch

import oasiskv
from oasiskv import KvConfig
from oasiskv.engine import Engine, Request
from support.engines import DrafterWithConfidence, gpu_model, repeated_prompts, teacher_forced_logits

# Private names read here: ``Eagle3Drafter._states`` (the head's per-request cache, no public view):
# the prompt features' state must stay on the device; ``PrefillCache._items`` (where an entry's
# tensors are held).

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def test_gpu_oasis_full_budget_matches_gpu_dense_and_cpu():
    dev = torch.device("cuda")
    prompts = repeated_prompts(301, [333, 150, 97])
    forced = [repeated_prompts(301, [20], seed=9 + i)[0] for i in range(3)]
    kv = KvConfig(block_size=16, top_k_blocks=32, fetch_cap=4, sparse_threshold=64)
    on_gpu = gpu_model(dev)
    dense, _, _ = teacher_forced_logits(on_gpu, kv, "dense", prompts, forced)
    oasis, reqs, _ = teacher_forced_logits(on_gpu, kv, "oasis", prompts, forced)
    assert all(r.sparse for r in reqs[:2])
    torch.testing.assert_close(oasis, dense, atol=2e-4, rtol=1e-3)
    cpu, _, _ = teacher_forced_logits(gpu_model("cpu"), kv, "oasis", prompts, forced)
    torch.testing.assert_close(oasis, cpu, atol=2e-4, rtol=1e-3)


@pytest.mark.parametrize(
    "kv_kw",
    [
        {},
        {"block_score": "codes"},
        {"sink_blocks": 2},
        {"block_score": "codes", "score_candidates": 2, "sink_blocks": 1},
        {"block_score": "codes", "score_candidates": 2, "pin_blocks": 2},
        {"successor_blocks": 1},
        {"block_score": "codes", "score_candidates": 2, "successor_blocks": 1, "sink_blocks": 1},
        {"block_score": "codes", "score_candidates": 1.5, "sticky_candidates": True, "successor_blocks": 1},
        {"layer_blocks": (2, 6, 4)},
        {"block_score": "codes", "score_candidates": 2, "layer_blocks": (3, 6, 2)},
        {"host_kv_dtype": "fp8_e4m3"},
        {"kv_dtype": "fp8_e4m3"},
        {"block_score": "codes", "score_candidates": 1.5, "sticky_candidates": True, "host_kv_dtype": "fp8"},
    ],
)
def test_gpu_small_budget_matches_cpu_engine_selection(kv_kw):
    """A budget far below the context: the GPU engine (background stream, capped fetches) makes the
    same selections as the CPU engine, so logits agree step by step (with either block score, the
    two-stage codes score, sink, pinned and successor blocks, per-layer budgets).

    The codes score quantises keys that the two engines compute within f32 rounding of each other:
    a key that lands on a 2-bit code boundary (one in tens of thousands) gets different codes and
    the selections part legitimately. So the first prompts whose codes match in both engines are
    compared (seed 0 of the two-stage pinned case has such a key, 4e-6 apart, in layer 1)."""
    dev = torch.device("cuda")
    forced = [repeated_prompts(301, [24], seed=3 + i)[0] for i in range(2)]
    kv = KvConfig(block_size=16, top_k_blocks=6, fetch_cap=2, sparse_threshold=128, **kv_kw)
    for seed in range(4):
        prompts = repeated_prompts(301, [700, 400], seed=seed)
        gpu, greqs, geng = teacher_forced_logits(gpu_model(dev), kv, "oasis", prompts, forced)
        cpu, creqs, ceng = teacher_forced_logits(gpu_model("cpu"), kv, "oasis", prompts, forced)
        if geng.pools.codes is None or all(
            torch.equal(g[: c.shape[0]].cpu(), c[: g.shape[0]])
            for g, c in zip(geng.pools.codes, ceng.pools.codes, strict=True)
        ):
            break
    else:
        pytest.fail("every prompt seed put a key on a code boundary")
    torch.testing.assert_close(gpu, cpu, atol=2e-3, rtol=1e-2)
    for g, c in zip(greqs, creqs, strict=True):
        assert g.metrics.fetched_bytes_total == c.metrics.fetched_bytes_total
        assert g.metrics.lookahead_recall == pytest.approx(c.metrics.lookahead_recall, abs=1e-6)


def test_gpu_generate_bf16_runs_and_reports_metrics():
    model = gpu_model(torch.device("cuda"), torch.bfloat16)
    llm = oasiskv.LLM(model, kv=KvConfig(block_size=16, top_k_blocks=8, fetch_cap=0.25, sparse_threshold=128))
    res = llm.generate(repeated_prompts(301, [600, 300, 50]), 16, ignore_eos=True)
    assert all(len(r.tokens) == 16 for r in res)
    m = res[0].metrics
    assert m.sparse_steps == m.steps and m.resident_kv_bytes < m.full_kv_bytes
    assert 0.0 <= m.lookahead_recall <= 1.0
    assert res[2].metrics.sparse_steps == 0


def test_gpu_eagle3_prompt_features_stay_on_the_device_and_match_cpu():
    """The prefill hands the EAGLE-3 drafter every prompt position's features on the GPU (no
    trip through the host); the head's prompt cache and first draft agree with the CPU engine."""
    from oasiskv.drafters import Eagle3Drafter
    from oasiskv.models.eagle3 import Eagle3Head

    class Spy(Eagle3Drafter):
        def feed_prompt(self, req_id, prompt, features, start=0):
            self.seen = (features.device, features.dtype, tuple(features.shape))
            super().feed_prompt(req_id, prompt, features, start)

    prompt = repeated_prompts(301, [333])[0]
    kv = KvConfig(block_size=16, top_k_blocks=32, fetch_cap=4, sparse_threshold=64)
    out = {}
    for dev in (torch.device("cuda"), torch.device("cpu")):
        model = gpu_model(dev, num_layers=8)
        head = Eagle3Head.random(model.config, 64, seed=2, device=dev).attach_target(model)
        drafter = Spy(head, model)
        eng = Engine(model, kv, "oasis", drafter)
        r = Request(id=0, prompt=prompt, max_new_tokens=2)
        eng.ensure_pools([r])
        drafter.begin(0, prompt)
        r.tokens = list(prompt)
        logits = eng.prefill(r)
        r.tokens.append(int(logits.argmax()))
        draft = drafter.propose(0, r.tokens, r.features)
        assert drafter.seen == (model.device, model.dtype, (len(prompt), 3 * model.config.hidden_size))
        assert r.features.device == model.device
        state = drafter._states[0]
        # On the GPU the head's cache is paged by default: read its rows back through the pool.
        keys = state.paged.gather(state)[0] if state.paged is not None else state.k[: state.length]
        out[dev.type] = (r.tokens[-1], draft, keys.float().cpu())
    assert out["cuda"][0] == out["cpu"][0]
    torch.testing.assert_close(out["cuda"][2], out["cpu"][2], atol=2e-4, rtol=1e-3)
    assert out["cuda"][1] == out["cpu"][1]


def test_gpu_continuous_batching_equals_each_request_alone():
    """LLMEngine on the GPU (double-buffered plan, pinned host pool, background stream): requests
    arrive at different steps, one is aborted; each finished request's greedy tokens equal the
    same request run alone, and the pools are full again."""
    from oasiskv import LLMEngine, SamplingParams

    model = gpu_model("cuda")
    kv = KvConfig(block_size=16, top_k_blocks=6, fetch_cap=2, sparse_threshold=64)
    ps = repeated_prompts(301, [150, 40, 260, 90, 120], seed=5)
    news = [12, 9, 14, 6, 10]
    eng = LLMEngine(model, kv=kv, drafter="ngram", max_num_seqs=3)
    rids: dict[int, str] = {}
    finals = {}
    step = 0
    while step < 6 or eng.has_unfinished_requests():
        if step < len(ps):
            rids[step] = eng.add_request(ps[step], SamplingParams(max_tokens=news[step], ignore_eos=True))
        if step == 4:
            eng.abort_request(rids[1])
        for o in eng.step():
            if o.finished:
                finals[o.request_id] = o
        step += 1
    rt = eng.engine.runtime
    assert rt.num_requests == 0 and rt.num_free == rt.pool_sizes
    for i, rid in rids.items():
        o = finals[rid]
        if o.finish_reason == "abort":
            continue
        alone = LLMEngine(model, kv=kv, drafter="ngram")
        a = alone.add_request(ps[i], SamplingParams(max_tokens=news[i], ignore_eos=True))
        assert o.token_ids == alone.run_to_completion([a])[a].token_ids, f"request {i}"
    assert any(o.metrics.sparse_steps > 0 for o in finals.values())


def test_gpu_lookahead_min_confidence_unsure_drafts_select_like_the_previous_query():
    """KvConfig(lookahead_min_confidence) on the GPU, CUDA graphs on (the per-slot flags written
    before each replay, gathered inside it): every draft unsure gives the previous-query
    drafter's tokens, traffic and recall exactly."""
    from oasiskv.drafters import PreviousQueryDrafter

    model = gpu_model(torch.device("cuda"))
    base = dict(
        block_size=16,
        top_k_blocks=4,
        fetch_cap=2,
        sparse_threshold=64,
        block_score="codes",
        score_candidates=1.5,
        sticky_candidates=True,
        successor_blocks=1,
    )
    ps = repeated_prompts(301, [333, 150, 60])
    runs = [
        oasiskv.LLM(model, kv=KvConfig(**base, **kw), drafter=d, cuda_graph=True).generate(
            ps, 24, ignore_eos=True
        )
        for kw, d in (
            ({"lookahead_min_confidence": 0.5}, DrafterWithConfidence(0.3)),
            ({}, PreviousQueryDrafter()),
        )
    ]
    for a, b in zip(*runs, strict=True):
        assert a.tokens == b.tokens
        assert a.metrics.fetched_bytes_total == b.metrics.fetched_bytes_total
        assert a.metrics.lookahead_recall == pytest.approx(b.metrics.lookahead_recall, abs=1e-6)
    assert any(r.metrics.sparse_steps > 0 for r in runs[0])


@pytest.mark.parametrize("backend", ["dense", "oasis"])
def test_gpu_prefill_cache_on_host_serves_the_same_tokens(backend):
    """A PrefillCache held in pinned host memory (``on_host=True``, fig11's default) keeps no
    K/V on the card, and a hit copied back in gives the tokens a fresh prefill gives."""
    dev = torch.device("cuda")
    model = gpu_model(dev)
    kv = KvConfig(block_size=16, top_k_blocks=8, fetch_cap=4, sparse_threshold=64)
    ps = repeated_prompts(301, [333])
    fresh = oasiskv.LLM(model, kv=kv, backend=backend, drafter="ngram").generate(ps, 12, ignore_eos=True)[0]
    cache = oasiskv.PrefillCache(on_host=True)
    first = oasiskv.LLM(model, kv=kv, backend=backend, drafter="ngram", prefill_cache=cache)
    a = first.generate(ps, 12, ignore_eos=True)[0]
    assert cache.hits == 0 and cache.nbytes > 0
    (entry,) = cache._items.values()
    assert all(t.device.type == "cpu" and t.is_pinned() for t in (*entry.k, *entry.v))
    b = oasiskv.LLM(model, kv=kv, backend=backend, drafter="ngram", prefill_cache=cache).generate(
        ps, 12, ignore_eos=True
    )[0]
    assert cache.hits == 1
    assert a.tokens == fresh.tokens and b.tokens == fresh.tokens


def test_gpu_dense_fp8_pages_match_the_cpu_engine():
    """KvConfig(kv_dtype="fp8_e4m3") with the dense backend: the CUDA quantize, append and
    attention kernels give the CPU engine's logits (within the float tolerance; a key on an E4M3
    rounding boundary can round the other way, which the tolerance covers at this size)."""
    dev = torch.device("cuda")
    prompts = repeated_prompts(301, [333, 150, 97])
    forced = [repeated_prompts(301, [20], seed=9 + i)[0] for i in range(3)]
    kv = KvConfig(block_size=16, top_k_blocks=32, kv_dtype="fp8_e4m3")
    gpu, _, geng = teacher_forced_logits(gpu_model(dev), kv, "dense", prompts, forced)
    cpu, _, ceng = teacher_forced_logits(gpu_model("cpu"), kv, "dense", prompts, forced)
    assert geng.pools.k_pages[0].dtype == torch.uint8
    torch.testing.assert_close(gpu, cpu, atol=5e-3, rtol=2e-2)
