"""Generate with OasisKV and read the per-request metrics.

    python examples/01_generate.py [--model smollm2|PATH] [--top-k-blocks 16]

The prompt is long enough to pass the sparse threshold, so the request decodes from a working set
of ``top_k_blocks`` blocks per KV head plus the local block, refreshed by the n-gram lookahead.
"""

import argparse

import oasiskv

ap = argparse.ArgumentParser()
ap.add_argument("--model", default="smollm2")
ap.add_argument("--top-k-blocks", type=int, default=16)
args = ap.parse_args()

llm = oasiskv.LLM(
    args.model,
    kv=oasiskv.KvConfig(block_size=16, top_k_blocks=args.top_k_blocks, fetch_cap=0.25, sparse_threshold=256),
    drafter="ngram",
)
facts = " ".join(f"Item {i} is stored in drawer {(7 * i) % 13}." for i in range(60))
prompt = llm.tokenizer.apply_chat_template(
    [{"role": "user", "content": facts + " In which drawer is item 12 stored?"}]
)
res = llm.generate(prompt, max_new_tokens=24)[0]
m = res.metrics
print(res.text)
print(f"prompt {m.prompt_tokens} tokens, {m.steps} steps ({m.sparse_steps} sparse)")
print(f"full KV {m.full_kv_bytes / 2**20:.2f} MiB, resident {m.resident_kv_bytes / 2**20:.2f} MiB")
print(f"fetched {m.fetched_bytes_per_step / 2**10:.1f} KiB per step, lookahead recall {m.lookahead_recall}")
