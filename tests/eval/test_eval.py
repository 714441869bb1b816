"""The evaluation's parts (oasis eval): corpus split, teacher-forced runs, lookahead recorder,
Quest-like mask, retrieval prompts, top-2 drafts, on a tiny model (the ``tiny`` and ``head``
fixtures of this folder's conftest). The harness end to end (results file, report, CLI) is
``test_eval_harness.py``."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from oasiskv import ops
from oasiskv.eval import corpus, report, retrieval, teacher
from oasiskv.eval.policies import CodesPolicy, ExactPolicy, QuestPolicy
from oasiskv.eval.teacher import Policy, TeacherForcing, summarize
from support.fakes import ByteTokenizer
from support.texts import repetitive

# Private names read here: ``harness._fill_preset`` (the CLI's preset defaults, applied to test
# arguments), ``report._pct``/``report._by_setting`` (the report's rounding and grouping, checked),
# ``Engine._initial_selection``/``_kept`` (the sticky candidates a recorder sees).

torch.set_num_threads(2)

BLOCK = 8


def _fake_roots(tmp_path: Path):
    std = tmp_path / "lib"
    site = tmp_path / "site-packages"
    for root, files in (
        (std, {"json/__init__.py": "x = 1\n", "json/decoder.py": "y = 2\n", "argparse.py": "z = 3\n"}),
        (
            site,
            {
                "torch/nn/linear.py": "import torch\n",
                "torch/README.md": "# torch\n",
                "torch/__pycache__/x.py": "cached\n",
                "torch-2.0.dist-info/METADATA.txt": "meta\n",
                "oasiskv/engine.py": "ours\n",
                "six.py": "six\n",
                "data.bin": "binary",
            },
        ),
    ):
        for rel, text in files.items():
            p = root / rel
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_text(text)
    (site / "bad.txt").write_bytes(b"\xff\xfe not utf-8")
    return [("stdlib", std), ("site", site)]


def test_corpus_keys_packages_and_exclusions(tmp_path):
    files = corpus.list_files(_fake_roots(tmp_path))
    keys = [f.key for f in files]
    assert keys == sorted(keys)
    assert set(keys) == {
        "stdlib/argparse.py",
        "stdlib/json/__init__.py",
        "stdlib/json/decoder.py",
        "site/bad.txt",
        "site/six.py",
        "site/torch/README.md",
        "site/torch/nn/linear.py",
    }
    pk = {f.key: f.package for f in files}
    assert pk["stdlib/json/decoder.py"] == "stdlib/json" and pk["stdlib/argparse.py"] == "stdlib/argparse"
    assert pk["site/torch/nn/linear.py"] == "site/torch" and pk["site/six.py"] == "site/six"
    assert corpus.read_text([f for f in files if f.key == "site/bad.txt"][0]) is None
    # The split is a fixed function of the package name: every file of a package on one side.
    for f in files:
        assert f.split == corpus.split_of(f.package)
    assert corpus.fingerprint(files) == corpus.fingerprint(corpus.list_files(_fake_roots(tmp_path)))
    only_std = corpus.list_files(_fake_roots(tmp_path), source="stdlib")
    assert {f.key.split("/")[0] for f in only_std} == {"stdlib"}


def test_split_rule_is_fixed():
    # Pinned values: changing the rule would silently move held-out text into training.
    assert corpus.split_of("stdlib/json") == corpus.split_of("stdlib/json")
    held = [p for p in (f"stdlib/pkg{i}" for i in range(2000)) if corpus.split_of(p) == "heldout"]
    assert 0.07 < len(held) / 2000 < 0.13
    assert corpus.split_of("stdlib/pdb") == "heldout" and corpus.split_of("stdlib/json") == "train"


def test_heldout_texts_are_long_enough_for_8k_and_deterministic():
    tok = ByteTokenizer()
    a = corpus.heldout_texts(tok, 8193, 8, source="stdlib")
    b = corpus.heldout_texts(tok, 8193, 8, source="stdlib")
    assert len(a) == 8 and all(len(t["tokens"]) == 8193 for t in a)
    assert [t["tokens"] for t in a] == [t["tokens"] for t in b]
    assert all(corpus.split_of(t["package"]) == "heldout" for t in a)
    assert len({t["package"] for t in a}) >= 4  # one window per package first
    with pytest.raises(ValueError, match="held-out split"):
        corpus.heldout_texts(tok, 8193, 8, source="stdlib", files=[])


# ------------------------------------------------------------------------------------------ teacher
def test_oracle_overlap_at_least_previous_query_on_repetitive_text(tiny):
    texts = [repetitive(257, seed=s) for s in range(2)]
    tf = TeacherForcing(tiny, texts, 24, block_size=BLOCK, batch_size=2, progress=False)
    dense = tf.run(Policy("dense"))
    recs = {
        d: summarize(tf.run(Policy("oasis", d, 4, None)), dense)
        for d in ("oracle", "previous-query", "ngram")
    }
    L = tiny.config.num_hidden_layers
    o, p, n = (recs[d]["lookahead"] for d in ("oracle", "previous-query", "ngram"))
    assert o["overlap"] >= p["overlap"] + 0.05, (o["overlap"], p["overlap"])
    assert len(o["overlap_per_layer"]) == L and o["steps_measured"] == 23  # step 0 is not a lookahead
    assert o["draft_accept"] == 1.0 and o["overlap_unmatched"] is None and o["n_matched"] == 23 * 2
    assert p["draft_accept"] is None and p["overlap_matched"] is None
    # On a periodic text the n-gram drafter finds the next token (after the first period).
    assert n["draft_accept"] > 0.9
    # Uncapped: the working set is exactly the prediction.
    assert o["resident_hit"] == pytest.approx(o["overlap"], abs=1e-6)
    for r in recs.values():
        assert 0.0 <= r["lookahead"]["overlap_min_layer"] <= r["lookahead"]["overlap"] <= 1.0
        assert r["fetched_bytes_per_step"] > 0 and r["kl"] >= 0


def test_teacher_forcing_scores_each_decode_step_against_the_next_text_token(tiny):
    """The runner's convention, against one causal forward over each whole text (outside the
    engine): decode step j feeds text[P + j], and its logits, scored against text[P + j + 1], are
    the full forward's logits at position P + j. Every request of a batch runs every step."""
    from oasiskv.models.transformer import dense_causal_attn

    steps = 10
    texts = [repetitive(129, seed=s) for s in range(3)]
    tf = TeacherForcing(tiny, texts, steps, block_size=BLOCK, batch_size=2, progress=False)
    res = tf.run(Policy("dense"))
    P = 128 - steps
    assert res.nll.shape == (steps, 3) and res.top1.shape == (steps, 3)
    for i, t in enumerate(texts):
        ids = torch.tensor(t[:-1])
        rows = torch.arange(P, 128)
        logits, _ = tiny(ids, torch.arange(128), dense_causal_attn(), logits_rows=rows)
        lp = torch.log_softmax(logits.float(), dim=-1)  # [S, V]: position P + j predicts t[P + j + 1]
        want = -lp.gather(1, torch.tensor(t[P + 1 :]).unsqueeze(1)).squeeze(1)
        torch.testing.assert_close(res.nll[:, i], want, atol=1e-4, rtol=1e-4)
        assert torch.equal(res.top1[:, i], lp.argmax(-1))


def test_fetch_cap_bounds_traffic_and_resident_hit(tiny):
    tf = TeacherForcing(tiny, [repetitive(257, seed=3)], 16, block_size=BLOCK, batch_size=1, progress=False)
    dense = tf.run(Policy("dense"))
    capped = summarize(tf.run(Policy("oasis", "previous-query", 6, 1)), dense)
    free = summarize(tf.run(Policy("oasis", "previous-query", 6, None)), dense)
    c = tiny.config
    entry = 2 * BLOCK * c.head_dim * 4
    assert capped["fetched_bytes_per_step"] <= c.num_hidden_layers * c.num_key_value_heads * 1 * entry
    assert capped["fetched_bytes_per_step"] <= free["fetched_bytes_per_step"]


@pytest.mark.parametrize("drafter", ["ngram", "eagle3", "eagle3-noprefill"])
def test_budget_covering_the_context_is_exact(tiny, head, drafter):
    """K >= every block: the sparse run reads everything, so fidelity is 0/1 and overlap is 1."""
    texts = [repetitive(161, seed=s) for s in range(2)]
    tf = TeacherForcing(tiny, texts, 12, block_size=BLOCK, batch_size=2, eagle3_head=head, progress=False)
    dense = tf.run(Policy("dense"))
    for pol in (Policy("oasis", drafter, 64, 0.05), Policy("quest", None, 64)):
        rec = summarize(tf.run(pol), dense)
        assert rec["kl"] == pytest.approx(0.0, abs=1e-6)
        assert rec["top1_agree"] == 1.0
        assert rec["delta_nll"] == pytest.approx(0.0, abs=1e-5)
        if pol.kind == "oasis":
            assert rec["lookahead"]["overlap"] == pytest.approx(1.0)
            assert rec["lookahead"]["resident_hit"] == pytest.approx(1.0)


def test_fp8_host_pool_variant_beside_a_float_one_in_one_teacher(tiny):
    """``+hfp8`` runs in the same TeacherForcing as the float variant, on pools of its own
    storage (the runner shares pools only between runs of one storage): the float variant's
    result is the same before and after the fp8 one ran, and the fp8 one differs from it a
    little (its host pool rounds the blocks)."""
    texts = [repetitive(257, seed=s) for s in range(2)]
    tf = TeacherForcing(tiny, texts, 12, block_size=BLOCK, batch_size=2, progress=False)
    dense = tf.run(Policy("dense"))
    first = summarize(tf.run(Policy("oasis", "ngram", 6, 0.5)), dense)
    fp8 = summarize(tf.run(Policy("oasis", "ngram+hfp8", 6, 0.5)), dense)
    again = summarize(tf.run(Policy("oasis", "ngram", 6, 0.5)), dense)
    assert again["delta_nll"] == first["delta_nll"] and again["kl"] == first["kl"]
    assert fp8["kl"] != first["kl"] and fp8["kl"] < 0.05


