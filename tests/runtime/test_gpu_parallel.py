"""Tensor parallelism on GPUs (NCCL, one GPU per rank): TP = 2, 4 and 8 greedy tokens equal
TP = 1's on a GPU, dense, OasisKV and OasisKV speculative for the dense Qwen3 model of
``test_parallel`` (dense and OasisKV for its mixture-of-experts twin); every rank runs the same
decode steps with the same budgets.

Each size needs that many GPUs: on a machine with fewer the test says so and skips (the CPU
twins over gloo are ``test_parallel.py``). ``bash scripts/device.sh tp-runs`` runs this file and
the throughput rows of issue 14 on a multi-GPU machine. float32, so that the all-reduces' order
of summation cannot flip a greedy token (bfloat16 would make equality a matter of luck).
"""

from __future__ import annotations

import pytest
import torch

from oasiskv.parallel import run_tp
from support.parallel import CFG, MODES, MOE_CFG, generate_job

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available(), reason="needs a CUDA GPU (torch.cuda.is_available() is False)"
    ),
]

#: Seconds a run of every mode may take (spawn, NCCL setup, three engines).
TIMEOUT_S = 300.0


def _needs(tp: int) -> None:
    n = torch.cuda.device_count()
    if n < tp:
        pytest.skip(f"TP={tp} needs {tp} GPUs, this machine has {n} (multi-GPU device kinds: issue 14)")


@pytest.mark.parametrize("cfg", [CFG, MOE_CFG], ids=["dense-mlp", "moe"])
@pytest.mark.parametrize("tp", [2, 4, 8])
def test_tp_greedy_tokens_equal_tp1_on_gpus(tp, cfg):
    _needs(tp)
    modes = tuple(MODES) if cfg is CFG else ("dense", "oasis")  # as test_parallel's MoE test
    want = run_tp(generate_job, tp=1, args=(modes, cfg), backend="nccl", timeout_s=TIMEOUT_S)[0]
    ranks = run_tp(generate_job, tp=tp, args=(modes, cfg), backend="nccl", timeout_s=TIMEOUT_S)
    for mode in modes:
        assert ranks[0][mode]["outputs"] == want[mode]["outputs"], mode
        for rank in ranks[1:]:
            assert rank[mode]["steps"] == ranks[0][mode]["steps"], mode
            assert rank[mode]["caps"] == ranks[0][mode]["caps"], mode
    sparse = [steps for _, _, _, steps in ranks[0]["oasis"]["outputs"].values()]
    assert sum(s > 0 for s in sparse) == 2, sparse  # the 150- and 200-token requests turn sparse
