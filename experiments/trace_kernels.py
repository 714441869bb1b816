"""Where a profiled decode step's device time goes: per kernel name, the launches and total
microseconds in a Chrome trace written by ``python -m oasiskv.bench.serve --fig11 --trace-dir``
(``torch.profiler``'s export), per stream, and the step's span on the device.

    python experiments/trace_kernels.py TRACE.json [TRACE2.json ...] [--top 25]
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict


def summarize(path: str, top: int) -> str:
    with open(path) as f:
        events = json.load(f).get("traceEvents", [])
    cats = ("kernel", "gpu_memcpy", "gpu_memset")
    kern = [e for e in events if e.get("ph") == "X" and e.get("cat") in cats]
    if not kern:
        return f"{path}: no device events"
    t0 = min(e["ts"] for e in kern)
    t1 = max(e["ts"] + e.get("dur", 0) for e in kern)
    by_name: dict[str, list[float]] = defaultdict(list)
    by_stream: dict[str, float] = defaultdict(float)
    for e in kern:
        name = e.get("name", "?")
        short = name.split("(")[0].split("<")[0][-60:]
        by_name[short].append(e.get("dur", 0.0))
        by_stream[str(e.get("tid"))] += e.get("dur", 0.0)
    total = sum(sum(v) for v in by_name.values())
    lines = [f"{path}: span {t1 - t0:.0f} us, busy (sum over streams) {total:.0f} us, {len(kern)} events"]
    streams = sorted(by_stream.items(), key=lambda x: -x[1])
    lines.append("streams: " + ", ".join(f"{s}={us:.0f}us" for s, us in streams))
    for name, durs in sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:top]:
        lines.append(f"  {sum(durs):9.0f} us  {len(durs):5d} x {sum(durs) / len(durs):7.1f} us  {name}")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("traces", nargs="+")
    p.add_argument("--top", type=int, default=25)
    a = p.parse_args()
    for t in a.traces:
        print(summarize(t, a.top))


if __name__ == "__main__":
    main()
