"""The sparse prefill on a GPU (``Engine.prefills_sparse``, issue 35): a long prompt prefilled in
one piece stores each layer straight into the host pool, with its summaries, key codes and bounds
built by the CUDA kernels, and takes only its working set of GPU pages. Against the path through
dense pages (``DIRECT_SPARSE_PREFILL`` off, then ``make_sparse``): the same host pool and metadata
bit for bit and the same logits, eager and under CUDA graphs, bf16 and fp8 host pools."""

from __future__ import annotations

import pytest
import torch

from oasiskv import KvConfig
from oasiskv.engine import pools as pools_mod
from oasiskv.models.transformer import CausalLM
from support.configs import QWEN3_GPU
from support.engines import repeated_prompts, teacher_forced_logits

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

KV = dict(block_size=16, top_k_blocks=16, fetch_cap=4, sparse_threshold=256)


def _host_state(eng, r) -> list[torch.Tensor]:
    """The host rows, summaries, codes and bounds of ``r`` in its logical block order."""
    p = eng.pools
    rows = torch.tensor(r.host_rows, dtype=torch.long)
    blocks = torch.tensor(r.host_blocks, dtype=torch.long, device=p.summaries[0].device)
    out = []
    for layer in range(eng.cfg.num_hidden_layers):
        out += [p.host_k[layer][rows], p.host_v[layer][rows], p.summaries[layer][blocks]]
        if p.host_kv8:
            out += [p.host_k_scales[layer][rows], p.host_v_scales[layer][rows]]
        if p.codes is not None:
            out += [p.codes[layer][blocks], p.bounds8[layer][blocks], p.bound_scales[layer][blocks]]
    return out


@pytest.mark.parametrize("selection", ["fidelity", "fast"])
@pytest.mark.parametrize("host_kv_dtype", [None, "fp8_e4m3"])
@pytest.mark.parametrize("cuda_graph", [False, True])
@pytest.mark.parametrize("chunks", [None, [400, 700]], ids=["one-piece", "chunked"])
def test_gpu_sparse_prefill_equals_the_path_through_pages(
    monkeypatch, selection, host_kv_dtype, cuda_graph, chunks
):
    """Two prompts of 1,000 (a partial last block) and 1,024 tokens (whole blocks) on a bf16 model,
    prefilled in one piece or in chunks ending at 400 and 700 (inside a block): the same logits at
    every forced step and the same host pool and metadata; the page pool holds only the working
    sets. An fp8 host pool keeps a chunked prompt on its dense pages (both runs take that path)."""
    dev = torch.device("cuda")
    model = CausalLM.random(QWEN3_GPU.replace(num_hidden_layers=2), seed=3, dtype=torch.bfloat16, device=dev)
    make = KvConfig.fidelity if selection == "fidelity" else KvConfig.fast
    kv = make(**KV, host_kv_dtype=host_kv_dtype)
    prompts = repeated_prompts(model.config.vocab_size, [1000, 1024], seed=5, period=211)
    g = torch.Generator().manual_seed(9)
    forced = [torch.randint(0, model.config.vocab_size, (8,), generator=g).tolist() for _ in prompts]
    runs = {}
    for direct in (False, True):
        monkeypatch.setattr(pools_mod, "DIRECT_SPARSE_PREFILL", direct)
        runs[direct] = teacher_forced_logits(
            model, kv, "oasis", prompts, forced, chunks=chunks, cuda_graph=cuda_graph
        )
    (lp, rp, ep), (ld, rd, ed) = runs[False], runs[True]
    direct = ed.prefills_sparse(1000, chunked=chunks is not None)
    assert direct == (chunks is None or host_kv_dtype is None) and torch.equal(ld, lp)
    for a, b in zip(rp, rd, strict=True):
        assert a.sparse and b.sparse and b.metrics.sparse_since_token == len(b.prompt)
        for x, y in zip(_host_state(ep, a), _host_state(ed, b), strict=True):
            assert torch.equal(x.cpu(), y.cpu())
    k1 = KV["top_k_blocks"] + 1
    if direct:
        assert ed.runtime.pool_sizes[0] <= len(prompts) * k1 < ep.runtime.pool_sizes[0]
    if cuda_graph:
        assert ed.graph_stats["replays"] > 0
