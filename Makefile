# Two commands for a newcomer: `make check` (the verification matrix on CPU) and `make test`;
# `make lint` (ruff, then mypy; configured in pyproject.toml) runs first in CI.
# Both create .venv when it is missing. torch is pinned to the CPU build this machine offers
# (a bare `torch` requirement would pull a multi-GB CUDA build); the package itself accepts >=2.11.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
TORCH ?= torch==2.13.0

.PHONY: check test lint venv clean

# .base: what `moeshard check` needs (torch, rich, safetensors; numpy only because torch warns
# at import without it); .installed adds the test tools (pytest, transformers, triton), which
# `make check` does not wait for.
$(VENV)/.base: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH)" numpy
	$(PY) -m pip install -q -e .
	touch $@

$(VENV)/.installed: $(VENV)/.base
	$(PY) -m pip install -q -e ".[test,lint]"
	touch $@

venv: $(VENV)/.installed

check: $(VENV)/.base
	$(VENV)/bin/moeshard check

test: $(VENV)/.installed
	$(PY) -m pytest -q

# Both tools always run (a ruff finding does not hide mypy's); fails if either reports anything.
lint: $(VENV)/.installed
	$(VENV)/bin/ruff check src tests scripts; ruff=$$?; \
	$(VENV)/bin/mypy src; mypy=$$?; \
	test $$ruff -eq 0 && test $$mypy -eq 0

clean:
	rm -rf $(VENV)
