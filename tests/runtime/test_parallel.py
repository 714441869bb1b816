"""Tensor parallelism on the CPU (gloo, 2 processes): TP=2 greedy tokens equal one process's,
dense, OasisKV and OasisKV speculative; a rank that dies mid-run ends the run with an error
naming it, not a hang; a failure on a worker alone becomes that request's error on the driver.
Plus the shard rules and the option checks, in process."""

from __future__ import annotations

import json
import os
import time

import pytest
import torch

from oasiskv import KvConfig, LLMEngine, SamplingParams
from oasiskv.errors import ConfigError, OutOfBlocksError, RankFailedError, TensorParallelError
from oasiskv.models.tp import TPCausalLM, kv_replicas, shard_hf_tensor, tp_config, valid_tp_sizes, vocab_shard
from oasiskv.models.transformer import CausalLM, dense_causal_attn
from oasiskv.parallel import TPGroup, TPLLMEngine, run_tp
from support.fakes import pools_are_full, prompt
from support.parallel import CFG, ENGINE, KV, MODES, MOE_CFG, SEED, SPECS, drive, generate_job, spec_requests

torch.set_num_threads(2)

#: Seconds within which the survivors of a dead rank must fail (the issue's "not a hang").
DEAD_RANK_LIMIT_S = 30.0


# ------------------------------------------------------------------------- jobs of the ranks
def _dying_job(group, steps):
    """Rank 1 exits (``os._exit``, no exception, no cleanup) inside its ``steps + 1``-th decode
    step; rank 0 drives until it fails."""
    model = TPCausalLM.random(CFG, seed=SEED, group=group)
    eng = TPLLMEngine(model, backend="oasis", kv=KvConfig(**KV), **ENGINE)
    if not eng.is_driver:
        real, seen = eng.engine.decode_step, [0]

        def decode_step(*args, **kwargs):
            seen[0] += 1
            if seen[0] > steps:
                os._exit(17)
            return real(*args, **kwargs)

        eng.engine.decode_step = decode_step
        eng.worker_loop()
        return None
    drive(eng)
    return "rank 0 finished although rank 1 died"


def _worker_fails_job(group):
    """Rank 1's first dense -> sparse transition fails (as if its pools were full); the driver
    must finish that request with an error and the others normally, every pool full again. The
    prompts go through dense pages (a prompt admitted sparse never makes that transition)."""
    from oasiskv.engine import pools

    pools.DIRECT_SPARSE_PREFILL = False  # this rank's process only
    model = TPCausalLM.random(CFG, seed=SEED, group=group)
    eng = TPLLMEngine(model, backend="oasis", kv=KvConfig(**KV), **ENGINE)
    if not eng.is_driver:
        real, failed = eng.engine.make_sparse, []

        def make_sparse(r):
            if not failed:
                failed.append(r.id)
                raise OutOfBlocksError("injected: no host blocks left")
            return real(r)

        eng.engine.make_sparse = make_sparse
        eng.worker_loop()
        return {"failed": failed, "pools_full": pools_are_full(eng)}
    try:
        got = drive(eng)
    finally:
        eng.shutdown()
    return {"outputs": got, "pools_full": pools_are_full(eng)}


# ----------------------------------------------------------------------------------- tests
def _reference(mode: str, cfg=CFG) -> dict:
    """One process, the unsharded model, the plain LLMEngine."""
    model = CausalLM.random(cfg, seed=SEED)
    return drive(LLMEngine(model, kv=KvConfig(**KV), **MODES[mode], **ENGINE))


