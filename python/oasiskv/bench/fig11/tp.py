"""``--fig11 --tp N``: the job each rank runs under :func:`~oasiskv.parallel.run_tp`. Rank 0 runs
the sweep on a :class:`~oasiskv.parallel.TPLLMEngine` and writes the report; the other ranks build
the engine of each set of options rank 0 broadcasts and follow it (``worker_loop``).
"""

from __future__ import annotations

from .model import build_model, free_memory
from .report import write_reports
from .sweep import Fig11


def tp_job(group, args):
    """One rank of ``--fig11 --tp``: rank 0 runs the sweep (writing the report after every row)
    and returns it; the others build an engine for each set of options rank 0 sends and follow
    it, until rank 0 says it is done."""
    if group.rank != 0:
        return tp_worker(group, args)
    fig = None
    try:
        fig = Fig11(args, group)
        return fig.run(checkpoint=lambda rep: write_reports(args, rep))
    finally:
        if group.broken is None:
            if fig is not None:
                fig.close_live()
            group.broadcast_object(("done", None))


def tp_worker(group, args) -> None:
    """A rank other than 0: build this rank's shard of the model, then for every ``("engine",
    options)`` rank 0 broadcasts make that engine (with this rank's own prefill cache of the
    context rank 0 tags) and follow it, until ``("done", None)``."""
    from ...engine import PrefillCache
    from ...parallel import TPLLMEngine

    model, _, dev = build_model(args, group)
    import torch

    caches: dict = {}  # rank 0's cache tag -> this rank's cache (of its shard), the latest only
    while True:
        kind, kw = group.broadcast_object(None)
        if kind == "done":
            return None
        tag = kw.get("prefill_cache")
        if tag is not None:
            if tag not in caches:
                caches.clear()  # a new context: the last one's entry goes
                caches[tag] = PrefillCache(on_host=tag[2])  # ("prefill-cache", ctx, on_host)
            kw = {**kw, "prefill_cache": caches[tag]}
        eng = TPLLMEngine(model, group=group, **kw)
        eng.worker_loop()
        del eng
        free_memory(torch, dev)
