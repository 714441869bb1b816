# s28s (the short form of s28a, when under 600 s of device time is left; carry dist .whl; about
# 5 minutes): the zero-copy probe (s28z), then s27d (silu_mul GPU tests + the 40 x 16K pair off/on).
set -u
bash results/pending-s28/s28z.sh 2>&1 | tail -80
bash results/pending-s27/s27d.sh 2>&1 | tee $OUT/s27d.txt
