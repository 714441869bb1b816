"""The GPU gather's launch shapes (``ops.set_gather_launch``, float and kv8 host pools): validated,
process-wide, each its own, restorable.
Every shape copies the same entries; the GPU tests (test_gpu_kernels_random.py::test_gather_blocks)
check random shapes against the CPU twin."""

from __future__ import annotations

import pytest

from oasiskv import ops


def test_the_default_shape_and_a_round_trip():
    assert ops.gather_launch() == (4, 4, 32, 6)
    try:
        ops.set_gather_launch(5, 1, 32)
        assert ops.gather_launch() == (5, 1, 32, 6)
        ops.set_gather_launch(0, 4, 8, 0)
        assert ops.gather_launch() == (0, 4, 8, 0)
    finally:
        ops.set_gather_launch()
    assert ops.gather_launch() == (4, 4, 32, 6)


@pytest.mark.parametrize("shape", [(0, 0, 8), (0, 5, 8), (0, 4, 0), (0, 4, 33), (0, 4, 8, 33)])
def test_a_bad_shape_is_refused_and_changes_nothing(shape):
    pattern = "warps_per_block must be 1..=4 and entries_per_warp 1..=32.*stage_entries 0..=32"
    with pytest.raises(ValueError, match=pattern):
        ops.set_gather_launch(*shape)
    assert ops.gather_launch() == (4, 4, 32, 6)


def test_a_negative_cap_is_refused():
    with pytest.raises((ValueError, OverflowError, TypeError)):
        ops.set_gather_launch(-1, 4, 8)
    assert ops.gather_launch() == (4, 4, 32, 6)


def test_the_kv8_launch_is_its_own_setting():
    """Gathers from fp8_e4m3 host pools take their own launch, default ``(0, 4, 8, 0)`` (every
    entry through registers, a block per 32 entries); setting one leaves the other alone."""
    assert ops.gather_launch(kv8=True) == (0, 4, 8, 0)
    try:
        ops.set_gather_launch(16, stage_entries=3, kv8=True)
        assert ops.gather_launch(kv8=True) == (16, 4, 8, 3)
        assert ops.gather_launch() == (4, 4, 32, 6)
        ops.set_gather_launch(2, 1, 3, 1)
        assert ops.gather_launch(kv8=True) == (16, 4, 8, 3)
        with pytest.raises(ValueError, match="stage_entries 0..=32"):
            ops.set_gather_launch(0, 4, 8, 33, kv8=True)
        assert ops.gather_launch(kv8=True) == (16, 4, 8, 3)
    finally:
        ops.set_gather_launch()
        ops.set_gather_launch(kv8=True)
    assert ops.gather_launch(kv8=True) == (0, 4, 8, 0) and ops.gather_launch() == (4, 4, 32, 6)
