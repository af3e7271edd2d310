# The README's two commands: `make site` (build the post-mortem site) and `make test`.
# Each sets itself up on a fresh machine (scripts/setup.sh creates .venv).
VENV  := .venv
PY    := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup test site lab clean
setup: $(STAMP)

$(STAMP): pyproject.toml scripts/setup.sh
	bash scripts/setup.sh

test: $(STAMP)
	$(PY) -m pytest -n 2 --dist loadscope

clean:
	rm -rf $(VENV) site/_build .pytest_cache .hypothesis
