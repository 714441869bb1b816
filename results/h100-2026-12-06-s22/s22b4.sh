# s23: issue 35's 16K/32K rows (64 tokens, EAGLE-3) with dense in the same lease, 128K again, issue 33's pairs
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
R=$OUT/b4.txt; REPO=$PWD
cd /tmp; . $REPO/.stage/d/row.sh
nvidia-smi --query-gpu=name --format=csv,noheader > $R
E="--max-tokens 64 --drafter eagle3 --host-kv-budget 100GiB"
row o128f8 260 --preset qwen3-8b-128k --contexts 131008 --modes oasis --concurrency 8 $E --host-kv-dtype fp8_e4m3 --prefill-cache host
cat $R
