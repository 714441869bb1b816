# s26c (issue 36 on the full H200: run with kind nvidia-h200, after `scripts/device.sh run` with
# NO_BENCH=1 in the same lease; about 25 minutes, so a lease of its own). Fig. 11 rows at 16K and
# 32K, 32 tokens per request, one device kind, one run: dense bf16 at its best concurrency (the
# issue: 48 x 16K / 24 x 32K fill the H200's KV budget), dense fp8 (twice the requests), OasisKV
# with an fp8 host pool of 100 GiB (86 x 16K / 43 x 32K fit). Targets: OasisKV fp8 host >= 2x
# dense bf16 at 16K, >= 2.5x at 32K; dense fp8 beside it. Then Fig. 12 over an fp8 host tier
# (half the staged bytes of bf16; same_tokens against the full transfer). One row per call, under
# run's 600 s: `bash results/pending-s26/s26c.sh N` runs the Nth (1-7 the rows, 8 Fig. 12).
set -u
K=${KV8_KERNEL:-registers}  # --kv8-attention-kernel: the default since s27 (1.26 x tile)
C="--preset qwen3-8b --max-tokens 32 --kv8-attention-kernel $K"
# Row 4 (o16f8p): OasisKV with both tiers in fp8 (the gather copies codes, no conversion;
# attention reads half the bytes), the configuration the registers kernel is for.
case "${1:?usage: s26c.sh N (1-8)}" in
1) bash scripts/device.sh row d16 420 $C --contexts 16384 --modes dense --concurrency 44,48 ;;
2) bash scripts/device.sh row d16f8 420 $C --contexts 16384 --modes dense --concurrency 88,96 --kv-dtype fp8_e4m3 --prefill-cache host ;;
3) bash scripts/device.sh row o16f8 480 $C --contexts 16384 --modes oasis --concurrency 86 --host-kv-budget 100GiB --host-kv-dtype fp8_e4m3 --prefill-cache device ;;
4) bash scripts/device.sh row o16f8p 480 $C --contexts 16384 --modes oasis --concurrency 86 --host-kv-budget 100GiB --kv-dtype fp8_e4m3 --prefill-cache device ;;
5) bash scripts/device.sh row d32 420 $C --contexts 32768 --modes dense --concurrency 22,24 ;;
6) bash scripts/device.sh row d32f8 420 $C --contexts 32768 --modes dense --concurrency 44,48 --kv-dtype fp8_e4m3 --prefill-cache host ;;
7) bash scripts/device.sh row o32f8 480 $C --contexts 32768 --modes oasis --concurrency 43 --host-kv-budget 100GiB --host-kv-dtype fp8_e4m3 --prefill-cache device ;;
8)
    DISAGG_SECS=${DISAGG_SECS:-200} bash scripts/device.sh disagg --preset qwen3-8b --prompt-tokens 16384 --max-tokens 64 \
      --requests 6 --rates 0.2,0.8 --top-k-blocks 128 --fetch-cap 0.05 --transport tcp --cuda-graph --host-kv-dtype fp8_e4m3 > /dev/null
    mv $OUT/disagg.md $OUT/disagg-fp8.md 2>/dev/null; mv $OUT/disagg.json $OUT/disagg-fp8.json 2>/dev/null; mv $OUT/disagg.log $OUT/disagg-fp8.log 2>/dev/null
    grep "^| \(full\|partial\)" $OUT/disagg-fp8.md | head -4
    ;;
*) echo "N must be 1-8"; exit 2 ;;
esac
