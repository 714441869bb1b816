"""How fast can a kernel read scattered entries of pinned host memory? (issue 36's fp8 gather at
0.9 x H2D; the bf16 gather reads at 0.62 x, and at 40 x 16K the gathers are the step.)

A stand-alone probe, not the product: it compiles its own kernels with NVRTC and launches them
through the driver API (ctypes), on a pinned host buffer of `--pool-mib` and `--entries` entries of
`--entry-bytes` each (random or in order), into device memory. Rows, one per load path and grid:

- `ld`: the gather's register path (every lane 16-byte loads, `--unroll` in flight per lane);
- `ld.nc.L2::256B` / `ld.L2::128B`: the same loads with a non-coherent / L2 prefetch-size hint;
- `bulk`: one TMA bulk copy (cp.async.bulk, sm_90) per entry into shared memory, `stages` entries
  in flight per warp, then the lanes store it;
- `memcpy`: one cudaMemcpyAsync of the whole (contiguous) bytes: the ceiling;
- `batch-memcpy` (`--batch-memcpy`, run last: a wrong driver ABI would crash the process): the
  copy engines on the scattered entries, one cuMemcpyBatchAsync (CUDA 12.8+) of every entry.

Usage (on the GPU machine): python experiments/exp_zero_copy.py [--json out.json]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import sys
from pathlib import Path

SRC = r"""
typedef unsigned long long u64;
struct __align__(16) V4 { unsigned x, y, z, w; };

template <int MODE>
__device__ __forceinline__ V4 load16(const V4* p) {
    V4 r;
    if (MODE == 0) {
        r = *p;
    } else if (MODE == 1) {
        asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0,%1,%2,%3}, [%4];"
                     : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
    } else {
        asm volatile("ld.global.L2::128B.v4.u32 {%0,%1,%2,%3}, [%4];"
                     : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
    }
    return r;
}

// Warps stride over the entries; a warp loads UNROLL 16-byte words per lane before storing them.
template <int MODE>
__device__ void gather_ld(const V4* __restrict__ src, V4* __restrict__ dst, const int* __restrict__ idx,
                          int n_entries, int n16) {
    const int lane = threadIdx.x & 31;
    const long warp = (long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    const long warps = (long)gridDim.x * (blockDim.x >> 5);
    for (long e = warp; e < n_entries; e += warps) {
        const V4* s = src + (long)idx[e] * n16;
        V4* d = dst + e * n16;
        for (int base = 0; base < n16; base += 32 * UNROLL) {
            V4 r[UNROLL];
#pragma unroll
            for (int u = 0; u < UNROLL; ++u) {
                const int i = base + u * 32 + lane;
                if (i < n16) r[u] = load16<MODE>(s + i);
            }
#pragma unroll
            for (int u = 0; u < UNROLL; ++u) {
                const int i = base + u * 32 + lane;
                if (i < n16) d[i] = r[u];
            }
        }
    }
}

#define LD(M) \
    extern "C" __global__ void gather_ld##M(const V4* s, V4* d, const int* idx, int n, int n16) { \
        gather_ld<M>(s, d, idx, n, n16); \
    }
LD(0)
LD(1)
LD(2)

__device__ __forceinline__ unsigned smem_addr(const void* p) {
    return (unsigned)__cvta_generic_to_shared(p);
}

__device__ __forceinline__ void bulk_issue(void* slot, const void* src, unsigned bytes,
                                           unsigned long long* bar) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;"
                 :: "r"(smem_addr(bar)), "r"(bytes) : "memory");
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                 :: "r"(smem_addr(slot)), "l"(src), "r"(bytes), "r"(smem_addr(bar)) : "memory");
}

__device__ __forceinline__ void bulk_wait(unsigned long long* bar, unsigned parity) {
    unsigned done = 0;
    while (!done) {
        asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; "
                     "selp.u32 %0, 1, 0, p; }"
                     : "=r"(done) : "r"(smem_addr(bar)), "r"(parity) : "memory");
    }
}

