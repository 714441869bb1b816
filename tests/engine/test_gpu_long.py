"""Long contexts on a GPU (issue 35): a 64K-token request whose budget covers its whole context
decodes, through the default selection and CUDA graphs, the same greedy tokens as dense."""

from __future__ import annotations

import pytest
import torch

import oasiskv
from oasiskv import KvConfig
from oasiskv.models.transformer import CausalLM
from support.configs import QWEN3_GPU
from support.engines import repeated_prompts

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

CONTEXT = 65536
NEW_TOKENS = 16
#: 512 blocks of 128 tokens hold every full block of the prompt (``MAX_TOP_K_BLOCKS`` is 512), and
#: the block being written is the working set's local block: the budget covers the context.
BLOCK = 128


def test_64k_covering_budget_oasis_equals_dense_greedy():
    dev = torch.device("cuda")
    cfg = QWEN3_GPU.replace(num_hidden_layers=2, max_position_embeddings=CONTEXT + 1024)
    model = CausalLM.random(cfg, seed=3, dtype=torch.float32, device=dev)
    (prompt,) = repeated_prompts(cfg.vocab_size, [CONTEXT], seed=4, period=997)
    kv = KvConfig(block_size=BLOCK, top_k_blocks=CONTEXT // BLOCK, fetch_cap=CONTEXT // BLOCK)
    assert kv.block_score == "codes"  # the default (fidelity) selection

    def run(backend):
        llm = oasiskv.LLM(model, kv=kv, backend=backend, drafter="ngram")
        (out,) = llm.generate([prompt], max_new_tokens=NEW_TOKENS, ignore_eos=True)
        return llm, out

    oasis_llm, oasis = run("oasis")
    assert oasis.metrics.sparse_steps > 0  # the request did turn sparse: its pages are the host pool's
    assert oasis_llm.engine.graph_stats["replays"] > 0
    _, dense = run("dense")
    assert oasis.tokens == dense.tokens
