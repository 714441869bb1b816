# s27c (one call, carry dist .whl; about 5 minutes; replaces s27a when device time is short): the
# GPU tests of silu_mul (the MLP's silu(gate) * up in one kernel) and of the fused decoder; then
# issue 33's step pairs, fidelity (mma bound) and fast alternating, at 40 x 16K: silu_mul off
# (torch's two kernels), on, and on with a high-priority capture stream; at 20 x 32K: on, and on
# at high priority.
set -u
TESTS="tests/kernels/test_gpu_silu_mul.py tests/kernels/test_gpu_fused.py" NO_BENCH=1 OVERLAY_PY=1 PYTEST_SECS=90 \
  bash scripts/device.sh run 2>&1 | tail -3
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
R=$PWD
cd /tmp
for spec in "40 16384 0 --no-silu-mul" "40 16384 0 --silu-mul" "40 16384 -1 --silu-mul" "20 32768 0 --silu-mul" "20 32768 -1 --silu-mul"; do
  set -- $spec
  tag="p$3-$1x$2$4"
  timeout 150 python3 $R/experiments/exp_step_host.py --full --same-prompt --cuda-graph --no-recall \
    --requests $1 --context $2 --top-k-blocks 128 --steps 8 --variants fidmma:2:0,fast:2:0 --repeat 2 \
    --capture-priority $3 ${4:-} --json $OUT/$tag.json > $OUT/$tag.log 2>&1; echo "$tag rc=$?"
  grep -o '"selection": "[a-z]*".\{0,100\}step_ms": [0-9.]*' $OUT/$tag.log | sed 's/"background.*step_ms"/step/' | head -4
done
