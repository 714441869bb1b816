# s28z (one call, carry dist .whl, under 60 s): the zero-copy probe (experiments/exp_zero_copy.py):
# plain / hinted 16-byte loads and TMA bulk copies of scattered 4 KiB and 2 KiB entries of pinned
# host memory, against one memcpy of the same bytes.
set -u
export PYTHONUNBUFFERED=1
timeout 120 python3 experiments/exp_zero_copy.py --json $OUT/zero-copy.json 2>&1 | tee $OUT/zero-copy.txt
timeout 60 python3 experiments/exp_zero_copy.py --batch-memcpy --entry-bytes 4096 2048 32768 --json $OUT/zero-copy-batch.json 2>&1 | tee $OUT/zero-copy-batch.txt
