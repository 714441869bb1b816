# s30b (one call, carry dist .whl, under 90 s; after an install in the lease): the copy engines on
# scattered pinned entries, cuMemcpyBatchAsync, now on a stream of the probe's own (s28's rows
# failed: torch's current stream is the legacy NULL stream, which the call refuses). Is a
# host-driven gather by the copy engines past the SM-read ceiling of hosts like s20-s27's
# (0.60-0.62 x H2D)? Note: the call has no CUDA-graph node form, so a captured step could not
# hold it.
set -u
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
timeout 80 python3 experiments/exp_zero_copy.py --batch-memcpy --entry-bytes 4096 2048 8192 32768 \
  --json $OUT/zero-copy-batch.json 2>&1 | tee $OUT/zero-copy-batch.txt
