# s24 call 2: issue 35's 128K row with the sparse prefill (11 requests fit the 100 GiB fp8 pool),
# dense's best (3) in the same lease. After s24a in the same warm lease.
E="--max-tokens 64 --drafter eagle3 --host-kv-budget 100GiB --host-kv-dtype fp8_e4m3"
bash scripts/device.sh row o128 ${OSECS:-330} --preset qwen3-8b-128k --contexts 131008 --modes oasis --concurrency ${CONC:-11} $E --prefill-cache host > /dev/null
bash scripts/device.sh row d128 ${DSECS:-200} --preset qwen3-8b-128k --contexts 131008 --modes dense --concurrency 3 --prefill-cache host --max-tokens 64
