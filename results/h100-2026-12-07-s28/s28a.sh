# s28a (one call, carry dist .whl; about 9 minutes): the zero-copy probe (s28z), then s27d (silu_mul
# GPU tests + the 40 x 16K pair off/on), s27f (kv8 tensor-core tests + attention rows), then the
# gather rows against both H2D ceilings (copy engines, SM reads).
set -u
bash results/h100-2026-12-07-s28/s28z.sh 2>&1 | tail -80
bash results/pending-s27/s27d.sh 2>&1 | tee $OUT/s27d.txt
bash results/pending-s27/s27f.sh 2>&1 | tee $OUT/s27f.txt
(cd /tmp && PYTHONPATH=/tmp/site timeout 90 python3 -m oasiskv.bench.kernels --only gather --refcheck --json $OUT/bench-gather.json > $OUT/bench-gather.log 2>&1; echo "gather rc=$?"; tail -4 $OUT/bench-gather.log)