def test_tp2_greedy_tokens_equal_tp1_dense_and_oasis():
    """TP=2 over gloo: each rank owns 2 of the 4 KV heads (and 4 of the 8 query heads); the greedy
    tokens of three continuously batched requests equal the single-process engine's, token for
    token, with the dense backend, with OasisKV (the long requests turn sparse) and with OasisKV
    accepting drafts (speculative); both ranks ran the same decode steps (requests, tokens,
    drafts, sparse or not)."""
    ranks = run_tp(generate_job, tp=2, args=(tuple(MODES),), timeout_s=120)
    for mode in MODES:
        want = _reference(mode)
        got = ranks[0][mode]["outputs"]
        assert got == want, mode
        assert ranks[0][mode]["steps"] == ranks[1][mode]["steps"], mode
        assert ranks[0][mode]["caps"] == ranks[1][mode]["caps"], mode  # agreed budgets
        for rank in ranks:
            info = rank[mode]
            assert (info["kv_heads"], info["qo_heads"]) == (2, 4)
            assert info["pools_full"], mode
    assert len(ranks[0]["oasis"]["steps"]) >= max(m for _, m in SPECS) - 1
    sparse = [steps for _, _, _, steps in ranks[0]["oasis"]["outputs"].values()]
    assert sum(s > 0 for s in sparse) == 2, sparse  # the 150- and 200-token requests


def test_moe_tp2_greedy_tokens_equal_tp1_dense_and_oasis():
    """A Qwen3-MoE model (layers 0, 2, 3 mixtures of experts) over gloo: each rank holds half of
    every expert and routes its (replicated) rows itself; the greedy tokens equal the
    single-process engine's, dense and OasisKV (the long requests turn sparse), and both ranks
    ran the same decode steps."""
    modes = ("dense", "oasis")
    ranks = run_tp(generate_job, tp=2, args=(modes, MOE_CFG), timeout_s=120)
    for mode in modes:
        assert ranks[0][mode]["outputs"] == _reference(mode, MOE_CFG), mode
        assert ranks[0][mode]["steps"] == ranks[1][mode]["steps"], mode
        for rank in ranks:
            assert rank[mode]["moe_width"] == [32, 32, 32] and rank[mode]["pools_full"], mode
    sparse = [steps for _, _, _, steps in ranks[0]["oasis"]["outputs"].values()]
    assert sum(s > 0 for s in sparse) == 2, sparse


def test_rank_killed_mid_run_fails_the_others_not_a_hang():
    """Rank 1 dies in its third decode step: rank 0's next collective fails at once, it raises
    TensorParallelError from run_to_completion, and run_tp raises RankFailedError naming rank 1
    with its exit code, well within the limit."""
    t0 = time.monotonic()
    with pytest.raises(RankFailedError) as info:
        run_tp(_dying_job, tp=2, args=(2,), timeout_s=DEAD_RANK_LIMIT_S)
    elapsed = time.monotonic() - t0
    err = info.value
    assert err.rank == 1 and err.exitcode == 17, str(err)
    assert "rank 1 of 2 died" in str(err)
    assert list(err.errors) == [0], "rank 0 must raise on its own, not be terminated"
    assert "TensorParallelError" in err.errors[0]
    assert elapsed < DEAD_RANK_LIMIT_S, elapsed


def test_a_failure_on_one_worker_becomes_that_requests_error():
    """A transition that fails on rank 1 only fails on the driver too (the same error class),
    so its LLMEngine finishes that request with an error naming rank 1 and goes on; the other
    requests' tokens are the single-process ones; every rank's pools are full again."""
    driver, worker = run_tp(_worker_fails_job, tp=2, timeout_s=120)
    want = _reference("oasis")
    got = driver["outputs"]
    errored = [rid for rid, (_, reason, _, _) in got.items() if reason == "error"]
    assert len(errored) == 1 and len(worker["failed"]) == 1
    assert "rank 1" in got[errored[0]][2] and "injected" in got[errored[0]][2]
    for rid in got:
        if rid not in errored:
            assert got[rid] == want[rid]
    assert driver["pools_full"] and worker["pools_full"]


