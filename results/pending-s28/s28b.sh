# s28b (right after results/pending-s27/s27d.sh in the same warm lease, carry dist .whl; about 10 minutes, so run it with
# the call's full 600 s): the capture-priority pair at 40 x 16K, then s27e (the background chains in a
# CUDA green context of 16 / 32 / 66 SMs, 40 x 16K, fidelity (mma) and fast) as far as it gets.
# (s27b's memcheck ran in s28: 0 errors.)
set -u
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
R=$PWD
cd /tmp
for prio in 0 -1; do
  timeout 150 python3 $R/experiments/exp_step_host.py --full --same-prompt --cuda-graph --no-recall \
    --requests 40 --context 16384 --top-k-blocks 128 --steps 8 --variants fidmma:2:0,fast:2:0 --repeat 1 \
    --capture-priority $prio --json $OUT/prio$prio-40x16384.json > $OUT/prio$prio-40x16384.log 2>&1; echo "prio $prio rc=$?"
  grep -o '"selection": "[a-z]*".\{0,100\}step_ms": [0-9.]*' $OUT/prio$prio-40x16384.log | sed 's/"background.*step_ms"/step/' | head -2
done
cd $R
bash results/pending-s27/s27e.sh 2>&1 | tee $OUT/s27e.txt
