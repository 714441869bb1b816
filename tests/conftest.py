"""The tests' layout and ids.

Layout: ``tests/<part>/test_*.py`` mirrors ``python/oasiskv/`` (``engine/``, ``kernels/`` for
``ops``, ``serve/``, ...); a GPU test (``test_gpu_*.py``, marked ``gpu``) sits beside the CPU tests
of its part. The folders are not packages (pytest's default ``prepend`` import mode), so every
test basename is unique across ``tests/``. What the tests share lives in the package
``tests/support/``; this file puts ``tests/`` on ``sys.path`` so ``from support.fakes import tiny``
works from every folder, and test modules never import each other (``test_layout.py`` checks).

Ids that name what they vary: `[bfloat16-128-4-7-True]`, not `[dtype0-128-4-7-True]`, so a
subset can be picked with `-k` (e.g. `-k "decode_attention and float16"` under compute-sanitizer)."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

TESTS = Path(__file__).resolve().parent
if str(TESTS) not in sys.path:
    sys.path.insert(0, str(TESTS))


def pytest_make_parametrize_id(config, val, argname):
    if isinstance(val, torch.dtype):
        return str(val).removeprefix("torch.")
    return None
