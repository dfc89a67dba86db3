# scrubgate: `make demo` and `make test` are all the set-up a fresh machine needs (Python 3.11+, Go 1.26+, make).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# The Kubernetes release the demo and the end-to-end tests run on (devcluster/k8s/go.mod pins the default).
K8S_VERSION ?=
export K8S_VERSION

.PHONY: demo test lint check-examples cluster-bins bench clean

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

test: lint cluster-bins
	$(BIN)/pytest -q

bench: $(STAMP)
	$(BIN)/python bench/check_throughput.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis
