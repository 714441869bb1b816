"""Speculative decoding in the CUDA-graph path (``LLMEngine(speculative=True, cuda_graph=True)``).

A draft is verified inside the step on the device (greedy: row 0's argmax against the draft;
sampling: the speculative-sampling rule with the row's temperature, top_p and uniforms read as
step inputs; a per-row flag either way) and the accepted drafts' K/V is stored by the same captured
step, so the graph path speculates. The greedy tokens equal the non-speculative engine's (attention
exact here: the dense backend, or a working set holding every context) and the eager speculative
engine's, the graphs really replayed, and the stored KV is the non-speculative run's (a rejected
draft leaves nothing). Steps with sampling rows replay graphs too, and keep the distribution.
Forced verdicts (``OracleDrafter(force=True)``, measurement only) reach the captured step as a
per-row device input too: the acceptance is exactly the drafter's hits, in replayed graphs.
"""

from __future__ import annotations

import pytest
import torch

from oasiskv import KvConfig, LLMEngine, PrefillCache, SamplingParams
from oasiskv.drafters import Eagle3Drafter, OracleDrafter
from oasiskv.models.eagle3 import Eagle3Head
from support.engines import gpu_model, repeated_prompts
from support.fakes import drain

# Private names read here: ``LLMEngine._by_id`` (a request's engine-side state) and
# ``Engine._decode_graph`` (wrapped to record which steps replay a graph): what these tests check,
# with no public hook.

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

DENSE_KV = KvConfig(block_size=16, top_k_blocks=8)
# Sparse from 64 tokens on, but K x block_size = 1024 holds every context here: exact attention
# through the host pool, summaries, selection and gather.
SPARSE_EXACT_KV = KvConfig(block_size=16, top_k_blocks=64, sparse_threshold=64, fetch_cap=None)
EXACT = [("dense", DENSE_KV), ("oasis", SPARSE_EXACT_KV)]
# A working set smaller than the context (K x block_size = 64 tokens): lossy sparse attention.
SPARSE_LOSSY_KV = KvConfig(block_size=16, top_k_blocks=4, fetch_cap=0.25, sparse_threshold=64)
PROMPT_LENS = [300, 170, 90, 40, 260]
MAX_TOKENS = [30, 22, 14, 8, 26]  # the batch shrinks through the buckets 8, 4, 2, 1


def _drafter(kind, model, ref):
    if kind == "oracle":
        return OracleDrafter(ref)
    if kind == "eagle3":
        head = Eagle3Head.random(model.config, 64, seed=5, device=next(model.parameters()).device)
        return Eagle3Drafter(head.attach_target(model), model)
    return kind


def _run(model, backend, kv, drafter, *, speculative, cuda_graph, temperatures=None, hook=None):
    """Tokens of every prompt (request order) and the LLMEngine; ``eng.metrics_of_run``: each
    request's final metrics; ``hook(eng)`` runs before the requests are added."""
    eng = LLMEngine(
        model,
        kv=kv,
        backend=backend,
        drafter=drafter,
        device="cuda",
        max_num_seqs=8,
        cuda_graph=cuda_graph,
        speculative=speculative,
        seed=3,
    )
    if hook is not None:
        hook(eng)
    temps = temperatures or [0.0] * len(PROMPT_LENS)
    for i, (p, m, t) in enumerate(zip(repeated_prompts(301, PROMPT_LENS), MAX_TOKENS, temps, strict=True)):
        sp = SamplingParams(max_tokens=m, temperature=t, ignore_eos=True)
        eng.add_request(p, sp, request_id=str(i))
    done = drain(eng)
    outs = [done[str(i)] for i in range(len(PROMPT_LENS))]
    eng.metrics_of_run = [o.metrics for o in outs]
    return [list(o.token_ids) for o in outs], eng


@pytest.mark.parametrize("backend,kv", EXACT, ids=["dense", "oasis-sparse"])
@pytest.mark.parametrize("drafter", ["ngram", "oracle", "eagle3"])
def test_graph_speculative_greedy_tokens_equal_non_speculative(backend, kv, drafter):
    # EAGLE-3 taps three distinct layers (2, L // 2, L - 3): at least 7
    model = gpu_model(torch.device("cuda"), num_layers=8 if drafter == "eagle3" else 3)
    ref, _ = _run(model, backend, kv, "ngram", speculative=False, cuda_graph=False)
    eager, e_eng = _run(model, backend, kv, _drafter(drafter, model, ref), speculative=True, cuda_graph=False)
    graph, g_eng = _run(model, backend, kv, _drafter(drafter, model, ref), speculative=True, cuda_graph=True)
    eng = g_eng.engine
    assert eng.cuda_graph and eng.graph_error is None, eng.graph_error
    # One graph per (bucket, capacities), speculative; most steps replay one.
    assert eng.graph_stats["captures"] >= 3 and eng.graph_stats["replays"] >= 5, eng.graph_stats
    assert eng.spec_eager_steps == 0  # every step greedy: verified in the graph
    assert graph == eager
    assert graph == ref
    # The same drafts accepted, so the same metrics, in both paths.
    assert g_eng.spec_stats == e_eng.spec_stats
    s = g_eng.spec_stats
    assert s["tokens"] == sum(m - 1 for m in MAX_TOKENS)  # the first token is the prefill's
    assert s["accepted"] <= s["drafts"], s
    if drafter != "eagle3":  # a random head over a random target drafts right almost never (0 on the H200)
        assert s["accepted"] > 0, s
    if drafter == "oracle":
        assert s["acceptance_rate"] == 1.0 and s["tokens_per_step"] > 1.6, s
    for me, mg in zip(e_eng.metrics_of_run, g_eng.metrics_of_run, strict=True):
        got = (mg.steps, mg.decode_tokens, mg.draft_tokens, mg.accepted_tokens, mg.tokens_per_step)
        assert got == (me.steps, me.decode_tokens, me.draft_tokens, me.accepted_tokens, me.tokens_per_step)
    if backend == "oasis":
        assert sum(m.sparse_steps > 0 for m in g_eng.metrics_of_run) >= 3  # the long ones ran sparse


