# s22 lease 2 (one call, ~9 min of device time left): fused chain + kv8 tests, fp8 attention rows, issue 33's pairs
TESTS="tests/kernels/test_gpu_key_codes.py tests/kernels/test_gpu_kv8.py tests/engine/test_gpu_long.py" \
  PYTEST_SECS=150 BENCH_SECS=60 BENCH_ARGS="--only attention" bash scripts/device.sh run -q -x 2>&1 | tail -8
grep -i "attn" $OUT/bench-kernels.log | head -8
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
R=$OUT/m.txt; REPO=$PWD
cd /tmp; . $REPO/.stage/d/row.sh
E="--host-kv-budget 100GiB --prefill-cache device --max-tokens 64 --drafter eagle3"
row f32 95 --preset qwen3-8b --contexts 32768 --modes oasis --concurrency 22 $E
row q32 95 --preset qwen3-8b --contexts 32768 --modes oasis --concurrency 22 $E --selection fast
cat $R
row f16 95 --preset qwen3-8b --contexts 16384 --modes oasis --concurrency 44 $E
row q16 95 --preset qwen3-8b --contexts 16384 --modes oasis --concurrency 44 $E --selection fast
cat $R
