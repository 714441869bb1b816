"""Test ids that name what they vary: `[bfloat16-128-4-7-True]`, not `[dtype0-128-4-7-True]`, so a
subset can be picked with `-k` (e.g. `-k "decode_attention and float16"` under compute-sanitizer)."""

from __future__ import annotations

import torch


def pytest_make_parametrize_id(config, val, argname):
    if isinstance(val, torch.dtype):
        return str(val).removeprefix("torch.")
    return None
