"""Disaggregated prefill and decode through the ``oasis-rt`` daemon (``oasiskv.disagg``).

The loopback test runs three processes: the daemon (the cargo-built binary), the prefill worker
(``tests/support/disagg_worker.py``) and the decode engine (this one). Greedy tokens through the daemon
equal dense when the budget covers the context, and the single-process OasisKV engine's with a
small budget; bytes at admission are counted from the protocol's frames. Faults: a daemon killed
or stalled mid-decode fails only the requests whose KV it holds, within the timeout; a released
request fails alone; a client without the token is refused.
"""

from __future__ import annotations

import dataclasses
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from oasiskv import KvConfig, LLMEngine, disagg, errors
from oasiskv._core import RtClient
from oasiskv.disagg import (
    ADMISSIONS,
    PrefillWorker,
    StagedRequest,
    kv_source_url,
    parse_kv_source,
    split_kv_source,
)
from oasiskv.models.transformer import CausalLM
from support.configs import TINY_QWEN3
from support.fakes import pools_are_full, prompt, tiny
from support.rtd import TRANSPORTS, Daemon
from support.staged import (
    BIG,
    SEEDS,
    SMALL,
    M,
    P,
    ReadLog,
    all_released,
    params,
    reference,
    run_batch,
    staged_engine,
    staged_small,
)

# Private names read here: ``RtClient`` from ``oasiskv._core`` (the daemon's client; no public
# re-export) and the remote source's own steps, each what its test checks:
# ``_rows_for``/``_forget_row``/``_by_req`` (the bounded host pool's reads and evictions, in
# order, and the daemon id of a request), ``_prefetch`` (the read-ahead queue drained),
# ``Engine._flush_deferred`` (named in a docstring: the deferred fetch of a step's misses).

#: The prefill worker runs as ``python -m support.disagg_worker`` from ``tests/``.
TESTS = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def model():
    return tiny()


def _stage_in_worker_process(addr: str, jobs: list[dict], token: str | None = None) -> list[StagedRequest]:
    args = [sys.executable, "-m", "support.disagg_worker", addr, json.dumps(jobs)] + (
        [token] if token else []
    )
    out = subprocess.run(args, capture_output=True, text=True, timeout=300, cwd=TESTS)
    assert out.returncode == 0, out.stderr[-3000:]
    return [StagedRequest.from_json(line) for line in out.stdout.splitlines()]


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("transfer", ["partial", "full"])
def test_loopback_three_processes(model, transfer, transport):
    with Daemon(transport=transport) as d:
        jobs = [{"prompt_len": P, "prompt_seed": 7, "first_query": "first_token", **BIG}]
        jobs += [{"prompt_len": P, "prompt_seed": s, "first_query": "prompt", **SMALL} for s in SEEDS]
        big, *small = _stage_in_worker_process(d.url, jobs)
        assert big.prompt_len == P and big.first_query == "first_token" and big.draft is not None
        assert all(h.request_id != big.request_id for h in small)

        # Budget covering the context: the daemon's tokens are dense's.
        eng = LLMEngine(
            model, kv=KvConfig.fast(**BIG), drafter="ngram", kv_source=d.url, kv_transfer=transfer
        )
        assert eng.kv_source.transport == eng.kv_source.client.transport == transport
        (got,) = run_batch(eng, [lambda e: e.add_staged_request(big.to_json(), params())])
        (dense,) = reference(model, KvConfig.fast(**BIG), "dense", [big.prompt])
        assert got.finish_reason == "length", got.error
        assert got.token_ids == dense.token_ids
        assert got.metrics.network_admission_bytes > 0 and got.metrics.network_fetched_bytes == 0
        assert pools_are_full(eng)

        # A small budget: the single-process OasisKV engine's tokens, two requests in one batch.
        # Reads after the step, whose submissions the ReadLog sees; the default, in-step reads,
        # decode the same tokens (test_disagg_in_step.py).
        eng = staged_engine(model, d, kv_transfer=transfer, kv_in_step_reads=False)
        rec = eng.kv_source.coord = ReadLog(eng.kv_source)
        outs = run_batch(eng, [lambda e, h=h: e.add_staged_request(h, params()) for h in small])
        refs = reference(model, KvConfig.fast(**SMALL), "oasis", [h.prompt for h in small])
        for o, ref, h in zip(outs, refs, small, strict=True):
            assert o.finish_reason == "length", o.error
            assert o.token_ids == ref.token_ids
            assert o.metrics.lookahead_recall == ref.metrics.lookahead_recall
            assert o.metrics.fetched_bytes_total == ref.metrics.fetched_bytes_total  # PCIe gathers
            m = o.metrics
            if transfer == "partial":
                assert 0 < m.network_admission_bytes < h.kv_bytes
                assert m.network_fetched_bytes > 0  # the selection drifted to blocks not sent yet
            else:
                assert m.network_admission_bytes > h.kv_bytes and m.network_fetched_bytes == 0
        st = eng.kv_source.stats
        # After the requests end nothing is left to read; a full transfer never had anything.
        assert eng.kv_source.idle
        if transfer == "partial":
            # Misses aggregated per layer across requests, each block-head read once: at admission
            # (each head's first working set) and after it (fetched_entries, with the prefetches
            # the coordinator chose, which the log does not see).
            assert len(rec.keys) == len(set(rec.keys))
            assert len(rec.keys) + st.prefetched_entries >= st.fetched_entries > 0
            assert all(head >= 0 for *_, head in rec.keys)
            cs = eng.kv_source.coordinator_stats
            # Every block-head sent landed once (none read twice, none failed): a prefetch a step
            # took over while queued was sent again by the step, not read twice, and one queued
            # when its request ended was not sent.
            unsent = cs["prefetch_taken"] + cs["prefetch_cancelled"]
            assert cs["sent_entries"] - unsent == cs["entries"] and cs["failed_entries"] == 0
            assert cs["entries"] - cs["prefetched_entries"] <= len(rec.keys)
            assert st.peak_cached_bytes < sum(h.kv_bytes for h in small)
        else:
            assert rec.keys == [] or all(head == -1 for *_, head in rec.keys)
            assert st.peak_cached_bytes == sum(h.kv_bytes for h in small)
        assert st.cached_bytes == 0 and st.failures == 0
        assert pools_are_full(eng)
        assert all_released(eng.kv_source.client)  # every request released


