# s27b (after s27a in the same warm lease; carry dist .whl): compute-sanitizer memcheck over the
# two new default kernels' GPU tests (kv8 "registers", bound8 "mma"; issue 36's memcheck).
set -u
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
for spec in "tests/kernels/test_gpu_kv8.py tensor_core_kernels and registers" "tests/kernels/test_gpu_bound8.py mma"; do
  set -- $spec; f=$1; shift; k="$*"
  timeout 100 compute-sanitizer --tool memcheck --error-exitcode 9 python3 -m pytest -q -p no:cacheprovider -m gpu --rootdir=. $f -k "$k" \
    > $OUT/memcheck-$(basename $f .py).log 2>&1; echo "memcheck $f -k '$k' rc=$?"; tail -2 $OUT/memcheck-$(basename $f .py).log
done
