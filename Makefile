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

.PHONY: venv demo test
venv: $(VENV)/.installed

demo: venv
	$(VENV)/bin/dllm generate

test: venv
	$(PY) -m pytest -q
