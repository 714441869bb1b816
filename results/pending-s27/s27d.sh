# s27d (one call, carry dist .whl; about 7 minutes): the GPU tests of silu_mul and of the fused decoder
# (both MLP paths); then issue 33's step pair at 40 x 16K with silu_mul off and on (fidelity with
# the mma bound, and fast, alternating). The short form of s27c.sh. (s28: 60 s per run was too short to
# build the full host pool: 150 s.)
set -u
TESTS="tests/kernels/test_gpu_silu_mul.py tests/kernels/test_gpu_fused.py" NO_BENCH=1 OVERLAY_PY=1 PYTEST_SECS=70 \
  bash scripts/device.sh run 2>&1 | tail -3
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
R=$PWD
cd /tmp
for s in --no-silu-mul --silu-mul; do
  timeout 150 python3 $R/experiments/exp_step_host.py --full --same-prompt --cuda-graph --no-recall \
    --requests 40 --context 16384 --top-k-blocks 128 --steps 8 --variants fidmma:2:0,fast:2:0 --repeat 1 \
    $s --json $OUT/p0-40x16384$s.json > $OUT/p0-40x16384$s.log 2>&1; echo "$s rc=$?"
  grep -o '"selection": "[a-z]*".\{0,100\}step_ms": [0-9.]*' $OUT/p0-40x16384$s.log | sed 's/"background.*step_ms"/step/' | head -2
done
