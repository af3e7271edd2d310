# The README's two commands: `make site` (build the post-mortem site) and `make test`.
# Each sets itself up on a fresh machine (scripts/setup.sh creates .venv).
VENV  := .venv
PY    := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup lint test test-fast site lab clean gpu-records
setup: $(STAMP)

$(STAMP): pyproject.toml scripts/setup.sh requirements/cpu.lock
	bash scripts/setup.sh

# Unit and kernel tests, then every notebook through nbval: all cells must run, and cells
# marked "# NBVAL_CHECK_OUTPUT" (verdict tables, key figures) must print what is committed.
# loadscope keeps each notebook (and each test module) on one worker.
NBVAL := --nbval-lax --nbval-current-env --nbval-sanitize-with tests/nbval-sanitize.cfg

# Lint, format and types first: they take seconds and fail fast.
CODE := kernels workbench postmortems tests benchmarks

lint: $(STAMP)
	$(VENV)/bin/ruff check $(CODE)
	$(VENV)/bin/ruff format --check $(CODE)
	$(VENV)/bin/mypy

# pytest's exit 5 means it collected no test (PYTEST_ADDOPTS selecting nothing): not a failure
# of the code, and its closing line says "no tests ran".
test: lint
	bash scripts/system-deps.sh
	$(PY) -m pytest -n 2 --dist loadscope tests notebooks $(NBVAL) || [ $$? -eq 5 ]

# The edit loop: unit and kernel tests without the `slow` ones, the notebooks and the browser
# (no notebook, so no nbval: its import alone costs seconds of CPU before the workers start).
# worksteal: an idle worker takes tests from a busy one, so one heavy module ends no run alone.
test-fast: $(STAMP)
	$(PY) -m pytest -p no:nbval -n 2 --dist worksteal -m "not slow and not browser" tests || [ $$? -eq 5 ]

# Executes every notebook afresh and renders site/_build/ (open site/_build/index.html).
site: $(STAMP)
	$(VENV)/bin/varlen-workbench build

# Every committed GPU record, whether the code it measured changed since, and the device calls
# that remake the stale ones (wheels, then tests, then records).
gpu-records: $(STAMP)
	$(VENV)/bin/varlen-workbench gpu-records

lab: $(STAMP)
	$(VENV)/bin/varlen-workbench lab

clean:
	rm -rf $(VENV) site/_build .pytest_cache .hypothesis
