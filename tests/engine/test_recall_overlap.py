"""``engine.recall_overlap`` (the lookahead recall, per layer and step) against a loop over sets."""

from __future__ import annotations

import torch

from oasiskv.engine import recall_overlap


def reference(actual, prev):
    sums, counts = [], []
    for a_s, p_s in zip(actual.tolist(), prev.tolist(), strict=True):
        total, counted = 0.0, 0
        for a_h, p_h in zip(a_s, p_s, strict=True):
            want = {x for x in a_h if x >= 0}
            if want:
                total += len(want & {x for x in p_h if x >= 0}) / len(want)
                counted += 1
        sums.append(total)
        counts.append(counted)
    return sums, counts


def test_recall_overlap_equals_the_set_reference():
    g = torch.Generator().manual_seed(0)
    for _ in range(200):
        n, h, k = (int(x) for x in torch.randint(1, 7, (3,), generator=g))
        # Distinct valid blocks per head (as top-K gives), -1 padded; prev arbitrary, -1 padded.
        actual = torch.stack([torch.randperm(16, generator=g)[:k] for _ in range(n * h)]).view(n, h, k)
        actual[torch.rand(n, h, k, generator=g) < 0.3] = -1
        prev = torch.randint(-1, 16, (n, h, k), generator=g)
        got_sum, got_n = recall_overlap(actual.int(), prev.int())
        want_sum, want_n = reference(actual, prev)
        assert got_sum.dtype == torch.float32 and got_n.dtype == torch.float32
        torch.testing.assert_close(got_sum, torch.tensor(want_sum), rtol=1e-6, atol=1e-6)
        assert got_n.tolist() == [float(c) for c in want_n]