#: A prompt asked twice (the second prefill is a cache hit) and another one; whole-prompt
#: prefills (a chunked one does not consult the cache).
CACHE_SPECS = [(0, 150, 6), (0, 150, 9), (1, 40, 7)]
CACHE_ENGINE = {**ENGINE, "max_num_batched_tokens": 512}


def _cache_requests():
    return [(prompt(n, i), SamplingParams(max_tokens=m, ignore_eos=True)) for i, n, m in CACHE_SPECS]


def _prefill_cache_job(group, diverge: bool):
    """Rank-local prefill caches under TP=2; ``diverge``: rank 1's cache never keeps an entry, so
    it misses where rank 0 hits. Returns the driver's outputs, each rank's cache hits and how many
    prompt forwards (prefills) each rank's model ran."""
    from oasiskv import PrefillCache

    model = TPCausalLM.random(CFG, seed=SEED, group=group)
    cache = PrefillCache(capacity=2)
    if diverge and group.rank == 1:
        cache.put = lambda key, item: None
    forwards, real = [0], model.forward

    def forward(ids, *args, **kwargs):
        forwards[0] += int(ids.numel() >= 40)  # a whole prompt; decode steps carry a few tokens
        return real(ids, *args, **kwargs)

    model.forward = forward
    eng = TPLLMEngine(model, backend="oasis", kv=KvConfig(**KV), prefill_cache=cache, **CACHE_ENGINE)
    got = None
    if eng.is_driver:
        try:
            ids = [eng.add_request(p, sp) for p, sp in _cache_requests()]
            outs = eng.run_to_completion(ids)
            got = {rid: (o.token_ids, o.error) for rid, o in outs.items()}
        finally:
            eng.shutdown()
    else:
        eng.worker_loop()
    return {"outputs": got, "hits": cache.hits, "forwards": forwards[0]}


@pytest.mark.parametrize("diverge", [False, True], ids=["same-caches", "rank1-misses"])
def test_tp2_prefill_cache_serves_a_prompt_only_where_every_rank_has_it(diverge):
    """A PrefillCache per rank under TP=2: the repeated prompt is served from the caches on both
    ranks (one prompt forward fewer on each), and the tokens equal one process's without a cache.
    Where rank 1's cache misses while rank 0's hits, both ranks run the forward (no rank waits
    in a collective the other skipped) and the tokens are the same."""
    ranks = run_tp(_prefill_cache_job, tp=2, args=(diverge,), timeout_s=120)
    ref = LLMEngine(CausalLM.random(CFG, seed=SEED), backend="oasis", kv=KvConfig(**KV), **CACHE_ENGINE)
    ids = [ref.add_request(p, sp) for p, sp in _cache_requests()]
    want = {rid: (o.token_ids, o.error) for rid, o in ref.run_to_completion(ids).items()}
    assert ranks[0]["outputs"] == want
    assert all(err is None for _, err in want.values())
    if diverge:
        assert ranks[0]["hits"] == 1 and ranks[1]["hits"] == 0
        assert ranks[0]["forwards"] == ranks[1]["forwards"] == 3  # the hit was not used
    else:
        assert ranks[0]["hits"] == ranks[1]["hits"] == 1
        assert ranks[0]["forwards"] == ranks[1]["forwards"] == 2


def _raising_job(group):
    if group.rank == 1:
        raise ValueError("boom on rank 1")
    return group.all_gather_object(group.rank)  # fails: rank 1 is gone


def test_run_tp_returns_in_rank_order_and_names_a_raising_rank():
    assert run_tp(_ranks_job, tp=2) == [(0, 2, [0, 1]), (1, 2, [0, 1])]
    with pytest.raises(RankFailedError) as info:
        run_tp(_raising_job, tp=2, timeout_s=DEAD_RANK_LIMIT_S)
    assert info.value.rank == 1 and "ValueError: boom on rank 1" in str(info.value)


def _ranks_job(group):
    return (group.rank, group.size, group.all_gather_object(group.rank))


