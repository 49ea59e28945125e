# fedgpu — developer and operator entry points.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
CHECKOV_VENV := .venv-checkov
PROTO_SRC := $(wildcard fedgpu/proto/fedgpu/v1/*.proto)

.PHONY: venv demo test lint proto bench clean images up down e2e checkov-venv docs

venv: $(STAMP)

# One line per step; pip's and setuptools' own output goes to $(VENV)/install.log, shown only
# when a step fails (a first install takes minutes: the lines say where it is).
INSTALL_LOG := $(VENV)/install.log
FAILED = { tail -n 60 $(INSTALL_LOG); echo "make venv failed: the whole log is $(INSTALL_LOG)"; exit 1; }

$(STAMP): pyproject.toml
	@echo "setting up $(VENV) (the first time takes a few minutes)"
	@$(PY) -m venv $(VENV)
	@: > $(INSTALL_LOG)
	@echo "[1/3] pip"
	@$(BIN)/pip install --upgrade pip >>$(INSTALL_LOG) 2>&1 || $(FAILED)
	@# A torch already in the venv (a GPU site's CUDA build) is kept; else the CPU build of
	@# 2.13.0 (a local wheel on CI machines: '+cpu' never matches PyPI's multi-GB CUDA build).
	@echo "[2/3] torch (kept if the venv has one; else the CPU build)"
	@{ $(BIN)/python -c 'import torch' 2>/dev/null || $(BIN)/pip install 'torch==2.13.0+cpu' \
		|| $(BIN)/pip install torch; } >>$(INSTALL_LOG) 2>&1 || $(FAILED)
	@echo "[3/3] fedgpu and its node and dev extras (editable)"
	@$(BIN)/pip install -e '.[node,dev]' >>$(INSTALL_LOG) 2>&1 || $(FAILED)
	@touch $(STAMP)
	@echo "ready: $(VENV)"

demo: venv
	$(BIN)/fedgpu run --nodes 3 --rounds 5

test: venv
	@# Without checkov (no registry reachable) its test skips, saying why; the rest still runs.
	@$(MAKE) --no-print-directory checkov-venv || echo "warning: checkov not installed"
	$(BIN)/python -m pytest -q --durations=25

# checkov (the security linter of deploy/k8s, tests/unit/test_k8s_security.py) pins
# networkx < 2.7 and packaging < 24, which would downgrade the dev venv under torch: it gets
# a venv of its own, like Flower below. Pinned: a new checkov brings new checks.
checkov-venv: $(CHECKOV_VENV)/.installed
$(CHECKOV_VENV)/.installed:
	$(PY) -m venv $(CHECKOV_VENV)
	$(CHECKOV_VENV)/bin/pip install -q --upgrade pip
	$(CHECKOV_VENV)/bin/pip install -q 'checkov==3.3.30'
	touch $@

lint: venv
	$(BIN)/ruff check fedgpu node server tests benchmarks tools
	$(BIN)/python tools/lint_layers.py
	$(BIN)/python tools/import_cycles.py
	$(BIN)/hadolint images/*.Dockerfile

# The documentation site (MkDocs + Material, pinned in docs/requirements.txt and the dev extra)
# into site/; --strict: a broken link, anchor or generated page fails the build.
docs: venv
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --site-dir site

proto: venv
	$(BIN)/python -m fedgpu.proto.generate

# Flower needs protobuf < 7, fedgpu's generated code protobuf 7: Flower gets its own venv,
# and the benchmarks run its side there as a subprocess. .venv itself is never changed.
BENCH_VENV := .venv-bench
# Flower's simulation runs its clients on Ray (flwr[simulation]); they train fedgpu's own digits
# task (benchmarks/flower_sim.py), so torch (the CPU build, as in .venv) and fedgpu's source
# without its dependencies (no protobuf 7 here) come along.
$(BENCH_VENV)/.installed: pyproject.toml
	$(PY) -m venv $(BENCH_VENV)
	$(BENCH_VENV)/bin/pip install -q --upgrade pip
	$(BENCH_VENV)/bin/pip install -q 'flwr[simulation,dp]>=1.8' ml_dtypes nvidia-ml-py blake3 safetensors
	$(BENCH_VENV)/bin/python -c 'import torch' 2>/dev/null \
		|| $(BENCH_VENV)/bin/pip install -q 'torch==2.13.0+cpu' || $(BENCH_VENV)/bin/pip install -q torch
	$(BENCH_VENV)/bin/pip install -q --no-deps -e .
	touch $@

bench: venv $(BENCH_VENV)/.installed
	$(BIN)/python -m benchmarks.run_all

# --- containers ---------------------------------------------------------------
PROFILE ?=
OFFLINE ?=
E2E_BUILD ?= offline

images:   ## fedgpu/server:dev and fedgpu/node:dev (OFFLINE=1: local base + wheelhouse, no registry)
	@bash images/build.sh $(if $(filter 1 yes true,$(OFFLINE)),--offline,)

up:       ## make up PROFILE=cpu|gpu-offered|gpu-enforced|hetero
	@bash compose/compose.sh up "$(PROFILE)"

down:
	@bash compose/compose.sh down

e2e: venv ## real Docker: builds images, runs compose federations (E2E_BUILD=offline|online|skip)
	bash tests/e2e/setup_docker.sh up
	FEDGPU_E2E_BUILD=$(E2E_BUILD) $(BIN)/python -m pytest -q -m e2e tests/e2e

clean:
	rm -rf $(VENV) $(CHECKOV_VENV) runs site .pytest_cache