def test_attention_mass_matches_a_per_token_reference_and_bounds(tiny):
    """block_attention_mass against a per-token float64 softmax read position by position from the
    host pool; every share lies in (0, 1], all are 1 at full budget, the best K blocks hold the most,
    and sampling follows mass_every."""
    from oasiskv.eval import teacher as T

    checked = {"n": 0}
    orig = T.block_attention_mass

    def reference(engine, layer, r, q_row) -> torch.Tensor:
        """[num_kv_heads, blocks]: per-token float64 softmax, summed per block, mean over the group."""
        g, b = engine.geo, engine.kv.block_size
        group = g.num_qo_heads // g.num_kv_heads
        host_k = engine.pools.host_k[layer]
        out = torch.zeros(g.num_kv_heads, r.kv_len // b + 1, dtype=torch.float64)
        for h in range(g.num_qo_heads):
            kh = h // group
            logits = [
                float(host_k[r.host_blocks[pos // b], kh, pos % b].double() @ q_row[h].double())
                * g.head_dim**-0.5
                for pos in range(r.kv_len + 1)  # x_t sits at position kv_len
            ]
            w = [math.exp(x - max(logits)) for x in logits]
            for pos, x in enumerate(w):
                out[kh, pos // b] += x / sum(w) / group
        return out

    def checking(engine, layer, sp_reqs, q):
        out = orig(engine, layer, sp_reqs, q)
        for i, r in enumerate(sp_reqs):
            want = reference(engine, layer, r, q[i].cpu())
            torch.testing.assert_close(out[i, :, : want.shape[1]], want, rtol=0, atol=1e-6)
            torch.testing.assert_close(out[i].sum(-1), torch.ones(want.shape[0], dtype=torch.float64))
        checked["n"] += 1
        return out

    T.block_attention_mass = checking
    try:
        tf = TeacherForcing(
            tiny, [repetitive(129, seed=7)], 6, block_size=BLOCK, batch_size=1, progress=False, mass_every=2
        )
        dense = tf.run(Policy("dense"))
        small = summarize(tf.run(Policy("oasis", "oracle", 3, None)), dense)["lookahead"]["attn_mass"]
        full = summarize(tf.run(Policy("oasis", "oracle", 64, None)), dense)["lookahead"]["attn_mass"]
    finally:
        T.block_attention_mass = orig
    L = tiny.config.num_hidden_layers
    assert checked["n"] == 2 * 2 * L  # measured steps 1..5, sampled at 2 and 4; two runs
    assert small["cells"] == 2 * L
    for k in ("exact", "predicted", "resident", "best"):
        assert 0.0 < small[k] <= 1.0 + 1e-9
        assert full[k] == pytest.approx(1.0, abs=1e-9)
    # No K blocks hold more attention than the K blocks of most attention.
    assert small["best"] >= max(small["exact"], small["predicted"], small["resident"]) - 1e-12
    assert small["exact"] < 1.0 and small["predicted_unmatched"] is None  # oracle: every draft matches
    with pytest.raises(ValueError, match="mass_every"):
        TeacherForcing(tiny, [[1] * 100], 8, mass_every=-1)


def test_covered_mass_counts_each_block_once_with_the_local_block():
    from oasiskv.eval.teacher import covered_mass

    mass = torch.tensor([[[0.1, 0.2, 0.3, 0.4]], [[0.25, 0.25, 0.25, 0.25]]], dtype=torch.float64)
    blocks = torch.tensor([[[0, 0, -1]], [[1, 2, -1]]])
    local = torch.tensor([3, 2])  # request 1's local block is also in its set
    assert covered_mass(mass, local, blocks).tolist() == pytest.approx([0.5, 0.5])


def test_best_mass_blocks_ranks_complete_blocks_only():
    from oasiskv.eval.teacher import best_mass_blocks

    mass = torch.tensor([[[0.1, 0.2, 0.3, 0.4]], [[0.5, 0.1, 0.4, 0.0]]], dtype=torch.float64)
    local = torch.tensor([3, 1])  # request 0: blocks 0..2 are candidates; request 1: block 0 only
    assert best_mass_blocks(mass, local, 2).tolist() == [[[2, 1]], [[0, -1]]]
    assert best_mass_blocks(mass, local, 6).shape == (2, 1, 6)


def test_small_budget_changes_the_output(tiny):
    tf = TeacherForcing(tiny, [repetitive(257, seed=5)], 8, block_size=BLOCK, batch_size=1, progress=False)
    dense = tf.run(Policy("dense"))
    for pol in (Policy("quest", None, 2), Policy("oasis", "oracle", 2, 1)):
        assert summarize(tf.run(pol), dense)["kl"] > 1e-5


def test_teacher_forcing_rejects_bad_input(tiny):
    with pytest.raises(ValueError, match="equal length"):
        TeacherForcing(tiny, [[1] * 100, [1] * 90], 8)
    with pytest.raises(ValueError, match="steps"):
        TeacherForcing(tiny, [[1] * 100], 99)
    with pytest.raises(ValueError, match="drafter"):
        Policy("oasis", "magic", 4)
    tf = TeacherForcing(tiny, [[1] * 100], 8, progress=False)
    with pytest.raises(ValueError, match="EAGLE-3 head"):
        tf.run(Policy("oasis", "eagle3", 2))


# ------------------------------------------------------------------------------------------ quest
def _quest_reference_scores(q, kmin, kmax, group):
    """Quest score per block and KV head, in torch: sum over the group's query heads of
    sum_d max(q*min, q*max). q [Hq, D]; kmin/kmax [nb, Hkv, D] -> [nb, Hkv]."""
    qg = q.view(-1, group, q.shape[-1])  # [Hkv, group, D]
    s = torch.maximum(qg.unsqueeze(0) * kmin.unsqueeze(2), qg.unsqueeze(0) * kmax.unsqueeze(2))
    return s.sum(dim=(2, 3))


def test_quest_mask_restricts_attention_to_current_query_top_k(tiny, monkeypatch):
    """During a Quest-like step, attention reads exactly the current query's top-K blocks (by an
    independent torch Quest score) plus the local block, per KV head; its output equals softmax
    attention over those tokens only; the mapping is restored afterwards."""
    K = 3
    text = repetitive(201, seed=7)
    tf = TeacherForcing(tiny, [text], 4, block_size=BLOCK, batch_size=1, progress=False)
    tf.run(Policy("dense"))
    c = tiny.config
    group = c.num_attention_heads // c.num_key_value_heads
    seen = []
    orig = ops.decode_attention

    def spy(geo, q, k_pages, v_pages, kv_indptr, kv_indices, last_len, *, page_map=None, **kw):
        out = orig(geo, q, k_pages, v_pages, kv_indptr, kv_indices, last_len, page_map=page_map, **kw)
        seen.append(
            dict(
                q=q.clone(),
                k=k_pages.clone(),
                v=v_pages.clone(),
                pages=kv_indices.tolist(),
                last=int(last_len[0]),
                pm=page_map.clone(),
                out=out.clone(),
            )
        )
        return out

    monkeypatch.setattr(ops, "decode_attention", spy)
    res = tf.run(Policy("quest", None, K))
    assert len(seen) == 4 * c.num_hidden_layers
    qm = tf.quest_policy
    for call in seen:
        pages, pm, q = call["pages"], call["pm"], call["q"][0, 0]  # one request, row 0
        n_blocks = len(pages)
        local = n_blocks - 1  # x_t's own block: always visible
        vis = pm[pages]  # [n_blocks, Hkv], logical block or -1
        kb = call["k"][pages]  # [nb, Hkv, B, D]
        complete = kb[:local]
        scores = _quest_reference_scores(q.float(), complete.amin(2).float(), complete.amax(2).float(), group)
        for h in range(c.num_key_value_heads):
            top = set(torch.topk(scores[:, h], K).indices.tolist())
            visible = {int(i) for i in range(n_blocks) if vis[i, h] >= 0}
            assert visible == top | {local}, (visible, top)
            # Reference attention over the visible tokens of this head's group.
            ks, vs = [], []
            for i in sorted(visible):
                n_tok = call["last"] if i == local else BLOCK
                ks.append(call["k"][pages[i], h, :n_tok])
                vs.append(call["v"][pages[i], h, :n_tok])
            kk, vv = torch.cat(ks).float(), torch.cat(vs).float()
            for g in range(h * group, (h + 1) * group):
                w = torch.softmax(kk @ q[g].float() * c.head_dim**-0.5, dim=0)
                torch.testing.assert_close(call["out"][0, 0, g].float(), w @ vv, atol=1e-5, rtol=1e-4)
    # The mapping is restored after every call, and the would-fetch statistic is filled.
    eng_pm = [v for v in qm.last_visible.values()]
    assert eng_pm and all(v == c.num_key_value_heads * (K + 1) for v in eng_pm)
    assert res.would_fetch_bytes_per_step is not None
    assert qm.churn_steps == {0: 4}  # after_step: once per decode step of the one request


def test_exact_policy_reads_the_blocks_holding_most_of_the_true_attention(tiny, monkeypatch):
    """ExactPolicy: during each decode step attention reads, per KV head, the K complete blocks
    holding most of the current query's softmax attention over the cached tokens (an independent
    float64 computation from the pages attention reads), plus the local block."""
    from oasiskv import LLM, KvConfig

    K = 3
    seen = []
    orig = ops.decode_attention

    def spy(geo, q, k_pages, v_pages, kv_indptr, kv_indices, last_len, *, page_map=None, **kw):
        seen.append((q.clone(), k_pages.clone(), kv_indices.tolist(), int(last_len[0]), page_map.clone()))
        return orig(geo, q, k_pages, v_pages, kv_indptr, kv_indices, last_len, page_map=page_map, **kw)

    monkeypatch.setattr(ops, "decode_attention", spy)
    llm = LLM(tiny, kv=KvConfig(block_size=BLOCK), backend="dense", drafter=None, policy=ExactPolicy(K))
    llm.generate([repetitive(150, seed=3)], 4, ignore_eos=True)
    c = tiny.config
    group, d = c.num_attention_heads // c.num_key_value_heads, c.head_dim
    assert len(seen) >= 3 * c.num_hidden_layers
    for q, k, pages, last, pm in seen:
        local = len(pages) - 1
        for h in range(c.num_key_value_heads):
            # Every token before x_t: the complete blocks, then the local page's first last - 1.
            keys = torch.cat([k[pages[:local], h].reshape(-1, d), k[pages[local], h, : last - 1]]).double()
            w = torch.stack(
                [
                    torch.softmax(keys @ q[0, 0, g].double() * d**-0.5, 0)
                    for g in range(h * group, (h + 1) * group)
                ]
            ).mean(0)
            mass = w[: local * BLOCK].view(local, BLOCK).sum(-1)
            top = set(torch.topk(mass, K).indices.tolist())
            visible = {i for i in range(len(pages)) if pm[pages[i], h] >= 0}
            assert visible == top | {local}, (h, visible, top)
    with pytest.raises(ValueError, match="top_k_blocks"):
        ExactPolicy(0)


def test_codes_policy_reads_the_codes_scores_top_k(tiny, monkeypatch):
    """CodesPolicy: per KV head, attention reads the current query's top-K complete blocks by the
    codes score (test_key_codes' float64 reference over codes of the resident keys inside their
    blocks' 8-bit bounds), plus the local block."""
    from oasiskv import LLM, KvConfig
    from support.key_codes import code_weights, decode_bound, ref_key_codes

    K = 3
    seen = []
    orig = ops.decode_attention

    def spy(geo, q, k_pages, v_pages, kv_indptr, kv_indices, last_len, *, page_map=None, **kw):
        seen.append((q.clone(), k_pages.clone(), kv_indices.tolist(), page_map.clone()))
        return orig(geo, q, k_pages, v_pages, kv_indptr, kv_indices, last_len, page_map=page_map, **kw)

    monkeypatch.setattr(ops, "decode_attention", spy)
    llm = LLM(tiny, kv=KvConfig(block_size=BLOCK), backend="dense", drafter=None, policy=CodesPolicy(K))
    llm.generate([repetitive(150, seed=5)], 3, ignore_eos=True)
    c = tiny.config
    group = c.num_attention_heads // c.num_key_value_heads
    assert len(seen) >= 2 * c.num_hidden_layers
    geo = ops.KvGeometry(c.num_attention_heads, c.num_key_value_heads, seen[0][1].shape[-1], BLOCK)
    for q, k, pages, pm in seen:
        local = len(pages) - 1
        blocks = k[pages[:local]]  # [nc, hk, B, D]
        summ = torch.stack([blocks.amin(2), blocks.amax(2)], dim=2)  # [nc, hk, 2, D]
        bounds = ops.empty_bounds8(geo, local)
        ops.build_bounds8(geo, summ, torch.arange(local, dtype=torch.int32), *bounds)
        codes = ref_key_codes(blocks, *bounds, list(range(local)))
        lo_all, hi_all = decode_bound(*bounds)
        for h in range(c.num_key_value_heads):
            score = torch.zeros(local, dtype=torch.float64)
            for i in range(local):
                lo, hi = lo_all[i, h], hi_all[i, h]
                for g in range(h * group, (h + 1) * group):
                    qg = q[0, 0, g]
                    logits = qg.double() @ lo + codes[i][0][h].double() @ code_weights(qg, lo, hi)
                    score[i] += logits.max()
            top = set(torch.topk(score, K).indices.tolist())
            visible = {i for i in range(len(pages)) if pm[pages[i], h] >= 0}
            assert visible == top | {local}, (h, visible, top)


def test_quest_policy_runs_on_a_dense_engine_only(tiny):
    from oasiskv.config import KvConfig
    from oasiskv.engine import Engine
    from oasiskv.errors import ConfigError

    with pytest.raises(ConfigError, match="'dense' engine"):
        Engine(tiny, KvConfig(top_k_blocks=2), "oasis", None, policy=QuestPolicy(2))
    with pytest.raises(ValueError, match="top_k_blocks"):
        QuestPolicy(0)
    eng = Engine(tiny, KvConfig(top_k_blocks=2), "dense", None, policy=QuestPolicy(2))
    assert eng.policy.top_k_blocks == 2 and eng.model is tiny  # no wrapper: prefills stay shared


def test_eval_harness_does_not_import_the_cli():
    """The CLI imports the harness; the harness (and the whole eval package) must not import the
    CLI back (the device helpers live in oasiskv.devices)."""
    import subprocess
    import sys

    code = "import sys, oasiskv.eval.harness; assert 'oasiskv.cli' not in sys.modules, 'cycle'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_engine_recorder_default_is_off_and_cheap(tiny):
    import oasiskv

    llm = oasiskv.LLM(tiny, kv=oasiskv.KvConfig(block_size=8, top_k_blocks=2, sparse_threshold=32))
    assert llm.engine.recorder is None
    calls = []

    class Rec:
        kept_reference = False

        def on_recall(self, engine, layer, sp_reqs, actual, prev, slot_pages, q=None):
            calls.append((layer, actual.shape, prev.shape, slot_pages.shape))

    llm.engine.recorder = Rec()
    llm.generate([repetitive(80)], max_new_tokens=4, ignore_eos=True)
    L = tiny.config.num_hidden_layers
    assert len(calls) % L == 0 and len(calls) >= L
    assert calls[0][1] == (1, 2, 2) and calls[0][3] == (1, 2)


# ------------------------------------------------------------------------------------------ retrieval
def test_retrieval_trials_fit_the_context_and_score():
    tok = ByteTokenizer()
    lines = [f"line {i} of some held-out text\n" for i in range(400)]
    trials = retrieval.make_trials(tok, retrieval.TASKS, 600, 4, [0.1, 0.9], haystack_lines=lines, seed=1)
    assert len(trials) == 4 * len(retrieval.TASKS)
    for t in trials:
        n = len(tok.encode(t["prompt"]))
        assert 600 - t["max_new_tokens"] - 40 <= n <= 600 - t["max_new_tokens"]
        assert t["answer"] in t["prompt"]
        assert abs(t["actual_depth"] - t["depth"]) < 0.05
    # The fact sits at its depth: about `depth` of the prompt lies before it (long prompts, where
    # the instructions are negligible).
    for t in retrieval.make_trials(tok, retrieval.TASKS, 4000, 2, [0.1, 0.9], haystack_lines=lines, seed=1):
        at = t["prompt"].index(t["answer"]) / len(t["prompt"])
        assert abs(at - t["depth"]) < 0.06, (t["task"], at, t["depth"])
    again = retrieval.make_trials(tok, retrieval.TASKS, 600, 4, [0.1, 0.9], haystack_lines=lines, seed=1)
    assert [t["prompt"] for t in trials] == [t["prompt"] for t in again]
    with pytest.raises(ValueError, match="too small"):
        retrieval.make_trial("passkey", tok, 100, 0, 0.5)
    assert retrieval.score("passkey", "12345", " 12345. The pass key")
    assert not retrieval.score("passkey", "12345", " 123456")
    assert retrieval.score("kv", "0a1b2c3d", '0a1b2c3d"\n')
    assert not retrieval.score("kv", "0a1b2c3d", "0a1b")


def test_copy_trials_ask_for_one_exact_line_among_near_distractors():
    """The exact-copy set: the asked line is in the prompt once, with its code once; the other
    token lines have the same shape and other codes; only an exact copy scores."""
    import re

    tok = ByteTokenizer()
    for i, depth in enumerate([0.0, 0.3, 0.7, 1.0]):
        t = retrieval.make_trial("copy", tok, 3000, i, depth, seed=4)
        prompt, code = t["prompt"], t["answer"]
        assert re.fullmatch(r"[a-z0-9]{5}-[a-z0-9]{5}", code)
        name = re.search(r"value of (TOKEN_[A-Z]+) in", prompt).group(1)
        assert prompt.count(f'{name} = "{code}"\n') == 1
        assert prompt.count(code) == 1
        assert prompt.endswith(f'# Answer: {name} = "')
        others = re.findall(r'TOKEN_[A-Z]+_\d+ = "([a-z0-9]{5}-[a-z0-9]{5})"', prompt)
        assert len(others) >= 20 and code not in others
        assert abs(t["actual_depth"] - depth) < 0.05
        assert retrieval.score("copy", code, f'{code}"\n')
        assert not retrieval.score("copy", code, code[:-1] + ("a" if code[-1] != "a" else "b"))
        assert not retrieval.decided("copy", code, code[:4])
        assert retrieval.decided("copy", code, code)
    assert "copy" not in retrieval.DEFAULT_TASKS
    with pytest.raises(ValueError, match="unknown retrieval task"):
        retrieval.score("cpy", "a", "a")


def test_copy_digits_trials_are_the_copy_file_with_digit_codes():
    """copy-digits: the copy task's file and question, 7-digit codes on the asked line and on every
    distractor token line; scored by the first integer (a longer number or a near miss fails)."""
    import re

    tok = ByteTokenizer()
    for i, depth in enumerate([0.0, 0.5, 1.0]):
        t = retrieval.make_trial("copy-digits", tok, 3000, i, depth, seed=4)
        prompt, code = t["prompt"], t["answer"]
        assert re.fullmatch(r"[1-9]\d{6}", code)
        name = re.search(r"value of (TOKEN_[A-Z]+) in", prompt).group(1)
        assert prompt.count(f'{name} = "{code}"\n') == 1
        assert prompt.endswith(f'# Answer: {name} = "')
        others = re.findall(r'TOKEN_[A-Z]+_\d+ = "(\d{7})"', prompt)
        assert len(others) >= 20 and code not in others
        assert not re.search(r'TOKEN_[A-Z]+_\d+ = "[a-z]', prompt), "no letter codes left"
        assert abs(t["actual_depth"] - depth) < 0.05
        assert t["max_new_tokens"] == retrieval.MAX_NEW_TOKENS["copy-digits"]
        assert retrieval.score("copy-digits", code, f'{code}"\n')
        assert not retrieval.score("copy-digits", code, f'{code}1"')
        assert not retrieval.score("copy-digits", code, code[:-1])
        assert not retrieval.decided("copy-digits", code, code[:4])
        assert retrieval.decided("copy-digits", code, f'{code}"')
    assert "copy-digits" not in retrieval.DEFAULT_TASKS


# ------------------------------------------------------------------------------------------ top-2 drafts
def test_drafter_names_with_sinks_and_top2():
    spec = teacher.parse_drafter("eagle3+current+codes+sink4+top2")
    assert spec == teacher.DrafterSpec("eagle3", "lookahead+current", "codes", 4, True)
    assert teacher.parse_drafter("ngram+sink2").sink_blocks == 2
    assert teacher.drafter_parts("oracle+codes+sink1") == ("oracle", "lookahead")
    assert teacher.block_score_of("oracle+codes+sink1") == ("oracle+sink1", "codes")
    for bad in ("ngram+top2", "eagle3+sink", "eagle3+sinkx", "eagle3+sink2+codes", "eagle3+top2+top2"):
        with pytest.raises(ValueError, match="unknown drafter"):
            teacher.parse_drafter(bad)


def test_drafter_names_with_a_two_stage_codes_score():
    """``+codesF``: the codes rank the Quest bound's best F x K blocks (KvConfig.score_candidates)."""
    spec = teacher.parse_drafter("eagle3+codes3+sink1")
    assert (spec.block_score, spec.score_candidates, spec.sink_blocks) == ("codes", 3.0, 1)
    assert teacher.parse_drafter("oracle+codes1.5").score_candidates == 1.5
    assert teacher.parse_drafter("oracle+codes").score_candidates is None
    assert teacher.block_score_of("eagle3+codes3+sink1") == ("eagle3+sink1", "codes")
    for bad in ("eagle3+codes0.5", "eagle3+codesx", "eagle3+codes3+codes", "eagle3+codes-2", "ngram+codes1."):
        with pytest.raises(ValueError, match="unknown drafter"):
            teacher.parse_drafter(bad)
    # +b16: the first stage over the 16-bit summaries (KvConfig.candidate_bound); two stages only.
    assert teacher.parse_drafter("oracle+codes1.5").kv_kwargs()["candidate_bound"] == "fp8"
    assert teacher.parse_drafter("oracle+codes1.5+b16+sticky").kv_kwargs()["candidate_bound"] == "summaries"
    assert teacher.parse_drafter("eagle3+fidelity+b16").candidate_bound == "summaries"
    for bad in ("oracle+b16", "oracle+codes+b16", "oracle+b16+codes2", "oracle+codes2+sticky+b16"):
        with pytest.raises(ValueError, match="unknown drafter"):
            teacher.parse_drafter(bad)


def test_drafter_names_with_an_fp8_host_pool():
    """``+hfp8``: KvConfig(host_kv_dtype="fp8_e4m3"), after the selection's suffixes."""
    assert teacher.parse_drafter("eagle3+fidelity+hfp8").kv_kwargs()["host_kv_dtype"] == "fp8_e4m3"
    assert teacher.parse_drafter("ngram+codes1.25+sticky").kv_kwargs()["host_kv_dtype"] is None
    assert teacher.parse_drafter("eagle3+hfp8+top2").top2
    for bad in ("eagle3+hfp8+fidelity", "eagle3+hfp8+hfp8", "ngram+hfp8+sink2"):
        with pytest.raises(ValueError, match="unknown drafter"):
            teacher.parse_drafter(bad)


def test_union_by_rank_alternates_and_skips_repeats():
    a = torch.tensor([[[5, 1, 2, 3]], [[0, -1, -1, -1]]])
    b = torch.tensor([[[1, 7, 5, 9]], [[0, -1, -1, -1]]])
    got = teacher.union_by_rank(a, b, 4)
    assert got.tolist() == [[[5, 1, 7, 2]], [[0, -1, -1, -1]]]


class _ShadowCheck(teacher.LookaheadRecorder):
    """A recorder that rebuilds each step's true query with shadow_queries (x_t as the token)."""

    def __init__(self) -> None:
        super().__init__()
        self.enabled, self.layers = True, 0

    def on_recall(self, engine, layer, sp_reqs, actual, prev, slot_pages, q=None) -> None:
        if layer == 0:
            toks = torch.tensor([[r.tokens[-1], 7] for r in sp_reqs])
            self.shadow = teacher.shadow_queries(engine, sp_reqs, toks)
        torch.testing.assert_close(self.shadow[layer][:, 0], q, atol=1e-5, rtol=1.3e-6)
        assert not torch.equal(self.shadow[layer][:, 1], q)  # another token: another query
        self.layers += 1


def test_shadow_queries_rebuild_the_true_query_under_a_full_budget(tiny):
    """With a budget covering the context, attention is dense, so the shadow query of x_t at its
    own position (context before it, plus itself) is the engine's query of this step."""
    import oasiskv

    kv = oasiskv.KvConfig.fast(block_size=BLOCK, top_k_blocks=64, fetch_cap=None, sparse_threshold=40)
    llm = oasiskv.LLM(tiny, kv=kv, backend="oasis", drafter="ngram")
    rec = llm.engine.recorder = _ShadowCheck()
    llm.generate([repetitive(90, seed=1), repetitive(61, seed=2)], 3, ignore_eos=True)
    assert rec.layers >= 2 * tiny.config.num_hidden_layers


def test_top2_measurement_and_sinks_through_the_teacher(tiny, head):
    """eagle3+top2: the top-2 sets are measured beside the engine's own (all of the context under a
    full budget); +sink2 changes the exact top-K (blocks 0 and 1 in it, tested in test_engine)."""
    texts = [repetitive(161, seed=s) for s in range(2)]
    tf = TeacherForcing(
        tiny, texts, 9, block_size=BLOCK, batch_size=2, eagle3_head=head, progress=False, mass_every=4
    )
    dense = tf.run(Policy("dense"))
    full = summarize(tf.run(Policy("oasis", "eagle3+top2", 64, None)), dense)["lookahead"]
    assert full["top2"]["overlap"] == {"top1": 1.0, "union_rank": 1.0, "union_max": 1.0}
    small = summarize(tf.run(Policy("oasis", "eagle3+top2", 4, 0.5)), dense)["lookahead"]
    top2 = small["top2"]
    assert set(top2["attn_mass"]) == set(teacher.TOP2_SETS) and top2["mass_cells"] > 0
    assert all(0.0 < v <= 1.0 for v in top2["overlap"].values())
    assert 0.0 <= top2["runner_up_accept"] <= 1.0
    rec = {"section": "teacher", "context": 160, "policy": "oasis", "drafter": "eagle3+top2", "budget": "4b"}
    md = report.render_markdown({"records": [{**rec, "fetch_cap": 0.5, "lookahead": small}]})
    assert "| 4b | 0.5 | eagle3+top2 |" in md and "union by rank" in md
    sink = summarize(tf.run(Policy("oasis", "eagle3+sink2", 4, 0.5)), dense)["lookahead"]
    assert "top2" not in sink  # opt-in
    assert sink["attn_mass"]["exact"] != small["attn_mass"]["exact"]


def test_drafter_names_with_sticky_candidates():
    """``+sticky`` after ``+codesF``: KvConfig(sticky_candidates=True); it needs two stages.
    ``+confP`` (EAGLE-3 only): KvConfig(lookahead_min_confidence=P)."""
    spec = teacher.parse_drafter("previous-query+codes1.25+sticky+succ8")
    assert spec.kv_kwargs()["sticky_candidates"] is True and spec.score_candidates == 1.25
    assert spec.successor_blocks == 8
    assert teacher.parse_drafter("eagle3+codes2").kv_kwargs()["sticky_candidates"] is False
    spec = teacher.parse_drafter("eagle3+codes1.25+sticky+succ8+conf0.25")
    assert spec.kv_kwargs()["lookahead_min_confidence"] == 0.25
    assert teacher.parse_drafter("eagle3").kv_kwargs()["lookahead_min_confidence"] is None
    for bad in ("ngram+conf0.5", "eagle3+conf1.5", "eagle3+conf", "eagle3+conf0.5+succ8"):
        with pytest.raises(ValueError, match="unknown drafter"):
            teacher.parse_drafter(bad)
    for bad in ("eagle3+codes+sticky", "eagle3+sticky", "eagle3+sticky+codes2", "eagle3+codes2+succ8+sticky"):
        with pytest.raises(ValueError, match="unknown drafter"):
            teacher.parse_drafter(bad)


def test_drafter_names_with_successor_blocks():
    """``+succN``: the next block of each head's N best blocks (KvConfig.successor_blocks)."""
    spec = teacher.parse_drafter("eagle3+codes1.5+pin4+succ2")
    assert (spec.pin_blocks, spec.successor_blocks, spec.score_candidates) == (4, 2, 1.5)
    assert spec.kv_kwargs()["successor_blocks"] == 2
    assert teacher.parse_drafter("ngram").kv_kwargs()["successor_blocks"] == 0
    for bad in ("eagle3+succ", "eagle3+succx", "eagle3+succ2+pin1", "eagle3+succ1+succ1"):
        with pytest.raises(ValueError, match="unknown drafter"):
            teacher.parse_drafter(bad)


class _KeptCheck(teacher.LookaheadRecorder):
    """Checks each recall's kept reference against its definition: the true query's top-K over the
    same blocks as the plain one, keeping what the judged prediction kept (the prediction before it,
    per slot; none after a request's first selection)."""

    def __init__(self, engine) -> None:
        super().__init__()
        self.enabled, self.checked, self.differs = True, 0, 0
        self.preds: dict = {}  # (layer, slot) -> that slot's predictions, oldest first
        self.calls: list = []  # top-K calls since the last recall
        self.pred_next = None  # the layer whose prediction comes next (after its recall)
        inner = self.inner = engine.top_k_blocks

        def recorded(layer, q, csr, k, slots=None, *, keep=None, every_block=False):
            out = inner(layer, q, csr, k, slots, keep=keep, every_block=every_block)
            if self.pred_next == layer:
                for i, slot in enumerate(slots.tolist()):
                    self.preds[layer, slot].append(out[i].tolist())
                self.pred_next = None
            else:
                self.calls.append((q, csr, k, slots, keep, out))
            return out

        first = engine._initial_selection

        def initial(layer, slot, pred):
            self.preds[layer, slot] = [pred.tolist()]
            first(layer, slot, pred)

        engine.top_k_blocks, engine._initial_selection = recorded, initial

    def on_recall(self, engine, layer, sp_reqs, actual, prev, slot_pages, q=None, actual_kept=None) -> None:
        super().on_recall(engine, layer, sp_reqs, actual, prev, slot_pages, q, actual_kept=actual_kept)
        assert actual_kept is not None
        (q1, csr1, k1, s1, keep1, out1), (q2, csr2, k2, s2, keep2, out2) = self.calls[-2:]
        self.calls.clear()
        assert keep1 is None and out1 is actual and out2 is actual_kept and torch.equal(q1, q2) and k1 == k2
        assert all(torch.equal(a, b) for a, b in zip(csr1, csr2, strict=True)) and torch.equal(s1, s2)
        for i, slot in enumerate(s2.tolist()):
            hist = self.preds[layer, slot]
            assert prev[i].tolist() == hist[-1]  # the prediction this recall judges
            kept = hist[-2] if len(hist) > 1 else [[-1] * len(row) for row in hist[-1]]
            assert keep2[i].tolist() == kept, (layer, slot)
        again = self.inner(layer, q2, csr2, k2, s2, keep=keep2)
        assert torch.equal(actual_kept, again)
        self.differs += int(not torch.equal(actual, actual_kept))
        self.checked += 1
        self.pred_next = layer


def test_recall_with_sticky_candidates_also_ranks_what_the_prediction_kept(tiny):
    """With sticky candidates and a recorder, each recall also gives ``actual_kept``: the true
    query's top-K over the same blocks with the blocks the judged prediction kept as candidates
    (checked call by call against that definition); it differs from the plain exact top-K
    somewhere. Without sticky candidates there is none, nor for a recorder that does not ask for
    it (``kept_reference``), whose ``on_recall`` need not take it."""
    import oasiskv

    kw = dict(block_size=BLOCK, top_k_blocks=3, fetch_cap=None, sparse_threshold=40, block_score="codes")
    kv = oasiskv.KvConfig(**kw, score_candidates=1.5, sticky_candidates=True)
    llm = oasiskv.LLM(tiny, kv=kv, backend="oasis", drafter="ngram")
    rec = llm.engine.recorder = _KeptCheck(llm.engine)
    llm.generate([repetitive(130, seed=3), repetitive(97, seed=4)], 12, ignore_eos=True)
    layers = tiny.config.num_hidden_layers
    assert rec.checked >= 10 * layers and rec.differs > 0
    plain = oasiskv.LLM(
        tiny,
        kv=oasiskv.KvConfig(**kw, score_candidates=1.5, sticky_candidates=False),
        backend="oasis",
        drafter="ngram",
    )
    seen = []

    class Plain(teacher.LookaheadRecorder):
        def on_recall(self, engine, layer, sp_reqs, actual, prev, slot_pages, q=None, **kw) -> None:
            seen.append(kw)

    plain.engine.recorder = Plain()
    plain.generate([repetitive(130, seed=3)], 4, ignore_eos=True)
    assert seen and all(kw == {} for kw in seen)

    class OldStyle:  # a recorder that does not ask for actual_kept
        kept_reference = False
        calls = 0

        def on_recall(self, engine, layer, sp_reqs, actual, prev, slot_pages, q=None) -> None:
            OldStyle.calls += 1

    sticky = oasiskv.LLM(tiny, kv=kv, backend="oasis", drafter="ngram")
    sticky.engine.recorder = OldStyle()
    sticky.generate([repetitive(130, seed=3)], 4, ignore_eos=True)
    assert OldStyle.calls > 0 and all(k is None for k in sticky.engine._kept)


def test_a_recorder_that_is_not_a_recall_recorder_is_refused(tiny):
    """``engine.recorder`` is a :class:`~oasiskv.engine.RecallRecorder`: an object lacking
    ``kept_reference`` or ``on_recall`` is refused when set, naming what it lacks; None clears."""
    import oasiskv
    from oasiskv.errors import ConfigError

    llm = oasiskv.LLM(tiny, kv=oasiskv.KvConfig(block_size=8, top_k_blocks=2, sparse_threshold=32))

    class NoFlag:
        def on_recall(self, engine, layer, sp_reqs, actual, prev, slot_pages, q=None):
            pass

    with pytest.raises(ConfigError, match="NoFlag lacks kept_reference"):
        llm.engine.recorder = NoFlag()
    with pytest.raises(ConfigError, match="object lacks on_recall and kept_reference"):
        llm.engine.recorder = object()
    assert llm.engine.recorder is None
    llm.engine.recorder = teacher.LookaheadRecorder()
    llm.engine.recorder = None
    assert llm.engine.recorder is None


def test_teacher_reports_the_overlap_against_the_selections_own_choice(tiny):
    """A sticky selection's lookahead summary has ``kept`` (the overlap against its own choice with
    the true query), unlike the same selection without stickiness; the report shows it."""
    texts = [repetitive(161, seed=s) for s in range(2)]
    tf = TeacherForcing(tiny, texts, 9, block_size=BLOCK, batch_size=2, progress=False)
    dense = tf.run(Policy("dense"))
    sticky = summarize(tf.run(Policy("oasis", "previous-query+codes1.5+sticky", 4, None)), dense)["lookahead"]
    plain = summarize(tf.run(Policy("oasis", "previous-query+codes1.5", 4, None)), dense)["lookahead"]
    assert "kept" not in plain
    kept = sticky["kept"]
    assert 0.0 < kept["overlap"] <= 1.0 and len(kept["overlap_per_layer"]) == tiny.config.num_hidden_layers
    assert kept["overlap"] != sticky["overlap"]
    rec = {
        "section": "teacher",
        "context": 160,
        "policy": "oasis",
        "drafter": "previous-query+codes1.5+sticky",
    }
    md = report.render_markdown(
        {"records": [{**rec, "budget": "4b", "fetch_cap": None, "lookahead": sticky}]}
    )
    assert "own choice" in md and f"{kept['overlap']:.3f}" in md


def test_report_keeps_runs_of_other_text_counts_apart():
    """Records of one context with 4 and 14 texts get a section each (no table cell holds the
    other run's value) and plot tags of their own."""
    base = {"section": "teacher", "context": 8192, "steps": 128, "policy": "oasis", "drafter": "eagle3"}
    recs = [
        {**base, "texts": 4, "budget": "1/4", "fetch_cap": 0.05, "lookahead": {"overlap": 0.111}},
        {**base, "texts": 14, "budget": "1/4", "fetch_cap": 0.05, "lookahead": {"overlap": 0.222}},
    ]
    md = report.render_markdown({"records": recs})
    assert "### Context 8192 (128 steps x 4 texts)" in md and "### Context 8192 (128 steps x 14 texts)" in md
    assert "0.111" in md and "0.222" in md
    tags = [tag for _, tag, _ in report._by_setting(recs)]
    assert tags == ["C8192-128x4", "C8192-128x14"]
    assert [tag for _, tag, _ in report._by_setting(recs[:1])] == ["C8192"]