def _model_16k(num_kv_heads: int, context: int) -> CausalLM:
    cfg = TINY_QWEN3.replace(num_key_value_heads=num_kv_heads, max_position_embeddings=context + 64)
    return CausalLM.random(cfg, seed=1)


def _admission_vs_full(context: int, num_kv_heads: int) -> dict:
    """Stage one ``context``-token prompt twice at K = 128 blocks of 16 tokens with the union
    admission set (whole blocks); admit one copy partially and one fully; the wire bytes of each
    admission and the protocol's own accounting."""
    model = _model_16k(num_kv_heads, context)
    kv = KvConfig.fast(block_size=16, top_k_blocks=128)
    chunk = 2048  # prefill chunks (an 8K chunk's causal scores would take GBs)
    ids = torch.randint(0, 301, (context,), generator=torch.Generator().manual_seed(0)).tolist()
    out = {}
    with Daemon(memory="1GiB") as d:
        worker = PrefillWorker(model, kv, d.addr, admission="union", max_num_batched_tokens=chunk)
        for transfer in ("partial", "full"):
            h = worker.prefill(ids)
            eng = LLMEngine(model, kv=kv, kv_source=d.url, kv_transfer=transfer, max_num_batched_tokens=chunk)
            (o,) = run_batch(eng, [lambda e, h=h: e.add_staged_request(h, params(2))])
            assert o.finish_reason == "length", o.error
            out[transfer] = o.metrics.network_admission_bytes
            out["handle"] = h
    h = out["handle"]
    layers, hk, b, dim, elem, nb, fmt = h.geometry
    assert fmt == disagg.KV_FORMAT_PLAIN
    block, row = 2 * hk * b * dim * elem, hk * 2 * dim * elem
    sections = 1 + (1 + 10 + 4 + 0) + (1 + 11 + 4 + layers * 4 * dim * elem)  # meta length below
    # FetchAdmission: request frame 4 + 8 + 13; reply 4 + 8 + geometry 14 + one run of every
    # block's summary per layer + the union's blocks + the sections.
    partial = 25 + 12 + 14 + (4 + layers * (10 + nb * row)) + (4 + h.admission_blocks * (6 + block))
    meta = out["partial"] - partial - sections
    assert 50 < meta < 600, meta  # the JSON meta section's length: everything else is accounted
    out["ratio"] = out["full"] / out["partial"]
    out["kv_bytes"] = h.kv_bytes
    # A full transfer moves every block: the KV, plus its key and reply entry (16 + 6 bytes per
    # block), the frames' headers and the sections.
    assert h.kv_bytes < out["full"] < h.kv_bytes + layers * nb * 22 + 65536
    # The bound: the union holds at least K blocks per layer and every summary row crosses.
    union = h.admission_blocks / layers
    assert union >= 128
    bound = (nb * block) / (union * block + nb * row)
    assert out["ratio"] == pytest.approx(bound, rel=0.02)
    return out


def test_bytes_at_admission_16k(model):
    """16K context, K = 128 blocks of 16, one KV head (a random model's heads pick unrelated
    blocks; with one head the union is exactly K, as when a real model's heads agree). The
    union (K of 1024 blocks: 1/8 of the KV) plus every summary row (1/16) bound the reduction
    at 1 / (1/8 + 1/16) = 5.3x: >= 6x is out of reach at 16K (it needs >= 24K: test below)."""
    out = _admission_vs_full(16384, num_kv_heads=1)
    print(f"16K: admission {out['partial']} B, full {out['full']} B, {out['ratio']:.2f}x")
    assert out["ratio"] > 5.0


