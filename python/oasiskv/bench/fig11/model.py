"""The model under test and its device: built from ``--model`` or a ``--preset``'s random weights
(this rank's shard under ``--tp``), the device memory handed back between rows, and the device's
HBM read bandwidth (the roofline's denominator).
"""

from __future__ import annotations

import gc


def free_memory(torch, dev) -> None:
    """Collect garbage and, on CUDA, return the cached device blocks and torch's cached pinned
    host blocks, so the next row's peak and free memory start clean."""
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
        torch.cuda.empty_cache()
        empty_host = getattr(torch._C, "_host_emptyCache", None)  # torch's cached pinned blocks
        if empty_host is not None:
            empty_host()


#: Bytes the HBM read measurement reduces over: far past the L2 (50 MB on an H100), so every
#: byte comes from HBM. Arbitrary round size.
HBM_READ_BYTES = 1 << 30
#: Timed repeats of each reduction; the best is kept (arbitrary).
HBM_READ_REPEATS = 10


def hbm_read_Bps(torch, dev) -> float:
    """The device's HBM read bandwidth in bytes/s: a read-only reduction (``sum`` and ``amax``)
    over a :data:`HBM_READ_BYTES` bf16 tensor, each timed with CUDA events, the best of
    :data:`HBM_READ_REPEATS` after a warm-up (the reduction writes one element, so its bytes are
    reads). CUDA only. NOTE: a reduction is not a perfect read kernel; it bounds the read rate
    from below, so a fraction of it errs high rather than low."""
    x = torch.empty(HBM_READ_BYTES // 2, dtype=torch.bfloat16, device=dev)
    best = float("inf")
    for op in (torch.sum, torch.amax):
        op(x)  # warm-up: the kernel chosen and loaded
        torch.cuda.synchronize(dev)
        for _ in range(HBM_READ_REPEATS):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            op(x)
            b.record()
            b.synchronize()
            best = min(best, a.elapsed_time(b) * 1e-3)
    del x
    return HBM_READ_BYTES / best


def build_model(args, group=None):
    """``(model, name, device)``: ``--model`` (loaded; this rank's shard of it under ``group``)
    or ``--preset``'s random weights, on ``--device`` (a rank: the group's device)."""
    import torch

    from ...devices import compute_dtype, resolve_device

    tp = group.size if group is not None else 1
    dev = torch.device(resolve_device(args.device)) if tp == 1 else group.device
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    dtype = compute_dtype(dev.type) if args.dtype == "auto" else getattr(torch, args.dtype)
    if args.model:
        from ...models.loader import load_model

        model, _ = load_model(args.model, dtype=dtype, device=dev if tp == 1 else "cpu")
        name = args.model
        if tp > 1:
            from ...models.tp import TPCausalLM

            model = TPCausalLM.from_full(model, group=group, device=dev)
    else:
        from ...models.config import preset_config

        cfg = preset_config(args.preset)
        name = f"{args.preset} (random weights)"
        if tp > 1:
            from ...models.tp import TPCausalLM

            model = TPCausalLM.random_shards(cfg, seed=args.seed, dtype=dtype, device=dev, group=group)
        else:
            from ...models.random_weights import random_model

            model = random_model(cfg, dtype, dev, args.seed)
    return model.eval(), name, dev
