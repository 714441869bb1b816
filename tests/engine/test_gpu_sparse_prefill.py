"""The sparse prefill on a GPU (``Engine.prefills_sparse``, issue 35): a long prompt prefilled in
one piece stores each layer straight into the host pool, with its summaries, key codes and bounds
built by the CUDA kernels, and takes only its working set of GPU pages. Against the path through
dense pages (``DIRECT_SPARSE_PREFILL`` off, then ``make_sparse``): the same host pool and metadata
bit for bit and the same logits, eager and under CUDA graphs, bf16 and fp8 host pools, in one
piece and in chunks; over an fp8 host pool, chunks read the prompt back as fp8 pages do."""

from __future__ import annotations

import pytest
import torch

from oasiskv import KvConfig
from oasiskv.engine import Engine, Request
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


#: (host_kv_dtype, chunk ends): one piece over bf16 and fp8 host pools, chunks over a bf16 one
#: (over an fp8 one the chunks read the prompt back quantized: the last test).
CASES = [(None, None), ("fp8_e4m3", None), (None, [400, 700])]


@pytest.mark.parametrize("selection", ["fidelity", "fast"])
@pytest.mark.parametrize("host_kv_dtype,chunks", CASES, ids=["bf16", "fp8-host", "bf16-chunked"])
@pytest.mark.parametrize("cuda_graph", [False, True])
def test_gpu_sparse_prefill_equals_the_path_through_pages(
    monkeypatch, selection, host_kv_dtype, chunks, cuda_graph
):
    """Two prompts of 1,000 (a partial last block) and 1,024 tokens (whole blocks) on a bf16 model,
    prefilled in one piece or in chunks ending at 400 and 700 (inside a block): the same logits at
    every forced step and the same host pool and metadata; the page pool holds only the working
    sets."""
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
    assert ed.prefills_sparse(1000) and torch.equal(ld, lp)
    for a, b in zip(rp, rd, strict=True):
        assert a.sparse and b.sparse and b.metrics.sparse_since_token == len(b.prompt)
        for x, y in zip(_host_state(ep, a), _host_state(ed, b), strict=True):
            assert torch.equal(x.cpu(), y.cpu())
    k1 = KV["top_k_blocks"] + 1
    assert ed.runtime.pool_sizes[0] <= len(prompts) * k1 < ep.runtime.pool_sizes[0]
    if cuda_graph:
        assert ed.graph_stats["replays"] > 0


def test_gpu_chunks_over_an_fp8_host_pool_read_the_prompt_back_as_fp8_pages_do():
    """Chunks ending on block boundaries over an fp8 host pool: the prefill's logits equal those
    of the same chunks over fp8 pages (the path through pages) bit for bit, and the host rows hold
    the codes and scales those pages hold."""
    dev = torch.device("cuda")
    model = CausalLM.random(QWEN3_GPU.replace(num_hidden_layers=2), seed=3, dtype=torch.bfloat16, device=dev)
    (ids,) = repeated_prompts(model.config.vocab_size, [1000], seed=5, period=211)
    ends = [512, 768, len(ids)]

    def chunked(kv):
        eng = Engine(model, kv, "oasis", None)
        r = Request(id=0, prompt=ids, max_new_tokens=4)
        eng.ensure_pools([r])
        for start, end in zip([0, *ends[:-1]], ends, strict=True):
            logits = eng.prefill_chunk(r, start, end)
        return eng, r, logits

    e8, r8, pages8 = chunked(KvConfig(**KV, kv_dtype="fp8_e4m3"))
    eh, rh, host8 = chunked(KvConfig(**KV, host_kv_dtype="fp8_e4m3"))
    assert not r8.sparse and rh.sparse and torch.equal(host8, pages8)
    pages = torch.tensor(r8.pages, dtype=torch.long, device=dev)
    rows = torch.tensor(rh.host_rows, dtype=torch.long)
    for layer in range(model.config.num_hidden_layers):
        p8, ph = e8.pools, eh.pools
        assert torch.equal(p8.k_pages[layer][pages].cpu(), ph.host_k[layer][rows])
        assert torch.equal(p8.v_pages[layer][pages].cpu(), ph.host_v[layer][rows])
        assert torch.equal(p8.k_scales[layer][pages].cpu(), ph.host_k_scales[layer][rows])
