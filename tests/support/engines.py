"""Engine builders the engine tests share: the GPU tests' model and prompts, a teacher-forced
decode that returns every step's logits (``tests/engine/test_gpu_engine.py``,
``test_gpu_graph.py``, ``test_gpu_speculative.py``, ``tests/kernels/test_gpu_wait_stamp.py``),
a drafter that reports a fixed confidence (``tests/engine/test_selection.py`` and its GPU twin),
the CPU tests' small models (``qwen3_like``, ``llama_like``) with their small budget ``SMALL_KV``,
and the sparse prefill tests' chunked prefill and host-pool views (``tests/engine/
test_sparse_prefill.py`` and its GPU twin)."""

from __future__ import annotations

import torch

import oasiskv
from oasiskv.drafters import NgramDrafter
from oasiskv.engine import Engine, Request
from oasiskv.models.transformer import CausalLM
from support.configs import LLAMA_8L, QWEN3_3L, QWEN3_GPU


def gpu_model(device, dtype=torch.float32, num_layers=3) -> CausalLM:
    """A random ``QWEN3_GPU`` model (``num_layers`` layers) on ``device``."""
    cfg = QWEN3_GPU.replace(num_hidden_layers=num_layers)
    return CausalLM.random(cfg, seed=1, dtype=dtype, device=device)


def repeated_prompts(vocab, lens, seed=0, period=41):
    """One prompt per length, each repeating a random ``period``-token phrase (drawn in turn from
    one generator), so the n-gram drafter finds matches."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in lens:
        base = torch.randint(0, vocab, (period,), generator=g).tolist()
        out.append((base * (n // period + 1))[:n])
    return out


#: A budget of 3 blocks of 8 (fetch cap 1) from 40 tokens on: the selection tests' small budget.
SMALL_KV = dict(block_size=8, top_k_blocks=3, fetch_cap=1, sparse_threshold=40)


def qwen3_like(**kw) -> CausalLM:
    """A random CPU model of ``QWEN3_3L`` (fields replaced by ``kw``)."""
    return CausalLM.random(QWEN3_3L.replace(**kw), seed=1)


def llama_like() -> CausalLM:
    """A random two-layer CPU model of ``LLAMA_8L``."""
    return CausalLM.random(LLAMA_8L.replace(num_hidden_layers=2), seed=2)


def prefill_in_chunks(eng, r, ends) -> torch.Tensor:
    """``eng.prefill_chunk`` over ``r``'s prompt in chunks ending at ``ends`` (those inside the
    prompt, then its end); returns the last chunk's logits."""
    n = len(r.prompt)
    ends = [e for e in ends if 0 < e < n] + [n]
    for start, end in zip([0, *ends[:-1]], ends, strict=True):
        logits = eng.prefill_chunk(r, start, end)
    return logits


def chunked_prefill(model, kv, ids, ends) -> tuple[Engine, Request, torch.Tensor]:
    """A fresh ``oasis`` engine (no drafter) prefilling ``ids`` in chunks ending at ``ends``
    (:func:`prefill_in_chunks`): the engine, the request and the last chunk's logits."""
    eng = Engine(model, kv, "oasis", None)
    r = Request(id=0, prompt=ids, max_new_tokens=4)
    eng.ensure_pools([r])
    return eng, r, prefill_in_chunks(eng, r, ends)


def host_state(eng, r) -> list[torch.Tensor]:
    """Everything the host pool and the metadata hold of ``r`` (host rows, summaries, fp8 scales,
    key codes, 8-bit bounds), per layer in its logical block order, on the CPU."""
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
    return [x.cpu() for x in out]


def kv8_pages_and_host_rows(dense, dense_req, sparse, sparse_req) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Pairs (on the CPU) of what ``dense``'s fp8 pages hold of ``dense_req``'s prompt and what
    ``sparse``'s fp8 host rows hold of ``sparse_req``'s: K and V codes, K and V scales, per layer."""
    pages = torch.tensor(dense_req.pages, dtype=torch.long, device=dense.pools.k_pages[0].device)
    rows = torch.tensor(sparse_req.host_rows, dtype=torch.long)
    p8, ph = dense.pools, sparse.pools
    return [
        (a[layer][pages].cpu(), b[layer][rows].cpu())
        for layer in range(dense.cfg.num_hidden_layers)
        for a, b in (
            (p8.k_pages, ph.host_k),
            (p8.v_pages, ph.host_v),
            (p8.k_scales, ph.host_k_scales),
            (p8.v_scales, ph.host_v_scales),
        )
    ]


def teacher_forced_logits(model, kv, backend, prompts, forced, drafter="ngram", chunks=None, **engine_kw):
    """Prefill, then decode with the given tokens forced (not sampled); a request turns sparse
    right after its prefill or before the step it passes the threshold at. Returns the logits
    [steps, reqs, vocab], the requests and the engine (``engine_kw``: more Engine arguments).
    ``chunks``: prefill each prompt in chunks ending at these positions (then at its end)."""
    eng = Engine(model, kv, backend, oasiskv.drafters.make_drafter(drafter), **engine_kw)
    reqs = [Request(id=i, prompt=p, max_new_tokens=len(forced[i]) + 1) for i, p in enumerate(prompts)]
    eng.ensure_pools(reqs)

    def turn_sparse(rs):
        for r in rs:
            if backend == "oasis" and not r.sparse and eng.runtime.wants_sparse(r.id):
                eng.make_sparse(r)

    for r in reqs:
        eng.drafter.begin(r.id, r.prompt)
        r.tokens = list(r.prompt)
        if chunks is None:
            eng.prefill(r)
        else:
            prefill_in_chunks(eng, r, chunks)
        r.tokens.append(forced[r.id][0])
        r.draft = eng.drafter.propose(r.id, r.tokens) if eng.rows == 2 else None
        turn_sparse([r])  # right after its prefill, whose last query picks the first working set
    out = []
    for t in range(1, len(forced[0])):
        turn_sparse(reqs)
        logits = eng.decode_step(reqs)
        out.append(logits.float().cpu())
        for r in reqs:
            r.tokens.append(forced[r.id][t])
            if eng.rows == 2:
                r.draft = eng.drafter.propose(r.id, r.tokens)
    for r in reqs:
        eng.finalize_metrics(r)
    return torch.stack(out), reqs, eng


class DrafterWithConfidence(NgramDrafter):
    """The n-gram drafter reporting a fixed probability for every draft, as the EAGLE-3 drafter
    does with ``track_confidence`` (``last_confidence``)."""

    reports_confidence = True

    def __init__(self, conf: float) -> None:
        super().__init__()
        self.conf = conf
        self.last_confidence: dict[int, float] = {}

    def propose_batch(self, req_ids, tokens_list, features_list):
        out = super().propose_batch(req_ids, tokens_list, features_list)
        self.last_confidence.update({r: self.conf for r in req_ids})
        return out
