export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
R=$OUT/b5.txt; REPO=$PWD
cd /tmp; . $REPO/.stage/d/row.sh
nvidia-smi --query-gpu=name --format=csv,noheader > $R
E="--max-tokens 64 --drafter eagle3 --host-kv-budget 100GiB"
row o128f8c10 200 --preset qwen3-8b-128k --contexts 131008 --modes oasis --concurrency 10 $E --host-kv-dtype fp8_e4m3 --prefill-cache host
row d128 200 --preset qwen3-8b-128k --contexts 131008 --modes dense --concurrency 3 --prefill-cache host --max-tokens 64
cat $R
