// wait_stamp.cu — the stream waits: how long the compute stream waits for the background streams
// (the transfers), and a layer's wait for its remote reads.
//
// wait_epoch: a disaggregated decode step publishes each layer's plan to the host (copies into
// pinned memory, then the step's epoch into the layer's ready word); the coordinator's step reader
// reads the plan's missing block-heads into the host pool while the step goes on, then writes the
// epoch into the layer's landed word. wait_epoch, queued before the layer's gather on its
// background stream, holds that stream until the landed word reaches the step's epoch (read from
// device memory, so a captured graph waits for each replay's own epoch), or gives up after
// timeout_ns (stats[0] += 1, stats[1] = the epoch: the engine fails the step's remote requests).
// stats[2] adds the nanoseconds it held the stream, stats[3] counts the waits (atomics: the
// layers' background streams wait at once). One thread; it sleeps a microsecond between looks.
// CPU twin: oasis_core::kernels::wait_epoch.
//
// The engine queues wait_stamp(mode 0) on the compute stream just before it waits on background
// work (an event or a stream join) and wait_stamp(mode 1) just after: the second kernel runs
// only once the wait is over, so the difference of the two device clocks is the time the stream
// was held (plus the launch gap between two kernels, about a microsecond in a graph). Kernels,
// not CUDA events, because they are captured into a CUDA graph like any other node and need no
// host synchronisation; the totals are read when a metric is asked for.
//
// CPU twin: oasis_core::kernels::wait_stamp (the CPU path never waits: its chain runs inline).
#include "oasis_common.cuh"
#include "oasis_params.cuh"

namespace oasis {

// The GPU's global nanosecond timer (the same on every SM).
__device__ __forceinline__ u64 global_ns() {
    u64 t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

}  // namespace oasis

extern "C" __global__ void wait_epoch(const __grid_constant__ oasis::WaitEpochParams p) {
    if (threadIdx.x != 0 || blockIdx.x != 0) return;
    const oasis::u64 want = static_cast<oasis::u64>(*p.epoch);
    const volatile oasis::u64* landed = p.landed;
    const oasis::u64 t0 = oasis::global_ns();
    oasis::u64 now = t0;
    while (*landed < want) {
        if (now - t0 > static_cast<oasis::u64>(p.timeout_ns)) {
            atomicAdd(p.stats, 1ull);
            atomicExch(p.stats + 1, want);
            break;
        }
        __nanosleep(1000);
        now = oasis::global_ns();
    }
    atomicAdd(p.stats + 2, now - t0);
    atomicAdd(p.stats + 3, 1ull);
    // The gather after this reads host rows the reader wrote before it wrote `landed`.
    __threadfence_system();
}

// One thread. mode 0: stamps[0] = now. Otherwise: stamps[1] += now - stamps[0] (0 if the clock
// went back), stamps[2] += 1. Ordered after the previous kernel of the stream, so it sees
// stamps[0] of the mode-0 kernel before it.
extern "C" __global__ void wait_stamp(const __grid_constant__ oasis::WaitStampParams p) {
    if (threadIdx.x != 0 || blockIdx.x != 0) return;
    const oasis::u64 now = oasis::global_ns();
    if (p.mode == 0) {
        p.stamps[0] = now;
    } else {
        const oasis::u64 start = p.stamps[0];
        p.stamps[1] += now > start ? now - start : 0;
        p.stamps[2] += 1;
    }
}