def test_bench_serve_tp2_sweeps_on_the_cpu(tmp_path, capsys):
    """``python -m oasiskv.bench.serve --in-process tiny-moe --tp 2 --device cpu``: two gloo
    ranks, each with one of the preset's two KV heads and half of every expert; rank 0 runs the
    closed-loop sweep (the 80-token prompts turn sparse) and the command prints and writes its
    rows. A tp that does not divide the heads, and --tp without --in-process, are messages."""
    from oasiskv.bench import serve as bench

    out = tmp_path / "tp2.json"
    sweep = ["--concurrency", "1,2", "--requests", "3", "--prompt-tokens", "80", "--max-tokens", "5"]
    engine = ["--device", "cpu", "--top-k-blocks", "4", "--fetch-cap", "0.5", "--sparse-threshold", "64"]
    assert bench.main(["--in-process", "tiny-moe", "--tp", "2", *sweep, *engine, "--json", str(out)]) == 0
    table = capsys.readouterr().out
    assert table.splitlines()[0].split()[:3] == ["conc", "reqs", "tok/s"] and len(table.splitlines()) == 3
    rep = json.loads(out.read_text())
    assert (rep["mode"], rep["tp"], rep["kv_heads_per_rank"], rep["random_weights"]) == (
        "in-process",
        2,
        1,
        True,
    )
    assert [r["concurrency"] for r in rep["rows"]] == [1, 2]
    for r in rep["rows"]:
        assert r["requests"] == 3 and r["output_tokens"] == 15 and r["tokens_per_s"] > 0
        assert r["ttft_p50_s"] > 0 and r["tpot_p50_s"] > 0
    assert bench.main(["--in-process", "tiny-moe", "--tp", "3", *sweep, *engine, "--json", ""]) == 2
    assert "num_attention_heads=4" in capsys.readouterr().err
    assert bench.main(["--endpoint", "http://127.0.0.1:1", "--tp", "2", *sweep]) == 2
    assert "use it with --in-process or --fig11" in capsys.readouterr().err


def test_bench_fig11_tp2_on_the_cpu(tmp_path):
    """``--fig11 --tp 2``: rank 0 runs the sweep, the other rank builds each engine it is sent
    and follows it; the rows are rank 0's (one KV head of tiny-moe's two), dense and OasisKV make
    every token, and OasisKV fetched blocks (the 128-token prompts turn sparse). The shared prompt
    is served from each rank's prefill cache (a hit on one rank alone would hang the other)."""
    from oasiskv.bench import serve as bench

    out = tmp_path / "fig11.json"
    args = ["--fig11", "--preset", "tiny-moe", "--tp", "2", "--device", "cpu", "--contexts", "128"]
    args += ["--max-tokens", "3", "--concurrency", "2", "--modes", "dense,oasis", "--top-k-blocks", "4"]
    assert bench.main([*args, "--fetch-cap", "0.5", "--json", str(out), "--md", "", "--png", ""]) == 0
    rep = json.loads(out.read_text())
    assert rep["tp"] == 2 and rep["contexts"]["128"]["ttft_cold_s"] > 0
    assert rep["contexts"]["128"]["prefill_cache_bytes"] > 0  # shared prompts: every rank's cache
    rows = {r["mode"]: r for r in rep["rows"]}
    assert sorted(rows) == ["dense", "oasis"]
    for mode, r in rows.items():
        assert r["status"] == "ok" and r["output_tokens"] == 6 and r["decode_tokens_per_s"] > 0, mode
    assert rows["oasis"]["fetched_bytes_per_step"] > 0 and rows["dense"]["fetched_bytes_per_step"] is None


