# s31c (issues 37 and 35, any H100 lease after the install call, carry dist, .whl; about 8
# minutes, under one call's 600 s with the limits below):
#  1. Fig. 12 at 16K over TCP, partial and full, with the layers' read waits on their background
#     streams (today's default) and on the transfer stream (`--transfer-stream`), one process
#     each: does the partial TPOT come down from 1.61 x, and the median GPU wait from 4.6 ms?
#  2. issue 35's 16K row with EAGLE-3 at the most that fit, now that the head's KV is reserved
#     and counted (s31: 2.38 x at 72, 80 and 88 out of memory), beside dense's best.
# Run the disaggregation GPU tests first (`TESTS=tests/disagg/test_gpu_disagg.py bash
# scripts/device.sh run`, with the daemon carried in dist): the in-step test runs both ways.
set -u
(cd python && find oasiskv -name '*.py' -exec cp --parents {} /tmp/site/ \;)
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
for ts in "" "--transfer-stream"; do
  tag=${ts:+ts}; tag=${tag:-streams}
  DISAGG_SECS=${DISAGG_SECS:-150} bash scripts/device.sh disagg --preset qwen3-8b --prompt-tokens 16384 \
    --max-tokens 64 --requests 6 --rates 0.8 --top-k-blocks 128 --fetch-cap 0.05 --transport tcp --cuda-graph \
    --transfers full,partial $ts > /dev/null
  for x in md json log; do mv $OUT/disagg.$x $OUT/disagg-$tag.$x 2>/dev/null; done
  echo "== $tag"; grep "^| \(full\|partial\)" $OUT/disagg-$tag.md | head -2
done
C="--preset qwen3-8b --max-tokens 64 --gpu-kv-budget real --contexts 16384 --concurrency max"
bash scripts/device.sh row d16t64 100 $C --modes dense --prefill-cache host > /dev/null
bash scripts/device.sh row o16f8e 150 $C --modes oasis --host-kv-budget 100GiB --prefill-cache device \
  --host-kv-dtype fp8_e4m3 --drafter eagle3 > /dev/null
cat $OUT/rows.txt
