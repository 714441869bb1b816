"""The tensor-parallel runs the CPU test (gloo, ``tests/runtime/test_parallel.py``) and the GPU
test (NCCL, ``test_gpu_parallel.py``) share: the small dense and mixture-of-experts models, the
requests, the engines compared, and the job every rank runs (``generate_job``, started by
``oasiskv.parallel.run_tp`` in spawned processes, so it lives in an importable module)."""

from __future__ import annotations

from oasiskv import KvConfig, SamplingParams
from oasiskv.models.config import ModelConfig
from oasiskv.models.tp import TPCausalLM
from oasiskv.parallel import TPLLMEngine
from support.fakes import pools_are_full, prompt

#: The issue's small model: Qwen3 family (q/k norm), 4 layers, 8 query heads, 4 KV heads, head_dim
#: 32; the vocabulary odd, so the last vocabulary shard is padded.
CFG = ModelConfig(
    family="qwen3",
    vocab_size=301,
    hidden_size=128,
    intermediate_size=192,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=32,
    max_position_embeddings=1024,
)
#: The same with Qwen3-MoE layers (issue 14): 8 tensor-parallel experts of 64 columns, 2 a token,
#: layer 1 dense; each rank holds 32 columns of every expert.
MOE_CFG = CFG.replace(
    num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64, norm_topk_prob=True, mlp_only_layers=(1,)
)
SEED = 3
#: Budget of 4 blocks of 16 and a threshold of 64 tokens: the long prompts turn sparse.
KV = dict(block_size=16, top_k_blocks=4, fetch_cap=0.25, sparse_threshold=64)
#: (prompt tokens, new tokens): three requests, two seats, so one waits for a seat.
SPECS = [(150, 10), (40, 14), (200, 8)]
ENGINE = dict(drafter="ngram", max_num_seqs=2, max_num_batched_tokens=96)


def spec_requests():
    """The ``SPECS`` requests: repetitive prompts, greedy, ``ignore_eos``."""
    return [(prompt(n, i), SamplingParams(max_tokens=m, ignore_eos=True)) for i, (n, m) in enumerate(SPECS)]


def drive(eng) -> dict:
    """Run the ``SPECS`` requests to the end: per request its tokens, finish reason, error and
    sparse steps."""
    ids = [eng.add_request(p, sp) for p, sp in spec_requests()]
    outs = eng.run_to_completion(ids)
    return {rid: (o.token_ids, o.finish_reason, o.error, o.metrics.sparse_steps) for rid, o in outs.items()}


def log_steps(engine) -> list:
    """Record what every decode step of ``engine`` runs: per request its id, position, current
    token, draft and whether it is sparse."""
    log, real = [], engine.decode_step

    def decode_step(reqs, *args, **kwargs):
        log.append([(r.id, len(r.tokens), r.tokens[-1], r.draft, r.sparse) for r in reqs])
        return real(reqs, *args, **kwargs)

    engine.decode_step = decode_step
    return log


#: The engines compared: name -> LLMEngine options.
MODES = {
    "dense": dict(backend="dense"),
    "oasis": dict(backend="oasis"),
    "oasis-speculative": dict(backend="oasis", speculative=True),
}


def generate_job(group, modes, cfg=CFG):
    """Every mode's outputs on the driver; every rank reports what it owns and ran."""
    model = TPCausalLM.random(cfg, seed=SEED, group=group)
    out = {}
    for mode in modes:
        eng = TPLLMEngine(model, kv=KvConfig(**KV), **MODES[mode], **ENGINE)
        steps = log_steps(eng.engine)
        if eng.is_driver:
            try:
                got = drive(eng)
            finally:
                eng.shutdown()
        else:
            eng.worker_loop()
            got = None
        out[mode] = {
            "outputs": got,
            "kv_heads": eng.engine.geo.num_kv_heads,
            "qo_heads": eng.engine.geo.num_qo_heads,
            "pools_full": pools_are_full(eng),
            "caps": eng.engine.runtime.caps,
            "steps": steps,
            "moe_width": [layer.moe.intermediate_size for layer in model.layers if layer.moe is not None],
        }
    return out
