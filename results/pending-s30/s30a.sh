# s30a (issue 36's Fig. 12 in fp8 on the GPU; after `bash scripts/device.sh build` here, carry dist,
# .whl, in a warm lease after any install): Qwen3-8B shapes, 16K prompts, TCP, in-step reads, the
# single-process engine first (`local`) and `--first-query prompt`, so every staged row's tokens
# compare with the single-process engine's of the same KvConfig; bf16, then an fp8 host tier
# (staged blocks fp8). Expect half the staged and fetched bytes per request. About 6 minutes.
set -u
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
for v in bf16 hfp8; do
  X=""; [ $v = hfp8 ] && X="--host-kv-dtype fp8_e4m3"
  DISAGG_SECS=${DISAGG_SECS:-170} bash scripts/device.sh disagg --preset qwen3-8b --prompt-tokens 16384 \
    --max-tokens 64 --requests 6 --rates 0.8 --top-k-blocks 128 --fetch-cap 0.05 --transport tcp --cuda-graph \
    --transfers local,full,partial --first-query prompt $X > /dev/null
  for x in md json log; do mv $OUT/disagg.$x $OUT/disagg-fp8-$v.$x 2>/dev/null; done
  echo "== $v"; grep "^| \(local\|full\|partial\)" $OUT/disagg-fp8-$v.md | head -4
done
