# s25 call: install; the GPU tests of the sparse prefill (the read-back race fixed), in-step reads
# and key codes (d3802d4); Fig. 12 over TCP with in-step reads; the 32K prefill read-back variants;
# the 40 x 16K step with and without the sparse admission.
set -u
TESTS="tests/engine/test_gpu_sparse_prefill.py tests/disagg/test_gpu_disagg.py tests/kernels/test_gpu_key_codes.py" \
  OVERLAY_PY=1 NO_BENCH=1 PYTEST_SECS=${PYTEST_SECS:-150} bash scripts/device.sh run 2>&1 | tail -4
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
R=$PWD; S=$R/results/h100-2026-12-07-s25/scripts-s24
DISAGG_SECS=${DISAGG_SECS:-150} bash scripts/device.sh disagg --preset qwen3-8b --prompt-tokens 16384 --max-tokens 64 \
  --requests 6 --rates 0.2,0.8 --top-k-blocks 128 --fetch-cap 0.05 --transport tcp --cuda-graph --kv-in-step-reads > /dev/null
grep "^| \(full\|partial\)" $OUT/disagg.md | head -4
(cd /tmp; for v in default old; do timeout 60 python3 $S/prefill_variants.py $v 32768 $OUT/pv-$v.json > $OUT/pv-$v.log 2>&1; echo "$v rc=$?"; grep chunked $OUT/pv-$v.log; done)
(cd /tmp; for dsp in 1 0; do timeout 70 python3 $R/results/pending-s25/step_direct.py $dsp $R/experiments/exp_step_host.py --full --same-prompt --cuda-graph --no-recall \
  --requests 40 --context 16384 --top-k-blocks 128 --steps 10 --variants fast:2:0 --repeat 1 --json $OUT/sd-$dsp.json > $OUT/sd-$dsp.log 2>&1; echo "direct=$dsp rc=$?"; grep step_ms $OUT/sd-$dsp.log | head -2; done)
