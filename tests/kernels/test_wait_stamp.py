"""Timing the compute stream's waits (``ops.wait_stamp``, ``Engine.transfer_wait``) on the CPU:
the twin's clock arithmetic, argument checks, and the CPU engine's zero (its chain runs inline).
The GPU kernel is checked in tests/kernels/test_gpu_wait_stamp.py."""

from __future__ import annotations

import time

import pytest
import torch

from oasiskv import KvConfig, errors, ops
from oasiskv.engine import Engine


def test_a_wait_is_timed_and_counted():
    s = torch.zeros(3, dtype=torch.int64)
    ops.wait_stamp(s, 0)
    time.sleep(0.02)
    ops.wait_stamp(s, 1)
    total, waits = int(s[1]), int(s[2])
    assert waits == 1 and 20e6 <= total < 2e9, s
    ops.wait_stamp(s, 0)
    ops.wait_stamp(s, 1)
    assert int(s[2]) == 2 and int(s[1]) >= total


@pytest.mark.parametrize(
    "stamps, err",
    [
        (torch.zeros(3, dtype=torch.int32), errors.DTypeError),
        (torch.zeros(4, dtype=torch.int64), errors.ShapeError),
        (torch.zeros(1, 3, dtype=torch.int64), errors.ShapeError),
    ],
)
def test_bad_stamps_are_typed_errors(stamps, err):
    with pytest.raises(err, match="stamps"):
        ops.wait_stamp(stamps, 0)


def test_the_cpu_engine_never_waits():
    from oasiskv.models.config import ModelConfig
    from oasiskv.models.transformer import CausalLM

    cfg = ModelConfig(
        family="llama",
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=128,
    )
    eng = Engine(CausalLM.random(cfg, seed=0), KvConfig(), "oasis", None)
    assert eng.transfer_wait() == (0.0, 0)
