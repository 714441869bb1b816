# s31a (issue 36 on the full H200: kind nvidia-h200, after `scripts/device.sh run` with NO_BENCH=1
# in the same lease). s26c's rows with the card's real budget (`auto` is real only on an H100,
# so s26c as written would have emulated an H100 on the H200) and `--concurrency max`: each row
# runs at the most requests that fit (dense: the real KV budget; oasis: a 100 GiB host pool).
# Two rows per call, each under its own limit. Qwen3-8B shapes, random bf16 weights, 32 tokens
# per request, K = 128, cap 0.05, CUDA graphs, n-gram drafter, the default selection.
#   bash results/pending-s31/s31a.sh N     N = 1: 16K dense bf16 + OasisKV fp8 host
#                                            2: 32K dense bf16 + OasisKV fp8 host
#                                            3: dense fp8 at 16K and 32K
#                                            4: OasisKV with both tiers fp8 at 16K and 32K
set -u
# The tree's Python over the installed wheel's (a Python change since the wheel was built).
(cd python && find oasiskv -name '*.py' -exec cp --parents {} /tmp/site/ \;)
S=${ROW_SECS:-280}
C="--preset qwen3-8b --max-tokens 32 --gpu-kv-budget real --concurrency max"
O="--modes oasis --host-kv-budget 100GiB --prefill-cache device"
D="--modes dense --prefill-cache host"
row() { bash scripts/device.sh row "$@" > /dev/null; }
case "${1:?usage: s31a.sh N (1-4)}" in
1) row d16 "$S" $C --contexts 16384 $D; row o16f8 "$S" $C --contexts 16384 $O --host-kv-dtype fp8_e4m3 ;;
2) row d32 "$S" $C --contexts 32768 $D; row o32f8 "$S" $C --contexts 32768 $O --host-kv-dtype fp8_e4m3 ;;
3) row d16f8 "$S" $C --contexts 16384 $D --kv-dtype fp8_e4m3; row d32f8 "$S" $C --contexts 32768 $D --kv-dtype fp8_e4m3 ;;
4) row o16f8p "$S" $C --contexts 16384 $O --kv-dtype fp8_e4m3; row o32f8p "$S" $C --contexts 32768 $O --kv-dtype fp8_e4m3 ;;
*) echo "N must be 1-4"; exit 2 ;;
esac
cat "$OUT/rows.txt"
