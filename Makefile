# hetrl: the two commands.
#   make train   run the main job on the embedded default (tiny CPU run)
#   make test    run the test suite
# Both bootstrap .venv on first use (pinned by constraints.txt) and re-install when
# pyproject.toml or constraints.txt change. `make test` also bootstraps .venv-sglang (a real
# SGLang server for the SGLang-pool integration tests; tests/sglang_server/, ~2 min, 2.4 GB once).

PYTHON ?= python3.11
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.hetrl-$(shell cat pyproject.toml constraints.txt | sha1sum | cut -c1-12)
PYTEST_ARGS ?=
PYTEST_WORKERS ?= 2  # pytest-xdist workers; each takes whole test files (their module fixtures are shared)

.PHONY: venv sglang-venv sandbox-tools test train bench clean

venv: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet -c constraints.txt -e ".[dev]"
	@rm -f $(VENV)/.hetrl-* && touch $@

sglang-venv:
	@$(PYTHON) tests/sglang_server/bootstrap.py >/dev/null

# bubblewrap gives the code sandbox its minimal view of the machine (hetrl.envs.sandbox); best effort:
# as root with apt reachable it is installed, elsewhere one line says the fallback is used.
sandbox-tools:
	@command -v bwrap >/dev/null 2>&1 || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 \
	  && (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq bubblewrap libseccomp2) \
	  >/dev/null 2>&1 && echo "sandbox: installed bubblewrap"; } \
	  || echo "sandbox: bubblewrap unavailable (not root or offline); the sandbox falls back to unshare namespaces"

test: $(STAMP) sglang-venv sandbox-tools
	$(PY) -m pytest -n $(PYTEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=25 $(PYTEST_ARGS)

train: $(STAMP)
	$(VENV)/bin/hetrl train

bench: $(STAMP)
	$(VENV)/bin/hetrl bench correction_overhead

clean:
	rm -rf $(VENV) .venv-sglang .pytest_cache .hypothesis .cache
