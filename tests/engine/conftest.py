"""Fixtures of the engine's tests."""

from __future__ import annotations

import pytest

from support.engines import qwen3_like


@pytest.fixture(scope="module")
def qwen3():
    """A random three-layer Qwen3-like CPU model (``QWEN3_3L``), one per test module."""
    return qwen3_like()
