# The two commands of the README: `make demo` (the main job) and `make test` (every test).
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin

.PHONY: setup test lint kube demo bench clean

setup: $(VENV)/.installed

# One venv per checkout; pip's own cache makes a fresh clone's install quick on a machine seen before.
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[test,speed]'
	touch $@

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

# The end-to-end tests run on a real control plane built from upstream Kubernetes (e2e/kube): about
# 7 minutes cold on 2 cores, cached by pin outside the tree, a no-op after that. Built here, before
# pytest, so its progress shows.
kube:
	@nice -n 10 bash e2e/kube/build.sh >/dev/null

# pytest exits 5 when it collects nothing; that is not a failure of the suite.
test: lint kube
	ROUTERFLEET_KUBE_BIN=$$(bash e2e/kube/build.sh | tail -1) $(BIN)/python -m pytest -q -p no:cacheprovider; \
	rc=$$?; [ $$rc -eq 5 ] && rc=0; exit $$rc

demo: setup
	$(BIN)/python -m e2e.demo

bench: setup
	$(BIN)/pip install -q ai-dynamo-runtime && $(BIN)/python -m bench.ingest_match

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis
