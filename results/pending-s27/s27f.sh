# s27f (one call, carry dist .whl; about 4 minutes): install; the GPU tests of the kv8 tensor-core
# kernels, all three ("tile", "registers", "registers-deep": twice the pipeline depth), over long
# sequences too; then bench.kernels' attention rows (issue 36's 0.8 x copy).
set -u
TESTS="tests/kernels/test_gpu_kv8.py" OVERLAY_PY=1 PYTEST_SECS=150 BENCH_ARGS="--only attention" BENCH_SECS=120 \
  bash scripts/device.sh run -k "tensor_core" 2>&1 | tail -4
grep -o '"label": "[^"]*attn[^"]*"\|"ratio_to_d2d": [0-9.]*' $OUT/bench-kernels.json 2>/dev/null | paste - - | head -12
