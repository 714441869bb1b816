# s22 call: issue 33's 5 %: fidelity vs fast step time, background streams and the fused rescore,
# one process per shape (one host pool), alternating. Python-only changes: OVERLAY_PY.
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
REPO=$PWD
(cd python && find oasiskv -name '*.py' -exec cp --parents {} /tmp/site/ \;)
V="${V:-fidelity:2:0,fast:2:0,fid16:2:0}"
cd /tmp
for shape in ${SHAPES:-"20,32768" "40,16384"}; do
  shape=${shape/,/ }
  set -- $shape
  timeout 280 python3 $REPO/experiments/exp_step_host.py --full --same-prompt --cuda-graph --no-recall \
    --requests $1 --context $2 --top-k-blocks 128 --steps 10 --variants $V --repeat ${REPEAT:-3} \
    --json $OUT/x-$1x$2.json > $OUT/x-$1x$2.log 2>&1 || echo "x $1x$2 rc=$?" >> $OUT/x-$1x$2.log
  grep -v "^ *$" $OUT/x-$1x$2.log | tail -16
done
[ -n "${NO_SCORE:-}" ] || timeout 150 python3 -m oasiskv.bench.kernels --only score --json $OUT/bench-score.json > $OUT/bench-score.log 2>&1 || echo "bench rc=$?" >> $OUT/bench-score.log
grep -i "chain\|fused\|rescore" $OUT/bench-score.log | head -30
