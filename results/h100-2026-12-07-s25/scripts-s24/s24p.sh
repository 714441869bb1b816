# s24: issue 33's 5 %: fidelity vs fast step time at the full host pool, one engine per shape,
# alternating (experiments/exp_step_host.py --variants). After s24a in the same warm lease.
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
REPO=$PWD
V="${V:-fidelity:2:0,fast:2:0}"
cd /tmp
for shape in ${SHAPES:-"40,16384" "20,32768"}; do
  shape=${shape/,/ }
  set -- $shape
  timeout ${XSECS:-280} python3 $REPO/experiments/exp_step_host.py --full --same-prompt --cuda-graph --no-recall \
    --requests $1 --context $2 --top-k-blocks 128 --steps 10 --variants $V --repeat ${REPEAT:-3} \
    --json $OUT/x-$1x$2.json > $OUT/x-$1x$2.log 2>&1 || echo "x $1x$2 rc=$?" >> $OUT/x-$1x$2.log
  grep -v "^ *$" $OUT/x-$1x$2.log | tail -12
done
# fp8 host pool: the kv8 gather's register launch (default) against staged few-block launches, 72 x 16K
if [ -n "${KV8:-}" ]; then
  timeout ${XSECS:-280} python3 $REPO/experiments/exp_step_host.py --full --same-prompt --cuda-graph --no-recall \
    --requests 72 --context 16384 --top-k-blocks 128 --steps 10 --host-kv-dtype fp8_e4m3 --gather-kv8 \
    --gather-blocks ${KV8_LAUNCHES:-0:4:8:0,8:4:32:6,16:4:32:6,0:4:8:0} --json $OUT/x-kv8.json > $OUT/x-kv8.log 2>&1 || echo "kv8 rc=$?" >> $OUT/x-kv8.log
  grep -v "^ *$" $OUT/x-kv8.log | tail -8
fi