def test_per_head_admission_reads_only_each_heads_blocks():
    """With 4 KV heads a random model's heads pick unrelated blocks, so the union admission set
    moves most of the KV. The default admission (``"heads"``) stages no blocks: the decode side
    reads each head's top-K block-heads when it selects, so admission stays near the one-head
    bound 1 / (1/8 + 1/16) = 5.3x below a full transfer, with the same tokens as the union's."""
    model = _model_16k(4, 16384)
    kv = KvConfig.fast(block_size=16, top_k_blocks=128)
    chunk = 2048
    ids = torch.randint(0, 301, (16384,), generator=torch.Generator().manual_seed(0)).tolist()
    out = {}
    with Daemon(memory="1GiB") as d:
        for admission in ADMISSIONS:
            worker = PrefillWorker(model, kv, d.addr, admission=admission, max_num_batched_tokens=chunk)
            h = worker.prefill(ids)
            eng = LLMEngine(
                model, kv=kv, kv_source=d.url, kv_transfer="partial", max_num_batched_tokens=chunk
            )
            (o,) = run_batch(eng, [lambda e, h=h: e.add_staged_request(h, params(3))])
            assert o.finish_reason == "length", o.error
            out[admission] = (o.metrics.network_admission_bytes, list(o.token_ids), h)
            worker.close()
    heads_bytes, heads_tokens, h = out["heads"]
    union_bytes, union_tokens, hu = out["union"]
    layers = h.geometry[0]
    assert h.admission_blocks == 0  # 16384 tokens fill their blocks: no local block to stage
    assert hu.admission_blocks > 2 * 128 * layers  # the heads' sets differ: the union is large
    ratio = h.kv_bytes / heads_bytes
    print(f"admission: heads {heads_bytes} B ({ratio:.2f}x below full), union {union_bytes} B")
    assert 5.0 < ratio < 5.34
    assert union_bytes > 1.8 * heads_bytes
    assert heads_tokens == union_tokens


@pytest.mark.slow
def test_bytes_at_admission_32k_are_6x_below_full():
    out = _admission_vs_full(32768, num_kv_heads=1)
    print(f"32K: admission {out['partial']} B, full {out['full']} B, {out['ratio']:.2f}x")
    assert out["ratio"] >= 6.0


def test_a_client_without_the_token_is_refused(model):
    with Daemon(token="s3cret") as d:
        with pytest.raises(errors.RemoteAuthError):
            LLMEngine(model, kv=KvConfig.fast(**SMALL), kv_source=d.url)
        with pytest.raises(errors.RemoteAuthError):
            PrefillWorker(model, KvConfig.fast(**SMALL), d.addr, token="wrong")
        worker = PrefillWorker(model, KvConfig.fast(**SMALL), d.addr, token="s3cret")
        h = worker.prefill(prompt(P, 3))
        eng = LLMEngine(model, kv=KvConfig.fast(**SMALL), kv_source=d.url, kv_token="s3cret")
        (o,) = run_batch(eng, [lambda e: e.add_staged_request(h, params(4))])
        assert o.finish_reason == "length"


def test_a_staged_request_takes_only_its_working_set_on_the_gpu(model):
    """Admitted sparse (``Runtime.admit_sparse``): K + 1 pages, never the prompt's dense ones, so
    two 300-token requests decode together in a GPU pool of two working sets."""
    k = SMALL["top_k_blocks"]
    with Daemon() as d:
        handles = staged_small(model, d, seeds=(3, 5, 3, 5))
        free = LLMEngine(model, kv=KvConfig.fast(**SMALL), drafter="ngram", kv_source=d.url)
        want = run_batch(free, [lambda e, h=h: e.add_staged_request(h, params()) for h in handles[:2]])
        tight = LLMEngine(
            model,
            kv=KvConfig.fast(**SMALL, num_gpu_pages=2 * (k + 1), num_host_blocks=64),
            drafter="ngram",
            kv_source=d.url,
        )
        with pytest.raises(errors.OutOfBlocksError):
            tight.add_request(prompt(P, 3), params())  # dense, it needs the prompt's pages
        ids = [tight.add_staged_request(h, params()) for h in handles[2:]]
        tight.step()
        assert tight.num_running == 2
        assert tight.engine.runtime.reserved[0] == 2 * (k + 1)
        assert tight.engine.runtime.pool_sizes[0] == 2 * (k + 1)
        tight.engine.runtime.check_invariants()
        out = tight.run_to_completion(ids)
        assert [out[i].token_ids for i in ids] == [o.token_ids for o in want]
        assert all(out[i].finish_reason == "length" for i in ids)
        assert pools_are_full(tight)


@pytest.mark.parametrize("transfer", ["partial", "full"])
def test_prompts_at_the_block_and_threshold_edges_decode_the_single_process_tokens(model, transfer):
    """Prompt lengths at the edges: a single block and a partial one, one short of, at and one
    past the threshold (64), whole blocks (288) and a partial last block (300). Staged with the
    single-process engine's first query, each decodes that engine's greedy tokens, in one batch
    (a short one densely there, sparsely here over a budget that holds its context)."""
    lengths = (16, 40, 63, 64, 65, 288, 300)
    with Daemon() as d:
        worker = PrefillWorker(model, KvConfig.fast(**SMALL), d.addr, first_query="prompt")
        handles = [worker.prefill(prompt(n, n)) for n in lengths]
        worker.close()
        eng = staged_engine(model, d, kv_transfer=transfer)
        outs = run_batch(eng, [lambda e, h=h: e.add_staged_request(h, params()) for h in handles])
        refs = reference(model, KvConfig.fast(**SMALL), "oasis", [prompt(n, n) for n in lengths])
        for n, o, r in zip(lengths, outs, refs, strict=True):
            assert o.finish_reason == "length", (n, o.error)
            assert o.token_ids == r.token_ids, n
        assert pools_are_full(eng)
        eng.kv_source.close()


