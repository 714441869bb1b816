# s27 call 3 of a lease (after `receive a`, `receive b`; carry .stage/c dist .whl): install the wheel
# and SmolLM2; the GPU defaults tests (issue 33: LLM("smollm2") on the GPU with graphs, equal to
# eager); the batch-1 demo, default (fidelity) vs --selection fast, alternating, three pairs; then
# the fidelity/fast step at the full host pool under 2, 3 and 4 background streams (is the
# fidelity selection's 6 % the two streams' ordering of selection kernels behind gathers?).
set -u
TESTS=tests/api/test_gpu_defaults.py NO_BENCH=1 OVERLAY_PY=1 PYTEST_SECS=150 bash scripts/device.sh run 2>&1 | tail -3
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
R=$PWD
cd /tmp
for i in 1 2 3; do
  for sel in fidelity fast; do
    timeout 100 python3 -m oasiskv.cli demo --json --ignore-eos --max-new-tokens 64 --selection $sel > $OUT/demo-$sel-$i.json 2> $OUT/demo-$sel-$i.err || echo "demo $sel $i rc=$?"
    python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(sys.argv[2], {k: v for k, v in d.items() if 'tok' in k or 'per_s' in k})" $OUT/demo-$sel-$i.json $sel-$i 2>&1 | tail -1
  done
done
tar czf $OUT/demo.tgz -C $OUT $(cd $OUT && ls demo-*.json demo-*.err 2>/dev/null) && rm -f $OUT/demo-*.json $OUT/demo-*.err
for shape in "40 16384" "20 32768"; do
  set -- $shape
  timeout 130 python3 $R/experiments/exp_step_host.py --full --same-prompt --cuda-graph --no-recall \
    --requests $1 --context $2 --top-k-blocks 128 --steps 10 --variants fidelity:2:0,fast:2:0,fidelity:3:0,fast:3:0,fidelity:4:0 --repeat 2 \
    --json $OUT/streams-$1x$2.json > $OUT/streams-$1x$2.log 2>&1; echo "streams $1x$2 rc=$?"
  grep -o '"selection": "[a-z]*", "background_streams": [0-9]*.\{0,60\}step_ms": [0-9.]*' $OUT/streams-$1x$2.log | sed 's/"fused.*step_ms"//'
done
