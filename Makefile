# Two commands for a newcomer: `make check` (the verification matrix on CPU) and `make test`;
# `make lint` (ruff, then mypy; configured in pyproject.toml) runs first in CI.
# Both create .venv when it is missing. Every package they install has the exact version in
# constraints.txt (pip -c), so a new release upstream cannot change CI's verdict; the package's
# own dependencies stay ranges in pyproject.toml. `make upgrade-constraints` re-resolves the file
# to current releases and runs lint and the suite with it. torch is the CPU build this machine
# offers (a bare `torch` requirement would pull a multi-GB CUDA build); the package accepts >=2.11.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
TORCH ?= torch==2.13.0
CONSTRAINTS := constraints.txt
PIP_C := -c $(CONSTRAINTS)

.PHONY: check test test-slow test-all test-compat lint venv clean upgrade-constraints gpu-check

# .base: what `moeshard check` needs (torch, rich, safetensors; numpy only because torch warns
# at import without it); .installed adds the test tools (pytest, transformers, triton), which
# `make check` does not wait for.
$(VENV)/.base: pyproject.toml $(CONSTRAINTS)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip $(PIP_C)
	$(PY) -m pip install -q "$(TORCH)" numpy $(PIP_C)
	$(PY) -m pip install -q -e . $(PIP_C)
	touch $@

$(VENV)/.installed: $(VENV)/.base
	$(PY) -m pip install -q -e ".[test,lint]" $(PIP_C)
	touch $@

venv: $(VENV)/.installed

check: $(VENV)/.base
	$(VENV)/bin/moeshard check

# `make test`: everything but the cases marked slow (pytest.ini_options in pyproject.toml says
# which); `make test-slow` runs those, `make test-all` both. Nothing is dropped. JOBS pytest-xdist
# workers (2: CI's cores; `make test JOBS=8` on a larger machine). Most tests are one process, so
# a second worker keeps the second core busy: on an idle 2-core machine one worker took 7 min 28 s
# and two 5 min 53 s. Tests write only under their own temporary directories and take free
# ports, so the workers do not meet.
JOBS ?= 2
test: $(VENV)/.installed
	$(PY) -m pytest -q -n $(JOBS) -m "not slow"

test-slow: $(VENV)/.installed
	$(PY) -m pytest -q -n $(JOBS) -m slow

test-all: $(VENV)/.installed
	$(PY) -m pytest -q -n $(JOBS)

# Both tools always run (a ruff finding does not hide mypy's); fails if either reports anything.
lint: $(VENV)/.installed
	$(VENV)/bin/ruff check src tests scripts; ruff=$$?; \
	$(VENV)/bin/mypy src; mypy=$$?; \
	test $$ruff -eq 0 && test $$mypy -eq 0

# The GPU gate (scripts/gpu_gate.py): GPU tests, moeshard check --device cuda, a short bench and a
# CUDA generate, in one command on the GPU machine (its own torch, no .venv). Summary and logs in
# results/<machine>/gate/, packed into results/<machine>/gate.tar.gz.
gpu-check:
	PYTHONPATH=src $(PYTHON) scripts/gpu_gate.py

# Re-resolve constraints.txt to the current releases: a throwaway venv installs the extras with
# no constraints, its versions are written to constraints.txt, then .venv is rebuilt from the new
# file and lint and the whole suite (slow cases too) run. Commit the file only if they pass.
RESOLVE := .venv-resolve
upgrade-constraints:
	rm -rf $(RESOLVE)
	$(PYTHON) -m venv $(RESOLVE)
	$(RESOLVE)/bin/python -m pip install -q --upgrade pip
	$(RESOLVE)/bin/python -m pip install -q "$(TORCH)" numpy
	$(RESOLVE)/bin/python -m pip install -q -e ".[test,lint]"
	$(PYTHON) scripts/freeze_constraints.py $(RESOLVE)/bin/python $(CONSTRAINTS)
	rm -rf $(RESOLVE) $(VENV)
	$(MAKE) lint test-all

# The GPU machine's transformers (5.17), which the suite supports beside the pinned one: a second
# venv adds .venv's site-packages after its own (a .pth line calling site.addsitedir, so that
# .venv's own .pth files, moeshard's editable install among them, are read) and holds
# transformers 5.17 (and what it needs); the test files that import transformers run there
# (slow cases too).
COMPAT := .venv-compat
COMPAT_TRANSFORMERS ?= transformers==5.17.0
COMPAT_TESTS = $(shell grep -l transformers tests/test_*.py)
test-compat: $(VENV)/.installed
	test -x $(COMPAT)/bin/python || $(PYTHON) -m venv $(COMPAT)
	$(PY) -c "import site; print('import site; site.addsitedir(%r)' % site.getsitepackages()[0])" > \
		"$$($(COMPAT)/bin/python -c 'import site; print(site.getsitepackages()[0])')/zz_moeshard_base.pth"
	$(COMPAT)/bin/python -m pip install -q "$(COMPAT_TRANSFORMERS)"
	$(COMPAT)/bin/python -m pytest -q -p no:cacheprovider -n 2 $(COMPAT_TESTS)

clean:
	rm -rf $(VENV) $(RESOLVE) $(COMPAT)
