"""Token lists the tests share."""

from __future__ import annotations

import torch


def repetitive(n: int, period: int = 37, seed: int = 0, vocab: int = 301) -> list[int]:
    """``n`` tokens repeating a random ``period``-token phrase (seeded): the n-gram drafter finds
    matches, and blocks repeat."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randint(0, vocab, (period,), generator=g).tolist()
    return (base * (n // period + 1))[:n]
