"""One source for each shared limit: ``oasis_core::limits``, exported by ``oasiskv._core``.

The kernels are compiled with these values (NVRTC defines), the Rust wrappers check them, and the
Python configuration must refuse exactly what they refuse: these tests hold the Python side to the
exported numbers.
"""

from __future__ import annotations

import pytest

from oasiskv import _core, config
from oasiskv.errors import ConfigError

# Private names read here: ``oasiskv._core`` (its exported limits are what this file checks).

LIMITS = (
    "MAX_BLOCK_SIZE",
    "MAX_TOP_K_BLOCKS",
    "MAX_CANDIDATES",
    "MAX_SELECT_BUDGET",
    "MAX_POOL_BLOCKS",
    "MAX_TOKENS",
    "MAX_HEAD_DIM",
)


@pytest.mark.parametrize("name", LIMITS)
def test_limits_are_positive_int32(name):
    v = getattr(_core, name)
    assert isinstance(v, int) and not isinstance(v, bool)
    assert 0 < v <= 2**31 - 1, (name, v)


@pytest.mark.parametrize("name", ["MAX_BLOCK_SIZE", "MAX_TOP_K_BLOCKS", "MAX_POOL_BLOCKS", "MAX_TOKENS"])
def test_config_uses_the_exported_limits(name):
    assert getattr(config, name) == getattr(_core, name), f"oasiskv.config.{name} differs from _core's"


def test_candidates_hold_a_full_top_k():
    # The two-stage score's candidates are capped at MAX_TOP_K_BLOCKS and its last top-K takes
    # m + successors of them.
    assert _core.MAX_TOP_K_BLOCKS <= _core.MAX_CANDIDATES


@pytest.mark.parametrize(
    ("field", "limit"),
    [("top_k_blocks", "MAX_TOP_K_BLOCKS"), ("block_size", "MAX_BLOCK_SIZE")],
)
def test_kv_config_refuses_one_past_the_limit(field, limit):
    hi = getattr(_core, limit)
    config.KvConfig(**{field: hi})
    with pytest.raises(ConfigError, match=rf"{field}={hi + 1} is above {hi}"):
        config.KvConfig(**{field: hi + 1})


def test_geometry_refuses_head_dim_past_the_limit():
    _core.KvGeometry(1, 1, _core.MAX_HEAD_DIM, 16)
    with pytest.raises(ConfigError, match=f"head_dim {_core.MAX_HEAD_DIM + 1} exceeds"):
        _core.KvGeometry(1, 1, _core.MAX_HEAD_DIM + 1, 16)
