# s25 call: install; the GPU tests of the sparse prefill (the read-back race fixed), in-step reads
# and key codes (d3802d4); Fig. 12 with in-step reads over TCP, then UCX (batched gets); the
# 40 x 16K step with and without the sparse admission. Outputs land in $OUT as they finish.
set -u
TESTS="tests/kernels/test_gpu_wait_epoch.py tests/engine/test_gpu_sparse_prefill.py tests/disagg/test_gpu_disagg.py tests/kernels/test_gpu_key_codes.py" \
  OVERLAY_PY=1 NO_BENCH=1 PYTEST_SECS=${PYTEST_SECS:-150} bash scripts/device.sh run 2>&1 | tail -4
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
R=$PWD
for t in tcp ucx; do
  DISAGG_SECS=${DISAGG_SECS:-150} bash scripts/device.sh disagg --preset qwen3-8b --prompt-tokens 16384 --max-tokens 64 \
    --requests 6 --rates 0.2,0.8 --top-k-blocks 128 --fetch-cap 0.05 --transport $t --cuda-graph --kv-in-step-reads > /dev/null
  mv $OUT/disagg.md $OUT/disagg-in-step-$t.md 2>/dev/null; mv $OUT/disagg.json $OUT/disagg-in-step-$t.json 2>/dev/null
  mv $OUT/disagg.log $OUT/disagg-in-step-$t.log 2>/dev/null
  echo "== $t"; grep "^| \(full\|partial\)" $OUT/disagg-in-step-$t.md | head -4
done
(cd /tmp; for dsp in 1 0; do timeout 70 python3 $R/results/pending-s25/step_direct.py $dsp $R/experiments/exp_step_host.py --full --same-prompt --cuda-graph --no-recall \
  --requests 40 --context 16384 --top-k-blocks 128 --steps 10 --variants fast:2:0 --repeat 1 --profile $OUT/sd-$dsp-prof.txt --json $OUT/sd-$dsp.json > $OUT/sd-$dsp.log 2>&1; echo "direct=$dsp rc=$?"; grep step_ms $OUT/sd-$dsp.log | head -2; done)