def test_rejected_drafts_leave_nothing_in_the_graph_path():
    """Host pool and summaries of the complete blocks after a graph-path speculative run equal the
    non-speculative run's: an accepted draft stored row 1's K/V (what the next step computes), a
    rejected one nothing (a summary that had seen its key would be off by O(1))."""
    model = gpu_model(torch.device("cuda"))
    lens, stop_at = (200, 130), 25
    kv = SPARSE_EXACT_KV

    def stored(speculative, cuda_graph):
        eng = LLMEngine(
            model,
            kv=kv,
            drafter="ngram",
            device="cuda",
            speculative=speculative,
            cuda_graph=cuda_graph,
        )
        rids = [
            eng.add_request(p, SamplingParams(max_tokens=40, ignore_eos=True))
            for p in repeated_prompts(301, lens, seed=4)
        ]
        seqs = [eng._by_id[r] for r in rids]
        while min(len(s.req.tokens) - len(s.req.prompt) for s in seqs) < stop_at:
            eng.step()
        e, p, b = eng.engine, eng.engine.pools, kv.block_size
        out = []
        for s in seqs:
            r = s.req
            assert r.sparse
            hb = torch.tensor(r.host_blocks[: (len(r.prompt) + stop_at - 1) // b])  # summaries by id
            hr = torch.tensor(r.host_rows[: len(hb)])  # K/V by host row
            for layer in range(e.cfg.num_hidden_layers):
                out.append(p.host_k[layer][hr].to("cuda").float())
                out.append(p.host_v[layer][hr].to("cuda").float())
                out.append(p.summaries[layer][hb.to(p.summaries[layer].device)].float())
        if speculative:
            s = eng.spec_stats
            assert 0 < s["accepted"] < s["drafts"], s
            if cuda_graph:
                assert e.graph_stats["replays"] > 0 and e.spec_eager_steps == 0, e.graph_stats
        for s in seqs:
            eng.abort_request(s.request_id)
        eng.step()
        return out

    want = stored(False, False)
    got = stored(True, True)
    for a, b in zip(want, got, strict=True):
        # NOTE: row 1 of step t and row 0 of step t+1 compute the same K/V, but on the GPU their
        # attention partials may round differently (the draft's own K/V is the extra entry of the
        # lookahead row, then a page entry): float32 tolerance, far below a stray key's effect.
        torch.testing.assert_close(b, a, atol=1e-4, rtol=1e-3)


def _spy_graph_steps(eng, steps: list) -> None:
    """Record every graph step of ``eng``: ``(it had sampling rows, it replayed a graph, it had
    forced verdicts)``."""
    e = eng.engine
    real = e._decode_graph

    def decode_graph(reqs, ids, speculate=None, samp=None, verdicts=None):
        before = e.graph_stats["replays"]
        out = real(reqs, ids, speculate, samp, verdicts)
        steps.append((samp is not None, e.graph_stats["replays"] > before, verdicts is not None))
        return out

    e._decode_graph = decode_graph


def test_sampling_requests_verify_in_the_graph():
    """Sampling acceptance is a device flag too: steps where a sampling request tries a draft are
    graphs of their own (the key's last element) and replay them, none runs eagerly, and the
    greedy requests beside it keep their tokens (argmax, as in the greedy graph)."""
    model = gpu_model(torch.device("cuda"))
    backend, kv = EXACT[1]
    ref, _ = _run(model, backend, kv, "ngram", speculative=False, cuda_graph=False)
    temps = [0.8, 0.0, 0.0, 0.0, 0.0]  # the longest request samples: most steps hold it
    steps: list = []
    toks, eng = _run(
        model,
        backend,
        kv,
        "ngram",
        speculative=True,
        cuda_graph=True,
        temperatures=temps,
        hook=lambda e: _spy_graph_steps(e, steps),
    )
    e = eng.engine
    assert e.cuda_graph and e.graph_error is None, e.graph_error
    assert e.spec_eager_steps == 0
    sampled = [replayed for samp, replayed, _ in steps if samp]
    assert len(sampled) >= 8 and sum(sampled) >= 3, (steps, e.graph_stats)
    assert eng.metrics_of_run[0].draft_tokens > 0
    for i, t in enumerate(temps):
        if t == 0.0:
            assert toks[i] == ref[i], i
        else:
            assert len(toks[i]) == MAX_TOKENS[i]


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 0.9)])
def test_graph_sampling_keeps_the_distribution(temperature, top_p):
    """``tests/engine/test_speculative.py``'s distribution test in the graph path: 2000 requests of 3
    tokens on a peaked 16-token model, the 2nd and 3rd tokens' joint distribution against the
    exact one (chi-square), the sampling steps replayed as graphs."""
    import copy

    from support.sampling import (
        ArgmaxDrafter,
        chi_square_p,
        exact_joint,
        peaked_model,
        second_and_third_tokens,
    )

    cpu = peaked_model()
    ids = [1, 5, 2, 7]
    exact: dict = {}
    for seq, pr in exact_joint(cpu, ids, temperature, top_p, 3).items():
        exact[seq[1:]] = exact.get(seq[1:], 0.0) + pr
    m = copy.deepcopy(cpu).to("cuda")
    eng = LLMEngine(
        m,
        kv=KvConfig(block_size=16, top_k_blocks=8, measure_recall=False),  # fewer graph keys
        backend="dense",
        drafter=ArgmaxDrafter(cpu),  # drafts from the CPU copy: the same argmax tokens
        device="cuda",
        speculative=True,
        cuda_graph=True,
        max_num_seqs=256,
        seed=11,
        prefill_cache=PrefillCache(),
    )
    steps: list = []
    _spy_graph_steps(eng, steps)
    n = 2000
    counts = second_and_third_tokens(eng, ids, n, temperature, top_p)
    assert chi_square_p(counts, exact, n) > 1e-3, eng.spec_stats
    s = eng.spec_stats
    assert s["drafts"] == n and 0.1 < s["acceptance_rate"] < 0.95, s
    e = eng.engine
    assert e.graph_error is None and e.spec_eager_steps == 0, e.graph_error
    assert all(samp for samp, _, _ in steps) and sum(r for _, r, _ in steps) >= 1, steps


