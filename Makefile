# Set-up and entry points. `make demo` and `make test` each do the whole set-up on a fresh machine.
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: setup demo test bench
setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml scripts/install-torch
	python3 -m venv $(VENV)
	scripts/install-torch $(PY)
	$(PY) -m pip install -e '.[dev]'
	touch $@

demo: setup
	$(VENV)/bin/ghostvis demo

test: setup
	$(VENV)/bin/pytest -q

bench: setup
	$(PY) benchmarks/run_all.py
