"""The compute stream's waits timed on the device (``ops.wait_stamp``, ``Engine.transfer_wait``):
a wait on a sleeping side stream is measured at least as long as the sleep, eagerly and inside a
captured CUDA graph, and an engine counts one wait per layer (eager) or per step (graph)."""

from __future__ import annotations

import pytest
import torch

from oasiskv import KvConfig, LLMEngine, SamplingParams, ops

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

SLEEP_CYCLES = 20_000_000  # torch.cuda._sleep: about 10 ms at 2 GHz


def _sleep_ns() -> float:
    """How long the side stream's sleep takes here, by CUDA events: the shortest of three, so at
    the highest clock the GPU ran it (a first sleep at an idle clock took 2x as long, and a wait
    measured later at full clock fell below 0.8x of it)."""
    runs = []
    for _ in range(3):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        torch.cuda._sleep(SLEEP_CYCLES)
        b.record()
        torch.cuda.synchronize()
        runs.append(a.elapsed_time(b) * 1e6)
    return min(runs)


def _wait_on_sleep(stamps, side):
    """The compute stream waits for a sleep on ``side``, timed by two stamps. The first stamp
    runs before the fork, so the wait holds the whole sleep however late the host launches it."""
    cur = torch.cuda.current_stream()
    ops.wait_stamp(stamps, 0)
    side.wait_stream(cur)  # fork
    with torch.cuda.stream(side):
        torch.cuda._sleep(SLEEP_CYCLES)
    cur.wait_stream(side)  # join: the wait timed
    ops.wait_stamp(stamps, 1)


def _warm(stamps):
    """Load the stamp kernel first: its first launch compiles it on the host, and the side
    stream's sleep would run out meanwhile (the wait then measures almost nothing)."""
    ops.wait_stamp(stamps, 0)
    torch.cuda.synchronize()
    stamps.zero_()


def test_a_wait_on_a_sleeping_stream_is_timed():
    sleep = _sleep_ns()
    stamps = torch.zeros(3, dtype=torch.int64, device="cuda")
    _warm(stamps)
    side = torch.cuda.Stream()
    _wait_on_sleep(stamps, side)
    torch.cuda.synchronize()
    start, total, waits = stamps.tolist()
    assert waits == 1 and start > 0
    assert 0.8 * sleep <= total <= 5 * sleep + 5e6, (total, sleep)
    # No wait: two stamps back to back cost a launch gap, far below the sleep.
    ops.wait_stamp(stamps, 0)
    ops.wait_stamp(stamps, 1)
    torch.cuda.synchronize()
    assert stamps[2] == 2 and int(stamps[1]) - total < 0.1 * sleep


def test_the_stamps_are_captured_into_a_graph():
    sleep = _sleep_ns()
    stamps = torch.zeros(3, dtype=torch.int64, device="cuda")
    side = torch.cuda.Stream()
    _warm(stamps)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, capture_error_mode="thread_local"):
        _wait_on_sleep(stamps, side)
    stamps.zero_()
    for _ in range(3):
        g.replay()
    torch.cuda.synchronize()
    _, total, waits = stamps.tolist()
    assert waits == 3 and total >= 3 * 0.8 * sleep, (total, sleep)


@pytest.mark.parametrize("cuda_graph", [False, True])
def test_an_engine_counts_its_waits(cuda_graph):
    from support.engines import gpu_model, repeated_prompts

    model = gpu_model(torch.device("cuda"))
    eng = LLMEngine(
        model,
        kv=KvConfig(block_size=16, top_k_blocks=4, fetch_cap=2, sparse_threshold=64, measure_recall=False),
        backend="oasis",
        drafter="ngram",
        device="cuda",
        cuda_graph=cuda_graph,
    )
    for i, p in enumerate(repeated_prompts(301, [300, 200])):
        eng.add_request(p, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True), request_id=str(i))
    steps = 0
    while eng.has_unfinished_requests():
        eng.step()
        steps += 1
    seconds, waits = eng.engine.transfer_wait()
    layers = model.config.num_hidden_layers
    assert seconds >= 0.0
    if cuda_graph:  # one join per sparse step (the first step of each graph key runs eagerly)
        assert 0 < waits <= steps * layers, (waits, steps)
    else:  # one wait per layer of every step after the first sparse one
        assert waits > 0 and waits % layers == 0 and waits <= steps * layers, (waits, steps)
