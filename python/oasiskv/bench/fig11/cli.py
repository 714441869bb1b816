"""The entry point ``bench.serve --fig11`` dispatches to: run the sweep in this process or on
``--tp`` ranks, turn a caller mistake into a message and exit status 2, and write the reports
and the plot.
"""

from __future__ import annotations

import sys

from .report import plot, write_reports
from .sweep import Fig11
from .tp import tp_job


def main(args) -> int:
    """Run the sweep the parsed ``args`` describe; write the JSON, markdown and plot."""
    from ...errors import OasisError

    if args.max_tokens < 3:
        print(
            "bench.serve: error: --fig11 needs --max-tokens >= 3 (a warm-up step and a timed one)",
            file=sys.stderr,
        )
        return 2

    def write(rep: dict) -> str:
        return write_reports(args, rep)

    if getattr(args, "tp", 1) > 1:
        if args.cuda_graph or args.speculative:  # graphs are off under --tp (not --enforce-eager)
            flag = "--cuda-graph" if args.cuda_graph else "--speculative"
            print(f"bench.serve: error: --fig11 --tp does not take {flag} yet", file=sys.stderr)
            return 2
        from ...errors import RankFailedError
        from ...parallel import run_tp

        try:
            rep = run_tp(tp_job, tp=args.tp, args=(args,), backend="gloo" if args.device == "cpu" else None)[
                0
            ]
        except (OasisError, RankFailedError) as e:
            print(f"bench.serve: error: {str(e).splitlines()[0]}", file=sys.stderr)
            return 2
        print(write(rep))
    else:
        try:
            # After every row too: a sweep cut short (a time limit) keeps the rows it made.
            rep = Fig11(args).run(checkpoint=write)
        except (OasisError, MemoryError) as e:
            print(f"bench.serve: error: {e}", file=sys.stderr)
            return 2
        print(write(rep))
    if args.png:
        try:
            plot(rep, args.png)
        except ImportError:  # the GPU machine has no matplotlib: plot the JSON elsewhere
            print(
                'bench.serve: matplotlib is not installed, so no plot; later: python -c "import json; '
                "from oasiskv.bench.fig11 import plot; plot(json.load(open('F.json')), 'F.png')\"",
                file=sys.stderr,
            )
    return 0
