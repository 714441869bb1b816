"""The EAGLE-3 head runs over the prompt at admission: the engine hands the drafter the prompt
features captured by its own prefill forward (``Drafter.feed_prompt``), the head's cache is
filled with the training-time pairing, and the PrefillCache serves the same features."""

from __future__ import annotations

import pytest
import torch

import oasiskv
from oasiskv import KvConfig, LLMEngine, PrefillCache, SamplingParams
from oasiskv.drafters import Eagle3Drafter
from oasiskv.engine import Engine, Request
from oasiskv.models.eagle3 import Eagle3State
from support import eagle3
from support.eagle3 import ATOL, CFG, RTOL, dense_features, prompt

# Private names read here: ``Eagle3Drafter._states`` (each request's head cache, no public view):
# what a prefill feeds into it is what these tests check.

torch.set_num_threads(2)

# The target and head of support.eagle3 (its fixtures).
model, head = eagle3.model, eagle3.head
PROMPT_LENS = (97, 54)
KV_FULL = KvConfig(block_size=16, top_k_blocks=32, fetch_cap=4, sparse_threshold=64)


class SpyDrafter(Eagle3Drafter):
    """Records what the engine hands over at prefill."""

    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        self.fed: list[tuple[int, list[int], torch.Tensor, int]] = []

    def feed_prompt(self, req_id, prompt, features, start=0) -> None:
        self.fed.append((req_id, list(prompt), features.clone(), start))
        super().feed_prompt(req_id, prompt, features, start)


def admit(eng: Engine, drafter, ids: list[int], req_id: int = 0) -> tuple[Request, int]:
    """Begin + prefill one request as ``LLM`` does; returns it and its first draft (the greedy
    first token appended)."""
    r = Request(id=req_id, prompt=list(ids), max_new_tokens=4)
    if eng.pools is None:
        eng.ensure_pools([r])
    drafter.begin(r.id, r.prompt)
    r.tokens = list(r.prompt)
    logits = eng.prefill(r)
    r.tokens.append(int(logits.argmax()))
    return r, drafter.propose(r.id, r.tokens, r.features)


def reference_first_draft(head, feats: torch.Tensor, ids: list[int], first: int):
    """The head stepped one row at a time over the prompt (row p: feature of p - 1, token p, RoPE
    position p, for p = 1 .. P - 1), then the first decode row (feature of P - 1, the first
    generated token at P). Returns (draft, hidden [1, H], state)."""
    state = Eagle3State()
    for p in range(1, len(ids)):
        head.step(state, feats[p - 1 : p], torch.tensor([ids[p]]), torch.tensor([p]))
    n = len(ids)
    d, h = head.step(state, feats[n - 1 : n], torch.tensor([first]), torch.tensor([n]))
    return int(d[0]), h, state


# ------------------------------------------------------------------------------------------ (a)
@pytest.mark.parametrize("n", [*PROMPT_LENS, 1])
def test_prefill_hands_over_the_dense_forward_features(model, head, n):
    ids = prompt(n, seed=n)
    drafter = SpyDrafter(head, model)
    eng = Engine(model, KV_FULL, "oasis", drafter)
    r, _ = admit(eng, drafter, ids)
    ref = dense_features(model, ids)
    assert len(drafter.fed) == 1, "one prefill, one hand-over"
    req_id, fed_prompt, feats, start = drafter.fed[0]
    assert (req_id, fed_prompt, start) == (0, ids, 0)
    assert feats.shape == (n, 3 * CFG.hidden_size) and feats.dtype == model.dtype
    assert feats.device == model.device
    assert torch.equal(feats, ref)  # exactly: the same forward, captured in place
    assert torch.equal(r.features, ref[-1])


def test_no_prefill_flag_feeds_nothing(model, head):
    drafter = SpyDrafter(head, model, prefill=False)
    assert drafter.name == "eagle3-noprefill" and not drafter.wants_prompt_features
    eng = Engine(model, KV_FULL, "oasis", drafter)
    assert not eng.prompt_features
    admit(eng, drafter, prompt(40))
    assert drafter.fed == [] and drafter._states[0].length == 1  # only the first decode row


