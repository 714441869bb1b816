# s22 call 3 (after receive a, receive b): the coordinator's GPU tests, then issue 35's 64K row with the fp8 host tier
TESTS="tests/disagg/test_gpu_disagg.py" PYTEST_SECS=150 NO_BENCH=1 bash scripts/device.sh run -q 2>&1 | tail -6
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
R=$OUT/a.txt; REPO=$PWD
cd /tmp; . $REPO/.stage/d/row.sh
nvidia-smi --query-gpu=name --format=csv,noheader > $R
row o64f8 330 --preset qwen3-8b-128k --contexts 65536 --modes oasis --concurrency 22 --host-kv-budget 100GiB --host-kv-dtype fp8_e4m3 --prefill-cache device --max-tokens 64 --drafter eagle3
cat $R