# ------------------------------------------------------------------ KV-head replication (TP=4)
#: Two KV heads at TP=4 (the 235B's 4 at TP8, halved twice): each KV head on two ranks, each of
#: those with 2 of its 4 query heads; the MoE twin's experts 16 columns a rank.
REP_CFG = CFG.replace(num_key_value_heads=2)
REP_MOE_CFG = MOE_CFG.replace(num_key_value_heads=2)
#: The OasisKV engines compared under replication: the default selection, the current query's
#: scores beside the lookahead's on the 2-bit key codes (both score paths reduced), and the
#: two-stage codes score.
REP_MODES = {
    "dense": dict(backend="dense"),
    "oasis": dict(backend="oasis"),
    "oasis-current-codes": dict(backend="oasis", select_queries="lookahead+current", block_score="codes"),
    # Two stages: the candidates and their codes scores are both reduced over the replicas.
    "oasis-codes-staged": dict(backend="oasis", block_score="codes", score_candidates=2, sink_blocks=1),
}


def _rep_engine(model, mode: str, cls=LLMEngine):
    opts = dict(REP_MODES[mode])
    backend = opts.pop("backend")
    return cls(model, backend=backend, kv=KvConfig(**KV, **opts), **ENGINE)


def _rep_drive(eng) -> dict:
    """Tokens, finish reason, sparse steps, bytes fetched and lookahead recall of every request
    (the last two of the driver's KV heads under TP)."""
    ids = [eng.add_request(p, sp) for p, sp in spec_requests()]
    outs = eng.run_to_completion(ids)
    return {
        rid: (
            o.token_ids,
            o.finish_reason,
            o.metrics.sparse_steps,
            o.metrics.fetched_bytes_total,
            o.metrics.lookahead_recall,
        )
        for rid, o in outs.items()
    }


#: (config, mode) of the engines run at TP=4, and the blocks the score test scores.
REP_RUNS = [("dense", mode) for mode in REP_MODES] + [("moe", "oasis")]
SCORE_BLOCKS = 23


def _replicated_job(group):
    """The driver's outputs of each of ``REP_RUNS``, what every rank held, and the scores of
    :func:`_score_job` (one spawn of 4 ranks for both tests: starting them is most of the time)."""
    return {"runs": _replicated_runs(group, REP_RUNS), "scores": _score_job(group, SCORE_BLOCKS)}


@pytest.fixture(scope="module")
def replicated():
    return run_tp(_replicated_job, tp=4, timeout_s=120)


def _replicated_runs(group, runs):
    """``runs``: (config name, mode) pairs; the driver's outputs of each, every rank's shape."""
    cfgs = {"dense": REP_CFG, "moe": REP_MOE_CFG}
    models, out = {}, {}
    for name, mode in runs:
        if name not in models:
            models[name] = TPCausalLM.random(cfgs[name], seed=SEED, group=group)
        eng = _rep_engine(models[name], mode, TPLLMEngine)
        if eng.is_driver:
            try:
                got = _rep_drive(eng)
            finally:
                eng.shutdown()
        else:
            eng.worker_loop()
            got = None
        e = eng.engine
        out[name, mode] = (
            got,
            e.geo.num_kv_heads,
            e.geo.num_qo_heads,
            e.score_reduce is not None,
            pools_are_full(eng),
        )
    return out


