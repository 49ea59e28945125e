# fedgpu — developer and operator entry points.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PROTO_SRC := $(wildcard fedgpu/proto/fedgpu/v1/*.proto)

.PHONY: venv demo test lint proto bench clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch pinned to the CPU build on this kind of machine; a GPU site installs its CUDA wheel first.
	$(BIN)/pip install -q 'torch==2.13.0' || $(BIN)/pip install -q torch
	$(BIN)/pip install -q -e '.[node,dev]'
	touch $(STAMP)

demo: venv
	$(BIN)/fedgpu run --nodes 3 --rounds 5

test: venv
	$(BIN)/python -m pytest -q

lint: venv
	$(BIN)/ruff check fedgpu node server tests benchmarks

proto: venv
	$(BIN)/python -m fedgpu.proto.generate

# Flower needs protobuf < 7, fedgpu's generated code protobuf 7: Flower gets its own venv,
# and the benchmarks run its side there as a subprocess. .venv itself is never changed.
BENCH_VENV := .venv-bench
$(BENCH_VENV)/.installed: pyproject.toml
	$(PY) -m venv $(BENCH_VENV)
	$(BENCH_VENV)/bin/pip install -q --upgrade pip
	$(BENCH_VENV)/bin/pip install -q 'flwr>=1.8'
	touch $@

bench: venv $(BENCH_VENV)/.installed
	$(BIN)/python -m benchmarks.run_all

clean:
	rm -rf $(VENV) runs .pytest_cache
