"""The EAGLE-3 head's paged KV (``Eagle3PagedKV``, ``Eagle3State(paged=...)``,
``Eagle3Drafter(paged=...)``): rows land where a contiguous cache keeps them, pages are reused
after release, a batched step's one decode-attention call equals float64 attention and the
per-request path, and the engine's outputs do not change."""

from __future__ import annotations

import pytest
import torch

from oasiskv import KvConfig, LLMEngine, SamplingParams
from oasiskv.drafters import Eagle3Drafter
from oasiskv.errors import ShapeError
from oasiskv.models.eagle3 import Eagle3Head, Eagle3PagedKV, Eagle3State
from oasiskv.models.transformer import CausalLM
from support import eagle3
from support.eagle3 import ATOL, CFG, RTOL, Logged, prompt

# Private names read here: ``Eagle3Drafter._states`` (each request's head cache on the paged pool,
# no public view): the pages a state holds are what these tests count.

torch.set_num_threads(2)

# The target and head of support.eagle3 (its fixtures), as test_eagle3_prefill's.
model, head = eagle3.model, eagle3.head

HKV, HQ, D = CFG.num_key_value_heads, CFG.num_attention_heads, CFG.head_dim


def pool(num_pages: int = 1, block_size: int = 8, dtype=torch.float32, device="cpu") -> Eagle3PagedKV:
    return Eagle3PagedKV(HQ, HKV, D, dtype=dtype, device=device, block_size=block_size, num_pages=num_pages)