def _spy_spec_steps(eng, steps: list) -> None:
    """Record every speculative decode step of ``eng``: per request (id, index of its next
    generated token), and the step's ``SpecStep``."""
    e = eng.engine
    real = e.decode_step

    def decode_step(reqs, **kw):
        rows = [(r.id, len(r.tokens) - len(r.prompt)) for r in reqs]
        res = real(reqs, **kw)
        steps.append((rows, res))
        return res

    e.decode_step = decode_step


@pytest.mark.parametrize(
    "backend,kv", [*EXACT, ("oasis", SPARSE_LOSSY_KV)], ids=["dense", "oasis-sparse", "oasis-lossy"]
)
def test_graph_forced_verdicts_set_the_acceptance_exactly(backend, kv):
    """``OracleDrafter(force=True)`` in the graph path: the forced verdicts are a graph input (the
    step's verdict buffer, written before every replay like the plan), so forced steps replay
    graphs and none runs eagerly; every verified draft is accepted exactly where the drafter's
    draw for its position is a hit (a lossy working set included), each step makes 1 + its
    accepted drafts tokens, and with exact attention the graph run's tokens and metrics are the
    eager run's."""
    model = gpu_model(torch.device("cuda"))
    ref, _ = _run(model, backend, kv, "ngram", speculative=False, cuda_graph=False)

    def run(cuda_graph):
        d = OracleDrafter(ref, accept=0.4, seed=5, vocab_size=301, force=True)
        spec_steps, graph_steps = [], []

        def hook(e):
            _spy_spec_steps(e, spec_steps)
            if cuda_graph:
                _spy_graph_steps(e, graph_steps)

        toks, eng = _run(model, backend, kv, d, speculative=True, cuda_graph=cuda_graph, hook=hook)
        verified = hits = 0
        for rows, res in spec_steps:
            for j, (rid, i) in enumerate(rows):
                if res.tried[j]:
                    verified += 1
                    hits += d.hit(rid, i)
                    assert res.accepted[j] == d.hit(rid, i), (cuda_graph, rid, i)
                else:
                    assert not res.accepted[j]
        s = eng.spec_stats
        assert (s["drafts"], s["accepted"]) == (verified, hits) and 0 < hits < verified, s
        assert s["tokens"] == s["steps"] + s["accepted"] == sum(m - 1 for m in MAX_TOKENS), s
        return toks, eng, graph_steps

    eager, e_eng, _ = run(False)
    graph, g_eng, graph_steps = run(True)
    e = g_eng.engine
    assert e.cuda_graph and e.graph_error is None, e.graph_error
    assert e.spec_eager_steps == 0
    forced = [replayed for _, replayed, has_verdicts in graph_steps if has_verdicts]
    assert len(forced) >= 8 and sum(forced) >= 3, (graph_steps, e.graph_stats)
    if kv is not SPARSE_LOSSY_KV:
        assert graph == eager
        assert g_eng.spec_stats == e_eng.spec_stats
