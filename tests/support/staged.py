"""What the disaggregation tests share (``tests/disagg``): the loopback requests' sizes and
budgets, sampling, running a batch and its single-process reference, staging small prompts with a
``PrefillWorker``, a dry run's read steps (so a fault can strike before a read), and
:class:`ReadLog`, which records what the remote source's coordinator is asked to read."""

from __future__ import annotations

from oasiskv import KvConfig, LLMEngine, SamplingParams
from oasiskv.disagg import PrefillWorker, StagedRequest
from support.fakes import pools_are_full, prompt
from support.rtd import Daemon, wait_until

# Private names read here: the remote source's ``_by_req`` (a request's daemon id) and ``coord``
# (its coordinator), which ReadLog wraps.

P, M = 300, 24  # prompt and new tokens of the loopback requests
#: The budget covers the context (32 blocks of 16 > 300 + 24 tokens); the request still turns
#: sparse at once (threshold 64), so its whole KV goes through the daemon.
BIG = {"block_size": 16, "top_k_blocks": 32, "sparse_threshold": 64}
#: A small budget: 4 blocks per KV head, at most one new block per head and step.
SMALL = {"block_size": 16, "top_k_blocks": 4, "sparse_threshold": 64}
SEEDS = (3, 5)  # the small-budget prompts, decoded in one batch


def params(n: int = M) -> SamplingParams:
    return SamplingParams(max_tokens=n, ignore_eos=True)


def run_batch(eng: LLMEngine, adds) -> dict:
    """Add every request at once (one batch), step to the end; outputs in add order."""
    ids = [add(eng) for add in adds]
    out = eng.run_to_completion(ids)
    return [out[i] for i in ids]


def staged_engine(model, d: Daemon, **engine_kw) -> LLMEngine:
    """``LLMEngine(kv_source=d.url, **engine_kw)`` with the small budget's Quest selection and the
    n-gram drafter (``kv_in_step_reads=False``: the reads after the step, whose submissions
    :class:`ReadLog` sees)."""
    return LLMEngine(model, kv=KvConfig.fast(**SMALL), drafter="ngram", kv_source=d.url, **engine_kw)


def decode_staged(model, d: Daemon, handles, **engine_kw) -> tuple[list, LLMEngine]:
    """``handles`` (staged in ``d``) decoded in one batch by ``LLMEngine(kv_source=d.url,
    **engine_kw)`` with the small budget's Quest selection and the n-gram drafter: ``(outputs in
    add order, the engine)``, its pools full again and its source still open (the caller reads
    its counters, then closes it)."""
    eng = staged_engine(model, d, **engine_kw)
    outs = run_batch(eng, [lambda e, h=h: e.add_staged_request(h, params()) for h in handles])
    assert pools_are_full(eng)
    return outs, eng


def reference(model, kv: KvConfig, backend: str, prompts) -> list:
    eng = LLMEngine(model, kv=kv, backend=backend, drafter="ngram")
    return run_batch(eng, [lambda e, p=p: e.add_request(p, params()) for p in prompts])


class ReadLog:
    """The remote source's coordinator (``oasiskv._core.Coordinator``), with every entry it is
    asked to read recorded as the daemon's key ``(request, layer, block, head)`` (head -1: a whole
    block): the planned entries that are absent when submitted (``on_read``, which a test may
    replace to log them); ``streamed``, those of them an admission streamed in the background
    (``submit(..., background=True)``); not a step's prefetch, which the coordinator chooses
    (its counts are in ``src.stats``). Install it before the first admission:
    ``src.coord = ReadLog(src)``."""

    def __init__(self, src) -> None:
        self.inner, self.src, self.keys, self.streamed = src.coord, src, [], []

    def on_read(self, keys) -> None:
        self.keys.extend(keys)

    def submit(self, layers, rows, heads, *, background=False, prefetch=0):
        hk = self.src.engine.geo.num_kv_heads
        keys, seen = [], set()
        for layer, row, head, (owner, logical) in zip(
            layers, rows, heads, self.inner.owners(rows), strict=True
        ):
            st = self.src._by_req.get(owner)
            if st is None or (layer, row, head) in seen:
                continue
            seen.add((layer, row, head))
            absent = [
                h for h in (range(hk) if head == -1 else [head]) if not self.inner.is_present(layer, row, h)
            ]
            if head == -1 and len(absent) == hk:
                keys.append((st.daemon_id, layer, logical, -1))
            else:
                keys += [(st.daemon_id, layer, logical, h) for h in absent]
        if keys:
            self.on_read(keys)
            if background:
                self.streamed += keys
        return self.inner.submit(layers, rows, heads, background=background, prefetch=prefetch)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def all_released(client, timeout_s: float = 5.0) -> bool:
    """Whether the daemon soon holds no staged request and no bytes (the decode side releases
    its copies from a coordinator connection's task, after the call that ended them)."""
    return wait_until(lambda: (s := client.stats())["live_requests"] == 0 and s["used_bytes"] == 0, timeout_s)


def staged_small(model, d: Daemon, seeds=SEEDS) -> list[StagedRequest]:
    worker = PrefillWorker(model, KvConfig.fast(**SMALL), d.url, first_query="prompt")
    try:
        return [worker.prefill(prompt(P, s)) for s in seeds]
    finally:
        worker.close()


def fetch_steps(model, d: Daemon, handles: list[StagedRequest], local: list | None, n: int) -> list[int]:
    """The steps (1-based) in which the first of these staged requests, decoded in a batch with
    the others (and a local prompt), reads misses from the daemon: a dry run of the same batch,
    so that a fault test can strike before a read (greedy decoding is deterministic). The dry run
    reads after each step (``kv_in_step_reads=False``), whose submissions ``ReadLog`` sees; the
    steps that miss are the same either way (the same plans)."""
    eng = staged_engine(model, d, kv_in_step_reads=False)
    rec = eng.kv_source.coord = ReadLog(eng.kv_source)
    for h in handles:
        eng.add_staged_request(h, params(n))
    if local is not None:
        eng.add_request(local, params(n))
    steps, k = [], 0
    first = handles[0].request_id
    while eng.has_unfinished_requests():
        before = len(rec.keys)
        eng.step()
        k += 1
        if any(key[0] == first for key in rec.keys[before:]):
            steps.append(k)
    return steps
