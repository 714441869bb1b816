# s29b (one call after an install in the lease, carry dist .whl; about 5 minutes): issue 33's 40 x 16K
# step pairs (fidelity with the mma bound, fast) in ONE process, so the 96 GB host pool is built
# once: silu_mul off and on at the capture stream's default priority, then silu_mul on with a
# high-priority capture stream; twice round (variants SELECTION:STREAMS:FUSED:SILU:PRIO). If the
# fidelity step is not slower with silu_mul, set transformer.FUSED_SILU_MUL = True.
set -u
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
R=$PWD
cd /tmp
V=fidmma:2:0:0:0,fast:2:0:0:0,fidmma:2:0:1:0,fast:2:0:1:0,fidmma:2:0:1:-1,fast:2:0:1:-1
timeout ${SECS:-420} python3 $R/experiments/exp_step_host.py --full --same-prompt --cuda-graph --no-recall \
  --requests 40 --context 16384 --top-k-blocks 128 --steps 8 --variants $V --repeat 2 \
  --json $OUT/s29b-40x16384.json > $OUT/s29b-40x16384.log 2>&1; echo "s29b rc=$?"
grep '^{"selection"' $OUT/s29b-40x16384.log | sed 's/"background_streams": 2, "fused_rescore": false, //; s/"host_ms": [0-9.]*, //'
