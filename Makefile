# Two entry points: `make demo` (generate with the embedded checkpoint) and `make test`.
# Both create .venv first; torch is pinned to the CPU wheel available offline. The venv holds the
# test, lm-eval, distributed (Ray Serve), ui (Gradio) and quant (torchao) extras, so their tests run too,
# and the lab (lab/: the task suite the embedded checkpoints were trained on, the trainer, the probes).
VENV := .venv
PY := $(VENV)/bin/python

$(VENV)/.installed: pyproject.toml lab/pyproject.toml
	python3 -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	$(VENV)/bin/pip install -q torch==2.13.0
	$(VENV)/bin/pip install -q -e ".[test,lm-eval,distributed,ui,quant]" -e ./lab
	touch $@

.PHONY: venv demo test test-fast test-engine test-lab wheel browser playground gpu-check
venv: $(VENV)/.installed

# Chromium from Debian's packages, for the playground's browser check (tests/test_playground_browser.py);
# where apt cannot install it (not root, not Debian) that test skips and says why
browser:
	@command -v chromium >/dev/null 2>&1 || { command -v apt-get >/dev/null 2>&1 && \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium; } \
		|| echo "chromium could not be installed: the browser check will skip"

playground: venv
	$(VENV)/bin/dllm playground --threads 1

# one thread, as the README's benchmarks: on a busy machine more threads only contend
demo: venv
	$(VENV)/bin/dllm generate --threads 1

test: venv browser
	@echo "running the test suite: about 9 minutes on 2 CPU cores"
	$(PY) -m pytest -q -n 2 --dist loadfile

# the one prepared device check (scripts/gpu_check.py; docs/performance.md): on a GPU machine, with
# the torch installed there (no venv: the CPU wheel is the venv's); writes gpu-check-out/
gpu-check:
	python3 scripts/gpu_check.py --out gpu-check-out

# the inner loop: every test not marked slow (pyproject.toml's markers), under a minute
test-fast: venv
	$(PY) -m pytest -q -m "not slow"

# the two tiers `make test` runs together (one process each here; `make test` runs two, a module per
# worker: pytest-xdist, tests/conftest.py gives each its share of the cores as torch threads): the engine's tests, and the lab's (dllm_lab)
test-engine: venv
	$(PY) -m pytest -q -m "not lab"

test-lab: venv
	$(PY) -m pytest -q -m lab

# the engine's sdist and wheel (with the embedded checkpoints) and the lab's, in dist/; docs/install.md
wheel: venv
	$(PY) -m build --outdir dist
	$(PY) -m build --outdir dist lab