def rows(n: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(n, HKV, D, generator=g), torch.randn(n, HKV, D, generator=g)


def test_rows_come_back_in_order_across_pages_growth_and_reuse():
    """Chunks and single rows crossing block boundaries, a pool that starts with one page and
    grows, a released state whose pages the next state takes: every state's gathered rows equal
    what was appended, in order."""
    g = torch.Generator().manual_seed(0)
    kv = pool(num_pages=1, block_size=8)
    a, b = Eagle3State(paged=kv), Eagle3State(paged=kv)
    want = {id(a): [], id(b): []}
    for st, n in ((a, 13), (b, 3), (a, 1), (b, 9), (a, 8)):
        k, v = rows(n, g)
        got_k, got_v = st.append(k, v)  # the contiguous-cache API: all rows so far
        want[id(st)].append((k, v))
        ref_k = torch.cat([x for x, _ in want[id(st)]])
        ref_v = torch.cat([y for _, y in want[id(st)]])
        assert torch.equal(got_k, ref_k) and torch.equal(got_v, ref_v)
    k, v = rows(2, g)
    kv.write_rows([b, a], k, v)  # one row each
    assert (a.length, b.length) == (23, 13)
    assert torch.equal(kv.gather(a)[0][-1], k[1]) and torch.equal(kv.gather(b)[1][-1], v[0])
    assert kv.num_pages >= 5 and kv.pages_in_use == len(a.pages) + len(b.pages) == 3 + 2
    before = kv.gather(b)
    held = list(a.pages)
    a.release()
    assert a.length == 0 and a.pages == [] and kv.pages_in_use == 2
    c = Eagle3State(paged=kv)
    k, v = rows(20, g)
    c.append(k, v)
    assert set(c.pages) <= set(held) | set(range(kv.num_pages))
    assert set(c.pages) & set(held), "released pages are taken again"
    assert torch.equal(kv.gather(c)[0], k)
    assert all(torch.equal(x, y) for x, y in zip(kv.gather(b), before, strict=True))


def test_bad_shapes_are_refused():
    kv = pool()
    st = Eagle3State(paged=kv)
    with pytest.raises(ShapeError, match="stores k, v"):
        kv.write(st, torch.zeros(2, HKV + 1, D), torch.zeros(2, HKV + 1, D))
    with pytest.raises(ShapeError, match="2 rows for 1 states"):
        kv.write_rows([st], torch.zeros(2, HKV, D), torch.zeros(2, HKV, D))
    with pytest.raises(ShapeError, match="at least one cached row"):
        kv.attend([st], torch.zeros(1, HQ, D), 1.0)


@pytest.mark.parametrize("block_size", [8, 16])
def test_attend_equals_float64_attention(block_size):
    """One decode-attention call over states of lengths 1, a full block, a block and one, and
    several blocks: each row against softmax(q k^T) v in float64, query head h on KV head
    h // (HQ / HKV)."""
    g = torch.Generator().manual_seed(block_size)
    kv = pool(num_pages=2, block_size=block_size)
    lens = (1, block_size, block_size + 1, 3 * block_size + 5)
    states, caches = [], []
    for n in lens:
        st = Eagle3State(paged=kv)
        k, v = rows(n, g)
        kv.write(st, k, v)
        states.append(st)
        caches.append((k, v))
    q = torch.randn(len(lens), HQ, D, generator=g)
    got = kv.attend(states, q, scale=0.25)
    assert got.shape == q.shape and got.dtype == q.dtype
    for i, (k, v) in enumerate(caches):
        kr = k.double().repeat_interleave(HQ // HKV, dim=1)  # [n, HQ, D]
        vr = v.double().repeat_interleave(HQ // HKV, dim=1)
        w = (torch.einsum("hd,nhd->hn", q[i].double(), kr) * 0.25).softmax(-1)
        ref = torch.einsum("hn,nhd->hd", w, vr)
        torch.testing.assert_close(got[i].double(), ref, atol=1e-5, rtol=1e-5)


def test_step_batch_and_step_over_pages_equal_contiguous_caches(head):
    """Prompt rows by ``extend`` (gather + causal attention), then batched steps (one
    decode-attention call) and one-row ``step`` calls (the paged one-row path): drafts, hidden
    states and cached rows equal contiguous states'."""
    g = torch.Generator().manual_seed(3)
    lens = (5, 0, 17, 1, 40)
    kv = pool(num_pages=1, block_size=16)
    flat, paged = [Eagle3State() for _ in lens], [Eagle3State(paged=kv) for _ in lens]
    for a, b, n in zip(flat, paged, lens, strict=True):
        if n:
            f = torch.randn(n, 3 * CFG.hidden_size, generator=g)
            t = torch.randint(0, CFG.vocab_size, (n,), generator=g)
            head.extend(a, f, t, torch.arange(1, n + 1))
            head.extend(b, f, t, torch.arange(1, n + 1))
    for step in range(4):
        f = torch.randn(len(lens), 3 * CFG.hidden_size, generator=g)
        t = torch.randint(0, CFG.vocab_size, (len(lens),), generator=g)
        pos = torch.tensor([st.length + 1 for st in flat])
        if step % 2:
            got = [head.step(st, f[i : i + 1], t[i : i + 1], pos[i : i + 1]) for i, st in enumerate(paged)]
            d, h = torch.cat([x[0] for x in got]), torch.cat([x[1] for x in got])
        else:
            d, h, _ = head.step_batch(paged, f, t, pos)
        d_ref, h_ref, _ = head.step_batch(flat, f, t, pos)
        assert torch.equal(d, d_ref)
        torch.testing.assert_close(h, h_ref, atol=ATOL, rtol=RTOL)
    for a, b in zip(flat, paged, strict=True):
        assert a.length == b.length
        pk, pv = kv.gather(b)
        torch.testing.assert_close(pk, a.k[: a.length], atol=ATOL, rtol=RTOL)
        torch.testing.assert_close(pv, a.v[: a.length], atol=ATOL, rtol=RTOL)


KVS = [
    ("dense", KvConfig(block_size=16, top_k_blocks=8)),
    ("oasis", KvConfig(block_size=16, top_k_blocks=4, fetch_cap=0.25, sparse_threshold=64)),
]


@pytest.mark.parametrize("speculative", [False, True])
@pytest.mark.parametrize("backend,kv", KVS, ids=["dense", "oasis-lossy"])
def test_llm_engine_outputs_and_drafts_equal_with_paged_head_caches(model, head, backend, kv, speculative):
    """The engine with the paged drafter (as on a GPU) against the contiguous one: the same
    tokens and drafts; every page is back in the pool when the requests are done."""
    lens, new = (20, 97, 45, 70), 12
    res, drafters = {}, {}
    for paged in (False, True):
        d = Logged.wrap(Eagle3Drafter)(head, model, paged=paged)
        eng = LLMEngine(model, kv=kv, backend=backend, drafter=d, speculative=speculative, max_num_seqs=3)
        sp = SamplingParams(max_tokens=new, ignore_eos=True)
        rids = [eng.add_request(prompt(n, i), sp) for i, n in enumerate(lens)]
        outs = eng.run_to_completion(rids)
        res[paged] = ([outs[r].token_ids for r in rids], d.log)
        drafters[paged] = d
    assert res[True] == res[False]
    assert drafters[False].pool is None
    kvp = drafters[True].pool
    assert kvp is not None and kvp.pages_in_use == 0 and kvp.num_pages >= 2


def test_drafter_begun_again_gives_its_pages_back(model, head):
    d = Eagle3Drafter(head, model, paged=True)
    p = prompt(40, 1)
    d.begin(7, p)
    d._states[7].append(*rows(40, torch.Generator().manual_seed(1)))
    assert d.pool.pages_in_use == 3
    d.begin(7, p)
    assert d.pool.pages_in_use == 0 and d._states[7].length == 0
    d.end(7)
    d.end(7)  # twice: nothing left to give back
    assert d.pool.pages_in_use == 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_attend_on_cuda_equals_float64_attention(dtype, block_size):
    g = torch.Generator().manual_seed(7)
    kv = pool(num_pages=1, block_size=block_size, dtype=dtype, device="cuda")
    lens = (1, 300, block_size, 77)
    states, caches = [], []
    for n in lens:
        st = Eagle3State(paged=kv)
        k, v = rows(n, g)
        kv.write(st, k.to("cuda", dtype), v.to("cuda", dtype))
        states.append(st)
        caches.append((k.to(dtype).double(), v.to(dtype).double()))
    q = torch.randn(len(lens), HQ, D, generator=g)
    got = kv.attend(states, q.to("cuda", dtype), scale=0.25).double().cpu()
    for i, (k, v) in enumerate(caches):
        kr, vr = k.repeat_interleave(HQ // HKV, dim=1), v.repeat_interleave(HQ // HKV, dim=1)
        w = (torch.einsum("hd,nhd->hn", q[i].to(dtype).double(), kr) * 0.25).softmax(-1)
        ref = torch.einsum("hn,nhd->hd", w, vr)
        tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=8e-3, rtol=2e-2)
        torch.testing.assert_close(got[i], ref, **tol)


class NotLaunched(Eagle3Drafter):
    """Drafts only in ``propose_batch``, after the step's host read (the path before
    ``launch_batch``)."""

    def launch_batch(self, *a) -> bool:
        return False


class Snapshots:
    @staticmethod
    def wrap(cls):
        class S(cls):
            def __init__(self, *a, **kw):
                super().__init__(*a, **kw)
                self.log: dict[int, list[int]] = {}
                self.final: dict[int, tuple] = {}
                self.launched = 0

            def launch_batch(self, *a):
                ok = super().launch_batch(*a)
                self.launched += ok
                return ok

            def propose_batch(self, req_ids, tokens_list, features_list):
                out = super().propose_batch(req_ids, tokens_list, features_list)
                for r, d in zip(req_ids, out, strict=True):
                    self.log.setdefault(r, []).append(d)
                return out

            def end(self, req_id):
                st = self._states.get(req_id)
                if st is not None:
                    k, v = (
                        st.paged.gather(st)
                        if st.paged is not None
                        else (st.k[: st.length], st.v[: st.length])
                    )
                    self.final[req_id] = (st.length, k.clone(), v.clone())
                super().end(req_id)

        return S


#: The lossy working set of the launch tests: the drafts steer the selection.
LAUNCH_KV = KvConfig(block_size=16, top_k_blocks=4, fetch_cap=0.25, sparse_threshold=64)


def _sharp_head(model, device="cpu"):
    """A random head whose drafts vary (std 0.2), so that a wrong launch input shows."""
    return Eagle3Head.random(CFG, draft_vocab_size=64, seed=5, std=0.2, device=device).attach_target(model)


def _launch_run(model, drafter, snap, requests, **engine_kw):
    """One engine run; ``(tokens, drafts, final head caches, launches)`` of ``snap`` (the
    drafter's Snapshots instance, or its shadow's)."""
    eng = LLMEngine(model, kv=LAUNCH_KV, backend="oasis", drafter=drafter, max_num_seqs=3, **engine_kw)
    rids = [eng.add_request(p, sp) for p, sp in requests]
    outs = eng.run_to_completion(rids)
    return eng, ([outs[r].token_ids for r in rids], snap.log, snap.final, snap.launched)


def _oracle_launch_run(model, head, cls, paged=None, **engine_kw):
    """An oracle forcing half of its verdicts, with a Snapshots(cls) EAGLE-3 shadow."""
    from oasiskv.drafters import OracleDrafter

    shadow = Snapshots.wrap(cls)(head, model, paged=paged)
    d = OracleDrafter(
        [prompt(16, 50 + i) for i in range(3)],
        accept=0.5,
        seed=2,
        vocab_size=CFG.vocab_size,
        force=True,
        shadow=shadow,
    )
    sp = SamplingParams(max_tokens=14, ignore_eos=True)
    requests = [(prompt(n, i), sp) for i, n in enumerate((20, 97, 45))]
    eng, res = _launch_run(model, d, shadow, requests, **engine_kw)
    return eng, shadow, res


def _assert_launch_changes_nothing(launched_run, plain_run, least: int) -> None:
    """The launched run against the one drafting after the host read: launches happened (only
    there), the same tokens and drafts, and head caches of the same rows."""
    toks, log, final, launched = launched_run
    toks0, log0, final0, launched0 = plain_run
    assert launched0 == 0 and launched > least
    assert toks == toks0 and log == log0
    assert final.keys() == final0.keys()
    for r, (n, k, v) in final.items():
        n0, k0, v0 = final0[r]
        assert n == n0
        torch.testing.assert_close(k, k0, atol=ATOL, rtol=RTOL)
        torch.testing.assert_close(v, v0, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("speculative", [False, True])
@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_drafts_launched_before_the_host_read_equal_drafting_after_it(model, paged, temperature, speculative):
    """``Eagle3Drafter.launch_batch`` (the next drafts queued from the step's tokens on the
    device, read back by ``propose_batch``) against drafting after the host read: the same drafts,
    tokens and head caches (each row appended once), greedy and sampled, with requests finishing
    at different steps; speculative steps launch from the accepted draft's row where one was
    accepted."""
    sharp = _sharp_head(model)
    requests = [
        (prompt(n, i), SamplingParams(max_tokens=m, temperature=temperature, seed=i))
        for i, (n, m) in enumerate(((20, 9), (97, 14), (45, 5), (70, 11)))
    ]
    res = {}
    for cls in (NotLaunched, Eagle3Drafter):
        d = Snapshots.wrap(cls)(sharp, model, paged=paged)
        _, res[cls] = _launch_run(model, d, d, requests, speculative=speculative)
    _assert_launch_changes_nothing(res[Eagle3Drafter], res[NotLaunched], least=8)
    log, final = res[Eagle3Drafter][1], res[Eagle3Drafter][2]
    assert len({x for v in log.values() for x in v}) > 8  # drafts that vary: the check can fail
    assert len(final) == 4


@pytest.mark.parametrize("paged", [False, True])
def test_speculative_launch_follows_the_accepted_row(model, paged):
    """Speculative steps with drafts accepted (an oracle forcing half of its verdicts, an EAGLE-3
    head as its shadow, launched or not): the shadow's next step takes row 1's token, features
    and position where the step accepted, row 0's elsewhere, exactly as drafting after the host
    read does (same shadow drafts and head caches; same tokens)."""
    sharp = _sharp_head(model)
    res = {}
    for cls in (NotLaunched, Eagle3Drafter):
        eng, _, res[cls] = _oracle_launch_run(model, sharp, cls, paged=paged, speculative=True)
        assert eng.spec_stats["accepted"] > 3
    _assert_launch_changes_nothing(res[Eagle3Drafter], res[NotLaunched], least=5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("speculative", [False, True])
def test_launched_drafts_on_cuda_graphs_equal_drafting_after_the_read(speculative):
    """The launch path where it matters: CUDA-graph steps, the head's pages on the GPU."""
    model = CausalLM.random(CFG, seed=4, device="cuda")
    sharp = _sharp_head(model, device="cuda")
    res = {}
    for cls in (NotLaunched, Eagle3Drafter):
        _, shadow, res[cls] = _oracle_launch_run(model, sharp, cls, speculative=speculative, cuda_graph=True)
        assert shadow.paged
    _assert_launch_changes_nothing(res[Eagle3Drafter], res[NotLaunched], least=5)


def test_reserve_pages_grows_once_and_keeps_every_row():
    """``reserve_pages`` grows the pool in one step to the pages asked for (never shrinks it); rows
    already written stay where they were, and states then take pages without growing it again."""
    g = torch.Generator().manual_seed(3)
    kv = pool(num_pages=2, block_size=8)
    a = Eagle3State(paged=kv)
    k, v = rows(11, g)
    a.append(k, v)
    kv.reserve_pages(40)
    assert kv.num_pages == 40 and kv.pages_in_use == 2
    assert torch.equal(kv.gather(a)[0], k) and torch.equal(kv.gather(a)[1], v)
    kv.reserve_pages(10)
    assert kv.num_pages == 40
    states = [Eagle3State(paged=kv) for _ in range(4)]
    for st in states:
        st.append(*rows(70, g))  # 9 pages each: 2 + 36 of the 40
    assert kv.num_pages == 40 and kv.pages_in_use == 38


def test_drafter_device_bytes_and_reserve(model, head):
    """``Eagle3Drafter.device_bytes``: the head's K and V of whole 16-row pages; ``reserve`` grows
    the paged pool once for the requests it is told of (``LLMEngine.reserve_pools`` calls it)."""
    d = Eagle3Drafter(head, model, paged=True)
    p = next(head.parameters())
    per_row = 2 * head.config.num_key_value_heads * head.config.head_dim * p.element_size()
    assert d.device_bytes(1) == d.device_bytes(16) == 16 * per_row
    assert d.device_bytes(17) == 32 * per_row
    d.reserve([100, 33])  # 7 + 3 pages
    assert d.pool.num_pages == 64  # the initial pool already holds them
    d.reserve([1000] * 8)  # 63 pages each
    assert d.pool.num_pages == 8 * 63
    flat = Eagle3Drafter(head, model, paged=False)
    flat.reserve([1000])
    assert flat.pool is None
    eng = LLMEngine(model, kv=KvConfig(block_size=8, top_k_blocks=4, sparse_threshold=40), drafter=d)
    eng.reserve_pools([(2000, 16)] * 4)  # 126 pages each: past what the pool holds
    assert d.pool.num_pages == 4 * 126
