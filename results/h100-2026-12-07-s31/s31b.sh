# s31b (issues 37 and 36: Fig. 12 at 16K on the GPU with the paper's first query; after any
# install in a warm lease, carry dist, .whl): s30a's rows with `--first-query first_token` (the
# default). s30 measured partial TPOT at 1.59-1.73 x a full transfer's with `--first-query
# prompt`, s27 at 1.01-1.15 x with first_token. The new "GPU wait p50 / max" column says whether
# the prompt rows' wait is a few first steps reading their misses in-step. bf16, then an fp8
# host tier. About 6 minutes; DISAGG_SECS bounds each.
set -u
(cd python && find oasiskv -name '*.py' -exec cp --parents {} /tmp/site/ \;)
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
for v in ${VARIANTS:-bf16 hfp8}; do
  X=""; [ $v = hfp8 ] && X="--host-kv-dtype fp8_e4m3"
  DISAGG_SECS=${DISAGG_SECS:-170} bash scripts/device.sh disagg --preset qwen3-8b --prompt-tokens 16384 \
    --max-tokens 64 --requests 6 --rates 0.8 --top-k-blocks 128 --fetch-cap 0.05 --transport tcp --cuda-graph \
    --transfers local,full,partial --first-query ${FIRST_QUERY:-first_token} $X > /dev/null
  for x in md json log; do mv $OUT/disagg.$x $OUT/disagg-ft-$v.$x 2>/dev/null; done
  echo "== $v"; grep "^| \(local\|full\|partial\)" $OUT/disagg-ft-$v.md | head -4
done
