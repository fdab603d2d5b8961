# Everything runs in .venv, which scripts/setup.sh creates or updates first (Python >= 3.12, jax==0.11.2).
# Extra pytest arguments: make test PYTEST_ARGS="-k sparse -x"
PY := .venv/bin/python
PYTEST_ARGS ?=

.PHONY: setup demo test test-all bench notebooks build-file clean distclean

setup:
	@bash scripts/setup.sh

demo: setup
	.venv/bin/mla-pallas demo

# Two pytest-xdist workers: CI machines have 2 cores. Tests marked slow are skipped here.
test: setup
	$(PY) -m pytest -n 2 tests $(PYTEST_ARGS)

test-all: setup
	$(PY) -m pytest -n 2 --runslow tests $(PYTEST_ARGS)

bench: setup
	.venv/bin/mla-pallas bench sparse_mla_decode

# Runs both notebooks on this machine (CPU or GPU; GPU cells skip themselves without a GPU), as tests/test_notebooks.py
# does; outputs are not written back (add --inplace to keep them).
notebooks: setup
	.venv/bin/jupyter execute notebooks/01_quickstart.ipynb notebooks/02_benchmarks.ipynb

# Regenerate BUILD after adding or removing a module under mla_pallas/ or a tests/test_*.py file.
build-file:
	python3 scripts/gen_build.py

clean:
	rm -rf build .pytest_cache .hypothesis *.egg-info
	find . -path ./.venv -prune -o -name __pycache__ -type d -prune -exec rm -rf {} +

distclean: clean
	rm -rf .venv
