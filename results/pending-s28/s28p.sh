# s28p (one call, carry dist .whl; about 6 minutes): the 40 x 16K step pair with silu_mul off and on
# (s27d's timed part; s28 ran its GPU tests, which passed, but 60 s per run was too short). If the
# step is not slower with silu_mul, set transformer.FUSED_SILU_MUL = True.
set -u
TESTS="tests/kernels/test_gpu_silu_mul.py" NO_BENCH=1 OVERLAY_PY=1 PYTEST_SECS=60 \
  bash scripts/device.sh run 2>&1 | tail -2
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
R=$PWD
cd /tmp
for s in --no-silu-mul --silu-mul; do
  timeout 170 python3 $R/experiments/exp_step_host.py --full --same-prompt --cuda-graph --no-recall \
    --requests 40 --context 16384 --top-k-blocks 128 --steps 8 --variants fidmma:2:0,fast:2:0 --repeat 1 \
    $s --json $OUT/p0-40x16384$s.json > $OUT/p0-40x16384$s.log 2>&1; echo "$s rc=$?"
  grep -o '"selection": "[a-z]*".\{0,100\}step_ms": [0-9.]*' $OUT/p0-40x16384$s.log | sed 's/"background.*step_ms"/step/' | head -2
done
