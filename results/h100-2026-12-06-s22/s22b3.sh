export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
R=$OUT/b3.txt; REPO=$PWD
cd /tmp; . $REPO/.stage/d/row.sh
nvidia-smi --query-gpu=name --format=csv,noheader > $R
E="--max-tokens 64 --drafter eagle3 --host-kv-budget 100GiB"
row o16f8 170 --preset qwen3-8b --contexts 16384 --modes oasis --concurrency 72 $E --host-kv-dtype fp8_e4m3 --prefill-cache host
row o32f8 170 --preset qwen3-8b --contexts 32768 --modes oasis --concurrency 36 $E --host-kv-dtype fp8_e4m3 --prefill-cache host
cat $R
