# Two entry points for a fresh machine: `make demo` (the main job) and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
# The CPU wheel lies on this machine's disk; a bare `torch` requirement would pull a multi-GB CUDA build.
TORCH_SPEC ?= torch==2.13.0

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[dev]"
	touch $@

install: $(VENV)/.installed

demo: $(VENV)/.installed
	$(VENV)/bin/memfit estimate gpt-7b --micro-batch 1 --seq 4096 --precision bf16 --device a100-80gb

test: $(VENV)/.installed
	$(PY) -m pytest

bench: $(VENV)/.installed
	$(PY) benchmarks/estimate_accuracy.py

.PHONY: install demo test bench
