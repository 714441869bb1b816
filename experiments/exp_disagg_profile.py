"""Where the decode loop's time goes under disaggregation: ``python -m oasiskv.bench.disagg``
(its arguments) run in this process under cProfile; prints the functions by own time and what
the decode-time reads call. The prefill process is not profiled.

    python experiments/exp_disagg_profile.py --preset qwen3-8b --daemon dist/oasis-rt \
        --transfers partial --rates 0.5 --requests 2 --max-tokens 32 --cuda-graph
"""

from __future__ import annotations

import cProfile
import pstats
import sys


def main() -> int:
    from oasiskv.bench import disagg

    prof = cProfile.Profile()
    prof.enable()
    rc = disagg.main(sys.argv[1:])
    prof.disable()
    st = pstats.Stats(prof)
    st.sort_stats("tottime").print_stats(30)
    st.sort_stats("cumulative").print_callees("before_gathers|_read$|_store$|_fix_up_gathers")
    return rc


if __name__ == "__main__":
    sys.exit(main())
