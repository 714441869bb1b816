export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
R=$OUT/c.txt; REPO=$PWD
cd /tmp; . $REPO/.stage/d/row.sh
nvidia-smi --query-gpu=name --format=csv,noheader > $R
row o128f8 250 --preset qwen3-8b-128k --contexts 131008 --modes oasis --concurrency 8 --host-kv-budget 100GiB --host-kv-dtype fp8_e4m3 --prefill-cache host --max-tokens 64 --drafter eagle3
cat $R