def test_kv_head_replication_tp4_tokens_equal_tp1(replicated):
    """2 KV heads over 4 gloo ranks: each KV head on two ranks, each with half of its query heads.
    The greedy tokens equal one process's with the dense backend, with OasisKV (the long requests
    turn sparse and fetch blocks under a budget of 4 of their 10-13 blocks) and with OasisKV
    choosing by the lookahead and current queries on key codes; and the same for OasisKV on a
    Qwen3-MoE model. Every rank reduces its scores (lookahead, current, and the recall's exact
    top-K); the driver's metrics are of its own KV head."""
    ranks = [rank["runs"] for rank in replicated]
    full = {"dense": CausalLM.random(REP_CFG, seed=SEED), "moe": CausalLM.random(REP_MOE_CFG, seed=SEED)}
    for name, mode in REP_RUNS:
        want = _rep_drive(_rep_engine(full[name], mode))
        got = ranks[0][name, mode][0]
        assert got.keys() == want.keys()
        for rid in want:
            tokens, reason, sparse, fetched, recall = got[rid]
            assert (tokens, reason) == want[rid][:2], (name, mode, rid)
            assert sparse == want[rid][2], (name, mode, rid)
            if mode != "dense":  # the driver fetches for its one KV head, one process for both
                assert fetched <= want[rid][3] and (fetched > 0) == (sparse > 0), (name, mode, rid)
                assert (recall is None) == (want[rid][4] is None), (name, mode, rid)  # its head's only
        for rank in ranks:
            _, kv_heads, qo_heads, reduces, full_again = rank[name, mode]
            assert (kv_heads, qo_heads, reduces, full_again) == (1, 2, True, True), (name, mode)
        if mode != "dense":
            stats = list(got.values())
            assert sum(s[2] > 0 for s in stats) == 2 and all(s[3] > 0 for s in stats if s[2] > 0), stats


def _score_job(group, n_blocks):
    """This rank's partial scores of the blocks for its KV head's replica group (Quest and key
    codes), reduced over the replicas; the summaries, codes and queries drawn alike everywhere."""
    from oasiskv import ops

    hq, hkv, d, bs = 8, 2, 32, 16
    rep, per = group.size // hkv, hq // group.size
    gen = torch.Generator().manual_seed(5)
    k = torch.randn(n_blocks, hkv, bs, d, generator=gen)
    q = torch.randn(3, hq, d, generator=gen)
    head, qs = group.rank // rep, slice(group.rank * per, (group.rank + 1) * per)
    geo = ops.KvGeometry(per, 1, d, bs)
    k_mine = k[:, head : head + 1].contiguous()
    summaries = torch.stack([k_mine.amin(2), k_mine.amax(2)], dim=2).contiguous()
    codes, bounds = ops.empty_key_codes(geo, n_blocks), ops.empty_bounds8(geo, n_blocks)
    ids = torch.arange(n_blocks, dtype=torch.int32)
    ops.encode_blocks(geo, k_mine, summaries, ids, codes, *bounds)
    indptr = torch.tensor([0, 10, 10, n_blocks], dtype=torch.int32)
    indices = torch.arange(n_blocks, dtype=torch.int32).flip(0).contiguous()
    q_mine = q[:, qs].contiguous()
    reduce = group.replica_sum(rep)
    out = {}
    for name, partial in (
        ("quest", ops.score_blocks(geo, q_mine, summaries, indptr, indices)),
        ("codes", ops.score_blocks_codes(geo, q_mine, *bounds, codes, indptr, indices)),
    ):
        out[name] = (partial, reduce(partial))
    return out


def test_replica_score_sum_equals_tp1_scores(replicated):
    """Each of 4 ranks scores the blocks of its KV head (of 2) with its 2 of the head's 4 query
    heads; summed over the head's two ranks the scores are one process's (f32 tolerance: the sum
    is split in two), bit-identical on both replicas, and their top-K is one process's; the
    partial scores alone would pick other blocks."""
    from oasiskv import ops

    n_blocks = SCORE_BLOCKS
    ranks = [rank["scores"] for rank in replicated]
    hq, hkv, d, bs = 8, 2, 32, 16
    gen = torch.Generator().manual_seed(5)
    k = torch.randn(n_blocks, hkv, bs, d, generator=gen)
    q = torch.randn(3, hq, d, generator=gen)
    geo = ops.KvGeometry(hq, hkv, d, bs)
    summaries = torch.stack([k.amin(2), k.amax(2)], dim=2).contiguous()
    codes, bounds = ops.empty_key_codes(geo, n_blocks), ops.empty_bounds8(geo, n_blocks)
    ops.encode_blocks(geo, k, summaries, torch.arange(n_blocks, dtype=torch.int32), codes, *bounds)
    indptr = torch.tensor([0, 10, 10, n_blocks], dtype=torch.int32)
    indices = torch.arange(n_blocks, dtype=torch.int32).flip(0).contiguous()
    want = {
        "quest": ops.score_blocks(geo, q, summaries, indptr, indices),
        "codes": ops.score_blocks_codes(geo, q, *bounds, codes, indptr, indices),
    }
    top = 4
    for name, full in want.items():
        full_top = ops.topk_blocks(hkv, full, indptr, top)
        partial_differs = False
        for rank, got in enumerate(ranks):
            partial, reduced = got[name]
            head = rank // 2
            assert torch.equal(reduced, ranks[rank ^ 1][name][1]), (name, rank)  # same bits on both
            torch.testing.assert_close(reduced[:, 0], full[:, head], atol=1e-5, rtol=1.3e-6)
            assert torch.equal(ops.topk_blocks(1, reduced, indptr, top)[:, 0], full_top[:, head]), (
                name,
                rank,
            )
            own = ops.topk_blocks(1, partial, indptr, top)[:, 0]
            partial_differs |= not torch.equal(own, full_top[:, head])
        assert partial_differs, name


