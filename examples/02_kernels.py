"""Call the OasisKV kernels directly on torch tensors (the CPU twins here; CUDA tensors use the GPU).

    python examples/02_kernels.py

One request, one layer: its full KV sits in the host pool; the GPU working set holds 4 blocks per
KV head. A lookahead query scores the block summaries, delta selection plans at most 2 new blocks
per head, the gather copies them, and attention runs over the working set plus the local block.
"""

import torch

from oasiskv import ops

torch.manual_seed(0)
hq, hk, d, b = 8, 2, 64, 16
geo = ops.KvGeometry(hq, hk, d, b)
n_blocks, budget, cap = 12, 4, 2

# Host pool: the request's 12 complete blocks; summaries = per-block min/max of the keys.
host_k = torch.randn(n_blocks, hk, b, d)
host_v = torch.randn(n_blocks, hk, b, d)
summaries = torch.empty(n_blocks, hk, 2, d)
ids = torch.arange(n_blocks, dtype=torch.int32)
ops.build_summaries(geo, host_k, ids, torch.full((n_blocks,), b, dtype=torch.int32), summaries)

# GPU pool: pages 0..3 are the budget slots, page 4 the local block (5 tokens so far).
k_pages, v_pages = torch.zeros(5, hk, b, d), torch.zeros(5, hk, b, d)
page_map = torch.full((5, hk), -1, dtype=torch.int32)  # the head-wise mapping: all slots empty
page_map[4] = n_blocks
last_selected = torch.full((5, hk), -1, dtype=torch.int32)
slot_pages = torch.arange(budget, dtype=torch.int32).view(1, budget)

q_look = torch.randn(1, hq, d)  # the lookahead token's query
blk_indptr = torch.tensor([0, n_blocks], dtype=torch.int32)
scores = ops.score_blocks(geo, q_look, summaries, blk_indptr, ids)
pred = ops.topk_blocks(hk, scores, blk_indptr, budget)
plan_slots, plan_blocks, (pairs, kept, missing) = ops.delta_select(
    hk, pred, slot_pages, page_map, last_selected, step=0, fetch_cap=cap
)
copied = ops.gather_blocks(
    geo, plan_slots, plan_blocks, slot_pages, blk_indptr, ids, host_k, host_v, k_pages, v_pages
)
print(f"predicted {pred[0].tolist()}; fetched {copied} block-head entries (cap {cap} per head)")
print(f"head-wise mapping of the slots:\n{page_map[:budget].T}")

q = torch.randn(1, 2, hq, d)  # rows: current token, lookahead token
out = ops.decode_attention(
    geo,
    q,
    k_pages,
    v_pages,
    torch.tensor([0, budget + 1], dtype=torch.int32),
    torch.arange(budget + 1, dtype=torch.int32),
    torch.tensor([5], dtype=torch.int32),
    page_map=page_map,
    extra_k=torch.randn(1, hk, d),
    extra_v=torch.randn(1, hk, d),
)
print("attention output", tuple(out.shape))
