"""``ops.wait_epoch`` on the CPU (``oasis_core::kernels::wait_epoch``, the twin of the kernel a
disaggregated step queues before each layer's gather): it returns once another thread writes the
layer's landed word up to the epoch, counts the time it held and the wait, gives up after the
timeout (counting that and the epoch), and refuses bad arguments with typed errors."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from oasiskv import errors, ops


def _later(landed: torch.Tensor, layer: int, value: int, after_s: float) -> threading.Thread:
    def write():
        time.sleep(after_s)
        landed[layer] = value

    t = threading.Thread(target=write)
    t.start()
    return t


def test_the_wait_ends_when_the_layer_lands():
    landed = torch.zeros(3, dtype=torch.int64)
    stats = torch.zeros(4, dtype=torch.int64)
    epoch = torch.tensor([5], dtype=torch.int64)
    writer = _later(landed, 1, 5, 0.05)
    t0 = time.perf_counter()
    ops.wait_epoch(landed, 1, epoch, stats, 5.0)
    held = time.perf_counter() - t0
    writer.join()
    assert 0.04 <= held < 2.0
    gave_up, last, ns, waits = stats.tolist()
    assert (gave_up, last, waits) == (0, 0, 1)
    assert 0.04e9 <= ns <= held * 1e9 + 1e6
    # Landed already (an older epoch's wait, or a later word): at once.
    ops.wait_epoch(landed, 1, torch.tensor([4], dtype=torch.int64), stats, 5.0)
    assert stats[3] == 2 and stats[0] == 0


def test_a_wait_past_its_timeout_gives_up_and_says_so():
    landed = torch.zeros(2, dtype=torch.int64)
    stats = torch.zeros(4, dtype=torch.int64)
    t0 = time.perf_counter()
    ops.wait_epoch(landed, 0, torch.tensor([7], dtype=torch.int64), stats, 0.05)
    assert 0.04 <= time.perf_counter() - t0 < 2.0
    gave_up, last, ns, waits = stats.tolist()
    assert (gave_up, last, waits) == (1, 7, 1) and ns >= 0.04e9


@pytest.mark.parametrize(
    "kw, error",
    [
        ({"layer": 3}, errors.InvalidArgumentError),
        ({"timeout_s": 0.0}, errors.InvalidArgumentError),
        ({"timeout_s": float("nan")}, errors.InvalidArgumentError),
        ({"stats": torch.zeros(2, dtype=torch.int64)}, errors.ShapeError),
        ({"epoch": torch.zeros(1, dtype=torch.int32)}, errors.DTypeError),
        ({"landed": torch.zeros(3, dtype=torch.float32)}, errors.DTypeError),
    ],
)
def test_bad_arguments_are_typed_errors(kw, error):
    args = {
        "landed": torch.zeros(3, dtype=torch.int64),
        "layer": 0,
        "epoch": torch.zeros(1, dtype=torch.int64),
        "stats": torch.zeros(4, dtype=torch.int64),
        "timeout_s": 1.0,
    }
    args.update(kw)
    with pytest.raises(error):
        ops.wait_epoch(**args)
