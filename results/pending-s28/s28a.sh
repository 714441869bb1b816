# s28a (one call, carry dist .whl): the zero-copy probe (s28z), then s27d (silu_mul GPU tests + the
# 40 x 16K pair off/on), then s27f (kv8 tensor-core tests + attention rows)
set -u
bash results/pending-s28/s28z.sh 2>&1 | tail -80
bash results/pending-s27/s27d.sh 2>&1 | tee $OUT/s27d.txt
bash results/pending-s27/s27f.sh 2>&1 | tee $OUT/s27f.txt
