"""What the serving benchmarks share: the prompt-id range and the percentile their rows report.

Its own module so that :mod:`~oasiskv.bench.serve` (the sweeps and the ``--fig11`` entry point)
and :mod:`~oasiskv.bench.fig11` (the Fig. 11 runner it dispatches to) both import it, and
``fig11`` never imports ``serve`` back.
"""

from __future__ import annotations

#: Prompt ids are drawn from [lo, hi): past the special tokens, inside every real vocabulary.
PROMPT_ID_RANGE = (256, 16000)


def percentile(xs: list[float], q: float) -> float | None:
    """The ``q`` quantile of ``xs`` as the nearest rank (rounded ``q * (len - 1)``), None when
    ``xs`` is empty."""
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]
