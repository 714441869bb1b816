"""What every row of ``bench.kernels`` shares: the presets' kernel geometry, CUDA-event and
CUDA-graph timing, the torch profiler's per-kernel breakdown, a pinned host tensor seen from the
device (UVA), and the copy ceilings the rows are ratios to."""

from __future__ import annotations

import statistics
import sys

import torch

from ...models.config import PRESETS as MODEL_PRESETS

#: The kernels' geometry of the model presets benchmarked here (heads from the model's config,
#: blocks of 16 tokens).
PRESETS = {
    name: {
        "num_qo_heads": MODEL_PRESETS[name].num_attention_heads,
        "num_kv_heads": MODEL_PRESETS[name].num_key_value_heads,
        "head_dim": MODEL_PRESETS[name].head_dim,
        "block_size": 16,
    }
    for name in ("qwen3-8b", "qwen3-8b-128k", "llama3.1-8b")
}


def time_cuda(fn, warmup: int = 5, repeat: int = 20) -> float:
    """Median milliseconds of ``fn`` over ``repeat`` eager calls, timed with CUDA events.

    NOTE: an eager call includes the host-side launch cost (Python, argument validation); when that
    exceeds the kernel time the GPU idles between the events. :func:`time_graph` removes it.
    """
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeat):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def time_graph(fn, calls: int = 10, repeat: int = 20) -> float | None:
    """Median milliseconds per call of ``fn`` captured ``calls`` times into one CUDA graph and
    replayed: the device time of the kernels without host launch gaps (how a serving loop with
    CUDA graphs runs them). None when the call cannot be captured."""
    fn()
    torch.cuda.synchronize()
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(calls):
                fn()
    except Exception as e:  # noqa: BLE001 - report and fall back to eager timing
        print(
            f"graph capture failed ({type(e).__name__}: {str(e)[:120]}); eager timing only", file=sys.stderr
        )
        torch.cuda.synchronize()
        return None
    times = []
    for _ in range(repeat):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / calls)
    return statistics.median(times)


def time_both(fn) -> tuple[float, float]:
    """(milliseconds used for the ratios, eager milliseconds): graph-replayed when capturable."""
    eager = time_cuda(fn)
    g = time_graph(fn)
    return (g if g is not None else eager), eager


def kernel_breakdown(fn, calls: int = 20) -> dict[str, float]:
    """Device microseconds per call of each kernel ``fn`` launches (torch profiler over ``calls``
    eager calls): where a chain's time goes. Graph time minus their sum is the gaps between
    kernels."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    out: dict[str, float] = {}
    for ev in prof.key_averages():
        t = getattr(ev, "self_device_time_total", None)
        if t is None:
            t = getattr(ev, "self_cuda_time_total", 0.0)
        if t > 0:
            out[ev.key[:60]] = round(t / calls, 2)
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def i32(x, dev):
    return torch.as_tensor(x, dtype=torch.int32).to(dev)


def uva_view(host: torch.Tensor, dev) -> torch.Tensor:
    """A pinned, contiguous CPU tensor as a CUDA tensor over the same bytes (unified addressing):
    kernels that read it issue their loads over PCIe, as the gathers do. torch takes the pointer
    through ``__cuda_array_interface__`` (it accepts host memory registered with CUDA)."""

    class _Host:
        __cuda_array_interface__ = {
            "shape": tuple(host.shape),
            "typestr": {torch.int32: "<i4", torch.uint8: "|u1"}[host.dtype],
            "data": (host.data_ptr(), False),
            "strides": None,
            "version": 2,
        }

    return torch.as_tensor(_Host(), device=dev)


def ceilings(dev) -> dict:
    """The copy ceilings the rows are ratios to: ``d2d_copy_Bps`` (a device copy, read + write),
    ``h2d_pinned_Bps`` (one cudaMemcpy of pinned host memory: the copy engines), and
    ``h2d_sm_Bps``: pinned host memory read by an SM kernel (torch's elementwise ``bitwise_not``
    over :func:`uva_view`), the path every gather takes. On some hosts SM reads of host memory run
    well below the copy engines (34 against 55 GB/s on the H100 hosts of s20-s27; 51 on s28's),
    so a gather's ``ratio_to_h2d`` is bounded by ``h2d_sm_Bps / h2d_pinned_Bps``; None where
    torch refuses the view."""
    n = 1 << 30  # 1 GiB
    src = torch.empty(n, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    ms = time_cuda(lambda: dst.copy_(src))
    d2d = 2 * n / (ms * 1e-3)
    host = torch.empty(n // 4, dtype=torch.uint8).pin_memory()
    dh = torch.empty(n // 4, dtype=torch.uint8, device=dev)
    ms = time_cuda(lambda: dh.copy_(host, non_blocking=True))
    h2d = (n // 4) / (ms * 1e-3)
    try:
        words = uva_view(host.view(torch.int32), dev)
        out = dh.view(torch.int32)
        ms = time_cuda(lambda: torch.bitwise_not(words, out=out))
        ok = bool(torch.equal(out.cpu(), torch.bitwise_not(host.view(torch.int32))))
        h2d_sm = (n // 4) / (ms * 1e-3) if ok else None
    except (RuntimeError, TypeError, ValueError) as e:  # torch refused the view: say so, go on
        print(f"no SM read ceiling ({e})", file=sys.stderr)
        h2d_sm = None
    return {"d2d_copy_Bps": d2d, "h2d_pinned_Bps": h2d, "h2d_sm_Bps": h2d_sm}
