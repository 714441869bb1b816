# s27e (one call after any install in the lease, carry dist .whl; about 4 minutes): the background
# chains (selection, gathers) confined to a CUDA green context of N SMs, so that their kernels stop
# slowing the compute stream's (s27's profile: the MLP's elementwise kernels 3 x slower beside the
# fidelity chain), while the compute stream keeps every SM. 40 x 16K, fidelity (mma bound) and
# fast alternating, N = all (ordinary streams), 16, 32, 66. Needs torch.cuda.green_contexts (and
# its cuda.bindings); a row that fails says why in its log.
set -u
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
R=$PWD
cd /tmp
for sms in "" 16 32 66; do
  tag="g${sms:-all}-40x16384"
  timeout 150 python3 $R/experiments/exp_step_host.py --full --same-prompt --cuda-graph --no-recall \
    --requests 40 --context 16384 --top-k-blocks 128 --steps 8 --variants fidmma:2:0,fast:2:0 --repeat 1 \
    ${sms:+--background-sms $sms} --json $OUT/$tag.json > $OUT/$tag.log 2>&1; echo "$tag rc=$?"
  grep -o '"selection": "[a-z]*".\{0,100\}step_ms": [0-9.]*' $OUT/$tag.log | sed 's/"background.*step_ms"/step/' | head -2
  grep -m1 -i "error" $OUT/$tag.log
done
