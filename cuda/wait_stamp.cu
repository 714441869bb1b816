// wait_stamp.cu — how long the compute stream waits for the background streams (the transfers).
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
