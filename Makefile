# scrubgate: `make demo` and `make test` are all the set-up a fresh machine needs (Python 3.11+, Go 1.26+, make).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# The Kubernetes release the demo and the end-to-end tests run on (devcluster/k8s/go.mod pins the default).
K8S_VERSION ?=
export K8S_VERSION

.PHONY: demo test lint check-examples cluster-bins bench clean

# The test extra brings the server extra (webhook, agent, cluster commands) with it.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[test]'
	touch $(STAMP)

# etcd, kube-apiserver, kube-controller-manager, kube-scheduler and kubectl, built once from their Go modules
# into ~/.cache/scrubgate/k8s/v<version>/bin; a second run does nothing.
cluster-bins:
	bash devcluster/k8s/build.sh

# The check over the examples, then the lifecycle story on the real control plane (devcluster/demo.py).
demo: check-examples cluster-bins
	$(BIN)/python -m devcluster.demo

check-examples: $(STAMP)
	@echo "== scrubgate check manifests/examples/good (expect no findings)"
	$(BIN)/scrubgate check manifests/examples/good
	@echo "== scrubgate check manifests/examples/bad (expect a finding per file)"
	$(BIN)/scrubgate check manifests/examples/bad; test $$? -eq 1

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

# Test files on TEST_WORKERS parallel workers (each e2e file starts its own control planes, mostly waiting on
# them: two workers a core); TEST_WORKERS=0 runs them in this process, one at a time.
TEST_WORKERS ?= $(shell echo $$(( $$(nproc 2>/dev/null || echo 1) * 2 )))
test: lint cluster-bins helm-bin promtool-bin
	$(BIN)/pytest -q -n $(TEST_WORKERS) --dist loadfile

bench: $(STAMP)
	$(BIN)/python bench/check_throughput.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis

.PHONY: helm-bin promtool-bin chart-schema image

# helm and promtool, each built from its Go module (tools/<tool>/go.mod) into
# ~/.cache/scrubgate/<tool>/v<version>/<tool>, once; each prints the binary's path on stdout, progress on stderr.
helm-bin:
	tools/build-go-tool.sh helm

promtool-bin:
	tools/build-go-tool.sh promtool

# charts/scrubgate/values.schema.json from the policy's own schema (after a change to policies/config.py).
chart-schema: $(STAMP)
	$(BIN)/python tools/chart_schema.py

# The one image for webhook, agent and reports (needs a container engine; not used by the tests).
image:
	docker build -t ghcr.io/scrubgate/scrubgate:$$(sed -n 's/^__version__ = "\(.*\)"/\1/p' scrubgate/__init__.py) .
