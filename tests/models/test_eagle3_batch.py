"""The batched EAGLE-3 draft (``Eagle3Drafter.propose_batch`` / ``Eagle3Head.step_batch``): one head
step for every request of a decode step drafts what the per-request path drafts, leaves each
request's head state as that path leaves it, and changes no engine output."""

from __future__ import annotations

import pytest
import torch

from oasiskv import KvConfig, LLMEngine, SamplingParams
from oasiskv.drafters import Drafter, Eagle3Drafter, NgramDrafter
from oasiskv.errors import ShapeError
from oasiskv.models.eagle3 import Eagle3State
from support import eagle3
from support.eagle3 import ATOL, CFG, RTOL, Logged, dense_features, prompt

# Private names read here: ``Eagle3Drafter._states`` (each request's head cache, no public view):
# the batched path must leave every state as the per-request path does.

torch.set_num_threads(2)

# The target and head of support.eagle3 (its fixtures), as test_eagle3_prefill's.
model, head = eagle3.model, eagle3.head

# NOTE: the batched path computes the same sums with other shapes (B rows per matmul), so results
# agree to the f32 tolerance, not bit for bit.
PROMPT_LENS = (97, 54, 1, 13, 2)  # odd lengths, a one-token prompt (no prompt rows), unequal caches
STEPS = 6


def tracking(head, model) -> Eagle3Drafter:
    d = Eagle3Drafter(head, model)
    d.track_confidence = d.track_runner_up = True
    return d


def assert_states_equal(a: Eagle3State, b: Eagle3State) -> None:
    assert a.length == b.length
    if a.length:
        torch.testing.assert_close(a.k[: a.length], b.k[: b.length], atol=ATOL, rtol=RTOL)
        torch.testing.assert_close(a.v[: a.length], b.v[: b.length], atol=ATOL, rtol=RTOL)


def test_batched_drafts_and_states_equal_the_per_request_path(model, head):
    """Requests of different lengths (one without features in some steps), several steps: the
    drafts, confidences, runner-ups and head states of one batched call per step equal those of
    one ``propose`` per request."""
    one, many = tracking(head, model), tracking(head, model)
    ids = list(range(10, 10 + len(PROMPT_LENS)))
    toks = {}
    for i, (rid, n) in enumerate(zip(ids, PROMPT_LENS, strict=True)):
        p = prompt(n, seed=i)
        feats = dense_features(model, p)
        for d in (one, many):
            d.begin(rid, p)
            d.feed_prompt(rid, p, feats)
        toks[rid] = p + [int(torch.randint(0, CFG.vocab_size, (1,)))]
    g = torch.Generator().manual_seed(9)
    for step in range(STEPS):
        feats = [torch.randn(3 * CFG.hidden_size, generator=g) for _ in ids]
        if step % 3 == 1:
            feats[1] = None  # a request without features drafts its current token
        tl = [toks[r] for r in ids]
        ref = [one.propose(r, t, f) for r, t, f in zip(ids, tl, feats, strict=True)]
        got = many.propose_batch(ids, tl, feats)
        assert got == ref and all(isinstance(x, int) for x in got)
        assert many.last_runner_up == one.last_runner_up
        assert one.last_confidence.keys() == many.last_confidence.keys()
        for r in ids:
            assert many.last_confidence[r] == pytest.approx(one.last_confidence[r], rel=1e-5)
            assert_states_equal(one._states[r], many._states[r])
        for r in ids:
            toks[r] = toks[r] + [int(torch.randint(0, CFG.vocab_size, (1,), generator=g))]


def test_step_batch_equals_step(model, head):
    """The head alone: hidden states and drafts of ``step_batch`` equal B one-row ``step`` calls,
    over caches of different lengths (padding masked), with GQA (6 query heads on 2 KV heads)."""
    g = torch.Generator().manual_seed(3)
    lens = (5, 0, 17, 1)
    a, b = [Eagle3State() for _ in lens], [Eagle3State() for _ in lens]
    for st_a, st_b, n in zip(a, b, lens, strict=True):
        if n:
            f = torch.randn(n, 3 * CFG.hidden_size, generator=g)
            t = torch.randint(0, CFG.vocab_size, (n,), generator=g)
            head.extend(st_a, f, t, torch.arange(1, n + 1))
            head.extend(st_b, f, t, torch.arange(1, n + 1))
    for _ in range(3):
        f = torch.randn(len(lens), 3 * CFG.hidden_size, generator=g)
        t = torch.randint(0, CFG.vocab_size, (len(lens),), generator=g)
        pos = torch.tensor([st.length + 1 for st in a])
        rows = [head.step(st, f[i : i + 1], t[i : i + 1], pos[i : i + 1]) for i, st in enumerate(a)]
        d, h, logits = head.step_batch(b, f, t, pos)
        assert torch.equal(d, torch.cat([r[0] for r in rows]))
        torch.testing.assert_close(h, torch.cat([r[1] for r in rows]), atol=ATOL, rtol=RTOL)
        assert logits.shape == (len(lens), 64) and logits.dtype == torch.float32
        for st_a, st_b in zip(a, b, strict=True):
            assert_states_equal(st_a, st_b)


def test_step_batch_checks_its_arguments(head):
    st = Eagle3State()
    f = torch.zeros(2, 3 * CFG.hidden_size)
    with pytest.raises(ShapeError, match="one row per state"):
        head.step_batch([st], f, torch.zeros(2, dtype=torch.long), torch.ones(2, dtype=torch.long))
    with pytest.raises(ShapeError, match="same Eagle3State twice"):
        head.step_batch([st, st], f, torch.zeros(2, dtype=torch.long), torch.ones(2, dtype=torch.long))


def test_default_propose_batch_loops_over_propose():
    ng, ref = NgramDrafter(), NgramDrafter()
    tl = [[1, 2, 3, 1, 2], [5, 6, 5], [7]]
    assert ng.propose_batch([0, 1, 2], tl, [None] * 3) == [ref.propose(i, t) for i, t in enumerate(tl)]


class PerRequest(Eagle3Drafter):
    """The per-request path (``Drafter.propose_batch``: one ``propose`` per request, nothing
    launched ahead)."""

    propose_batch = Drafter.propose_batch
    launch_batch = Drafter.launch_batch


# Sparse with a working set smaller than the context: the drafts steer the block selection.
KVS = [
    ("dense", KvConfig(block_size=16, top_k_blocks=8)),
    ("oasis", KvConfig(block_size=16, top_k_blocks=4, fetch_cap=0.25, sparse_threshold=64)),
]


@pytest.mark.parametrize("speculative", [False, True])
@pytest.mark.parametrize("backend,kv", KVS, ids=["dense", "oasis-lossy"])
def test_llm_engine_outputs_and_drafts_are_unchanged(model, head, backend, kv, speculative):
    lens, new = (20, 97, 45, 70), 12
    res = {}
    for cls in (PerRequest, Eagle3Drafter):
        d = Logged.wrap(cls)(head, model)
        eng = LLMEngine(model, kv=kv, backend=backend, drafter=d, speculative=speculative, max_num_seqs=3)
        sp = SamplingParams(max_tokens=new, ignore_eos=True)
        rids = [eng.add_request(prompt(n, i), sp) for i, n in enumerate(lens)]
        outs = eng.run_to_completion(rids)
        res[cls] = ([outs[r].token_ids for r in rids], d.log)
        if cls is Eagle3Drafter:
            assert max(d.batches) == 3  # a decode step drafts its three requests in one call
    assert res[Eagle3Drafter] == res[PerRequest]
