# s28b (right after s28a in the same warm lease, carry dist .whl; about 9 minutes): s27e (the
# background chains in a CUDA green context of 16 / 32 / 66 SMs, 40 x 16K, fidelity (mma) and fast),
# compute-sanitizer memcheck of the kv8 "registers" and bound8 "mma" GPU tests (s27b), then the
# high-priority capture stream pair at 40 x 16K.
set -u
bash results/pending-s27/s27e.sh 2>&1 | tee $OUT/s27e.txt
bash results/pending-s27/s27b.sh 2>&1 | tee $OUT/s27b.txt
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
R=$PWD
cd /tmp
for prio in 0 -1; do
  timeout 70 python3 $R/experiments/exp_step_host.py --full --same-prompt --cuda-graph --no-recall \
    --requests 40 --context 16384 --top-k-blocks 128 --steps 8 --variants fidmma:2:0,fast:2:0 --repeat 1 \
    --capture-priority $prio --json $OUT/prio$prio-40x16384.json > $OUT/prio$prio-40x16384.log 2>&1; echo "prio $prio rc=$?"
  grep -o '"selection": "[a-z]*".\{0,100\}step_ms": [0-9.]*' $OUT/prio$prio-40x16384.log | sed 's/"background.*step_ms"/step/' | head -2
done
