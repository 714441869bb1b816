# s26 call (one warm lease, ~11 min): install; the GPU tests of the kv8 tensor-core kernels (both:
# "tile" and "registers", eb974fa) and of the 8-bit bound's score (both: "fma" and "mma",
# af08671), in-step reads, the sparse prefill (the read-back race fixed in
# 481ff11) and the key codes; bench.kernels' attention rows (fp8 under each kernel) and score rows
# (the default chain under each bound8 kernel); Fig. 12 with
# in-step reads over TCP, then UCX, then TCP with four connections; the 40 x 16K step with and
# without the sparse admission; issue 33's pair at 20 x 32K with the bound8 MMA kernel.
# Outputs land in $OUT as they finish.
set -u
TESTS="tests/kernels/test_gpu_kv8.py tests/kernels/test_gpu_bound8.py tests/kernels/test_gpu_wait_epoch.py tests/engine/test_gpu_sparse_prefill.py tests/disagg/test_gpu_disagg.py tests/kernels/test_gpu_key_codes.py" \
  OVERLAY_PY=1 BENCH_ARGS="--only attention" BENCH_SECS=${BENCH_SECS:-120} PYTEST_SECS=${PYTEST_SECS:-300} \
  bash scripts/device.sh run 2>&1 | tail -4
grep -o '"label": "[^"]*attn[^"]*"\|"ratio_to_d2d": [0-9.]*\|"refcheck_max_abs_err": [0-9.e-]*' $OUT/bench-kernels.json 2>/dev/null | paste - - - | head -12
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
R=$PWD
# The selection chains, the 8-bit bound under "fma" and "mma" (af08671): the "[mma bound8]" rows.
(cd /tmp && timeout 120 python3 -m oasiskv.bench.kernels --only score --json $OUT/bench-score.json > $OUT/bench-score.log 2>&1; echo "rc=$?" >> $OUT/bench-score.log)
grep -i "chain\|staged\|mma\|rc=" $OUT/bench-score.log | head -24
for t in tcp ucx; do
  DISAGG_SECS=${DISAGG_SECS:-150} bash scripts/device.sh disagg --preset qwen3-8b --prompt-tokens 16384 --max-tokens 64 \
    --requests 6 --rates 0.2,0.8 --top-k-blocks 128 --fetch-cap 0.05 --transport $t --cuda-graph --kv-in-step-reads > /dev/null
  mv $OUT/disagg.md $OUT/disagg-in-step-$t.md 2>/dev/null; mv $OUT/disagg.json $OUT/disagg-in-step-$t.json 2>/dev/null
  mv $OUT/disagg.log $OUT/disagg-in-step-$t.log 2>/dev/null
  echo "== $t"; grep "^| \(full\|partial\)" $OUT/disagg-in-step-$t.md | head -4
done
# The same over TCP with four connections (frames go round robin across them in layer order; one
# connection reads about 2.5 GB/s of per-head entries on loopback, s26's CPU bench).
DISAGG_SECS=${DISAGG_SECS:-150} bash scripts/device.sh disagg --preset qwen3-8b --prompt-tokens 16384 --max-tokens 64 \
  --requests 6 --rates 0.2,0.8 --top-k-blocks 128 --fetch-cap 0.05 --transport tcp --cuda-graph --kv-in-step-reads --read-connections 4 > /dev/null
for x in md json log; do mv $OUT/disagg.$x $OUT/disagg-in-step-tcp4.$x 2>/dev/null; done
echo "== tcp x4"; grep "^| \(full\|partial\)" $OUT/disagg-in-step-tcp4.md | head -4
(cd /tmp; for dsp in 1 0; do timeout 100 python3 $R/results/pending-s26/step_direct.py $dsp $R/experiments/exp_step_host.py --full --same-prompt --cuda-graph --no-recall \
  --requests 40 --context 16384 --top-k-blocks 128 --steps 10 --variants fidelity:2:0,fidmma:2:0,fast:2:0 --repeat 1 --profile $OUT/sd-$dsp-prof.txt --json $OUT/sd-$dsp.json > $OUT/sd-$dsp.log 2>&1; echo "direct=$dsp rc=$?"; grep step_ms $OUT/sd-$dsp.log | head -4; done)
# Issue 33's pair at 20 x 32K with the bound8 MMA kernel (fidmma) beside fidelity and fast.
(cd /tmp; timeout 150 python3 $R/experiments/exp_step_host.py --full --same-prompt --cuda-graph --no-recall \
  --requests 20 --context 32768 --top-k-blocks 128 --steps 10 --variants fidelity:2:0,fidmma:2:0,fast:2:0 --repeat 2 \
  --json $OUT/pairs-32k.json > $OUT/pairs-32k.log 2>&1; echo "pairs-32k rc=$?"; grep '"selection"' $OUT/pairs-32k.log | cut -c1-120)
