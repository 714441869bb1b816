"""Helpers of the kernel tests on the GPU (``tests/kernels/test_gpu_*.py``): where a host pool
lives, poison values, bit-exact comparison, and the random draws and states the fixed-grid and the
randomized tests share (the topk-candidates case is also the CPU test's)."""

from __future__ import annotations

import torch

from support.reference import DEV, back

HOSTS = ["pinned", "cuda"]  # where the host pool of a CUDA call lives
POISON = float("nan")
INT_POISON = 12345


def host(t: torch.Tensor, where: str) -> torch.Tensor:
    """A copy of a host-pool tensor where a CUDA call may take it: pinned CPU memory or the GPU."""
    return t.pin_memory() if where == "pinned" else t.to(DEV)


def bits(t: torch.Tensor) -> torch.Tensor:
    """The bit pattern, for bit-exact comparisons that also hold for NaN poison."""
    return t.contiguous().view(torch.int16 if t.element_size() == 2 else torch.int32)


def assert_bits_equal(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    got = back(got)
    assert got.shape == want.shape and got.dtype == want.dtype, what
    diff = (bits(got) != bits(want)).nonzero()
    assert diff.numel() == 0, f"{what}: {diff.shape[0]} elements differ, first at {diff[0].tolist()}"


def rand(gen, dtype, *shape) -> torch.Tensor:
    """Standard normal values drawn in float32, then cast to ``dtype``."""
    return torch.randn(*shape, generator=gen).to(dtype)


def tied_scores(gen, nnz, hk) -> torch.Tensor:
    """Few distinct values (ties everywhere), with -0.0 and +0.0 mixed (equal scores)."""
    scores = torch.randint(-3, 4, (nnz, hk), generator=gen).float()
    neg_zero = (scores == 0) & (torch.rand(nnz, hk, generator=gen) < 0.5)
    scores[neg_zero] = -0.0
    return scores


def select_state(gen, ns, hk, budget, num_pred):
    """A valid random state: distinct slot pages, per (seq, head) distinct resident blocks with about
    40% of the slots empty (some as -7: every negative entry is empty), page_last_selected with many
    ties, garbage outside the slots, and predictions mixing resident and missing blocks with -1
    padding and repeats."""
    n_logical = 2 * budget + 3
    num_pages = ns * budget + 11
    slot_pages = torch.randperm(num_pages, generator=gen)[: ns * budget].view(ns, budget).to(torch.int32)
    page_map = torch.randint(-1, 50, (num_pages, hk), generator=gen, dtype=torch.int32)
    last_sel = torch.randint(-1, 6, (num_pages, hk), generator=gen, dtype=torch.int32)
    for s in range(ns):
        for h in range(hk):
            blocks = torch.randperm(n_logical, generator=gen)[:budget].to(torch.int32)
            r = torch.rand(budget, generator=gen)
            blocks[r < 0.4] = -1
            blocks[r < 0.1] = -7
            page_map[slot_pages[s].long(), h] = blocks
    predicted = torch.empty(ns, hk, num_pred, dtype=torch.int32)
    for s in range(ns):
        for h in range(hk):
            p = torch.randperm(n_logical, generator=gen)[:num_pred].to(torch.int32)
            r = torch.rand(num_pred, generator=gen)
            for i in range(1, num_pred):
                if r[i] < 0.1:
                    p[i] = p[int(torch.randint(0, i, (1,), generator=gen))]  # a repeat counts once
            p[r > 0.85] = -1
            predicted[s, h] = p
    return slot_pages, page_map, last_sel, predicted


def randint(gen: torch.Generator, lo: int, hi: int) -> int:
    """Uniform in ``lo..=hi``."""
    return int(torch.randint(lo, hi + 1, (1,), generator=gen))


def chance(gen: torch.Generator, p: float) -> bool:
    return float(torch.rand(1, generator=gen)) < p


def pick(gen: torch.Generator, options: list):
    return options[randint(gen, 0, len(options) - 1)]


def topk_candidates_case(seed, device="cpu"):
    """A random ``ops.topk_candidates`` input: ``(heads, indptr, candidates [S, heads, m] with -1
    padding, scores with many ties, forced blocks or None)``."""
    g = torch.Generator().manual_seed(seed)
    heads = int(torch.randint(1, 4, (1,), generator=g))
    lens = torch.randint(0, 24, (int(torch.randint(1, 5, (1,), generator=g)),), generator=g)
    indptr = torch.zeros(lens.numel() + 1, dtype=torch.int32)
    indptr[1:] = torch.cumsum(lens, 0)
    n = lens.numel()
    m = int(torch.randint(1, 12, (1,), generator=g))
    cand = torch.full((n, heads, m), -1, dtype=torch.int32)
    for s in range(n):
        for h in range(heads):
            perm = torch.randperm(int(lens[s]), generator=g)[:m]
            cand[s, h, : perm.numel()] = perm.to(torch.int32)
    # Small integers: many ties, resolved by position.
    scores = torch.randint(-3, 4, (n * m, heads), generator=g).float()
    scores = scores.masked_fill(cand.permute(0, 2, 1).reshape(n * m, heads) < 0, -torch.inf)
    n_forced = int(torch.randint(0, 4, (1,), generator=g))
    forced = torch.randint(-2, 26, (n, heads, n_forced), generator=g).to(torch.int32) if n_forced else None
    return heads, indptr, cand, scores, forced