def test_a_bounded_host_pool_decodes_as_the_unbounded_one(model):
    """``kv_cache_blocks=C`` below the context: the same greedy tokens as the unbounded partial
    run, at most ``C`` cached blocks (plus the partial last block, which the request writes) per
    request and layer in the host pool, no eviction of a block the layer being gathered reads, and
    a block-head read over the wire again only after its eviction."""
    g = model.config
    hk, layers = g.num_key_value_heads, g.num_hidden_layers
    c = hk * SMALL["top_k_blocks"]  # the floor: 8 cached blocks of the 19 staged
    b = SMALL["block_size"]
    with Daemon() as d:
        both = staged_small(model, d, seeds=(3, 5, 3, 5))  # a run releases what it decoded
        free = LLMEngine(model, kv=KvConfig.fast(**SMALL), drafter="ngram", kv_source=d.url)
        want = run_batch(free, [lambda e, h=h: e.add_staged_request(h, params()) for h in both[:2]])
        handles = both[2:]
        # Host rows for two bounded requests (C + ceil(L / b) - floor(P / b) each); the
        # unbounded reservation (ceil(L / b) = 21 rows each) would not fit both.
        rows = c + math.ceil((P + M - 1) / b) - P // b
        eng = LLMEngine(
            model,
            kv=KvConfig.fast(**SMALL, num_host_blocks=2 * rows),
            drafter="ngram",
            kv_source=d.url,
            kv_cache_blocks=c,
        )
        src = eng.kv_source
        rec = src.coord = ReadLog(src)
        events: list = []  # ("read", key) and ("evict", daemon id, logical), in order
        planned: set = set()
        rows_for, forget = src._rows_for, src._forget_row

        def rows_for_logged(st, logicals, pinned):
            planned.clear()
            planned.update(pinned)
            return rows_for(st, logicals, pinned)

        def forget_logged(st, row):
            ((_, logical),) = src.coord.owners([row])
            assert logical not in planned, "evicted a block the gather reads"
            events.append(("evict", st.daemon_id, logical))
            forget(st, row)

        def read_logged(keys):
            events.extend(("read", k) for k in keys)
            ReadLog.on_read(rec, keys)

        src._rows_for, src._forget_row, rec.on_read = rows_for_logged, forget_logged, read_logged
        ids = [eng.add_staged_request(h, params()) for h in handles]
        eng.step()
        assert eng.num_running == 2  # both admitted at once within the bounded host budget
        rt = eng.engine.runtime
        assert rt.reservation(P, M, sparse=True, cache_blocks=c)[1] == rows
        assert rt.reservation(P, M, sparse=True)[1] == 21 and 2 * 21 > 2 * rows
        out = eng.run_to_completion(ids)
        got = [out[i] for i in ids]
        assert [o.token_ids for o in got] == [o.token_ids for o in want]
        assert all(o.finish_reason == "length" for o in got), [o.error for o in got]
        st, unbounded = src.stats, free.kv_source.stats
        entry = 2 * b * g.head_dim * eng.engine.dtype.itemsize
        assert st.evicted_blocks > 0 and st.failures == 0
        assert st.peak_cached_bytes <= len(handles) * (c + 1) * entry * hk * layers
        assert st.peak_cached_bytes < unbounded.peak_cached_bytes
        assert st.fetched_entries > unbounded.fetched_entries  # evicted blocks come back
        # Wire counts: a block-head is read again only after its block was evicted.
        reads: dict = {}
        evictions: dict = {}
        for ev in events:
            if ev[0] == "evict":
                evictions[ev[1:]] = evictions.get(ev[1:], 0) + 1
                continue
            rid, layer, logical, head = ev[1]
            n = reads.get(ev[1], 0)
            assert n <= evictions.get((rid, logical), 0), f"block-head {ev[1]} read twice while cached"
            reads[ev[1]] = n + 1
        assert any(n > 1 for n in reads.values())
        assert st.cached_bytes == 0
        assert pools_are_full(eng)
        rt.check_invariants()
        assert all_released(src.client)  # every request released


