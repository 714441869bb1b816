"""Time the issue-4 workloads at SmolLM2-135M's shapes with random weights (GPU machine).

    python3 experiments/exp_eval_speed.py [--profile OUT.txt] [--no-train]

Per-step seconds of teacher-forced runs (dense, OasisKV, Quest-like) at 8K context and of one
EAGLE-3 training step, so the device calls with the real model can be planned. ``--profile``
writes torch.profiler's table (CPU and CUDA time per op, top 60) of one OasisKV run to a file:
where a decode step's time goes.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from oasiskv.eval.teacher import Policy, TeacherForcing
from oasiskv.models.config import ModelConfig
from oasiskv.models.transformer import CausalLM
from oasiskv.train import eagle3 as tr

cfg = ModelConfig(
    family="llama",
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    head_dim=64,
    rope_theta=100000.0,
    max_position_embeddings=8192,
    tie_word_embeddings=True,
)
ap = argparse.ArgumentParser()
ap.add_argument("--profile", default=None, help="write the profiler table of one OasisKV run here")
ap.add_argument("--no-train", action="store_true", help="skip the training-step timing")
ap.add_argument("--steps", type=int, default=32)
args = ap.parse_args()
model = CausalLM.random(cfg, seed=1, dtype=torch.bfloat16, device="cuda")
out = {}
g = torch.Generator().manual_seed(0)
C, S = 8192, args.steps
texts = [torch.randint(0, 49152, (C + 1,), generator=g).tolist() for _ in range(8)]
tf = TeacherForcing(model, texts, S, block_size=16, batch_size=8, progress=False)
for pol in (
    Policy("dense"),
    Policy("oasis", "ngram", 128, 0.05),
    Policy("oasis", "previous-query", 32, None),
    Policy("quest", top_k_blocks=128),
):
    torch.cuda.synchronize()
    t = time.perf_counter()
    tf.run(pol)
    torch.cuda.synchronize()
    out[pol.label] = round(time.perf_counter() - t, 2)
    print(pol.label, out[pol.label], "s for", S, "steps x 8 texts (incl. prefill)", flush=True)

if args.profile:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        tf.run(Policy("oasis", "previous-query", 128, 0.05))
    with open(args.profile, "w") as f:
        f.write(prof.key_averages().table(sort_by="cpu_time_total", row_limit=60))
        f.write("\n\n")
        f.write(prof.key_averages().table(sort_by="cuda_time_total", row_limit=40))
    print("profile written to", args.profile, flush=True)
if args.no_train:
    print(json.dumps(out), flush=True)
    raise SystemExit(0)
sel = torch.arange(0, 49152, 6)[:8192]
head = tr.new_head(model, sel, seed=0, device="cuda")
opt = torch.optim.AdamW(head.parameters(), lr=1e-4)
tokens = torch.randint(0, 49152, (8, 2048), generator=g)
for i in range(8):
    if i == 3:
        torch.cuda.synchronize()
        t = time.perf_counter()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        feats, z, _ = tr.target_pass(model, tokens, sel)
        outs = tr.ttt_forward(head, feats, tokens, 4)
        loss, _, _ = tr.ttt_loss(outs, z, 0.8)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
torch.cuda.synchronize()
out["train_step_s"] = round((time.perf_counter() - t) / 5, 4)
out["max_mem_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 1)
print(json.dumps(out), flush=True)
