"""The coordinator's decode-time prefetch (``RemoteKvSource.decode_prefetch``, crate
``oasis-coord``'s ``prefetch``) over TCP: after each step's own reads it brings, in the
background, the successors of the planned blocks and each request's most recent staged blocks.
Later steps then miss less (the source's ``miss_entries``), the prefetches count as hits when a
step plans them, and greedy tokens stay the single-process engine's. With a bounded host cache
(``kv_cache_blocks``) nothing is prefetched: its rows change hands between a step's layers.
"""

from __future__ import annotations

import pytest

from oasiskv import KvConfig, LLMEngine, errors
from oasiskv._core import RtClient
from oasiskv.disagg import wire
from support.fakes import tiny
from support.rtd import Daemon
from support.staged import SMALL, all_released, decode_staged, reference, staged_small

# Private names read here: ``RtClient`` from ``oasiskv._core`` (the daemon's client, to check
# that every staged request was released).


@pytest.fixture(scope="module")
def model():
    return tiny()


def _decode(model, d: Daemon, handles, prefetch: int, **kw):
    outs, eng = decode_staged(model, d, handles, kv_prefetch=prefetch, **kw)
    src = eng.kv_source
    stats, coord = src.stats, src.coordinator_stats
    src.close()
    return outs, stats, coord


def test_prefetch_lowers_later_steps_misses_and_keeps_the_tokens(model):
    assert wire.DECODE_PREFETCH > 0  # on by default
    with Daemon() as d:
        handles = staged_small(model, d)
        off, s_off, c_off = _decode(model, d, handles, 0)
        handles = staged_small(model, d)
        on, s_on, c_on = _decode(model, d, handles, wire.DECODE_PREFETCH)
        assert all_released(RtClient(d.url))
    refs = reference(model, KvConfig.fast(**SMALL), "oasis", [h.prompt for h in handles])
    for a, b, ref in zip(off, on, refs, strict=True):
        assert a.finish_reason == b.finish_reason == "length", (a.error, b.error)
        assert a.token_ids == b.token_ids == ref.token_ids
    assert s_off.prefetched_entries == s_off.prefetch_hits == c_off["prefetch_entries"] == 0
    assert s_on.prefetched_entries > 0 and s_on.prefetch_hits > 0
    unsent = c_on["prefetch_taken"] + c_on["prefetch_cancelled"]
    assert s_on.prefetch_hits <= s_on.prefetched_entries == c_on["prefetch_entries"] - unsent
    # The steps' own misses drop: some of what they plan was prefetched.
    assert 0 < s_on.miss_entries < s_off.miss_entries
    assert s_on.failures == s_off.failures == 0 and c_on["failed_entries"] == 0
    assert s_on.cached_bytes == s_off.cached_bytes == 0


def test_a_bounded_cache_prefetches_nothing(model):
    hk, k = model.config.num_key_value_heads, SMALL["top_k_blocks"]
    with Daemon() as d:
        handles = staged_small(model, d)
        outs, stats, coord = _decode(model, d, handles, wire.DECODE_PREFETCH, kv_cache_blocks=hk * k)
    assert all(o.finish_reason == "length" for o in outs), [o.error for o in outs]
    assert stats.prefetched_entries == coord["prefetch_entries"] == 0 and stats.miss_entries > 0


def test_decode_prefetch_is_validated(model):
    with Daemon() as d:
        eng = LLMEngine(model, kv=KvConfig.fast(**SMALL), kv_source=d.url)
        for bad in (-1, 1.5, True, "8"):
            with pytest.raises(errors.ConfigError, match="decode_prefetch"):
                eng.kv_source.decode_prefetch = bad
        eng.kv_source.decode_prefetch = 0
        assert eng.kv_source.decode_prefetch == 0
        eng.kv_source.close()
