# s24 call 1: install, the GPU tests of the sparse prefill, topk_candidates (b986730) and the fp8
# gather (1846ae4), the fp8 gather's launch probe, the score benchmark. carry: dist .whl
set -u
TESTS="tests/engine/test_gpu_sparse_prefill.py tests/kernels/test_gpu_key_codes.py tests/kernels/test_gpu_kv8.py" \
  OVERLAY_PY=1 NO_BENCH=1 PYTEST_SECS=${PYTEST_SECS:-200} bash scripts/device.sh run
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
timeout 100 python3 -m pytest -q -p no:cacheprovider -m gpu --rootdir=. tests/kernels/test_gpu_kernels.py \
  -k "candidates or two_stage or topk" > $OUT/pytest-kernels-k.log 2>&1; echo "rc=$?" >> $OUT/pytest-kernels-k.log
tail -3 $OUT/pytest-kernels-k.log
REPO=$PWD
(cd /tmp && timeout 100 python3 $REPO/results/h100-2026-12-07-s25/scripts-s24/gprobe.py > $OUT/gather-probe.txt 2>&1; echo "rc=$?" >> $OUT/gather-probe.txt)
cat $OUT/gather-probe.txt
(cd /tmp && timeout 90 python3 -m oasiskv.bench.kernels --only score --json $OUT/bench-score.json > $OUT/bench-score.log 2>&1; echo "rc=$?" >> $OUT/bench-score.log)
grep -i "chain\|candid\|rc=" $OUT/bench-score.log | head -20
