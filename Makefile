# hetrl: the two commands.
#   make train   run the main job on the embedded default (tiny CPU run)
#   make test    run the test suite
# Both bootstrap .venv on first use (pinned by constraints.txt) and re-install when
# pyproject.toml or constraints.txt change.

PYTHON ?= python3.11
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.hetrl-$(shell cat pyproject.toml constraints.txt | sha1sum | cut -c1-12)
PYTEST_ARGS ?=

.PHONY: venv test train bench clean

venv: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet -c constraints.txt -e ".[dev]"
	@rm -f $(VENV)/.hetrl-* && touch $@

test: $(STAMP)
	$(PY) -m pytest $(PYTEST_ARGS)

train: $(STAMP)
	$(VENV)/bin/hetrl train

bench: $(STAMP)
	$(PY) bench/correction_overhead.py

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
