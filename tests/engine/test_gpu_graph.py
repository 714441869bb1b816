"""CUDA-graph decode (``Engine(cuda_graph=True)``) against the eager path, on the GPU.

Teacher-forced runs compare logits step by step (forced tokens keep both runs on the same
tokens, so a near-tie in the logits cannot make them diverge) and the selection's traffic per
request; greedy runs through ``LLMEngine`` compare the tokens, as the batch shrinks through the
size buckets and requests arrive while others decode.
"""

from __future__ import annotations

import pytest
import torch

from oasiskv import KvConfig, LLMEngine, SamplingParams
from support.engines import gpu_model, repeated_prompts, teacher_forced_logits

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.mark.parametrize(
    "backend,drafter,kv_kw",
    [
        ("dense", "ngram", {}),
        ("oasis", "ngram", {}),
        ("oasis", "previous-query", {}),
        ("oasis", "ngram", {"block_score": "codes"}),
        # Two stages: top-K of the Quest bound, codes of the candidates, top-K mapped back.
        ("oasis", "ngram", {"block_score": "codes", "score_candidates": 2, "sink_blocks": 1}),
        # Pinned blocks: a per-slot table indexed by the plan's slots (no host sync).
        ("oasis", "ngram", {"block_score": "codes", "score_candidates": 2, "pin_blocks": 1}),
        ("oasis", "ngram", {"pin_blocks": 2}),
        # Successor blocks: one more top-K launch and device ops over the plan's CSR.
        ("oasis", "ngram", {"successor_blocks": 1}),
        ("oasis", "ngram", {"block_score": "codes", "score_candidates": 2, "successor_blocks": 1}),
        # Sticky candidates: the previous prediction, gathered by the plan's slots, kept every step.
        (
            "oasis",
            "ngram",
            dict(block_score="codes", score_candidates=1.5, sticky_candidates=True, successor_blocks=1),
        ),
        # Per-layer budgets: each smaller budget's slot pages are made with the plan, in the capture.
        ("oasis", "ngram", {"layer_blocks": (2, 4, 3)}),
        # Sink blocks are marked by device ops indexed by the plan's CSR (no host sync).
        ("oasis", "ngram", {"sink_blocks": 2}),
        ("oasis", "ngram", {"sink_blocks": 1, "select_queries": "lookahead+current"}),
    ],
)
def test_graph_replay_matches_the_eager_step(backend, drafter, kv_kw):
    dev = torch.device("cuda")
    model = gpu_model(dev)
    # Three requests: two sparse from the start, one that turns sparse during the run (so the
    # capacity key changes and a second graph is captured); small budget and cap, recall on.
    prompts = repeated_prompts(301, [333, 150, 60])
    forced = [repeated_prompts(301, [40], seed=9 + i)[0] for i in range(3)]
    kv = KvConfig(block_size=16, top_k_blocks=4, fetch_cap=2, sparse_threshold=64, **kv_kw)
    eager, er, _ = teacher_forced_logits(model, kv, backend, prompts, forced, drafter, cuda_graph=False)
    graph, gr, eng = teacher_forced_logits(model, kv, backend, prompts, forced, drafter, cuda_graph=True)
    assert eng.graph_stats["captures"] >= 1
    assert eng.graph_stats["replays"] >= 20, eng.graph_stats
    torch.testing.assert_close(graph, eager, atol=2e-4, rtol=1e-3)
    if backend == "oasis":
        assert all(r.sparse for r in gr)
        for a, b in zip(er, gr, strict=True):
            # The same blocks fetched at every step: the LRU step is read on the device, and the
            # padded entries of the graph add into the spare accumulator row only.
            assert a.metrics.fetched_bytes_total == b.metrics.fetched_bytes_total > 0
            assert a.metrics.lookahead_recall == pytest.approx(b.metrics.lookahead_recall, abs=1e-6)


def _greedy(model, backend, cuda_graph, prompts, max_tokens, late=(), drop_at=()):
    eng = LLMEngine(
        model,
        kv=KvConfig(block_size=16, top_k_blocks=8, fetch_cap=2, sparse_threshold=128),
        backend=backend,
        drafter="ngram",
        device="cuda",
        max_num_seqs=8,
        cuda_graph=cuda_graph,
    )
    for i, (p, m) in enumerate(zip(prompts, max_tokens, strict=True)):
        eng.add_request(p, SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True), request_id=str(i))
    done, steps = {}, 0
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                done[out.request_id] = list(out.token_ids)
        steps += 1
        if steps in drop_at:
            eng.engine.drop_graphs()  # as a pool growth does
        for j, (p, m) in enumerate(late):
            if steps == 5 + 3 * j:  # requests arriving while others decode
                params = SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True)
                eng.add_request(p, params, request_id=f"late{j}")
    return done, eng.engine


@pytest.mark.parametrize("backend", ["dense", "oasis"])
def test_graph_greedy_tokens_equal_eager(backend):
    dev = torch.device("cuda")
    model = gpu_model(dev)
    prompts = repeated_prompts(301, [300, 170, 90, 40, 260])
    max_tokens = [30, 22, 14, 8, 26]  # the batch shrinks through the buckets 8, 4, 2, 1
    late = [(p, 12) for p in repeated_prompts(301, [120, 200], seed=5)]
    eager, _ = _greedy(model, backend, False, prompts, max_tokens, late)
    graph, eng = _greedy(model, backend, True, prompts, max_tokens, late)
    assert eng.graph_stats["captures"] >= 3 and eng.graph_stats["replays"] > 0, eng.graph_stats
    assert graph == eager


def test_a_failed_capture_falls_back_to_eager_steps(monkeypatch):
    """A capture the driver refuses: the step that tried it stands (it ran eagerly), graphs turn
    off with the reason kept, and the tokens are the eager engine's."""
    from oasiskv.engine import StepGraph

    def refuse(self, eng):
        raise RuntimeError("capture refused (test)")

    dev = torch.device("cuda")
    model = gpu_model(dev)
    prompts = repeated_prompts(301, [300, 90])
    eager, _ = _greedy(model, "oasis", False, prompts, [12, 9])
    monkeypatch.setattr(StepGraph, "capture", refuse)
    graph, eng = _greedy(model, "oasis", True, prompts, [12, 9])
    assert graph == eager
    assert not eng.cuda_graph and "capture refused" in eng.graph_error
    stats = eng.graph_stats
    assert stats["captures"] == stats["replays"] == 0 and stats["eager"] >= 8  # the steps ran eagerly


def test_graphs_dropped_mid_run_are_captured_again():
    """Dropping every graph (what a pool growth does) frees their memory pool; the next steps
    capture into a new one and replay, and the tokens stay the eager engine's."""
    dev = torch.device("cuda")
    model = gpu_model(dev)
    prompts = repeated_prompts(301, [300, 170, 90])
    max_tokens = [20, 16, 12]
    eager, _ = _greedy(model, "oasis", False, prompts, max_tokens)
    graph, eng = _greedy(model, "oasis", True, prompts, max_tokens, drop_at=(4, 9))
    assert graph == eager
    assert eng.cuda_graph and eng.graph_error is None, eng.graph_error
    assert eng.graph_stats["captures"] >= 3 and eng.graph_stats["replays"] > 0, eng.graph_stats
