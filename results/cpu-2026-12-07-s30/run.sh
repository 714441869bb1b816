# s30, CPU (2 cores): Fig. 12 in bf16, with an fp8 host tier and with fp8 pages, SmolLM2 in bf16,
# the single-process engine first (issue 36's disaggregation row). Needs the release daemon
# (cargo build --release -p oasis-rt). About 10 minutes per tier on an unloaded 2-core machine.
C="--model smollm2 --device cpu --dtype bfloat16 --daemon target/release/oasis-rt --prompt-tokens 4096 --max-tokens 32 --requests 4 --rates 0.5 --top-k-blocks 64 --fetch-cap 0.05 --transfers local,full,partial --first-query prompt"
for v in bf16 hfp8 fp8; do
  case $v in bf16) X="";; hfp8) X="--host-kv-dtype fp8_e4m3";; fp8) X="--kv-dtype fp8_e4m3";; esac
  .venv/bin/python -m oasiskv.bench.disagg $C $X --json fig12-$v.json --md fig12-$v.md 2> fig12-$v.log | grep '^| '
done
