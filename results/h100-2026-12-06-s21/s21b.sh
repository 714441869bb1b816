export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
R=$OUT/b.txt; REPO=$PWD
cd /tmp; . $REPO/.stage/d/row.sh
nvidia-smi --query-gpu=name --format=csv,noheader > $R
row o64f8 190 --preset qwen3-8b-128k --contexts 65536 --modes oasis --concurrency 16 --host-kv-budget 100GiB --host-kv-dtype fp8_e4m3 --prefill-cache device --max-tokens 64 --drafter eagle3
row d64d 120 --preset qwen3-8b-128k --contexts 65536 --modes dense --concurrency 6 --prefill-cache host --max-tokens 64
row o128f8 230 --preset qwen3-8b-128k --contexts 131008 --modes oasis --concurrency 8 --host-kv-budget 100GiB --host-kv-dtype fp8_e4m3 --prefill-cache device --max-tokens 64 --drafter eagle3
cat $R