# -------------------------------------------------------------------------- in one process
def test_tp_config_splits_or_replicates_kv_heads():
    """tp divides the KV heads (whole heads a rank) or is a multiple of them (each head on
    tp / Hkv ranks, one KV head a rank); it must divide the query heads and the MLP."""
    assert tp_config(CFG, 2).num_key_value_heads == 2
    assert tp_config(CFG, 4).num_attention_heads == 2
    wide = CFG.replace(num_attention_heads=16, intermediate_size=256)
    assert (tp_config(wide, 8).num_key_value_heads, tp_config(wide, 8).num_attention_heads) == (1, 2)
    assert (kv_replicas(wide, 8), kv_replicas(wide, 4), kv_replicas(wide, 2)) == (2, 1, 1)
    assert valid_tp_sizes(wide) == [1, 2, 4, 8, 16]
    assert (tp_config(CFG, 8).num_key_value_heads, kv_replicas(CFG, 8)) == (1, 2)
    with pytest.raises(ConfigError, match="num_attention_heads=8") as info:
        tp_config(CFG, 16)
    assert "use tp in [1, 2, 4, 8]" in str(info.value)
    with pytest.raises(ConfigError, match="num_attention_heads=8, num_key_value_heads=4"):
        tp_config(CFG, 3)
    six = CFG.replace(num_attention_heads=12, num_key_value_heads=4, intermediate_size=192)
    with pytest.raises(ConfigError, match="num_key_value_heads=4") as info:
        tp_config(six, 6)  # divides the query heads and the MLP, but 4 KV heads on 6 ranks?
    assert "use tp in [1, 2, 4, 12]" in str(info.value)


