# Set-up and entry points. `make demo` and `make test` each do the whole set-up on a fresh machine.
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: setup browser slurm postgres hosts demo test bench gpu-check
setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml scripts/install-torch
	python3 -m venv $(VENV)
	scripts/install-torch $(PY)
	$(PY) -m pip install -e '.[dev]'
	# bytecode for the project's own modules: pip compiles the packages it installs, not an editable project, and with
	# PYTHONDONTWRITEBYTECODE set every process (each rank, each Dagster run) would compile them again (~0.1 s)
	$(PY) -m compileall -q ghostvis_core ghostvis_pipeline
	touch $@

demo: setup
	$(VENV)/bin/ghostvis demo

# Headless Chromium for tests/test_ui_browser.py and tests/test_ui_actions.py: Debian's package, driven by Playwright (its own
# browser download is not used). Installed with apt when missing (as root, or through sudo).
browser:
	@command -v chromium >/dev/null 2>&1 || { \
	  SUDO=$$([ "$$(id -u)" = 0 ] || echo sudo); \
	  $$SUDO apt-get update && $$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y chromium; }

# A real Slurm cluster for tests/test_slurm.py (tests/slurm_cluster.py starts munged, slurmctld and
# two slurmd on 127.0.0.1): Debian's packages, installed with apt when missing (as root, or through sudo).
slurm:
	@command -v slurmctld >/dev/null 2>&1 || { \
	  SUDO=$$([ "$$(id -u)" = 0 ] || echo sudo); \
	  $$SUDO apt-get update && $$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y slurm-wlm munge; }

# A PostgreSQL server for tests/test_postgres.py (tests/postgres_server.py runs initdb and postgres
# in a temporary folder as the `postgres` user, on 127.0.0.1): Debian's package, installed with apt
# when missing (as root, or through sudo). Its own cluster service is not used.
postgres:
	@ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || { \
	  SUDO=$$([ "$$(id -u)" = 0 ] || echo sudo); \
	  $$SUDO apt-get update && $$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y postgresql; }

# Separate hosts for tests/test_separate_hosts.py (tests/hosts.py makes network and mount namespaces
# joined by veth pairs): `ip` from Debian's iproute2 (unshare and nsenter come with util-linux).
hosts:
	@command -v ip >/dev/null 2>&1 || [ -x /usr/sbin/ip ] || { \
	  SUDO=$$([ "$$(id -u)" = 0 ] || echo sudo); \
	  $$SUDO apt-get update && $$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y iproute2; }

test: setup browser slurm postgres hosts
	$(VENV)/bin/pytest -q

bench: setup
	$(PY) benchmarks/run_all.py

# The GPU check (benchmarks/gpu_check.py): its carried folder benchmarks/gpu_wheels filled first when missing
# (needs PyPI), then the check, which exits 0 only when every part meets its goal (2 without a CUDA device).
# On the GPU machine, with the folder carried: make gpu-check PY=python3
gpu-check:
	@test -f benchmarks/gpu_wheels/carried.tar.xz || $(PY) benchmarks/gpu_check.py --prepare
	$(PY) benchmarks/gpu_check.py --out gpu_check.json
