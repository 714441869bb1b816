# s29a (one call, carry dist .whl; about 5 minutes): install; the kv8 GPU tests and the attention
# rows of bench.kernels (the fp8 kernels now read their pages' scales with the item list); then
# Nsight Compute on one warm launch of the bf16 and the fp8 `registers` decode attention at batch
# 256 (129 pages a sequence, the bench.kernels rows), and the fp8 kernel's time at each split
# count. Why the fp8 kernel read at 0.70 x copy while bf16 reads at 1.00 x (issue 36's 0.8).
set -u
TESTS="tests/kernels/test_gpu_kv8.py" BENCH_ARGS="--only attention" OVERLAY_PY=1 PYTEST_SECS=150 BENCH_SECS=100 \
  bash scripts/device.sh run -k "attention or tensor_core" 2>&1 | grep -v "^$" | tail -14
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
R=$PWD
NCU=$(command -v ncu || ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -1)
echo "ncu: ${NCU:-none}"
cd /tmp
for k in registers:256:0 registers:256:2 bf16:256:0 registers:64:0 registers:64:2; do
  IFS=: read kern bs s <<< "$k"
  python3 $R/experiments/prof_attn.py --kernel $kern --batch $bs --splits $s --calls 20 --time
done 2>&1 | tee $OUT/times.txt
if [ -n "${NCU:-}" ]; then
  for k in ${NCU_KERNELS:-registers:256 bf16:256}; do
    kern=${k%%:*}; bs=${k##*:}
    timeout ${NCU_SECS:-120} $NCU --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
      --section SchedulerStats --section MemoryWorkloadAnalysis --section InstructionStats \
      --metrics 'regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio' \
      -k regex:decode_attn --launch-skip 2 --launch-count 1 \
      python3 $R/experiments/prof_attn.py --kernel $kern --batch $bs --calls 3 > $OUT/ncu-$kern-$bs.txt 2>&1
    echo "ncu $kern rc=$?"
    grep -E "decode_attn|Duration|Throughput|Registers|Achieved Occupancy|Theoretical Occupancy|Block Limit|Warp Cycles Per Issued|Issued Ipc|No Eligible|Stall|One or More|Eligible Warps|Shared Memory Configuration|Dynamic Shared|Waves|stalled" $OUT/ncu-$kern-$bs.txt | head -90
  done
fi
