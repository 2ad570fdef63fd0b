# Two entry points for a fresh machine: `make demo` (the main job) and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
# The CPU wheel lies on this machine's disk; a bare `torch` requirement would pull a multi-GB CUDA build.
TORCH_SPEC ?= torch==2.13.0

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[dev]"
	touch $@

install: $(VENV)/.installed

# The main job: `memfit train` on its built-in default (a small GPT learning to sort digits, on the CPU).
demo: $(VENV)/.installed
	$(VENV)/bin/memfit train

test: $(VENV)/.installed
	$(PY) -m pytest

bench: $(VENV)/.installed
	$(PY) benchmarks/estimate_accuracy.py
	$(PY) benchmarks/estimate_7b.py
	$(PY) benchmarks/checkpoint_tradeoff.py
	$(PY) benchmarks/plan_7b.py
	$(PY) benchmarks/planner_cpu.py
	$(PY) benchmarks/loop_overhead.py

# BENCHMARKS.md, written from benchmarks/report/ and the scripts' results in benchmarks/results/.
bench-render:
	$(PY) benchmarks/render.py

.PHONY: install demo test bench bench-render
