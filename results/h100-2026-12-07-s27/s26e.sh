# s26 call 3 of 3 (after s26a.sh in the same warm lease): the 40 x 16K step with and without the
# sparse admission (is it why that step is 50 % slower than in s22?), each selection, the bound8
# MMA kernel beside them (fidmma), with kernel profiles; issue 33's pair at 20 x 32K likewise.
set -u
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
R=$PWD
(cd /tmp; for dsp in 1 0; do timeout 100 python3 $R/results/pending-s26/step_direct.py $dsp $R/experiments/exp_step_host.py --full --same-prompt --cuda-graph --no-recall \
  --requests 40 --context 16384 --top-k-blocks 128 --steps 10 --variants fidelity:2:0,fidmma:2:0,fast:2:0 --repeat 1 --profile $OUT/sd-$dsp-prof.txt --json $OUT/sd-$dsp.json > $OUT/sd-$dsp.log 2>&1; echo "direct=$dsp rc=$?"; grep step_ms $OUT/sd-$dsp.log | head -4; done)
# Issue 33's pair at 20 x 32K with the bound8 MMA kernel (fidmma) beside fidelity and fast.
(cd /tmp; timeout 150 python3 $R/experiments/exp_step_host.py --full --same-prompt --cuda-graph --no-recall \
  --requests 20 --context 32768 --top-k-blocks 128 --steps 10 --variants fidelity:2:0,fidmma:2:0,fast:2:0 --repeat 2 \
  --json $OUT/pairs-32k.json > $OUT/pairs-32k.log 2>&1; echo "pairs-32k rc=$?"; grep '"selection"' $OUT/pairs-32k.log | cut -c1-120)
