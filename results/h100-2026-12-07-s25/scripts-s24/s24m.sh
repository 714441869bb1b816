# s24: after `receive a`, `receive b` in this warm lease (and s24a's install): SmolLM2's wheel from
# its three parts into /tmp/site, then the batch-1 demo, default (fidelity) vs --selection fast,
# alternating, PAIRS times (issue 33's mean of three). carry: .stage/c .stage/d
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
name=$(awk '{print $2}' .stage/c/SHA256)
cat /tmp/stage/part-aa /tmp/stage/part-ab .stage/c/part-ac > "/tmp/stage/$name"
(cd /tmp/stage && sha256sum -c "$OLDPWD/.stage/c/SHA256") || { echo "model parts do not match their hash"; exit 3; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site "/tmp/stage/$name" 2>&1 | tail -2
cd /tmp
for i in ${PAIRS:-1 2 3}; do
  for sel in fidelity fast; do
    timeout 150 python3 -m oasiskv.cli demo --json --ignore-eos --max-new-tokens 64 --selection $sel > $OUT/demo-$sel-$i.json 2> $OUT/demo-$sel-$i.err || echo "demo $sel $i rc=$?"
    python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(sys.argv[2], {k: v for k, v in d.items() if 'tok' in k or 'per_s' in k})" $OUT/demo-$sel-$i.json $sel-$i 2>&1 | tail -1
  done
done
tar czf $OUT/demo.tgz -C $OUT $(cd $OUT && ls demo-*.json demo-*.err 2>/dev/null) && rm -f $OUT/demo-*.json $OUT/demo-*.err
