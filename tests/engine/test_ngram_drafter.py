"""The n-gram drafter's incremental index against a plain scan of the window (the definition)."""

from __future__ import annotations

import random

import pytest

from oasiskv.drafters import NgramDrafter
from oasiskv.errors import ConfigError


def scan(tokens, max_n, min_n, window):
    """Longest suffix n-gram's latest earlier occurrence (with a follower) in the last ``window``
    tokens; the token after it, else the current token."""
    toks = list(tokens[-window:])
    for n in range(min(max_n, len(toks) - 1), min_n - 1, -1):
        suffix = toks[len(toks) - n :]
        for start in range(len(toks) - n - 1, -1, -1):
            if toks[start : start + n] == suffix:
                return toks[start + n]
    return toks[-1]


@pytest.mark.parametrize("max_n,min_n,window", [(4, 1, 8192), (3, 2, 40), (1, 1, 7), (5, 1, 2), (2, 1, 3)])
@pytest.mark.parametrize("vocab", [3, 20, 1000])
def test_incremental_index_equals_the_scan(max_n, min_n, window, vocab):
    rng = random.Random(f"{max_n}-{min_n}-{window}-{vocab}")
    d = NgramDrafter(max_n=max_n, min_n=min_n, window=window)
    for req in range(3):
        tokens = [rng.randrange(vocab) for _ in range(rng.randrange(1, 120))]
        d.begin(req, list(tokens))
        for _ in range(150):  # the request's own list, appended to in place (as LLMEngine does)
            assert d.propose(req, tokens) == scan(tokens, max_n, min_n, window), (req, len(tokens))
            tokens.append(rng.randrange(vocab))
        d.end(req)


def test_a_list_that_changed_is_indexed_afresh():
    d = NgramDrafter(max_n=3)
    toks = [5, 6, 7, 8, 5, 6, 7]
    assert d.propose(0, toks) == 8
    toks[:] = [1, 2, 3, 1, 2]  # replaced in place, shorter
    assert d.propose(0, toks) == 3
    toks[-1] = 9  # same length, different last token
    toks.append(1)
    assert d.propose(0, toks) == scan(toks, 3, 1, 8192)
    other = [4, 4, 4]  # another list under the same id
    assert d.propose(0, other) == 4


def test_a_window_below_two_tokens_is_refused():
    with pytest.raises(ConfigError, match="window"):
        NgramDrafter(window=1)