def test_replicated_kv_shards_are_whole_kv_heads():
    """At tp=4 over 2 KV heads, ranks 0 and 1 hold KV head 0's K and V rows, ranks 2 and 3 head
    1's, and each a different quarter of the query heads; TPCausalLM.random draws them."""
    full = CausalLM.random(REP_CFG)
    d = REP_CFG.head_dim
    slots = full.hf_tensor_slots()
    for r in range(4):
        for name in ("self_attn.k_proj.weight", "self_attn.v_proj.weight"):
            t = slots["model.layers.0." + name]
            got = shard_hf_tensor(name, t, 4, r, num_kv_heads=2)
            assert torch.equal(got, t[(r // 2) * d : (r // 2 + 1) * d]), (name, r)
        q = slots["model.layers.0.self_attn.q_proj.weight"]
        assert torch.equal(
            shard_hf_tensor("self_attn.q_proj.weight", q, 4, r, 2), q[r * 2 * d : (r + 1) * 2 * d]
        )
        group = TPGroup(r, 4, torch.device("cpu"))  # no collective: no process group
        want = TPCausalLM.from_full(full, group=group).state_dict()
        got = TPCausalLM.random(REP_CFG, group=group).state_dict()
        assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
    # The benchmark's per-rank init gives the replicas of a KV head the same K and V rows.
    shards = [TPCausalLM.random_shards(REP_CFG, group=TPGroup(r, 4, torch.device("cpu"))) for r in range(4)]
    kv = [
        [s.hf_tensor_slots()["model.layers.1.self_attn." + n] for n in ("k_proj.weight", "v_proj.weight")]
        for s in shards
    ]
    assert all(torch.equal(a, b) for a, b in zip(kv[0] + kv[2], kv[1] + kv[3], strict=True))
    assert not torch.equal(kv[0][0], kv[2][0])
    model = shards[1]
    assert model.kv_replicas == 2 and model.score_reduce is not None
    with pytest.raises(TensorParallelError, match="no process group"):
        model.score_reduce(torch.zeros(3, 1))


@pytest.mark.parametrize("tp", [2, 3])
def test_shards_put_back_together_are_the_full_tensors(tp):
    """Rows of QKV and gate/up, columns of o/down, padded vocabulary rows: concatenated in rank
    order (padding dropped) they are the full tensors; norms are replicated."""
    full = CausalLM.random(CFG.replace(intermediate_size=192, num_attention_heads=12, num_key_value_heads=6))
    for name, t in full.hf_tensor_slots().items():
        parts = [shard_hf_tensor(name, t, tp, r) for r in range(tp)]
        if "embed_tokens" in name or name == "lm_head.weight":
            start, end, rows = vocab_shard(t.shape[0], tp, tp - 1)
            assert all(p.shape[0] == rows for p in parts)
            back = torch.cat(parts)[: t.shape[0]]
            assert not parts[-1][end - start :].any()
        elif name.endswith(("o_proj.weight", "down_proj.weight")):
            back = torch.cat(parts, dim=1)
        elif "norm" in name:
            assert all(p is t for p in parts)
            back = t
        else:
            back = torch.cat(parts)
        assert torch.equal(back, t), name
    # TPCausalLM.random draws the shards of CausalLM.random's model
    for r in range(tp):
        group = TPGroup(r, tp, torch.device("cpu"))
        want = TPCausalLM.from_full(full, group=group).state_dict()
        got = TPCausalLM.random(full.config, group=group).state_dict()
        assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)


def test_tp1_model_is_the_causal_lm():
    """Without a group the shard is the whole model: the same logits, bit for bit."""
    ids = torch.tensor(prompt(40, 0))
    pos = torch.arange(len(ids))
    want, _ = CausalLM.random(CFG, seed=SEED)(ids, pos, dense_causal_attn())
    got, _ = TPCausalLM.random(CFG, seed=SEED)(ids, pos, dense_causal_attn())
    assert torch.equal(got, want)


def test_tp_engine_refuses_what_it_cannot_split_yet():
    """EAGLE-3 and captured steps are refused with tp > 1 before any collective; a model sharded
    for another rank is refused too."""
    model = TPCausalLM(CFG, group=TPGroup(0, 2, torch.device("cpu")))  # no collective is run
    with pytest.raises(NotImplementedError, match="EAGLE-3"):
        TPLLMEngine(model, drafter="eagle3")
    with pytest.raises(ConfigError, match="cuda_graph"):
        TPLLMEngine(model, cuda_graph=True)
    with pytest.raises(ConfigError, match="shard 0 of 2 but this is rank 1 of 2"):
        TPLLMEngine(model, group=TPGroup(1, 2, torch.device("cpu")))
    # A model that is not a TPCausalLM is the whole model: shard 0 of 1, for a group of one only.
    with pytest.raises(ConfigError, match="shard 0 of 1 but this is rank 0 of 2"):
        TPLLMEngine(CausalLM.random(CFG, seed=SEED), group=TPGroup(0, 2, torch.device("cpu")))
