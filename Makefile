# The two commands: `make demo` and `make test`. Both create .venv and install what they need.
PYTHON ?= python3
VENV ?= .venv
TORCH_VERSION ?= 2.13.0
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-torch-$(TORCH_VERSION)
PYTEST_ARGS ?=

# The client suites the CI matrix runs on the other torch versions, each in a venv of its own
# (.venv-torch2.14.1, ...): everything that touches the DTensor internals rngcoord hooks.
# The probe itself; the shard arithmetic (_calc_shard_info); the exact Philox states set
# (_PhiloxState); the tracker on a real mesh in processes and threads; PyTorch's own random-op
# suite with torch.compile; the sharding-invariant policy; init_mesh's device choice; and
# examples/train_tp.py under torchrun end to end.
TORCH_SUITE ?= tests/client/test_compat.py tests/client/test_layout.py \
	tests/client/test_philox_states.py tests/client/test_dtensor.py \
	tests/client/test_random_parity.py tests/client/test_invariant.py \
	tests/client/test_fullgraph.py tests/client/test_torchtitan.py \
	tests/client/test_init_mesh.py tests/e2e/test_elastic.py

# pipefail: pip's output goes through a filter (PIP_QUIET) and pip's failure must still fail.
SHELL := /bin/bash
.SHELLFLAGS := -o pipefail -c
# Drops pip's lines that say nothing about progress: what is already there, and the warning
# this machine's pip config gives for each package its local file:// indexes lack.
PIP_QUIET := sed -u -e '/^Requirement already satisfied/d' -e "/^WARNING: Location 'file:.* is ignored/d"

# Where torch's wheels are kept between runs (see the venv rule).
WHEELHOUSE ?= $(HOME)/.cache/rngcoord/wheels

.PHONY: venv demo test test-fast test-torch bench lint proto clean

# The machine's global pip config may cap torch (a constraint file under /etc/xdg/pip); our own
# constraint file, named in PIP_CONSTRAINT, replaces it and pins this venv's torch exactly, so
# installing the package's extras can never move torch either. torch's wheels (with its CUDA
# dependencies, ~5 GB for a CUDA build) are kept in WHEELHOUSE between runs and venvs: pip's
# own HTTP cache kept nothing on this machine (~/.cache/pip stayed empty after a 5 GB
# install), and CI's fresh clone starts without venvs. torch goes in --no-compile, and the
# whole venv is then byte-compiled by one compileall on both cores (~10 s here). Leaving it
# to import time was no saving: where PYTHONDONTWRITEBYTECODE is set (it is on the
# developers' machines) Python never writes .pyc files, so every process compiled torch
# again, and `import torch.distributed.tensor` took 5.4 s instead of 2.4 s, in each of the
# suite's hundreds of torch processes. (PYC below does the same for the project's own
# sources before each run.) Every venv ignores itself (as Python 3.13's venv does), so
# .venv-torch* needs no entry in .gitignore, and ruff, which follows .gitignore, skips it.
$(STAMP): pyproject.toml
	@echo "==> [1/5] creating $(VENV) with $(PYTHON)"
	$(PYTHON) -m venv $(VENV)
	@printf '*\n' > $(VENV)/.gitignore
	@printf 'torch==%s\n' "$(TORCH_VERSION)" > $(VENV)/constraints.txt
	@echo "==> [2/5] upgrading pip"
	$(BIN)/pip install -q --upgrade pip
	@echo "==> [3/5] installing torch $(TORCH_VERSION) (a CPU build takes ~30 s, a CUDA build minutes); wheels kept in $(WHEELHOUSE)"
	PIP_CONSTRAINT=$(VENV)/constraints.txt $(BIN)/pip download --dest $(WHEELHOUSE) \
		"torch==$(TORCH_VERSION)" 2>&1 | $(PIP_QUIET)
	PIP_CONSTRAINT=$(VENV)/constraints.txt $(BIN)/pip install --no-compile --no-index \
		--find-links $(WHEELHOUSE) "torch==$(TORCH_VERSION)" 2>&1 | $(PIP_QUIET)
	@echo "==> [4/5] installing rngcoord with its server, client and dev extras"
	PIP_CONSTRAINT=$(VENV)/constraints.txt $(BIN)/pip install -e ".[server,client,dev]" 2>&1 | $(PIP_QUIET)
	@echo "==> [5/5] byte-compiling $(VENV) (two cores, ~10 s)"
	$(BIN)/python -m compileall -q -j 0 $(VENV)/lib >/dev/null 2>&1 || \
		echo "    (a few modules written for newer Pythons did not compile; none is imported)"
	rm -f $(VENV)/.installed-torch-*
	touch $@ $(PACKAGES)
	@echo "==> $(VENV) is ready (torch $(TORCH_VERSION))"

# The editable install maps the top-level packages it saw when it ran (setuptools' finder), so
# a package added since (rngcoord.demo was, in 8f1f968) stays unimportable in an older .venv.
# Adding or removing one changes its root folder's time: the install runs again (~15 s).
PACKAGES := $(VENV)/.packages
$(PACKAGES): $(STAMP) proto/rngcoord server/rngcoord client/rngcoord
	@echo "==> a package was added or removed: installing rngcoord into $(VENV) again"
	PIP_CONSTRAINT=$(VENV)/constraints.txt $(BIN)/pip install -q --no-deps -e . 2>&1 | $(PIP_QUIET)
	touch $@

venv: $(PACKAGES)

demo: $(PACKAGES)
	$(BIN)/rngcoord demo

# The whole suite on two processes (pytest-xdist; idle workers steal queued tests, so the long
# waits of the outage and torchrun tests overlap other work). `make test XDIST=` runs it on one.
XDIST ?= -n 2 --dist worksteal
# The project's own sources byte-compiled once, not in every subprocess (see the venv rule).
PYC = $(BIN)/python -m compileall -q -j 0 client server tests examples bench >/dev/null
test: $(PACKAGES)
	$(PYC)
	$(BIN)/python -m pytest $(XDIST) --durations=15 $(PYTEST_ARGS)

# The fast tier: everything but the tests marked slow or e2e, on SQLite (the PostgreSQL cases
# of the same tests run in `make test`), on two processes as `make test`; about a minute.
test-fast: $(PACKAGES)
	$(PYC)
	$(BIN)/python -m pytest -m "not slow and not e2e" -k "not postgresql" $(XDIST) $(PYTEST_ARGS)

# TORCH_SUITE on another torch: `make test-torch TORCH_VERSION=2.15.0`.
test-torch:
	$(MAKE) test VENV=.venv-torch$(TORCH_VERSION) PYTEST_ARGS="$(TORCH_SUITE) $(PYTEST_ARGS)"

bench: $(PACKAGES)
	$(BIN)/python bench/coordinator.py --quick
	$(BIN)/python bench/tracker.py
	$(BIN)/python bench/portable.py
	$(BIN)/python bench/heal.py

lint: $(PACKAGES)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
	$(BIN)/lint-imports

proto: $(PACKAGES)
	$(BIN)/python scripts/gen_proto.py

clean:
	rm -rf $(VENV) .venv-torch* .build .pytest_cache .mypy_cache .ruff_cache
