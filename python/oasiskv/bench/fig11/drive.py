"""One run of a row: ``C`` requests added at once, all prefilled, then decoded together, with the
decode steps timed (and on CUDA one profiled); plus the prompts it runs and the percentiles it
reports.

It drives any engine with :class:`~oasiskv.LLMEngine`'s interface (a
:class:`~oasiskv.parallel.TPLLMEngine` too) and knows nothing of budgets, modes or reports.
"""

from __future__ import annotations

import time

from ..common import PROMPT_ID_RANGE, percentile


class DoesNotFit(Exception):
    """Not every request of a row was admitted: the pools are full."""


def p50_p99(xs: list[float]) -> tuple[float | None, float | None]:
    """The median and 99th percentile of ``xs`` (None of none)."""
    return percentile(xs, 0.5), percentile(xs, 0.99)


def make_prompts(vocab: int, n_tokens: int, count: int, shared: bool, seed: int) -> list[list[int]]:
    """``count`` random prompts of ``n_tokens`` ids (the same one ``count`` times when ``shared``),
    drawn from ``seed`` and the length."""
    import random

    lo, hi = PROMPT_ID_RANGE if vocab >= PROMPT_ID_RANGE[1] else (0, vocab)
    rnd = random.Random(f"{seed}-{n_tokens}")
    one = [rnd.randrange(lo, hi) for _ in range(n_tokens)]
    if shared:
        return [one] * count
    return [one] + [[rnd.randrange(lo, hi) for _ in range(n_tokens)] for _ in range(count - 1)]


def profiled(torch, fn, trace: str | None = None):
    """``fn()`` under ``torch.profiler``: its result, the CUDA kernels launched and the copies
    (memcpy / memset) queued; with ``trace``, the Chrome trace of it written there (host and
    streams: where a step's time goes, e.g. a drafter between two steps)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        out = fn()
        torch.cuda.synchronize()
    if trace:
        prof.export_chrome_trace(trace)
    kernels = copies = 0
    for e in prof.events():
        if e.device_type != torch.autograd.DeviceType.CUDA:
            continue
        if e.name.startswith(("Memcpy", "Memset", "memcpy", "memset")):
            copies += 1
        else:
            kernels += 1
    return out, kernels, copies


def drive(
    eng, prompts: list[list[int]], max_tokens: int, profile_step: int | None = None, trace: str | None = None
) -> dict:
    """Add every prompt at once, prefill them all (no decode step), then decode them together.

    Returns TTFTs (from the common arrival), the timed decode steps (every step but the first and
    the profiled one, and, where requests finish apart -- speculative decoding --, those that
    began with fewer than all of them running), the tokens those steps made, each one's time per
    output token (its time over the tokens it made per request), the kernel counts of the
    profiled step, and each request's final output.
    """
    import torch

    from ...llm_engine import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    rids = [eng.add_request(p, params) for p in prompts]
    ttft: dict[str, float] = {}
    # The admission + prefill half of the step alone (LLMEngine.prefill_only), so that the decode
    # phase starts with every request running. One request per call (max_num_batched_tokens = the
    # context), so each TTFT is its own.
    while len(ttft) < len(rids):  # each request is in one round's done, once
        round_ = eng.prefill_only()
        now = time.perf_counter()
        for rid, error in round_.done:
            if error is not None and rid in round_.out_of_memory:
                # The pools fit (the row's fit checked them), the prefill's activations beside
                # them did not: the row is skipped with the reason, the sweep goes on.
                raise DoesNotFit(
                    f"request {rid}'s prefill ran out of device memory beside {eng.num_running} "
                    f"running requests: {error.splitlines()[0][:200]}"
                )
            if error is not None:
                raise RuntimeError(f"request {rid} failed: {error}")
            ttft.setdefault(rid, now - t0)
        if not round_.progressed:
            raise DoesNotFit(
                f"only {eng.num_running} of {len(prompts)} requests were admitted (the pools are full)"
            )
    cuda = eng.engine.device.type == "cuda"
    finals: dict = {}
    times: list[float] = []
    tpots: list[float] = []
    timed_tokens = 0
    kernels = copies = None
    waited = 0.0  # seconds the compute stream waited on transfers, over the timed steps
    wait_seen = eng.engine.transfer_wait()[0]  # the counter after the last step
    i = 0
    while eng.has_unfinished_requests():
        n = eng.num_running
        t = time.perf_counter()
        if i == profile_step and cuda:
            outs, kernels, copies = profiled(torch, eng.step, trace)
        else:
            outs = eng.step()
        dt = time.perf_counter() - t
        timed = i > 0 and i != profile_step and n == len(prompts)
        if timed:
            made = sum(len(o.new_token_ids) for o in outs)
            times.append(dt)
            tpots.append(dt * n / made if made else dt)
            timed_tokens += made
        wait_now = eng.engine.transfer_wait()[0]  # one read per step, outside its timing
        if timed:
            waited += wait_now - wait_seen
        wait_seen = wait_now
        for o in outs:
            if o.finished:
                if o.finish_reason != "length":
                    raise RuntimeError(f"request {o.request_id} finished with {o.finish_reason}: {o.error}")
                finals[o.request_id] = o
        i += 1
    return {
        "ttft": [ttft[r] for r in rids],
        "times": times,
        "tpots": tpots,
        "timed_tokens": timed_tokens,
        "transfer_wait_s": waited,
        "kernels": kernels,
        "copies": copies,
        "outputs": [finals[r] for r in rids],
    }
