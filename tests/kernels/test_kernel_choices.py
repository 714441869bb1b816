"""The process-wide kernel choices: the kv8 tensor-core attention (``ops.set_kv8_attention_kernel``)
and the 8-bit bound's score (``ops.set_bound8_score_kernel``). Each validated, restorable, and set
by its engine flag (``--kv8-attention-kernel``, ``--bound8-score-kernel``). The kernels against
the CPU twins on a GPU: test_gpu_kv8.py::test_kv8_tensor_core_kernels_match_the_twin and
test_gpu_bound8.py (both score kernels)."""

from __future__ import annotations

import argparse

import pytest

from oasiskv import ops


@pytest.fixture(autouse=True)
def _restore():
    before = ops.kv8_attention_kernel(), ops.bound8_score_kernel()
    yield
    ops.set_kv8_attention_kernel(before[0])
    ops.set_bound8_score_kernel(before[1])


def test_the_default_is_the_faster_registers_kernel_and_a_round_trip():
    assert ops.kv8_attention_kernel() == "registers"
    ops.set_kv8_attention_kernel("tile")
    assert ops.kv8_attention_kernel() == "tile"
    ops.set_kv8_attention_kernel("registers")
    assert ops.kv8_attention_kernel() == "registers"


def test_the_deep_registers_kernel_round_trips():
    ops.set_kv8_attention_kernel("registers-deep")
    assert ops.kv8_attention_kernel() == "registers-deep"


@pytest.mark.parametrize("name", ["", "Tile", "register", "fp8", "registers_deep", "deep"])
def test_an_unknown_kernel_is_refused_and_changes_nothing(name):
    ops.set_kv8_attention_kernel("registers")
    with pytest.raises(ValueError, match="must be 'tile', 'registers' or 'registers-deep'"):
        ops.set_kv8_attention_kernel(name)
    assert ops.kv8_attention_kernel() == "registers"


def test_the_bound8_score_kernel_defaults_to_mma_and_round_trips():
    assert ops.bound8_score_kernel() == "mma"
    ops.set_bound8_score_kernel("fma")
    assert ops.bound8_score_kernel() == "fma"
    with pytest.raises(ValueError, match="must be 'fma' or 'mma'"):
        ops.set_bound8_score_kernel("tensor")
    assert ops.bound8_score_kernel() == "fma"


def test_the_engine_flags_set_the_kernels():
    from oasiskv.serve.cli import add_engine_arguments, engine_kwargs

    p = argparse.ArgumentParser()
    add_engine_arguments(p)
    args = ["--device", "cpu", "--kv8-attention-kernel", "tile", "--bound8-score-kernel", "fma"]
    engine_kwargs(p.parse_args(args))
    assert (ops.kv8_attention_kernel(), ops.bound8_score_kernel()) == ("tile", "fma")
    # Flags left out leave the process's choice (here the one just set, not a default over it).
    engine_kwargs(p.parse_args(["--device", "cpu"]))
    assert (ops.kv8_attention_kernel(), ops.bound8_score_kernel()) == ("tile", "fma")
    engine_kwargs(p.parse_args(["--device", "cpu", "--kv8-attention-kernel", "registers"]))
    assert (ops.kv8_attention_kernel(), ops.bound8_score_kernel()) == ("registers", "fma")
    for bad in (["--kv8-attention-kernel", "fast"], ["--bound8-score-kernel", "fast"]):
        with pytest.raises(SystemExit):
            p.parse_args(bad)


def test_the_choice_leaves_the_cpu_twin_alone():
    """On the CPU both names run the twin: the same scores under either (the GPU tests compare
    the kernels with it)."""
    import torch

    geo = ops.KvGeometry(8, 2, 64, 16)
    gen = torch.Generator().manual_seed(5)
    s = torch.randn(6, 2, 2, 64, generator=gen)
    s = torch.stack([s.min(dim=2).values, s.max(dim=2).values], dim=2)
    b8, sc = ops.empty_bounds8(geo, 6)
    ops.build_bounds8(geo, s, torch.arange(6, dtype=torch.int32), b8, sc)
    q = torch.randn(2, 8, 64, generator=gen)
    args = (torch.tensor([0, 4, 6], dtype=torch.int32), torch.tensor([5, 0, 3, 1, 2, 4], dtype=torch.int32))
    ops.set_bound8_score_kernel("fma")
    a = ops.score_blocks_bound8(geo, q, b8, sc, *args)
    ops.set_bound8_score_kernel("mma")
    b = ops.score_blocks_bound8(geo, q, b8, sc, *args)
    assert torch.isfinite(a).all() and torch.equal(a, b)
