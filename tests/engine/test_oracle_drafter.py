"""``OracleDrafter(accept=a)``: the reference token with probability ``a``, a wrong one otherwise.

* The drafter alone: over thousands of positions (walked as speculative decoding walks them, one
  or two tokens a step) the fraction of reference drafts is ``a``; wrong drafts are never the
  reference token and lie in the vocabulary; the draws depend on (seed, request, position) only.
* In the engine, on exact attention: greedy tokens with speculation equal those without, and the
  engine accepts exactly the drafts that were the reference token (so its acceptance rate is the
  setting, up to sampling noise).
* ``shadow``: a drafter run beside the oracle for its cost (an EAGLE-3 head); its drafts are
  thrown away and the tokens stay lossless.
* Bad arguments are a :class:`~oasiskv.errors.ConfigError` that says what to pass.
* ``force=True`` (measurement only): the verdicts are the drafter's draws, forced. The engine's
  acceptance is the fraction of hits among the drafts it verified, exactly (dense, sparse exact
  and a lossy working set, where an unforced oracle leaves its reference), each step makes one
  token plus its accepted draft, and a forced hit stores the draft's K/V: the stored K/V and
  summaries equal those of a non-speculative run fed the same tokens.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from oasiskv import KvConfig, LLMEngine, SamplingParams, errors
from oasiskv.drafters import Eagle3Drafter, OracleDrafter, PreviousQueryDrafter
from oasiskv.models.eagle3 import Eagle3Head
from support.fakes import drain, pools_are_full, prompt, tiny

# Private names read here: ``LLMEngine._by_id``/``_running`` (the engine's live requests) and
# ``Eagle3Drafter._states`` (the shadow head's per-request caches, empty at the end): read to check
# the stored drafts and the cleanup; no public view.

torch.set_num_threads(2)

VOCAB = 301
ACCEPTS = [0.0, 0.4, 0.7, 1.0]
DENSE_KV = KvConfig(block_size=16, top_k_blocks=8)
# Sparse from 24 tokens on, K x block_size holds every context here: exact attention.
SPARSE_EXACT_KV = KvConfig(block_size=8, top_k_blocks=64, sparse_threshold=24, fetch_cap=None)


def walk(d: OracleDrafter, refs: list[list[int]], prompt_len: int = 5) -> tuple[int, int, list[int]]:
    """Draft every request to the end of its reference as greedy speculation would (two tokens
    after a reference draft, one after a wrong one); (reference drafts, drafts, wrong drafts)."""
    hits = n = 0
    wrong = []
    for k, ref in enumerate(refs):
        rid = d.first_id + k
        d.begin(rid, [0] * prompt_len)
        toks = [0] * prompt_len + ref[:1]
        while len(toks) - prompt_len < len(ref):
            i = len(toks) - prompt_len
            x = d.propose(rid, toks)
            n += 1
            if x == ref[i]:
                hits += 1
                toks += ref[i : i + 2]
            else:
                wrong.append(x)
                toks.append(ref[i])
        d.end(rid)
    return hits, n, wrong


@pytest.mark.parametrize("accept", ACCEPTS)
def test_the_reference_is_drafted_at_the_set_rate(accept):
    rnd = random.Random(7)
    refs = [[rnd.randrange(VOCAB) for _ in range(1500)] for _ in range(4)]
    d = OracleDrafter(refs, accept=accept, seed=11, vocab_size=VOCAB)
    hits, n, wrong = walk(d, refs)
    sigma = math.sqrt(accept * (1 - accept) / n)
    assert n >= 3000 and abs(hits / n - accept) <= 4 * sigma + 1e-12, (hits / n, accept)
    assert (d.drafts, d.reference_drafts, d.off_reference) == (n, hits, set())
    assert all(0 <= x < VOCAB for x in wrong)  # and never the reference token (walk's else branch)


def test_draws_depend_on_seed_request_and_position_only():
    rnd = random.Random(3)
    refs = [[rnd.randrange(VOCAB) for _ in range(200)] for _ in range(3)]

    def drafts(seed, order):
        d = OracleDrafter(refs, accept=0.5, seed=seed, vocab_size=VOCAB)
        out = {}
        for k in order:
            d.begin(k, [1, 2])
        for i in range(1, 200):  # every position, requests interleaved in ``order``
            for k in order:
                out[k, i] = d.propose(k, [1, 2, *refs[k][:i]])
        return out

    assert drafts(1, [0, 1, 2]) == drafts(1, [2, 0, 1])
    assert drafts(1, [0, 1, 2]) != drafts(2, [0, 1, 2])
    # set_reference(first_id=...): continuation k is request first_id + k, with k's draws.
    d = OracleDrafter(refs, accept=0.5, seed=1, vocab_size=VOCAB)
    d.set_reference(refs, first_id=30)
    d.begin(31, [1, 2])
    assert [d.propose(31, [1, 2, *refs[1][:i]]) for i in range(1, 200)] == [
        drafts(1, [0, 1, 2])[1, i] for i in range(1, 200)
    ]


def test_leaving_the_reference_is_counted():
    ref = [5, 6, 7, 8, 9]
    d = OracleDrafter([ref], accept=1.0)
    d.begin(0, [1, 2])
    assert d.propose(0, [1, 2, 5]) == 6
    assert d.propose(0, [1, 2, 5, 6, 7]) == 8 and d.off_reference == set()
    assert d.propose(0, [1, 2, 5, 6, 7, 4]) == 9 and d.off_reference == {0}
    assert d.propose(0, [1, 2, 5, 6, 7, 4, 9, 3]) == 3  # past the reference: the last token again


@pytest.mark.parametrize(
    "kwargs, says",
    [
        ({"accept": 1.5}, "accept must be a number in [0, 1]"),
        ({"accept": -0.1}, "accept must be a number in [0, 1]"),
        ({"accept": True}, "accept must be a number in [0, 1]"),
        ({"accept": "0.5"}, "accept must be a number in [0, 1]"),
        ({"vocab_size": 1}, "vocab_size must be None or an int >= 2"),
        ({"seed": 0.5}, "seed must be an int"),
        ({"first_id": -1}, "first_id must be an int >= 0"),
        ({"shadow": PreviousQueryDrafter()}, "shadow must be a Drafter with a lookahead row"),
    ],
)
def test_bad_arguments_say_what_to_pass(kwargs, says):
    with pytest.raises(errors.ConfigError, match=says.replace("[", r"\[").replace("]", r"\]")):
        OracleDrafter([[1]], **kwargs)


def test_a_request_without_a_continuation_is_refused():
    d = OracleDrafter([[1], [2]], first_id=4)
    with pytest.raises(errors.ConfigError, match=r"requests 4\.\.5 but request 6 started.*set_reference"):
        d.begin(6, [1])


# ---------------------------------------------------------------------- in the engine
@pytest.fixture(scope="module")
def model():
    return tiny()


@pytest.fixture(scope="module")
def reference(model):
    """Greedy tokens without speculation, per backend."""
    return {
        b: run(model, b, kv, "ngram", False)[0] for b, kv in (("dense", DENSE_KV), ("oasis", SPARSE_EXACT_KV))
    }


def run(model, backend, kv, drafter, speculative, lens=(20, 70, 45), new=40):
    eng = LLMEngine(model, kv=kv, backend=backend, drafter=drafter, speculative=speculative, max_num_seqs=3)
    sp = SamplingParams(max_tokens=new, ignore_eos=True)
    rids = [eng.add_request(prompt(n, i), sp) for i, n in enumerate(lens)]
    out = eng.run_to_completion(rids)
    return [out[r].token_ids for r in rids], eng


@pytest.mark.parametrize(
    "backend,kv", [("dense", DENSE_KV), ("oasis", SPARSE_EXACT_KV)], ids=["dense", "oasis"]
)
@pytest.mark.parametrize("accept", [0.4, 0.7])
def test_speculation_at_a_set_acceptance_is_lossless(model, reference, backend, kv, accept):
    ref = reference[backend]
    d = OracleDrafter(ref, accept=accept, seed=5, vocab_size=VOCAB)
    toks, eng = run(model, backend, kv, d, True)
    assert toks == ref and d.off_reference == set()
    s = eng.spec_stats
    # The engine accepts exactly the reference drafts it verified: every draft it did not verify
    # (a request's last token; a sparse request whose draft would complete its local block) is one
    # the drafter made, and wrong drafts are all rejected.
    assert s["accepted"] <= d.reference_drafts <= s["accepted"] + (d.drafts - s["drafts"])
    sigma = math.sqrt(accept * (1 - accept) / s["drafts"])
    assert abs(s["acceptance_rate"] - accept) <= 4 * sigma, s
    assert s["tokens_per_step"] > 1.0


def test_a_shadow_head_costs_but_does_not_draft():
    """An EAGLE-3 head as the shadow: the engine captures its layers and feeds it the prompt, it
    runs once per draft (batched across the step's requests), and the tokens are the reference's
    (its drafts thrown away)."""
    model8 = tiny(seed=2, layers=8)
    ref, _ = run(model8, "dense", DENSE_KV, "ngram", False, lens=(20, 45), new=8)

    class Counting(Eagle3Drafter):
        calls = 0

        def propose(self, req_id, tokens, features=None):
            Counting.calls += 1
            assert features is not None  # the engine captured the head's layers
            return super().propose(req_id, tokens, features)

        def propose_batch(self, req_ids, tokens_list, features_list):
            Counting.calls += len(req_ids)  # one head row per request, in one step for all
            assert all(f is not None for f in features_list)
            return super().propose_batch(req_ids, tokens_list, features_list)

    head = Eagle3Head.random(model8.config, draft_vocab_size=64, seed=5).attach_target(model8)
    shadow = Counting(head, model8)
    d = OracleDrafter(ref, accept=0.5, seed=1, vocab_size=VOCAB, shadow=shadow)
    assert d.wants_prompt_features and d.capture_layers(8) == shadow.capture_layers(8)
    toks, eng = run(model8, "dense", DENSE_KV, d, True, lens=(20, 45), new=8)
    assert toks == ref and eng.spec_stats["drafts"] > 0
    # One after each prefill and one after each decode step but a request's last.
    assert Counting.calls == eng.spec_stats["steps"]
    assert shadow._states == {}  # every request ended


# ---------------------------------------------------------------------- forced verdicts
# A working set smaller than the context: the drafts steer the selection, so an unforced oracle
# leaves its reference within a few tokens (the case forced verdicts are for).
SPARSE_LOSSY_KV = KvConfig(block_size=16, top_k_blocks=4, fetch_cap=0.25, sparse_threshold=64)
FORCED_CONFIGS = [("dense", DENSE_KV), ("oasis", SPARSE_EXACT_KV), ("oasis", SPARSE_LOSSY_KV)]
FORCED_IDS = ["dense", "oasis-exact", "oasis-lossy"]
FORCED_LENS = (20, 70, 130)


def test_forced_verdicts_are_the_draws():
    """``forced_verdicts``: None without ``force`` (and for every other drafter); with it, per
    request, :meth:`OracleDrafter.hit` of the next generated token's index -- the same draw that
    decides whether the reference token is drafted there."""
    rnd = random.Random(5)
    refs = [[rnd.randrange(VOCAB) for _ in range(60)] for _ in range(2)]
    assert PreviousQueryDrafter().forced_verdicts([0], [[1, 2]]) is None
    assert OracleDrafter(refs, accept=0.5).forced_verdicts([0], [[1, 2]]) is None
    d = OracleDrafter(refs, accept=0.5, seed=3, vocab_size=VOCAB, force=True)
    for k in range(2):
        d.begin(k, [7, 8, 9])
    seen = set()
    for i in range(1, 60):
        toks = [[7, 8, 9, *refs[k][:i]] for k in range(2)]
        verdicts = d.forced_verdicts([0, 1], toks)
        assert verdicts == [d.hit(0, i), d.hit(1, i)]
        for k in range(2):
            assert (d.propose(k, toks[k]) == refs[k][i]) == verdicts[k]
        seen.update(verdicts)
    assert seen == {True, False}
    assert all(OracleDrafter(refs, accept=1.0, force=True).hit(0, i) for i in range(50))
    assert not any(OracleDrafter(refs, accept=0.0, force=True).hit(0, i) for i in range(50))
    with pytest.raises(errors.ConfigError, match="force must be True or False"):
        OracleDrafter(refs, force=1)


def run_forced(model, backend, kv, d, lens=FORCED_LENS, new=40):
    """A speculative run with drafter ``d``, checking the runtime's invariants every step and
    recording every decode step: per request (id, index of its next generated token, draft) and
    the step's :class:`~oasiskv.engine.SpecStep`. Returns (tokens per prompt, engine, steps)."""
    eng = LLMEngine(model, kv=kv, backend=backend, drafter=d, speculative=True, max_num_seqs=3)
    steps = []
    real = eng.engine.decode_step

    def decode_step(reqs, **kw):
        rows = [(r.id, len(r.tokens) - len(r.prompt), r.draft) for r in reqs]
        res = real(reqs, **kw)
        steps.append((rows, res))
        return res

    eng.engine.decode_step = decode_step
    sp = SamplingParams(max_tokens=new, ignore_eos=True)
    rids = [eng.add_request(prompt(n, i), sp) for i, n in enumerate(lens)]
    final = drain(eng)
    assert pools_are_full(eng)
    return [final[r].token_ids for r in rids], eng, steps


@pytest.mark.parametrize("backend,kv", FORCED_CONFIGS, ids=FORCED_IDS)
@pytest.mark.parametrize("accept", ACCEPTS)
def test_forced_verdicts_set_the_acceptance_exactly(model, reference, backend, kv, accept):
    """``OracleDrafter(force=True)``: every verified draft is accepted exactly when the drafter's
    draw for its position is a hit, whatever the logits say and whatever the working set does to
    the tokens; so the engine's acceptance rate is the fraction of hits among the verified drafts,
    exactly, and each step makes 1 + its accepted drafts tokens. A hit emits the draft and then
    row 1's token; a miss emits row 0's argmax."""
    ref = reference["dense"]
    d = OracleDrafter(ref, accept=accept, seed=5, vocab_size=VOCAB, force=True)
    toks, eng, steps = run_forced(model, backend, kv, d)
    assert [len(t) for t in toks] == [40] * len(FORCED_LENS)
    by_id = {i: t for i, t in enumerate(toks)}
    verified = hits = 0
    for rows, res in steps:
        for j, (rid, i, draft) in enumerate(rows):
            if not res.tried[j]:
                assert not res.accepted[j]
                continue
            verified += 1
            hit = d.hit(rid, i)
            hits += hit
            assert res.accepted[j] == hit, (rid, i)
            if hit:  # the draft is token i, row 1's argmax token i + 1
                assert by_id[rid][i : i + 2] == [draft, res.token2[j]]
                assert res.token2[j] == int(res.draft_logits[j].argmax())
            else:  # row 0's argmax, even where it is the draft
                assert by_id[rid][i] == res.token[j] == int(res.logits[j].argmax())
    s = eng.spec_stats
    assert (s["drafts"], s["accepted"]) == (verified, hits) and verified > 50
    assert s["acceptance_rate"] == hits / verified
    assert s["tokens"] == s["steps"] + s["accepted"]  # tokens per step = 1 + accepted / steps
    assert s["tokens_per_step"] == pytest.approx(1 + s["accepted"] / s["steps"])
    if accept in (0.0, 1.0):
        assert s["acceptance_rate"] == accept
    else:
        sigma = math.sqrt(accept * (1 - accept) / verified)
        assert abs(s["acceptance_rate"] - accept) <= 4 * sigma, s


def stored_kv(llm, seq, n_pos: int) -> list[torch.Tensor]:
    """The K and V a request stored at positions ``0 .. n_pos - 1`` (its pages while dense, its
    host rows once sparse: written through), every layer; once sparse also the summaries of its
    blocks complete by then."""
    p, r, b = llm.engine.pools, seq.req, llm.kv.block_size
    pos = torch.arange(n_pos)
    table, ks, vs = (r.host_rows, p.host_k, p.host_v) if r.sparse else (r.pages, p.k_pages, p.v_pages)
    rows = torch.tensor(table)[pos // b]
    out = [torch.stack([k[rows, :, pos % b], v[rows, :, pos % b]]) for k, v in zip(ks, vs, strict=True)]
    if r.sparse:
        blocks = torch.tensor(r.host_blocks[: n_pos // b])
        out += [s[blocks] for s in p.summaries]
    return out


@pytest.mark.parametrize("backend,kv", FORCED_CONFIGS[:2], ids=FORCED_IDS[:2])
def test_forced_hits_store_the_drafts_kv(model, reference, backend, kv):
    """A forced hit does the work of an acceptance: the draft's K/V (computed by row 1) is stored
    and the tables move on by two tokens. With exact attention, the forced run's stored K/V (and
    summaries) equal those of a non-speculative run fed the same tokens (teacher forcing), and
    every token that is not a forced hit's draft is that run's argmax: a hit that stored nothing,
    or moved the tables by the wrong number of tokens, would shift or corrupt every later
    position."""
    lens, stop_at = (70, 45), 24
    d = OracleDrafter(reference["dense"], accept=0.5, seed=7, vocab_size=VOCAB, force=True)
    eng = LLMEngine(model, kv=kv, backend=backend, drafter=d, speculative=True)
    sp = SamplingParams(max_tokens=60, ignore_eos=True)
    seqs = [eng._by_id[eng.add_request(prompt(n, i), sp)] for i, n in enumerate(lens)]
    drafted: set = set()  # (request, index) of the tokens a forced hit emitted as the draft
    real = eng.engine.decode_step

    def decode_step(reqs, **kw):
        res = real(reqs, **kw)
        drafted.update(
            (r.id, len(r.tokens) - len(r.prompt)) for r, a in zip(reqs, res.accepted, strict=True) if a
        )
        return res

    eng.engine.decode_step = decode_step
    while min(len(s.req.tokens) - len(s.req.prompt) for s in seqs) < stop_at:
        eng.step()
    s = eng.spec_stats
    assert 0 < s["accepted"] < s["drafts"], s
    made = [s.req.tokens[len(s.req.prompt) :] for s in seqs]
    got = [stored_kv(eng, s, s.req.kv_len) for s in seqs]
    assert all(s.req.sparse for s in seqs) == (backend == "oasis")

    # The same tokens, one per step, without speculation.
    teacher = LLMEngine(model, kv=kv, backend=backend, drafter="ngram")
    argmax: dict = {}

    class Recorder:
        def on_step(self, info):
            for rid, row in zip(info.request_ids, info.logits.argmax(dim=-1).tolist(), strict=True):
                r = teacher._by_id[rid].req
                argmax[r.id, len(r.tokens) - len(r.prompt)] = row

    teacher.recorder = Recorder()
    tseqs = [
        teacher._by_id[teacher.add_request(prompt(n, i), sp, forced_tokens=m)]
        for i, (n, m) in enumerate(zip(lens, made, strict=True))
    ]
    while any(len(t.req.tokens) - len(t.req.prompt) < len(m) for t, m in zip(tseqs, made, strict=True)):
        teacher.step()
    for t, s, g in zip(tseqs, seqs, got, strict=True):
        assert t.req.tokens[: len(s.req.tokens)] == s.req.tokens
        for x, y in zip(stored_kv(teacher, t, s.req.kv_len), g, strict=True):
            assert torch.equal(x, y)
    for k, (s, m) in enumerate(zip(seqs, made, strict=True)):
        for i, tok in enumerate(m):
            if (s.req.id, i) not in drafted:
                assert tok == argmax[k, i], (k, i)
    assert any(m[i] != argmax[k, i] for k, m in enumerate(made) for i in range(len(m))), (
        "no forced hit emitted a token the model would not have: the test checks nothing"
    )
    for e in (eng, teacher):
        for q in list(e._running):
            e.abort_request(q.request_id)
        e.step()
        assert pools_are_full(e)
