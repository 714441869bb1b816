"""What the EAGLE-3 drafter tests share (``tests/models/test_eagle3_{prefill,batch,paged}.py``):
one target and head (module fixtures ``model`` and ``head``), their tolerance, prompts, the dense
features of a prompt, and a drafter wrapper that logs every draft.

A test module takes the fixtures by name: ``model, head = eagle3.model, eagle3.head`` after
``from support import eagle3``."""

from __future__ import annotations

import pytest
import torch

from oasiskv.models.eagle3 import Eagle3Head
from oasiskv.models.transformer import CausalLM, dense_causal_attn
from support.configs import LLAMA_8L

# f32 tolerance (tests/support/reference.py): results of different but equivalent schedules.
ATOL, RTOL = 1e-5, 1.3e-6
#: The target: 8 layers, so the head captures layers (2, 4, 5).
CFG = LLAMA_8L


@pytest.fixture(scope="module")
def model():
    return CausalLM.random(CFG, seed=4)


@pytest.fixture(scope="module")
def head(model):
    return Eagle3Head.random(CFG, draft_vocab_size=64, seed=5).attach_target(model)


def prompt(n: int, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, CFG.vocab_size, (n,), generator=g).tolist()


def dense_features(model, ids: list[int]) -> torch.Tensor:
    """[n, 3H]: the EAGLE-3 features of every position from a plain dense forward."""
    n, L = len(ids), model.num_layers
    _, cap = model(
        torch.tensor(ids), torch.arange(n), dense_causal_attn(), capture_layers=Eagle3Head.capture_layers(L)
    )
    return Eagle3Head.gather_features(cap, L)


class Logged:
    """Logs every draft a drafter class returns, by request, in order."""

    @staticmethod
    def wrap(cls):
        class L(cls):
            def __init__(self, *a, **kw):
                super().__init__(*a, **kw)
                self.log: dict[int, list[int]] = {}
                self.batches: list[int] = []

            def propose_batch(self, req_ids, tokens_list, features_list):
                self.batches.append(len(req_ids))
                out = super().propose_batch(req_ids, tokens_list, features_list)
                for r, d in zip(req_ids, out, strict=True):
                    self.log.setdefault(r, []).append(d)
                return out

        return L
