# s24: the speculation decision (issue 35): 44 x 16K, EAGLE-3 head's cost, acceptance 0.4/0.7 forced,
# against the plain row in the same process. After s24a in the same warm lease.
bash scripts/device.sh row spec16 ${SSECS:-540} --preset qwen3-8b --contexts 16384 --modes oasis --concurrency 44 --max-tokens 64 \
  --drafter eagle3 --host-kv-budget 100GiB --host-kv-dtype fp8_e4m3 --speculative --draft-acceptance 0.4,0.7