def test_refusals(model):
    with Daemon() as d:
        for bad in ("http://x:1", "oasis-rt://nohost", "oasis-rt://h:99999", "oasis-rt+ucx://nohost", 7):
            with pytest.raises(errors.ConfigError):
                LLMEngine(model, kv=KvConfig.fast(**SMALL), kv_source=bad)
        with pytest.raises(errors.ConfigError, match="backend='oasis'"):
            LLMEngine(model, kv=KvConfig.fast(**SMALL), backend="dense", kv_source=d.url)
        with pytest.raises(errors.ConfigError, match=r"KvConfig\.fast\(\)"):  # key codes are not staged yet
            LLMEngine(model, kv=KvConfig(**SMALL), kv_source=d.url)
        # A captured step cannot follow kv_cache_blocks' moves: refused where graphs run (a GPU, by
        # default); on the CPU graphs do not apply, so the combination stands.
        cpu = LLMEngine(model, kv=KvConfig.fast(**SMALL), kv_source=d.url, kv_cache_blocks=64)
        assert not cpu.cuda_graphs
        cpu.kv_source.close()
        with pytest.raises(errors.ConfigError, match="kv_transfer"):
            LLMEngine(model, kv=KvConfig.fast(**SMALL), kv_source=d.url, kv_transfer="some")
        with pytest.raises(errors.ConfigError, match="kv_source"):
            LLMEngine(model, kv=KvConfig.fast(**SMALL)).add_staged_request("{}")
        with pytest.raises(errors.ConfigError, match="kv_cache_blocks"):
            LLMEngine(model, kv=KvConfig.fast(**SMALL), kv_source=d.url, kv_cache_blocks=7)  # < 2 heads x K 4
        with pytest.raises(errors.ConfigError, match="kv_transfer='partial'"):
            LLMEngine(
                model, kv=KvConfig.fast(**SMALL), kv_source=d.url, kv_transfer="full", kv_cache_blocks=8
            )
        with pytest.raises(errors.ConfigError, match="needs kv_source"):
            LLMEngine(model, kv=KvConfig.fast(**SMALL), kv_cache_blocks=8)
        with pytest.raises(errors.ConfigError, match="kv_prefetch .* needs kv_source"):
            LLMEngine(model, kv=KvConfig.fast(**SMALL), kv_prefetch=4)
        with pytest.raises(errors.ConfigError, match="decode_prefetch must be an int >= 0"):
            LLMEngine(model, kv=KvConfig.fast(**SMALL), kv_source=d.url, kv_prefetch=-1)
        knob = LLMEngine(model, kv=KvConfig.fast(**SMALL), kv_source=d.url, kv_prefetch=0)
        assert knob.kv_source.decode_prefetch == 0  # LLMEngine(kv_prefetch=) sets the source's budget
        knob.kv_source.close()
        eng = LLMEngine(model, kv=KvConfig.fast(**SMALL), kv_source=d.url)
        with pytest.raises(errors.ConfigError, match="StagedRequest"):
            eng.add_staged_request('{"request_id": 1}')
        # A handle staged with another block size: the request fails, the engine goes on.
        worker = PrefillWorker(model, KvConfig.fast(block_size=8, top_k_blocks=4), d.addr)
        h = worker.prefill(prompt(P, 3))
        (o,) = run_batch(eng, [lambda e: e.add_staged_request(h, params(4))])
        assert o.finish_reason == "error" and "geometry" in o.error
        assert pools_are_full(eng)
        # Too short to turn sparse: decoded sparsely from its first step over a budget (4 + 1
        # blocks of 16) that holds its whole context, so its tokens are the single-process
        # engine's, which attends densely below the threshold.
        worker = PrefillWorker(model, KvConfig.fast(**SMALL), d.addr, first_query="prompt")
        h = worker.prefill(prompt(40, 3))
        (o,) = run_batch(eng, [lambda e: e.add_staged_request(h, params())])  # 63 tokens at most
        (ref,) = reference(model, KvConfig.fast(**SMALL), "oasis", [prompt(40, 3)])
        assert o.finish_reason == "length", o.error
        assert o.token_ids == ref.token_ids and not ref.metrics.sparse_since_token
        assert pools_are_full(eng)
        # Below a threshold raised past the budget, where the sparse steps would attend to less
        # than the dense ones: refused at admission, with the fix.
        high = LLMEngine(model, kv=KvConfig.fast(**{**SMALL, "sparse_threshold": 200}), kv_source=d.url)
        h = worker.prefill(prompt(150, 3))
        (o,) = run_batch(high, [lambda e: e.add_staged_request(h, params(4))])
        assert (
            o.finish_reason == "error" and "sparse budget of 80" in o.error and "sparse_threshold" in o.error
        )
        assert pools_are_full(high)
        high.kv_source.close()
        # An unknown request id.
        h = worker.prefill(prompt(P, 3))
        assert worker.release(h.request_id) > 0
        bogus = StagedRequest.from_json(h.to_json())
        (o,) = run_batch(eng, [lambda e: e.add_staged_request(bogus, params(4))])
        assert o.finish_reason == "error" and "unknown_request" in o.error
        assert pools_are_full(eng)
    assert parse_kv_source("oasis-rt://127.0.0.1:7470") == "127.0.0.1:7470"
    assert parse_kv_source("[::1]:7470") == "[::1]:7470"
    assert split_kv_source("oasis-rt+ucx://127.0.0.1:7470") == ("ucx", "127.0.0.1:7470")
    assert split_kv_source("h:1") == ("tcp", "h:1") and kv_source_url("h:1") == "oasis-rt://h:1"
    assert kv_source_url("oasis-rt+ucx://h:1") == "oasis-rt+ucx://h:1"


