# Two entry points, each creating its own virtual environment on first use:
#   make demo   run the main job (an encoder-cache workload through the engine)
#   make test   run the CPU test suite (real kernels in the Triton interpreter)
#
# TORCH_SPEC picks the PyTorch build. The default is the CPU wheel, which is what
# a CPU-only host needs (a bare `torch` requirement pulls a multi-GB CUDA build).
# On a GPU host use your CUDA build, e.g. `make test TORCH_SPEC=torch` and
# `EXTRAS=test,plot,cuda12`.
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
EXTRAS ?= test,plot
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test bench bench-alloc lint gpu-check clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[$(EXTRAS)]"
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m ecoffload.profiling.demo

test: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m pytest

bench: $(STAMP)
	$(PY) -m ecoffload.profiling.bench

bench-alloc: $(STAMP)
	$(PY) -m ecoffload.profiling.bench_alloc

gpu-check:
	bash profiling/gpu_check.sh gpu-check-out

clean:
	rm -rf $(VENV) bench-out gpu-check-out .pytest_cache .ruff_cache .hypothesis
