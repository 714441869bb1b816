# s22: batch-1 demo pairs, the default (fidelity) against --selection fast, alternating; after `run` installed the package
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
(cd python && find oasiskv -name '*.py' -exec cp --parents {} /tmp/site/ \;)
cd /tmp
for i in ${PAIRS:-1 2}; do
  for sel in fidelity fast; do
    timeout 150 python3 -m oasiskv.cli demo --json --ignore-eos --max-new-tokens 64 --selection $sel > $OUT/demo-$sel-$i.json 2> $OUT/demo-$sel-$i.err || echo "demo $sel $i rc=$?"
    python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(sys.argv[2], {k: v for k, v in d.items() if 'tok' in k or 'per_s' in k})" $OUT/demo-$sel-$i.json $sel-$i 2>&1 | tail -1
  done
done