// Each warp keeps STAGES entries in flight as TMA bulk copies into its slots of shared memory
// (dynamic: warps * STAGES * entry bytes), then its lanes store each entry to dst.
extern "C" __global__ void gather_bulk(const V4* __restrict__ src, V4* __restrict__ dst,
                                       const int* __restrict__ idx, int n_entries, int n16) {
    extern __shared__ V4 slots[];
    __shared__ unsigned long long bars[32 * STAGES];
    const int lane = threadIdx.x & 31;
    const int w = threadIdx.x >> 5;
    const long warp = (long)blockIdx.x * (blockDim.x >> 5) + w;
    const long warps = (long)gridDim.x * (blockDim.x >> 5);
    V4* mine = slots + (long)w * STAGES * n16;
    unsigned long long* bar = bars + w * STAGES;
    const unsigned bytes = (unsigned)n16 * 16u;
    if (lane == 0) {
        for (int s = 0; s < STAGES; ++s)
            asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" :: "r"(smem_addr(bar + s)) : "memory");
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncwarp();
    // Entry k of this warp is e = warp + k * warps, in slot k % STAGES, phase (k / STAGES) & 1.
    if (lane == 0) {
        for (int s = 0; s < STAGES; ++s) {
            const long e = warp + (long)s * warps;
            if (e < n_entries) bulk_issue(mine + (long)s * n16, src + (long)idx[e] * n16, bytes, bar + s);
        }
    }
    for (long k = 0;; ++k) {
        const long e = warp + k * warps;
        if (e >= n_entries) break;
        const int s = (int)(k % STAGES);
        bulk_wait(bar + s, (unsigned)((k / STAGES) & 1));
        const V4* slot = mine + (long)s * n16;
        V4* d = dst + e * n16;
        for (int i = lane; i < n16; i += 32) d[i] = slot[i];
        __syncwarp();
        if (lane == 0) {
            const long nxt = e + (long)STAGES * warps;
            if (nxt < n_entries) {
                asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
                bulk_issue(mine + (long)s * n16, src + (long)idx[nxt] * n16, bytes, bar + s);
            }
        }
    }
}
"""


def _nvrtc() -> ctypes.CDLL:
    """libnvrtc: ``OASIS_NVRTC_LIB``, else the one ``scripts/find_nvrtc.py`` picks (the Makefile's
    and oasis-cuda's choice: the newest CUDA major of the environment's NVIDIA wheels)."""
    if os.environ.get("OASIS_NVRTC_LIB"):
        return ctypes.CDLL(os.environ["OASIS_NVRTC_LIB"])
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    from find_nvrtc import find_nvrtc, site_dirs

    found = find_nvrtc(site_dirs())
    if found is None:
        raise SystemExit("no libnvrtc under nvidia/*/lib/; set OASIS_NVRTC_LIB")
    return ctypes.CDLL(str(found))


def compile_cubin(arch: str, unroll: int, stages: int) -> bytes:
    nvrtc = _nvrtc()
    prog = ctypes.c_void_p()
    src = SRC.encode()
    chk = nvrtc.nvrtcCreateProgram(ctypes.byref(prog), src, b"probe.cu", 0, None, None)
    assert chk == 0, chk
    opts = [
        f"--gpu-architecture={arch}".encode(),
        b"-std=c++17",
        f"-DUNROLL={unroll}".encode(),
        f"-DSTAGES={stages}".encode(),
        b"-lineinfo",
    ]
    arr = (ctypes.c_char_p * len(opts))(*opts)
    rc = nvrtc.nvrtcCompileProgram(prog, len(opts), arr)
    size = ctypes.c_size_t()
    nvrtc.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    nvrtc.nvrtcGetProgramLog(prog, log)
    if rc != 0:
        raise SystemExit("nvrtc: " + log.value.decode(errors="replace"))
    nvrtc.nvrtcGetCUBINSize(prog, ctypes.byref(size))
    out = ctypes.create_string_buffer(size.value)
    assert nvrtc.nvrtcGetCUBIN(prog, out) == 0
    return out.raw


class Driver:
    def __init__(self):
        self.cu = ctypes.CDLL("libcuda.so.1")
        self.mods = []

    def check(self, rc, what):
        if rc != 0:
            msg = ctypes.c_char_p()
            self.cu.cuGetErrorString(rc, ctypes.byref(msg))
            raise RuntimeError(f"{what}: {rc} {msg.value}")

    def functions(self, cubin: bytes, names: list[str]) -> dict:
        mod = ctypes.c_void_p()
        self.check(self.cu.cuModuleLoadData(ctypes.byref(mod), cubin), "cuModuleLoadData")
        self.mods.append(mod)
        out = {}
        for n in names:
            f = ctypes.c_void_p()
            self.check(self.cu.cuModuleGetFunction(ctypes.byref(f), mod, n.encode()), n)
            out[n] = f
        return out

    def launch(self, f, grid, block, smem, stream, *args):
        if smem > 48 * 1024:
            self.check(self.cu.cuFuncSetAttribute(f, 8, ctypes.c_int(smem)), "max dynamic smem")
        holders = [ctypes.c_uint64(a) if i < 3 else ctypes.c_int(a) for i, a in enumerate(args)]
        ptrs = [ctypes.cast(ctypes.byref(h), ctypes.c_void_p) for h in holders]
        params = (ctypes.c_void_p * len(holders))(*ptrs)
        rc = self.cu.cuLaunchKernel(f, grid, 1, 1, block, 1, 1, smem, ctypes.c_void_p(stream), params, None)
        self.check(rc, "cuLaunchKernel")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pool-mib", type=int, default=1024)
    ap.add_argument("--entries", type=int, default=65536)
    ap.add_argument("--entry-bytes", type=int, nargs="+", default=[4096, 2048])
    ap.add_argument("--unroll", type=int, default=8)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--json")
    ap.add_argument("--batch-memcpy", action="store_true", help="only the copy engines' batch rows")
    args = ap.parse_args()
    import torch

    dev = torch.device("cuda", 0)
    torch.cuda.init()
    torch.empty(1, device=dev)
    major, minor = torch.cuda.get_device_capability(dev)
    arch = f"sm_{major}{minor}"
    drv = Driver()
    kernels = {}
    for stages in (2, 4):
        cubin = compile_cubin(arch, args.unroll, stages)
        fs = drv.functions(cubin, ["gather_ld0", "gather_ld1", "gather_ld2", "gather_bulk"])
        if stages == 2:
            kernels["ld"] = fs["gather_ld0"]
            kernels["ld.nc.L2::256B"] = fs["gather_ld1"]
            kernels["ld.L2::128B"] = fs["gather_ld2"]
        kernels[f"bulk{stages}"] = fs["gather_bulk"]
    pool = torch.empty(args.pool_mib << 20, dtype=torch.uint8).pin_memory()
    pool.random_(0, 256)
    if args.batch_memcpy:
        return batch_memcpy(args, drv, pool, dev)
    stream = torch.cuda.current_stream(dev).cuda_stream
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    rows = []

    def timed(fn):
        fn()
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(args.iters):
            fn()
        b.record()
        torch.cuda.synchronize()
        return a.elapsed_time(b) / args.iters * 1e-3

    for eb in args.entry_bytes:
        n_slots = pool.numel() // eb
        n = min(args.entries, n_slots)
        dst = torch.empty(n * eb, dtype=torch.uint8, device=dev)
        moved = n * eb
        contiguous = pool[:moved]
        t = timed(lambda dst=dst, contiguous=contiguous: dst.copy_(contiguous, non_blocking=True))
        ceiling = moved / t
        rows.append({"path": "memcpy", "entry_bytes": eb, "order": "contiguous", "GBps": ceiling / 1e9})
        print(f"{eb} B entries: memcpy {ceiling / 1e9:.1f} GB/s", flush=True)
        for order in ("random", "sequential"):
            if order == "random":
                idx = torch.randperm(n_slots)[:n].to(torch.int32).to(dev)
            else:
                idx = torch.arange(n, dtype=torch.int32, device=dev)
            ref = pool.view(n_slots, eb)[idx.long().cpu()].to(dev).view(-1)
            for name, f in kernels.items():
                bulk = name.startswith("bulk")
                stages = int(name[4:]) if bulk else 0
                for blocks, warps in (
                    ((sms, 4), (2 * sms, 4), (4 * sms, 4), (8 * sms, 4))
                    if not bulk
                    else ((sms, 4), (2 * sms, 4), (sms, 8))
                ):
                    smem = warps * stages * eb if bulk else 0
                    if smem > 227 * 1024:
                        continue
                    dst.zero_()
                    try:
                        ptrs = (pool.data_ptr(), dst.data_ptr(), idx.data_ptr(), n, eb // 16)
                        t = timed(lambda k=(f, blocks, 32 * warps, smem, stream, *ptrs): drv.launch(*k))
                        ok = bool(torch.equal(dst, ref))
                    except RuntimeError as e:
                        print(name, blocks, warps, "failed:", e, flush=True)
                        continue
                    report(
                        rows,
                        f"{order:10s} {name:16s} {blocks:5d}x{warps}",
                        path=name,
                        entry_bytes=eb,
                        order=order,
                        blocks=blocks,
                        warps=warps,
                        moved=moved,
                        seconds=t,
                        ceiling=ceiling,
                        exact=ok,
                    )
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"device": torch.cuda.get_device_name(dev), "rows": rows}, fh, indent=1)


def report(rows: list, label: str, *, moved: int, seconds: float, ceiling: float, **row) -> None:
    """Append one row (its bandwidth and its share of the memcpy ceiling) and print it."""
    row.update(GBps=moved / seconds / 1e9, of_h2d=moved / seconds / ceiling)
    rows.append(row)
    print(
        f"{row['entry_bytes']} B {label} {row['GBps']:6.1f} GB/s {row['of_h2d']:5.2f} x memcpy "
        f"exact={row['exact']}",
        flush=True,
    )


class MemLoc(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class MemcpyAttrs(ctypes.Structure):
    _fields_ = [
        ("srcAccessOrder", ctypes.c_int),
        ("srcLocHint", MemLoc),
        ("dstLocHint", MemLoc),
        ("flags", ctypes.c_uint),
    ]


def batch_memcpy(args, drv, pool, dev):
    """The scattered entries by the copy engines: one cuMemcpyBatchAsync (the CUDA 12.8 ABI, which
    the driver keeps under this name) of every entry, host pointers as sources."""
    import torch

    # CUDA 13's entry point has no failIdx; the 12.8 one (kept under the plain name) has.
    v2 = hasattr(drv.cu, "cuMemcpyBatchAsync_v2")
    f = drv.cu.cuMemcpyBatchAsync_v2 if v2 else drv.cu.cuMemcpyBatchAsync
    # Not torch's current stream: that is the legacy NULL stream (handle 0), which
    # cuMemcpyBatchAsync refuses outright as an invalid argument (s28's first try). A created
    # stream; the timing events are recorded on it too.
    side = torch.cuda.Stream(dev)
    stream = side.cuda_stream
    rows = []
    for eb in args.entry_bytes:
        n_slots = pool.numel() // eb
        n = min(args.entries, n_slots)
        dst = torch.empty(n * eb, dtype=torch.uint8, device=dev)
        idx = torch.randperm(n_slots)[:n]
        ref = pool.view(n_slots, eb)[idx].to(dev).view(-1)
        dsts = (ctypes.c_uint64 * n)(*[dst.data_ptr() + i * eb for i in range(n)])
        srcs = (ctypes.c_uint64 * n)(*[pool.data_ptr() + int(j) * eb for j in idx])
        sizes = (ctypes.c_size_t * n)(*([eb] * n))
        # Any source order; no location hints (the driver ignores them for memory that is not
        # managed). s28's invalid argument was the legacy NULL stream, above.
        attrs = MemcpyAttrs(3, MemLoc(0, 0), MemLoc(0, 0), 0)
        idxs = (ctypes.c_size_t * 1)(0)
        fail = ctypes.c_size_t(0)

        call = (dsts, srcs, sizes, ctypes.c_size_t(n), ctypes.byref(attrs), idxs, ctypes.c_size_t(1))
        call += (ctypes.c_void_p(stream),) if v2 else (ctypes.byref(fail), ctypes.c_void_p(stream))

        def run(call=call, fail=fail):
            drv.check(f(*call), f"cuMemcpyBatchAsync (fail index {fail.value})")

        torch.cuda.synchronize()  # dst, ref and the pool are ready before the side stream reads them
        for _ in range(2):
            run()
        torch.cuda.synchronize()
        import time

        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0 = time.perf_counter()
        a.record(side)
        for _ in range(args.iters):
            run()
        b.record(side)
        host_s = (time.perf_counter() - t0) / args.iters
        torch.cuda.synchronize()
        t = a.elapsed_time(b) / args.iters * 1e-3
        ok = bool(torch.equal(dst, ref))
        moved = n * eb
        contiguous = pool[:moved]
        dst2 = torch.empty_like(dst)
        dst2.copy_(contiguous, non_blocking=True)
        torch.cuda.synchronize()
        c0 = torch.cuda.Event(enable_timing=True)
        c1 = torch.cuda.Event(enable_timing=True)
        c0.record()
        for _ in range(args.iters):
            dst2.copy_(contiguous, non_blocking=True)
        c1.record()
        torch.cuda.synchronize()
        ceiling = moved / (c0.elapsed_time(c1) / args.iters * 1e-3)
        report(
            rows,
            f"random batch-memcpy of {n} (host {host_s * 1e3:.1f} ms a call)",
            path="batch-memcpy",
            entry_bytes=eb,
            order="random",
            moved=moved,
            seconds=t,
            ceiling=ceiling,
            exact=ok,
            host_ms=host_s * 1e3,
        )
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"device": torch.cuda.get_device_name(dev), "rows": rows}, fh, indent=1)


if __name__ == "__main__":
    main()
