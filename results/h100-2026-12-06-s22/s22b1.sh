# s23: issue 35's 16K/32K rows (64 tokens, EAGLE-3) with dense in the same lease, 128K again, issue 33's pairs
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
R=$OUT/b.txt; REPO=$PWD
cd /tmp; . $REPO/.stage/d/row.sh
nvidia-smi --query-gpu=name --format=csv,noheader > $R
E="--max-tokens 64 --drafter eagle3 --host-kv-budget 100GiB"
row d16 100 --preset qwen3-8b --contexts 16384 --modes dense --concurrency 26 --prefill-cache host --max-tokens 64
row o16f8 170 --preset qwen3-8b --contexts 16384 --modes oasis --concurrency 86 $E --host-kv-dtype fp8_e4m3 --prefill-cache device
row d32 100 --preset qwen3-8b --contexts 32768 --modes dense --concurrency 13 --prefill-cache host --max-tokens 64
cat $R
