# Two entry points: `make demo` (generate with the embedded checkpoint) and `make test`.
# Both create .venv first; torch is pinned to the CPU wheel available offline. The venv holds the
# test, lm-eval and distributed (Ray Serve) extras, so their tests run too.
VENV := .venv
PY := $(VENV)/bin/python

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	$(VENV)/bin/pip install -q torch==2.13.0
	$(VENV)/bin/pip install -q -e ".[test,lm-eval,distributed]"
	touch $@

.PHONY: venv demo test test-fast
venv: $(VENV)/.installed

# one thread, as the README's benchmarks: on a busy machine more threads only contend
demo: venv
	$(VENV)/bin/dllm generate --threads 1

test: venv
	@echo "running the test suite: 3-5 minutes on 2 CPU cores"
	$(PY) -m pytest -q

# the inner loop: every test not marked slow (pyproject.toml's markers), under a minute
test-fast: venv
	$(PY) -m pytest -q -m "not slow"
