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

bench: venv
	$(BIN)/pip install -q -e '.[bench]'
	$(BIN)/python -m benchmarks.run_all

clean:
	rm -rf $(VENV) runs .pytest_cache
