# The README's two commands: `make site` (build the post-mortem site) and `make test`.
# Each sets itself up on a fresh machine (scripts/setup.sh creates .venv).
VENV  := .venv
PY    := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup test site lab clean
setup: $(STAMP)

$(STAMP): pyproject.toml scripts/setup.sh
	bash scripts/setup.sh

# Unit and kernel tests, then every notebook through nbval: all cells must run, and cells
# marked "# NBVAL_CHECK_OUTPUT" (verdict tables, key figures) must print what is committed.
# loadscope keeps each notebook (and each test module) on one worker.
NBVAL := --nbval-lax --nbval-current-env --nbval-sanitize-with tests/nbval-sanitize.cfg

test: $(STAMP)
	bash scripts/system-deps.sh
	$(PY) -m pytest -n 2 --dist loadscope tests notebooks $(NBVAL)

# Executes every notebook afresh and renders site/_build/ (open site/_build/index.html).
site: $(STAMP)
	$(VENV)/bin/workbench build

lab: $(STAMP)
	$(VENV)/bin/workbench lab

clean:
	rm -rf $(VENV) site/_build .pytest_cache .hypothesis
