"""The ``wait_epoch`` kernel (cuda/wait_stamp.cu), which holds a layer's background stream until
the coordinator's step reader writes the layer's landed epoch into pinned host memory: the stream
stays held until the host writes the word, then goes on; a wait past its timeout gives up and
counts itself; inside a captured CUDA graph each replay waits for the epoch it reads from device
memory at that replay."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from oasiskv import ops

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _tensors(layers: int = 2):
    dev = torch.device("cuda")
    landed = torch.zeros(layers, dtype=torch.int64, pin_memory=True)
    stats = torch.zeros(4, dtype=torch.int64, device=dev)
    epoch = torch.zeros(1, dtype=torch.int64, device=dev)
    return landed, stats, epoch


def _held(event: torch.cuda.Event, seconds: float) -> bool:
    """Whether ``event`` is still not reached after ``seconds``."""
    time.sleep(seconds)
    return not event.query()


def test_the_stream_waits_for_the_landed_word():
    landed, stats, epoch = _tensors()
    epoch.fill_(3)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        ops.wait_epoch(landed, 1, epoch, stats, 10.0)
        done = torch.cuda.Event()
        done.record()
    assert _held(done, 0.1), "the stream went on before the word was written"
    landed[1] = 3
    t0 = time.perf_counter()
    done.synchronize()
    assert time.perf_counter() - t0 < 2.0
    gave_up, last, ns, waits = stats.tolist()
    assert (gave_up, last, waits) == (0, 0, 1) and ns >= 0.08e9


def test_a_wait_past_its_timeout_gives_up():
    landed, stats, epoch = _tensors()
    epoch.fill_(9)
    ops.wait_epoch(landed, 0, epoch, stats, 0.05)
    torch.cuda.synchronize()
    gave_up, last, ns, waits = stats.tolist()
    assert (gave_up, last, waits) == (1, 9, 1) and ns >= 0.04e9


def test_a_captured_wait_reads_each_replays_epoch():
    landed, stats, epoch = _tensors()
    side = torch.cuda.Stream()
    graph = torch.cuda.CUDAGraph()
    epoch.fill_(1)
    landed[0] = 1  # the warm-up below passes at once
    ops.wait_epoch(landed, 0, epoch, stats, 10.0)
    torch.cuda.synchronize()
    with torch.cuda.graph(graph, stream=side):
        ops.wait_epoch(landed, 0, epoch, stats, 10.0)
    for e in (2, 3):
        epoch.fill_(e)
        graph.replay()
        done = torch.cuda.Event()
        done.record()
        assert _held(done, 0.1), f"replay {e} went on before its epoch landed"
        writer = threading.Timer(0.0, lambda e=e: landed.__setitem__(0, e))
        writer.start()
        done.synchronize()
        writer.join()
    gave_up, _, _, waits = stats.tolist()
    assert gave_up == 0 and waits == 3
