"""The defaults on a GPU (issue 33): ``oasiskv.LLM("smollm2")`` with no device, dtype or graph
argument runs on the GPU in bfloat16 and replays its decode steps as CUDA graphs, with the default
(fidelity) selection, and its greedy tokens equal those of ``enforce_eager=True``."""

from __future__ import annotations

import pytest
import torch

import oasiskv
from oasiskv.cli import demo_prompt
from oasiskv.devices import gpu_can_run_kernels

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

#: Past the default sparse threshold (128 blocks x 16 tokens), so most steps are sparse.
PROMPT_TOKENS = 3000
NEW_TOKENS = 32


def test_llm_defaults_run_on_the_gpu_with_cuda_graphs_and_match_eager():
    if not gpu_can_run_kernels():
        pytest.skip("the GPU cannot run OasisKV's kernels (oasiskv._core.cuda_status())")
    llm = oasiskv.LLM("smollm2")
    le = llm.llm_engine
    assert le.device.type == "cuda" and next(llm.model.parameters()).dtype == torch.bfloat16
    assert le.cuda_graphs and not le.enforce_eager
    assert llm.kv.block_score == "codes" and llm.kv.successor_blocks == 8
    prompt = demo_prompt(llm.tokenizer, PROMPT_TOKENS)
    (graphed,) = llm.generate(prompt, max_new_tokens=NEW_TOKENS, ignore_eos=True)
    stats = llm.engine.graph_stats
    assert stats["captures"] > 0 and stats["replays"] > 0, stats
    assert graphed.metrics.sparse_steps > 0

    eager = oasiskv.LLM(llm.model, tokenizer=llm.tokenizer, enforce_eager=True)
    assert not eager.llm_engine.cuda_graphs
    (plain,) = eager.generate(prompt, max_new_tokens=NEW_TOKENS, ignore_eos=True)
    assert eager.engine.graph_stats["replays"] == 0
    assert graphed.tokens == plain.tokens
