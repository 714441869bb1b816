"""Shared builders of the evaluation's tests: a tiny random Llama-shaped model and an EAGLE-3
head attached to it (module scope: each test module builds its own)."""

from __future__ import annotations

import pytest

from oasiskv.models.eagle3 import Eagle3Head
from oasiskv.models.transformer import CausalLM
from support.configs import LLAMA_EVAL


@pytest.fixture(scope="module")
def tiny():
    return CausalLM.random(LLAMA_EVAL, seed=1)


@pytest.fixture(scope="module")
def head(tiny):
    return Eagle3Head.random(tiny.config, 64, seed=2).attach_target(tiny)