def test_the_worker_frees_its_pages_and_stages_the_union(model):
    with Daemon() as d:
        kv = KvConfig.fast(**SMALL)
        # The default admission set holds the partial last block alone (the local block).
        hw = PrefillWorker(model, kv, d.addr, first_query="prompt")
        heads = hw.prefill(prompt(P, 3))
        assert heads.admission_blocks == heads.geometry[0] and P % 16
        hw.release(heads.request_id)
        hw.close()
        worker = PrefillWorker(model, kv, d.addr, first_query="prompt", admission="union")
        h = worker.prefill(prompt(P, 3))
        rt = worker.engine.runtime
        assert rt.num_requests == 0 and rt.num_free == rt.pool_sizes  # its pages are back
        layers, hk, b, dim, elem, nb, fmt = h.geometry
        assert (layers, hk, b, nb, fmt) == (2, 2, 16, math.ceil(P / 16), disagg.KV_FORMAT_PLAIN)
        # Per layer: the union of two heads' top-4 (4..8 blocks) and the partial last block.
        assert layers * 5 <= h.admission_blocks <= layers * 9
        s = worker.client.stats()
        assert s["staged_blocks"] == layers * nb and s["summary_rows"] == layers * nb
        assert h.staged_bytes == s["used_bytes"] > h.kv_bytes
        assert worker.release(h.request_id) == s["used_bytes"]
        assert StagedRequest.from_json(h.to_json()) == h
        with pytest.raises(errors.ConfigError, match="first_query"):
            PrefillWorker(model, kv, d.addr, first_query="draft")
        with pytest.raises(errors.ConfigError, match="admission"):
            PrefillWorker(model, kv, d.addr, admission="all")
        with pytest.raises(errors.ConfigError, match="stage_connections"):
            PrefillWorker(model, kv, d.addr, stage_connections=0)
        # One connection or three sending the layers: the same bytes staged.
        for conns in (1, 3):
            w = PrefillWorker(
                model, kv, d.addr, first_query="prompt", admission="union", stage_connections=conns
            )
            h2 = w.prefill(prompt(P, 3))
            assert (h2.staged_bytes, h2.admission_blocks) == (h.staged_bytes, h.admission_blocks)
            assert w.client.stats()["staged_blocks"] == layers * nb
            w.release(h2.request_id)
            w.close()
        with pytest.raises(errors.ConfigError, match="block_score"):
            PrefillWorker(model, KvConfig.fast(block_score="codes"), d.addr)


class Counting:
    """The admission's daemon client, counting ``fetch_admission`` calls."""

    def __init__(self, inner) -> None:
        self.inner, self.admissions = inner, 0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def fetch_admission(self, *args):
        self.admissions += 1
        return self.inner.fetch_admission(*args)


@pytest.mark.parametrize("small_frames", [False, True], ids=["frames", "small-frames"])
@pytest.mark.parametrize("transfer", ["partial", "full"])
def test_staged_data_is_read_ahead_off_the_decode_loop(model, transfer, small_frames, monkeypatch):
    """While a local request decodes, the waiting staged requests' admission data (summaries,
    sections; with ``"partial"`` each KV head's first working set selected on the CPU) is read in
    a background thread on its own connection, so the decode loop's connection reads none of it;
    their blocks (``"full"``: every block; ``"partial"``: the first working sets read ahead) are
    streamed by the coordinator in the background, and nothing else is read for them until they
    decode. Tokens and admission bytes equal those of an engine that reads at admission
    (``prefetch_depth = 0``). ``small_frames``: one layer per admission reply and one entry per
    read, so that the read ahead spreads a request's units over its two connections."""
    if small_frames:
        monkeypatch.setattr(disagg.wire, "BULK_FRAME_BYTES", 1)
    with Daemon() as d:
        handles = staged_small(model, d) + staged_small(model, d)  # the same prompts twice
        runs = {}
        for depth, hs in ((0, handles[:2]), (2, handles[2:])):
            # Reads after the step, whose submissions the ReadLog sees (in-step reads go to the
            # step reader: test_disagg_in_step.py).
            eng = staged_engine(model, d, kv_transfer=transfer, kv_in_step_reads=False)
            eng.kv_source.prefetch_depth = depth
            eng.kv_source.decode_prefetch = 0  # the decode-time reads compared: the steps' own alone
            rec = eng.kv_source.client = Counting(eng.kv_source.client)
            rec.log = eng.kv_source.coord = ReadLog(eng.kv_source)
            local = eng.add_request(prompt(P, 11), params())  # running while the staged ones wait
            eng.step()
            ids = [eng.add_staged_request(h, params()) for h in hs]
            out = eng.run_to_completion([local, *ids])
            runs[depth] = ([out[i] for i in [local, *ids]], rec, eng.kv_source.stats)
            assert not eng.kv_source._prefetch  # every read ahead was taken (or dropped)
            eng.kv_source.close()
        (plain, rec0, stats0), (ahead, rec2, stats2) = runs[0], runs[2]
        for a, b in zip(plain, ahead, strict=True):
            assert a.finish_reason == b.finish_reason == "length", (a.error, b.error)
            assert a.token_ids == b.token_ids
        for a, b in zip(plain[1:], ahead[1:], strict=True):
            assert a.metrics.network_admission_bytes == b.metrics.network_admission_bytes > 0
        assert rec0.admissions > 0 and rec2.admissions == 0
        if transfer == "full":
            for rec in (rec0, rec2):  # every block, whole, streamed; nothing read at decode
                assert rec.log.keys == rec.log.streamed and rec.log.keys
                assert all(head == -1 for *_, head in rec.log.keys)
            assert sorted(k[1:] for k in rec0.log.keys) == sorted(k[1:] for k in rec2.log.keys)
        else:
            # Each head's first working set was read ahead too (selected by the CPU twins from the
            # staged summaries and query): the loop read only decode-time misses.
            # The same entries; their bytes on the wire may differ by a frame header or so (32
            # bytes in about 125 KB were seen), since how a step's misses split into frames
            # depends on which connection an admission's stream still holds.
            st0, st2 = (sum(o.metrics.network_fetched_bytes for o in r[1:]) for r in (plain, ahead))
            assert stats0.fetched_entries == stats2.fetched_entries
            assert st0 > 0 and abs(st0 - st2) <= 0.005 * st0
            assert rec0.log.streamed == [] and rec2.log.streamed
            assert len(rec2.log.keys) - len(rec2.log.streamed) == stats2.fetched_entries < len(rec0.log.keys)


