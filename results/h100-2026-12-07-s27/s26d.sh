# s26 call 2 of 3 (after s26a.sh in the same warm lease): Fig. 12 with in-step reads over TCP,
# UCX, then TCP with four connections (issue 37). About 7 minutes.
set -u
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
R=$PWD
for t in tcp ucx; do
  DISAGG_SECS=${DISAGG_SECS:-150} bash scripts/device.sh disagg --preset qwen3-8b --prompt-tokens 16384 --max-tokens 64 \
    --requests 6 --rates 0.2,0.8 --top-k-blocks 128 --fetch-cap 0.05 --transport $t --cuda-graph --kv-in-step-reads > /dev/null
  mv $OUT/disagg.md $OUT/disagg-in-step-$t.md 2>/dev/null; mv $OUT/disagg.json $OUT/disagg-in-step-$t.json 2>/dev/null
  mv $OUT/disagg.log $OUT/disagg-in-step-$t.log 2>/dev/null
  echo "== $t"; grep "^| \(full\|partial\)" $OUT/disagg-in-step-$t.md | head -4
done
# The same over TCP with four connections (frames go round robin across them in layer order; one
# connection reads about 2.5 GB/s of per-head entries on loopback, s26's CPU bench).
DISAGG_SECS=${DISAGG_SECS:-150} bash scripts/device.sh disagg --preset qwen3-8b --prompt-tokens 16384 --max-tokens 64 \
  --requests 6 --rates 0.2,0.8 --top-k-blocks 128 --fetch-cap 0.05 --transport tcp --cuda-graph --kv-in-step-reads --read-connections 4 > /dev/null
for x in md json log; do mv $OUT/disagg.$x $OUT/disagg-in-step-tcp4.$x 2>/dev/null; done
echo "== tcp x4"; grep "^| \(full\|partial\)" $OUT/disagg-in-step-tcp4.md | head -4
