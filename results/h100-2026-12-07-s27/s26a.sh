# s26 call 1 of 3 (one warm lease; each call under run's 600 s; then s26d.sh, s26e.sh): install;
# the GPU tests of the kv8 tensor-core kernels (both: "tile" and "registers", eb974fa) and of the
# 8-bit bound's score (both: "fma" and "mma", af08671), in-step reads, the sparse prefill (the
# read-back race fixed in 481ff11) and the key codes; bench.kernels' attention rows (fp8 under each
# kernel) and score rows (the default chain under each bound8 kernel). Outputs land in $OUT.
set -u
TESTS="tests/kernels/test_gpu_kv8.py tests/kernels/test_gpu_bound8.py tests/kernels/test_gpu_wait_epoch.py tests/engine/test_gpu_sparse_prefill.py tests/disagg/test_gpu_disagg.py tests/kernels/test_gpu_key_codes.py" \
  OVERLAY_PY=1 BENCH_ARGS="--only attention" BENCH_SECS=${BENCH_SECS:-100} PYTEST_SECS=${PYTEST_SECS:-280} \
  bash scripts/device.sh run 2>&1 | tail -4
grep -o '"label": "[^"]*attn[^"]*"\|"ratio_to_d2d": [0-9.]*\|"refcheck_max_abs_err": [0-9.e-]*' $OUT/bench-kernels.json 2>/dev/null | paste - - - | head -12
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
R=$PWD
# The selection chains, the 8-bit bound under "fma" and "mma" (af08671): the "[mma bound8]" rows.
(cd /tmp && timeout 100 python3 -m oasiskv.bench.kernels --only score --json $OUT/bench-score.json > $OUT/bench-score.log 2>&1; echo "rc=$?" >> $OUT/bench-score.log)
grep -i "chain\|staged\|mma\|rc=" $OUT/bench-score.log | head -24
