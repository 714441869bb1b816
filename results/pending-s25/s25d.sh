# s25 call: install; the GPU tests of the sparse prefill (the read-back race fixed), in-step reads
# and key codes; the 32K prefill read-back variants; Fig. 12 over TCP with in-step reads.
set -u
TESTS="tests/engine/test_gpu_sparse_prefill.py tests/disagg/test_gpu_disagg.py tests/kernels/test_gpu_key_codes.py" \
  OVERLAY_PY=1 NO_BENCH=1 PYTEST_SECS=${PYTEST_SECS:-150} bash scripts/device.sh run 2>&1 | tail -5
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
R=$PWD; S=$R/results/h100-2026-12-07-s25/scripts-s24
(cd /tmp; for v in default old; do timeout 100 python3 $S/prefill_variants.py $v 32768 $OUT/pv-$v.json > $OUT/pv-$v.log 2>&1; echo "$v rc=$?"; grep chunked $OUT/pv-$v.log; done)
DISAGG_SECS=${DISAGG_SECS:-200} bash scripts/device.sh disagg --preset qwen3-8b --prompt-tokens 16384 --max-tokens 64 \
  --requests 6 --rates 0.2,0.8 --top-k-blocks 128 --fetch-cap 0.05 --transport tcp --cuda-graph --kv-in-step-reads > /dev/null
grep "^| \(full\|partial\)" $OUT/disagg.md | head -4
