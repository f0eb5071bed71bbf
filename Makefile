# The two commands: `make demo` and `make test`. Both create .venv and install what they need.
PYTHON ?= python3
VENV ?= .venv
TORCH_VERSION ?= 2.13.0
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-torch-$(TORCH_VERSION)
PYTEST_ARGS ?=

.PHONY: demo test test-fast bench lint proto clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "torch==$(TORCH_VERSION)"
	$(BIN)/pip install -q -e ".[server,client,dev]"
	rm -f $(VENV)/.installed-torch-*
	touch $@

demo: $(STAMP)
	$(BIN)/rngcoord demo

test: $(STAMP)
	$(BIN)/python -m pytest $(PYTEST_ARGS)

# The fast tier: everything but the tests marked slow or e2e, on two processes (pytest-xdist);
# under a minute on 2 cores.
test-fast: $(STAMP)
	$(BIN)/python -m pytest -m "not slow and not e2e" -n 2 $(PYTEST_ARGS)

bench: $(STAMP)
	$(BIN)/python bench/coordinator.py --quick
	$(BIN)/python bench/tracker.py
	$(BIN)/python bench/portable.py

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

proto: $(STAMP)
	$(BIN)/python scripts/gen_proto.py

clean:
	rm -rf $(VENV) .build .pytest_cache .mypy_cache .ruff_cache