@pytest.mark.parametrize("conns", [1, 2])
def test_a_daemon_out_of_budget_refuses_and_keeps_nothing(model, conns):
    """A daemon whose budget cannot hold the prompt's KV: the worker's staging (over one or two
    connections, from threads) raises the daemon's typed refusal, and nothing of it stays."""
    with Daemon(memory="64KiB") as d:
        w = PrefillWorker(model, KvConfig.fast(**SMALL), d.addr, stage_connections=conns)
        with pytest.raises(errors.RemoteError) as e:
            w.prefill(prompt(P, 3))
        assert e.value.code in ("busy", "out_of_memory")
        s = w.client.stats()
        assert s["live_requests"] == 0 and s["used_bytes"] == 0
        w.close()


@pytest.mark.parametrize("transfer", ["partial", "full"])
def test_the_source_is_idle_once_nothing_is_left_to_read(model, transfer):
    """``RemoteKvSource.idle`` (the engine may then capture CUDA graphs): a running partial
    transfer still has block-heads in the daemon; a full one has none after its admission."""
    with Daemon() as d:
        (h,) = staged_small(model, d, seeds=(3,))
        eng = LLMEngine(
            model, kv=KvConfig.fast(**SMALL), drafter="ngram", kv_source=d.url, kv_transfer=transfer
        )
        assert eng.kv_source.idle  # nothing staged is live yet
        rid = eng.add_staged_request(h, params())
        eng.step()  # admitted, first token
        assert eng.kv_source.idle == (transfer == "full")
        eng.run_to_completion([rid])
        assert eng.kv_source.idle


@pytest.mark.parametrize("transfer", ["partial", "full"])
def test_corrupt_sections_fail_the_request_not_the_engine(model, transfer):
    """A daemon that hands back an unreadable meta section or a query section of the wrong size
    (a bad or hostile peer): the request fails with a ConfigError's message, the engine goes on."""
    with Daemon() as d:
        bad_meta, bad_query, good = staged_small(model, d, seeds=(3, 5, 7))
        c = RtClient(d.url)
        meta = json.dumps({"format": 1, "prompt_len": len(bad_query.prompt), "dtype": "float32"}).encode()
        c.stage_admission(bad_meta.request_id, [], {"oasis/meta": b"{not json", "oasis/query": b""})
        c.stage_admission(bad_query.request_id, [], {"oasis/meta": meta, "oasis/query": b"\0" * 12})
        c.close()
        eng = LLMEngine(
            model, kv=KvConfig.fast(**SMALL), drafter="ngram", kv_source=d.url, kv_transfer=transfer
        )
        outs = run_batch(
            eng, [lambda e, h=h: e.add_staged_request(h, params()) for h in (bad_meta, bad_query, good)]
        )
        assert outs[0].finish_reason == "error" and "meta" in outs[0].error
        assert outs[1].finish_reason == "error" and "query section" in outs[1].error
        assert outs[2].finish_reason == "length", outs[2].error
        assert pools_are_full(eng)


@pytest.mark.parametrize("transfer", ["partial", "full"])
def test_staged_requests_speculate_losslessly(model, transfer):
    """``kv_source`` with ``speculative=True``: accepted drafts are stored in the request's own
    blocks (rows it writes itself, never the daemon's). With a budget covering the context the
    tokens are dense's; with a small one the single-process speculative engine's, which equal
    its non-speculative tokens' only where attention is exact, so that is not asserted."""
    with Daemon() as d:
        jobs = [{"prompt_len": P, "prompt_seed": 7, "first_query": "first_token", **BIG}]
        jobs += [{"prompt_len": P, "prompt_seed": s, "first_query": "prompt", **SMALL} for s in SEEDS]
        big, *small = _stage_in_worker_process(d.url, jobs)
        remote = {"kv_source": d.url, "kv_transfer": transfer}
        eng = LLMEngine(model, kv=KvConfig.fast(**BIG), drafter="ngram", speculative=True, **remote)
        (got,) = run_batch(eng, [lambda e: e.add_staged_request(big.to_json(), params())])
        (dense,) = reference(model, KvConfig.fast(**BIG), "dense", [big.prompt])
        assert got.finish_reason == "length", got.error
        assert got.token_ids == dense.token_ids
        assert eng.spec_stats["accepted"] > 0, eng.spec_stats  # the n-gram drafts the repeats
        assert pools_are_full(eng)

        eng = LLMEngine(model, kv=KvConfig.fast(**SMALL), drafter="ngram", speculative=True, **remote)
        outs = run_batch(eng, [lambda e, h=h: e.add_staged_request(h, params()) for h in small])
        local = LLMEngine(
            model, kv=KvConfig.fast(**SMALL), backend="oasis", drafter="ngram", speculative=True
        )
        refs = run_batch(local, [lambda e, h=h: e.add_request(h.prompt, params()) for h in small])
        for o, ref in zip(outs, refs, strict=True):
            assert o.finish_reason == "length", o.error
            assert o.token_ids == ref.token_ids
        assert eng.spec_stats == local.spec_stats
        assert pools_are_full(eng)
        assert all_released(eng.kv_source.client)


