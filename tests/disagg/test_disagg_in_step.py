"""In-step reads (``RemoteKvSource.in_step_reads``, :mod:`oasiskv.disagg.in_step`): each layer of a
decode step publishes its plan to the coordinator's step reader (a Rust thread), which reads the
misses while the step goes on; the layer's gather waits for its reads alone (``ops.wait_epoch``;
on the CPU path the wait runs inline). Over TCP on the CPU: the greedy tokens of the
single-process engine and of the reads after the step, the reader serving every step, misses
read once, pools full again; the knob is validated. (The faults with in-step reads: a released
request and a dead or stalled daemon, in ``test_disagg_faults.py``.)"""

from __future__ import annotations

import pytest

from oasiskv import KvConfig, LLMEngine, errors
from support.fakes import tiny
from support.rtd import Daemon
from support.staged import SMALL, decode_staged, params, reference, run_batch, staged_small

# Private names read here: the remote source's ``_in_step`` (its step reader's counters).


@pytest.fixture(scope="module")
def model():
    return tiny()


def _decode(model, d: Daemon, handles, in_step: bool, **kw):
    outs, eng = decode_staged(model, d, handles, kv_in_step_reads=in_step, **kw)
    src = eng.kv_source
    assert src.reads_in_step == in_step
    reader = src._in_step.stats() if in_step else None
    src.close()
    return outs, src.stats, reader


@pytest.mark.parametrize("prefetch", [0, 64])
def test_in_step_reads_keep_the_tokens_and_serve_every_step(model, prefetch):
    with Daemon() as d:
        handles = staged_small(model, d)
        after, s_after, _ = _decode(model, d, handles, False, kv_prefetch=prefetch)
        handles = staged_small(model, d)
        during, s_in, reader = _decode(model, d, handles, True, kv_prefetch=prefetch)
    refs = reference(model, KvConfig.fast(**SMALL), "oasis", [h.prompt for h in handles])
    for a, b, ref in zip(after, during, refs, strict=True):
        assert a.finish_reason == b.finish_reason == "length", (a.error, b.error)
        assert b.token_ids == a.token_ids == ref.token_ids
    layers = model.config.num_hidden_layers
    # Every decode step of the sparse requests went through the reader, every layer of it.
    assert reader["steps"] > 0 and reader["layers"] == reader["steps"] * layers
    assert reader["bad_entries"] == reader["refused"] == reader["stale_steps"] == 0, reader
    assert reader["entries"] > 0
    # The misses were read in the steps, and the same ones as the reads after the steps.
    assert s_in.miss_entries > 0 and s_in.failures == 0
    assert s_in.wait_seconds > 0  # the layers waited (inline on the CPU) for their reads
    if prefetch == 0:
        assert s_in.miss_entries == s_after.miss_entries
        assert s_in.fetched_entries == s_after.fetched_entries


def test_a_new_coordinator_or_prefetch_restarts_the_reader(model):
    """Changing ``read_connections`` (a new coordinator) or ``decode_prefetch`` after turning
    in-step reads on gives the mailbox a new reader for them: the tokens stay the single-process
    engine's, and the new reader serves every step."""
    with Daemon() as d:
        handles = staged_small(model, d)
        eng = LLMEngine(model, kv=KvConfig.fast(**SMALL), drafter="ngram", kv_source=d.url)
        src = eng.kv_source
        src.in_step_reads = True
        first = src._in_step.reader
        src.read_connections = 2
        src.decode_prefetch = 0
        assert src._in_step.reader is not first
        outs = run_batch(eng, [lambda e, h=h: e.add_staged_request(h, params()) for h in handles])
        reader = src._in_step.stats()
        src.close()
    refs = reference(model, KvConfig.fast(**SMALL), "oasis", [h.prompt for h in handles])
    for o, ref in zip(outs, refs, strict=True):
        assert o.finish_reason == "length" and o.token_ids == ref.token_ids, o.error
    assert reader["steps"] > 0 and reader["refused"] == 0 and reader["entries"] > 0


def test_in_step_reads_is_validated(model):
    with Daemon() as d:
        # The engine's default: on wherever it applies (a partial transfer, no bounded cache).
        eng = LLMEngine(model, kv=KvConfig.fast(**SMALL), drafter="ngram", kv_source=d.url)
        src = eng.kv_source
        assert src.in_step_reads is True and src.reads_in_step is True
        for bad in (1, "yes", None):
            with pytest.raises(errors.ConfigError, match="in_step_reads must be a bool"):
                src.in_step_reads = bad
        assert src.in_step_reads is True
        src.in_step_reads = False
        assert src._in_step is None and src.reads_in_step is False
        src.in_step_reads = True
        src.in_step_reads = True  # idempotent
        src.close()
        off = LLMEngine(
            model, kv=KvConfig.fast(**SMALL), drafter="ngram", kv_source=d.url, kv_in_step_reads=False
        )
        assert off.kv_source.in_step_reads is False
        off.kv_source.close()
        for kw in ({"kv_transfer": "full"}, {"kv_cache_blocks": 8}):
            quiet = LLMEngine(model, kv=KvConfig.fast(**SMALL), drafter="ngram", kv_source=d.url, **kw)
            assert quiet.kv_source.in_step_reads is False  # the default where it cannot apply
            quiet.kv_source.close()
            with pytest.raises(errors.ConfigError, match="kv_transfer='partial' and kv_cache_blocks=None"):
                LLMEngine(
                    model,
                    kv=KvConfig.fast(**SMALL),
                    drafter="ngram",
                    kv_source=d.url,
                    kv_in_step_reads=True,
                    **kw,
                )
        full = LLMEngine(
            model, kv=KvConfig.fast(**SMALL), drafter="ngram", kv_source=d.url, kv_transfer="full"
        )
        with pytest.raises(errors.ConfigError, match="kv_transfer='partial'"):
            full.kv_source.in_step_reads = True
        full.kv_source.close()
    with pytest.raises(errors.ConfigError, match="kv_in_step_reads .* needs kv_source"):
        LLMEngine(model, kv=KvConfig.fast(**SMALL), kv_in_step_reads=True)
    LLMEngine(model, kv=KvConfig.fast(**SMALL), kv_in_step_reads=False)  # off needs nothing