# ------------------------------------------------------------------------------------------ (b)
@pytest.mark.parametrize("n", PROMPT_LENS)
def test_first_draft_matches_a_step_by_step_reference(model, head, n):
    """The cache filled at admission equals the head stepped row by row over the prompt, so the
    first decode step's draft is conditioned on the whole prompt as in training."""
    ids = prompt(n, seed=10 + n)
    drafter = Eagle3Drafter(head, model)
    eng = Engine(model, KV_FULL, "oasis", drafter)
    r, draft = admit(eng, drafter, ids)
    ref_draft, ref_h, ref_state = reference_first_draft(head, dense_features(model, ids), ids, r.tokens[-1])
    state = drafter._states[0]
    assert state.length == ref_state.length == n  # rows 1 .. P - 1 plus the first decode row
    torch.testing.assert_close(state.k[:n], ref_state.k[:n], atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(state.v[:n], ref_state.v[:n], atol=ATOL, rtol=RTOL)
    assert draft == ref_draft
    # Without the prompt rows the head's first output is a different function of its input.
    _, h_empty = head.step(
        Eagle3State(), r.features.view(1, -1), torch.tensor([r.tokens[-1]]), torch.tensor([n])
    )
    assert not torch.allclose(h_empty, ref_h, atol=1e-3)


def test_teacher_forced_rows_match_forward_train(model, head):
    """The prompt rows the drafter feeds are exactly the rows training sees (forward_train over
    features of 0 .. P - 2 with tokens 1 .. P - 1 at positions 1 .. P - 1): same logits."""
    ids = prompt(61, seed=3)
    feats = dense_features(model, ids)
    drafter = Eagle3Drafter(head, model)
    drafter.begin(0, ids)
    drafter.feed_prompt(0, ids, feats)
    train = head.forward_train(feats[:-1], torch.tensor(ids[1:]), torch.arange(1, len(ids)))
    state = drafter._states[0]
    assert state.length == len(ids) - 1
    # Re-running the rows over a copy of the filled cache's keys gives the training logits.
    fresh = Eagle3State()
    h = head.extend(fresh, feats[:-1], torch.tensor(ids[1:]), torch.arange(1, len(ids)))
    torch.testing.assert_close(head.draft_logits(h), train, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(fresh.k[: fresh.length], state.k[: state.length], atol=0, rtol=0)


def test_chunked_feed_equals_one_shot(model, head):
    """feed_prompt per chunk (the contract for a chunked prefill) fills the same cache."""
    ids = prompt(97, seed=7)
    feats = dense_features(model, ids)
    one, chunked = Eagle3Drafter(head, model), Eagle3Drafter(head, model)
    one.begin(0, ids)
    one.feed_prompt(0, ids, feats)
    chunked.begin(0, ids)
    for a, b in ((0, 30), (30, 31), (31, 96), (96, 97)):
        chunked.feed_prompt(0, ids, feats[a:b], a)
    s1, s2 = one._states[0], chunked._states[0]
    assert s1.length == s2.length == len(ids) - 1
    torch.testing.assert_close(s2.k[: s2.length], s1.k[: s1.length], atol=ATOL, rtol=RTOL)
    tokens = [*ids, 5]
    assert one.propose(0, tokens, feats[-1]) == chunked.propose(0, tokens, feats[-1])
    with pytest.raises(ValueError, match="position order"):
        chunked.feed_prompt(0, ids, feats[:10], 0)
    with pytest.raises(ValueError, match="prompt positions only"):
        chunked.feed_prompt(0, ids, feats, 50)


# ------------------------------------------------------------------------------------------ (c)
def test_full_budget_eagle3_is_token_exact_vs_dense(model, head):
    """Budget >= context: with the prefilled EAGLE-3 head drafting, oasis emits dense's tokens."""
    ps = [prompt(n, seed=20 + n) for n in PROMPT_LENS]
    runs = {}
    for backend in ("dense", "oasis"):
        drafter = SpyDrafter(head, model)
        llm = oasiskv.LLM(model, kv=KV_FULL, backend=backend, drafter=drafter)
        runs[backend] = llm.generate(ps, 12, ignore_eos=True)
        assert [f[0] for f in drafter.fed] == [0, 1]  # every request's prompt went to the head
    assert [r.tokens for r in runs["oasis"]] == [r.tokens for r in runs["dense"]]
    o = runs["oasis"][0].metrics
    assert o.sparse_steps == o.steps > 0
    assert runs["oasis"][0].metrics.lookahead_recall == pytest.approx(1.0)


# ------------------------------------------------------------------------------------------ (d)
@pytest.mark.parametrize("first_filler", ["prefill", "noprefill"])
def test_prefill_cache_gives_the_same_first_draft(model, head, first_filler):
    """A prefill served from the PrefillCache hands over the same features, so the first draft and
    the head's cache equal the uncached path's -- also when the entry was filled by an engine whose
    drafter did not want prompt features."""
    ids = prompt(PROMPT_LENS[0], seed=30)
    base = Eagle3Drafter(head, model)
    r0, d0 = admit(Engine(model, KV_FULL, "oasis", base), base, ids)

    cache = PrefillCache(capacity=2)
    filler = Eagle3Drafter(head, model, prefill=first_filler == "prefill")
    admit(Engine(model, KV_FULL, "dense", filler, prefill_cache=cache), filler, ids)
    assert cache.hits == 0
    cached = SpyDrafter(head, model)
    r1, d1 = admit(Engine(model, KV_FULL, "oasis", cached, prefill_cache=cache), cached, ids)
    assert cache.hits == 1
    assert len(cached.fed) == 1 and cached.fed[0][2].shape[0] == len(ids)
    assert r1.tokens == r0.tokens and torch.equal(r1.features, r0.features)
    assert d1 == d0
    s0, s1 = base._states[0], cached._states[0]
    assert s0.length == s1.length == len(ids)
    assert torch.equal(s1.k[: s1.length], s0.k[: s0.length])
    assert torch.equal(s1.v[: s1.length], s0.v[: s0.length])


def test_chunked_prefill_through_llm_engine_drafts_as_one_forward(model, head):
    """LLMEngine prefilling the prompt in chunks (max_num_batched_tokens=40) feeds the head chunk by
    chunk: the same drafts and tokens as one prefill forward."""
    from support.fakes import prompt as repeated_prompt  # this module's prompt() draws other tokens

    ids = repeated_prompt(150, 3, vocab=CFG.vocab_size)
    runs = []
    for budget in (8192, 40):
        eng = LLMEngine(model, kv=KV_FULL, drafter=Eagle3Drafter(head, model), max_num_batched_tokens=budget)
        drafts = []

        class Rec:
            def on_step(self, info, drafts=drafts):
                drafts.extend(info.drafts)

        eng.recorder = Rec()
        rid = eng.add_request(ids, SamplingParams(max_tokens=6, ignore_eos=True))
        runs.append((eng.run_to_completion([rid])[rid].token_ids, drafts))
    assert runs[0] == runs[1]


@pytest.mark.parametrize("cached", [False, True])
def test_a_long_prompt_feeds_the_head_in_bounded_chunks(model, head, monkeypatch, cached):
    """The engine hands a prompt's features to the head ``FEED_CHUNK`` positions at a time (one
    call over a 128K prompt took 3 GiB of the head's activations at once), from a fresh prefill
    and from a :class:`PrefillCache` entry held on the host alike: the head's cache and first draft
    equal one call's."""
    from oasiskv.engine import core

    ids = prompt(97, seed=41)
    base = Eagle3Drafter(head, model)
    r0, d0 = admit(Engine(model, KV_FULL, "oasis", base), base, ids)
    monkeypatch.setattr(core, "FEED_CHUNK", 40)
    cache = PrefillCache(on_host=True) if cached else None
    if cached:
        filler = Eagle3Drafter(head, model)
        admit(Engine(model, KV_FULL, "oasis", filler, prefill_cache=cache), filler, ids)
    spy = SpyDrafter(head, model)
    r1, d1 = admit(Engine(model, KV_FULL, "oasis", spy, prefill_cache=cache), spy, ids)
    assert cache is None or cache.hits == 1
    assert [(f[2].shape[0], f[3]) for f in spy.fed] == [(40, 0), (40, 40), (17, 80)]
    assert r1.tokens == r0.tokens and torch.equal(r1.features, r0.features) and d1 == d0
    s0, s1 = base._states[0], spy._states[0]
    assert s0.length == s1.length == len(ids)
    torch.testing.assert_close(s1.k[: s1.length], s0.k[: s0.length], atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(s1.v[: s1.length], s0.v[: s0.length], atol=ATOL, rtol=RTOL)