def test_misses_are_fetched_after_the_step_s_compute_is_queued(model):
    """A decode step with a block source reads each layer's plan and fetches its misses once
    every layer's forward is queued (``Engine._flush_deferred``): every layer's plan goes to the
    coordinator at once, then each layer's gather waits for that layer's reads alone
    (``wait_for_layer_load``), in layer order; the tokens stay the single-process engine's
    (``test_loopback_three_processes``)."""
    with Daemon() as d:
        (h,) = _stage_in_worker_process(
            d.url, [{"prompt_len": P, "prompt_seed": 3, "first_query": "prompt", **SMALL}]
        )
        # The after-step path, this test's subject.
        eng = staged_engine(model, d, kv_transfer="partial", kv_in_step_reads=False)
        inner = eng.engine
        events: list = []
        forward = inner.model.forward

        def logged_forward(*a, **kw):
            events.append("forward")
            out = forward(*a, **kw)
            events.append("forward done")
            return out

        src = inner.block_source
        before = src.before_gathers

        def logged_before(plans):
            events.append(("fetch", tuple(p[0] for p in plans)))
            return before(plans)

        wait, gather = src.wait_for_layer_load, inner._gather

        def logged_wait(layer):
            events.append(("wait", layer))
            return wait(layer)

        def logged_gather(layer, *args):
            events.append(("gather", layer))
            return gather(layer, *args)

        inner.model.forward = logged_forward
        src.before_gathers, src.wait_for_layer_load, inner._gather = logged_before, logged_wait, logged_gather
        try:
            (o,) = run_batch(eng, [lambda e: e.add_staged_request(h, params(8))])
        finally:
            inner.model.forward = forward
        (ref,) = reference(model, KvConfig.fast(**SMALL), "oasis", [h.prompt])
        assert o.finish_reason == "length", o.error
        assert o.token_ids == ref.token_ids[:8]
        layers = model.config.num_hidden_layers
        done = [i for i, e in enumerate(events) if e == "forward done"]
        assert len(done) >= 7  # decode steps (the admission's selection fetches before them)
        per_layer = [e for layer in range(layers) for e in (("wait", layer), ("gather", layer))]
        for i in done[:-1]:
            # No fetch inside a forward; after each, every layer's plan handed over at once, then
            # per layer in order: wait for that layer's reads alone, gather it; then the next.
            assert events[i - 1] == "forward"
            assert events[i + 1] == ("fetch", tuple(range(layers)))
            assert events[i + 2 : i + 2 + 2 * layers] == per_layer
            assert events[i + 2 + 2 * layers] == "forward"


@pytest.mark.parametrize("transfer", ["partial", "full"])
def test_large_reads_spread_over_several_connections(model, transfer, monkeypatch):
    """A layer's many entries (a full transfer's blocks, a step's misses) are split into frames
    read on ``read_connections`` of the coordinator's connections at once, each writing its
    entries into the host pool: tokens, admission traffic (in entries) and decode-time entries
    equal those of one connection, in more frames."""
    monkeypatch.setattr(disagg.wire, "READ_SPLIT_MIN_ENTRIES", 1)  # split even the small model's reads
    runs = {}
    with Daemon() as d:
        for conns in (1, 3):
            handles = staged_small(model, d)
            eng = LLMEngine(
                model, kv=KvConfig.fast(**SMALL), drafter="ngram", kv_source=d.url, kv_transfer=transfer
            )
            src = eng.kv_source
            src.read_connections = conns
            assert f"connections={conns}" in repr(src.coord)
            src.prefetch_depth = 0  # the admissions read in the loop too, through the same reads
            src.decode_prefetch = 0  # decode-time entries compared exactly: no timing-dependent prefetch
            outs = run_batch(eng, [lambda e, h=h: e.add_staged_request(h, params()) for h in handles])
            runs[conns] = (outs, dataclasses.replace(src.stats), src.coordinator_stats)
            src.close()
            assert all_released(RtClient(d.url))  # every request released
    (one, s1, c1), (three, s3, c3) = runs[1], runs[3]
    for a, b in zip(one, three, strict=True):
        assert a.finish_reason == b.finish_reason == "length", (a.error, b.error)
        assert a.token_ids == b.token_ids
    assert s1.fetched_entries == s3.fetched_entries and s1.cached_bytes == s3.cached_bytes
    assert s1.peak_cached_bytes == s3.peak_cached_bytes and s3.failures == 0
    assert c1["entries"] == c3["entries"] > 0 and c3["frames"] > c1["frames"]
    if transfer == "partial":
        assert s3.fetched_entries > 0
    # More frames, so more frame headers: the payload is the same.
    assert s3.admission_bytes + s3.fetched_bytes >= s1.admission_bytes + s1.fetched_bytes
