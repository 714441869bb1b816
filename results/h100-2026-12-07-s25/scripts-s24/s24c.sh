# s24: Fig. 12 with the Rust coordinator (issue 37), the s8/s9 command. TRANSPORT=tcp|ucx.
# After s24a in the same warm lease (or: bash scripts/device.sh run with NO_BENCH=1 TESTS=none first).
DISAGG_SECS=${DISAGG_SECS:-560} bash scripts/device.sh disagg --preset qwen3-8b --prompt-tokens 16384 --max-tokens 64 \
  --requests 6 --rates 0.2,0.8 --top-k-blocks 128 --fetch-cap 0.05 --transport ${TRANSPORT:-tcp} --cuda-graph
cp $OUT/disagg.md $OUT/disagg-${TRANSPORT:-tcp}.md 2>/dev/null; cp $OUT/disagg.json $OUT/disagg-${TRANSPORT:-tcp}.json 2>/dev/null
rm -f $OUT/disagg.md $OUT/disagg.json
cat $OUT/disagg-${TRANSPORT:-tcp}.md 2>/dev/null | head -40
