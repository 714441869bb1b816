# s25's last device minutes: install; the GPU tests of in-step reads and the fixed read-back;
# Fig. 12 with in-step reads over TCP.
set -u
TESTS="tests/kernels/test_gpu_wait_epoch.py tests/disagg/test_gpu_disagg.py tests/engine/test_gpu_sparse_prefill.py" \
  OVERLAY_PY=1 NO_BENCH=1 PYTEST_SECS=${PYTEST_SECS:-110} bash scripts/device.sh run 2>&1 | tail -4
DISAGG_SECS=${DISAGG_SECS:-130} bash scripts/device.sh disagg --preset qwen3-8b --prompt-tokens 16384 --max-tokens 64 \
  --requests 6 --rates 0.2,0.8 --top-k-blocks 128 --fetch-cap 0.05 --transport tcp --cuda-graph --kv-in-step-reads > /dev/null
grep "^| \(full\|partial\)" $OUT/disagg.md | head -4
