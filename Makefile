# scrubgate: `make demo` and `make test` are all the set-up a fresh machine needs (Python 3.11+, make).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test lint check-examples bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[test]'
	touch $(STAMP)

# The check over the examples, then the lifecycle story on a local stand-in (devcluster/demo.py).
demo: check-examples
	$(BIN)/python -m devcluster.demo

check-examples: $(STAMP)
	@echo "== scrubgate check manifests/examples/good (expect no findings)"
	$(BIN)/scrubgate check manifests/examples/good
	@echo "== scrubgate check manifests/examples/bad (expect a finding per file)"
	$(BIN)/scrubgate check manifests/examples/bad; test $$? -eq 1

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

test: lint
	$(BIN)/pytest -q

bench: $(STAMP)
	$(BIN)/python bench/check_throughput.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis
