"""The kv8 tensor-core attention kernel choice (``ops.set_kv8_attention_kernel``): validated,
process-wide, restorable, and set by the engine flag ``--kv8-attention-kernel``. Both kernels
against the CPU twin on a GPU: test_gpu_kv8.py::test_kv8_tensor_core_kernels_match_the_twin."""

from __future__ import annotations

import argparse

import pytest

from oasiskv import ops


@pytest.fixture(autouse=True)
def _restore():
    before = ops.kv8_attention_kernel()
    yield
    ops.set_kv8_attention_kernel(before)


def test_the_default_is_the_measured_tile_kernel_and_a_round_trip():
    assert ops.kv8_attention_kernel() == "tile"
    ops.set_kv8_attention_kernel("registers")
    assert ops.kv8_attention_kernel() == "registers"
    ops.set_kv8_attention_kernel("tile")
    assert ops.kv8_attention_kernel() == "tile"


@pytest.mark.parametrize("name", ["", "Tile", "register", "fp8"])
def test_an_unknown_kernel_is_refused_and_changes_nothing(name):
    ops.set_kv8_attention_kernel("registers")
    with pytest.raises(ValueError, match="must be 'tile' or 'registers'"):
        ops.set_kv8_attention_kernel(name)
    assert ops.kv8_attention_kernel() == "registers"


def test_the_engine_flag_sets_the_kernel():
    from oasiskv.serve.cli import add_engine_arguments, engine_kwargs

    p = argparse.ArgumentParser()
    add_engine_arguments(p)
    engine_kwargs(p.parse_args(["--device", "cpu", "--kv8-attention-kernel", "registers"]))
    assert ops.kv8_attention_kernel() == "registers"
    engine_kwargs(p.parse_args(["--device", "cpu"]))
    assert ops.kv8_attention_kernel() == "tile"
    with pytest.raises(SystemExit):
        p.parse_args(["--kv8-attention-kernel", "fast"])
