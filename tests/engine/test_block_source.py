"""The engine's block source seam (issue 34): :class:`oasiskv.policy.BlockSource`, the local host
pool as the default source, and the calls an eager step makes to a source that is not local (the
remote source's verbs, here a fake that reads nothing and counts what it is asked)."""

from __future__ import annotations

import torch

from oasiskv import KvConfig, LLMEngine, SamplingParams
from oasiskv.disagg import RemoteKvSource
from oasiskv.policy import BlockSource, LocalHostPool
from support.fakes import prompt, tiny

torch.set_num_threads(2)

KV = KvConfig(block_size=8, top_k_blocks=3, fetch_cap=1, sparse_threshold=40, block_score="quest")


class CountingSource(BlockSource):
    """A non-local source with every block already in the host pool: it reads nothing, so the
    tokens must be those of the engine without it; it records the engine's calls."""

    def __init__(self, may_evict: bool) -> None:
        self.may_evict = may_evict
        self.single: list[int] = []
        self.batched: list[tuple[int, ...]] = []

    def before_gather(self, layer, plan_slots, plan_blocks, host_indptr, host_indices) -> bool:
        self.single.append(layer)
        return False

    def before_gathers(self, plans: list) -> list[bool]:
        self.batched.append(tuple(p[0] for p in plans))
        return [False] * len(plans)


def _tokens(source: BlockSource | None) -> list[int]:
    eng = LLMEngine(tiny(layers=2), kv=KV, backend="oasis", drafter="ngram", max_num_seqs=2)
    if source is not None:
        eng.engine.block_source = source
    rid = eng.add_request(prompt(60, 3), SamplingParams(max_tokens=6, ignore_eos=True))
    return list(eng.run_to_completion([rid])[rid].token_ids)


def test_the_protocol_defaults_describe_a_source_with_blocks_to_read():
    """A source inherits what it does not override: not local, not idle, no graph fix-ups, may
    evict, and ``before_gathers`` as one ``before_gather`` per plan. The local host pool is the
    opposite on every flag and reads nothing; the remote source is a BlockSource."""

    class Bare(BlockSource):
        def before_gather(self, layer, *rest) -> bool:
            return layer == 1

    bare = Bare()
    assert (bare.local, bare.idle, bare.fixes_up_graph_steps, bare.may_evict) == (False, False, False, True)
    assert bare.before_gathers([(0, None, None, None, None), (1, None, None, None, None)]) == [False, True]
    local = LocalHostPool()
    assert (local.local, local.idle, local.fixes_up_graph_steps, local.may_evict) == (True, True, True, False)
    assert local.before_gathers([(0, None, None, None, None)]) == [False]
    assert BlockSource in RemoteKvSource.__mro__  # inherits the defaults it does not override


def test_the_engine_calls_a_non_local_source_without_changing_tokens():
    """The default source is the local host pool. A non-local source that never evicts is asked
    once per sparse step for every layer's plans together (``before_gathers``, layers in order);
    one that may evict is asked layer by layer (``before_gather``), as both are for the initial
    selection when the request turns sparse. Neither changes the tokens."""
    plain = LLMEngine(tiny(layers=2), kv=KV, backend="oasis", drafter="ngram", max_num_seqs=2)
    assert isinstance(plain.engine.block_source, LocalHostPool)
    want = _tokens(None)
    batched, single = CountingSource(may_evict=False), CountingSource(may_evict=True)
    assert _tokens(batched) == want
    assert batched.batched and all(layers == (0, 1) for layers in batched.batched)
    assert batched.single == [0, 1]  # the initial selection as the request turns sparse
    assert _tokens(single) == want
    assert not single.batched
    assert len(single.single) > 2 and single.single == [0, 1] * (len(single.single) // 2)
