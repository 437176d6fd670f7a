"""A worker: the model, its paged KV cache and the step executor, built from config.
No request state lives here; every step says everything it needs."""

from __future__ import annotations

import functools
import threading
import uuid
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path

import structlog
import torch

from kernels import reference
from svc_common.cpu_features import read_cpu_features, resolve_dtype
from svc_common.log_setup import configure_logging
from worker_svc.attention.backend import load_backend, resolve_backend
from worker_svc.attention.kv_cache import ContiguousKVCache, PagedKVCache, kv_cache_class
from worker_svc.attention.prefill_route import prefill_route
from worker_svc.config import WorkerConfig
from worker_svc.lora import (
    AdapterRefused,
    LoraAdapter,
    LoraSlots,
    SlotUpdate,
    check_step_slots,
    lora_op,
    read_adapter,
    read_files,
)
from worker_svc.models import DecoderModel, load_spec
from worker_svc.models import UnsupportedModel as UnsupportedModel  # what __main__ reports as one line
from worker_svc.models.families import listing
from worker_svc.models.footprint import held_bytes
from worker_svc.models.spec import auto_dtype
from worker_svc.parallel.group import GroupSpec, TensorParallelGroup
from worker_svc.parallel.rank import ignore_stop_signals, serve_rank
from worker_svc.parallel.sampling import SamplingRank
from worker_svc.parallel.sharding import load_rank_model, lora_split
from worker_svc.runner.cuda_graphs import CudaGraphBackend, GraphBackend
from worker_svc.runner.memory import CudaMemory, MemoryBaseline
from worker_svc.runner.model_runner import ModelRunner
from worker_svc.runner.warm_up import warm_up
from worker_svc.sampling.sampler import Sampler
from worker_svc.step.errors import InvalidStep, StaleStep, StepOutOfMemory, WorkerDown
from worker_svc.step.input import StepInput, TokenMasks
from worker_svc.step.output import StepOutput
from worker_svc.step.validation import Limits, validate, validate_masks
from worker_svc.worker.device import (
    TORCH_DTYPES,
    describe,
    resolve_device,
    resolve_kv_dtype,
    set_threads,
    use_device,
    use_threads,
)
from worker_svc.worker.failures import DEVICE_LOST, OUT_OF_MEMORY, classify_failure
from worker_svc.worker.info import WorkerInfo
from worker_svc.worker.sizing import kv_pool_ids, offload_pool

log = structlog.get_logger(__name__)

# How long a step planned ahead waits for the step it names (sent just before it).
PREVIOUS_STEP_WAIT_S = 5.0


def warms_up(device: torch.device, graph_backend: GraphBackend | None) -> bool:
    """Whether a worker warms up before serving (runner/warm_up.py: graphs captured,
    every kernel a first request runs compiled): with graphs, and on CUDA (Triton
    compiles on first use). Every tensor-parallel rank runs the same warm-up
    forwards in the same order, so their collectives pair up; skipping it left
    the first request compiling every kernel on every rank (issue 27). A CPU
    worker without graphs has nothing to compile."""
    return graph_backend is not None or device.type == "cuda"


class Worker:
    def __init__(
        self,
        config: WorkerConfig,
        graph_backend: GraphBackend | None = None,
        parallel: TensorParallelGroup | None = None,
    ):
        """graph_backend: how decode graphs are captured; None = CUDA graphs on a CUDA
        device with a graph-safe backend (Triton), none elsewhere. --enforce-eager:
        none at all. `parallel`: this process's rank of a tensor-parallel worker
        (ranks 1..N-1 pass theirs, see run_rank); with --tensor-parallel-size > 1
        and none given, this process is rank 0 and starts the others."""
        self.config = config
        cpu = read_cpu_features()
        threads_reason, self._thread_plan = set_threads(config, cpu)
        if parallel is None and config.tensor_parallel_size > 1:
            parallel = TensorParallelGroup.launch(group_spec(config), functools.partial(run_rank, config))
        self.parallel = parallel
        self.device = parallel.device if parallel else resolve_device(config.device)
        use_device(self.device)
        self._failed: str | None = None  # why this worker cannot run steps any more
        self._failure_callbacks: list[Callable[[], None]] = []
        # The device before anything is loaded: memory sizing counts what this worker adds.
        memory = CudaMemory(self.device) if self.device.type == "cuda" else None
        baseline = MemoryBaseline.read(memory) if memory is not None else None
        self.dtype = resolve_dtype(config.dtype, self.device.type, cpu)
        if config.dtype == "auto":
            self.dtype = auto_dtype(self.dtype, self.device.type, config.model)
        dtype = TORCH_DTYPES[self.dtype]
        backend = load_backend(resolve_backend(config.attention_backend, self.device))
        self.backend = backend.name
        # A tensor-parallel forward needs every rank in its collectives: no graphs (the
        # warm-up runs on every rank, in step: the same forwards meet in the same collectives).
        eager = config.enforce_eager or parallel is not None
        # The fused forward (not --enforce-eager): the backend's fused element-wise ops
        # (Triton on CUDA, C++ on the CPU) and, on the CPU with the C++ kernels, the
        # weights packed for the C++ linear layers. --enforce-eager: the per-op torch
        # forward of the reference ops (and, on CUDA, no graphs).
        layer_ops = reference if eager else backend.ops
        self.cpu_linears = not eager and self.device.type == "cpu" and backend.name == "cpu"
        self.lora: LoraSlots | None = None
        if config.enable_lora:
            whole_spec = load_spec(config.model)
            op = lora_op(self.device, self.cpu_linears)
            split = lora_split(whole_spec, parallel) if parallel else None
            self.lora = LoraSlots(whole_spec, config.max_loras, config.max_lora_rank, dtype, self.device, op, split)
        hook = self.lora.adapt if self.lora else None
        if parallel:  # this rank's heads, MLP columns and vocabulary slice
            self.model = load_rank_model(config.model, dtype, parallel, hook)
        else:
            self.model = DecoderModel.load(
                config.model,
                dtype,
                self.device,
                ops=layer_ops,
                cpu_linears=self.cpu_linears,
                hook=hook,
                quant_activations=config.quant_activations,
            )
        spec = self.model.spec  # this rank's head counts
        ranks = parallel.size if parallel else 1
        whole = load_spec(config.model) if parallel else spec
        kv_dtype = resolve_kv_dtype(config.kv_dtype, dtype, self.device)
        max_len = min(config.max_model_len or spec.max_model_len, spec.max_model_len)
        log.info(
            "worker compute",
            device=describe(self.device),
            cpu=cpu.describe(),
            dtype=self.dtype,
            dtype_requested=config.dtype,
            threads=torch.get_num_threads(),
            threads_reason=threads_reason,
            attention_backend=backend.name,
            forward="per-op (eager)" if self.model.ops is reference else f"fused ({backend.name} ops)",
            linears="C++ (packed at load)" if self.cpu_linears else "torch",
            weights=self.model.weight_format,
            quant_activations=config.quant_activations,
            layer_loop=self.model.layer_loop_label,
        )
        if not eager and graph_backend is None and self.device.type == "cuda":
            graph_backend = CudaGraphBackend(self.device) if backend.graph_safe else None
            if graph_backend is None:  # the torch reference ops read lengths on the host
                log.info("cuda graphs off: they need a graph-safe attention backend", attention_backend=backend.name)
        graph_backend = None if eager else graph_backend
        # Paged: blocks of --block-size tokens. Contiguous: slots of max_len tokens,
        # one per sequence; the same [layers, ids, kv_heads, tokens, head_dim] tensor.
        contiguous = config.kv_layout == "contiguous"
        tokens_per_id = max_len if contiguous else config.block_size
        table_width = 1 if contiguous else -(-max_len // tokens_per_id)  # a graph's block tables
        route = prefill_route(config.prefill_attention, self.device, backend.name)
        shape = (spec.num_kv_heads, tokens_per_id, spec.head_dim)

        def make_cache(num_ids: int) -> PagedKVCache | ContiguousKVCache:
            cache_class = kv_cache_class(config.kv_layout)
            return cache_class(spec.num_layers, num_ids, *shape, kv_dtype, self.device, backend.ops)

        num_ids = config.max_batch if contiguous else config.num_blocks
        if not num_ids:
            # Profiled over a one-block scratch cache before the pool exists (runner/memory.py).
            scratch = lambda: ModelRunner(self.model, make_cache(1), Sampler(0), route, self.lora)
            graphs_width = table_width if graph_backend is not None else None
            per_id = PagedKVCache.bytes_per_block(
                spec.num_layers, spec.num_kv_heads, tokens_per_id, spec.head_dim, kv_dtype
            )
            num_ids = kv_pool_ids(config, per_id, memory, baseline, scratch, max_len, graphs_width)
            if parallel is not None:  # the ranks take the smallest count
                num_ids = parallel.min_over_ranks(num_ids)
        self.cache = make_cache(num_ids)
        self.offload = offload_pool(config, self.cache.tensors, self.cache.block_bytes, parallel)
        num_offload = self.offload.num_blocks if self.offload is not None else 0
        sampler = Sampler(None if config.seed < 0 else config.seed)
        self.runner = ModelRunner(
            self.model, self.cache, SamplingRank(sampler, parallel) if parallel else sampler, route, self.lora
        )
        self.limits = Limits(spec.vocab_size, num_ids, tokens_per_id, max_len, config.kv_layout, num_offload)
        self.info = WorkerInfo(
            model_name=Path(config.model).resolve().name,
            model_type=spec.model_type,
            num_layers=spec.num_layers,
            num_q_heads=whole.num_q_heads,
            num_kv_heads=whole.num_kv_heads,
            head_dim=spec.head_dim,
            vocab_size=spec.vocab_size,
            max_model_len=max_len,
            block_size=tokens_per_id,
            num_blocks=num_ids,
            kv_dtype=str(kv_dtype).removeprefix("torch."),
            dtype=self.dtype,
            device=describe(self.device),
            instance_id=uuid.uuid4().hex,
            kv_bytes_per_block=self.cache.block_bytes * ranks,
            sliding_window=spec.sliding_window,
            attention_backend=self.backend,
            kv_bytes_per_token=self.cache.block_bytes * ranks // tokens_per_id,
            kv_scale_bytes_per_block=self.cache.scale_block_bytes * ranks,
            kv_dtype_requested=config.kv_dtype,
            kv_layout=config.kv_layout,
            max_batch=num_ids if contiguous else 0,
            tensor_parallel_size=ranks,
            kv_bytes_per_block_per_rank=self.cache.block_bytes,
            max_num_seqs=config.max_num_seqs,
            hidden_size=self.model.spec.hidden_size,
            num_offload_blocks=num_offload,
            offload_medium=self.offload.medium if self.offload is not None else "",
            max_loras=self.lora.max_loras if self.lora else 0,
            max_lora_rank=self.lora.max_rank if self.lora else 0,
            kv_role=config.kv_role,
            weight_format=self.model.weight_format,
            weights_bytes=held_bytes(self.model),
        )
        # Before serving: capture the decode graphs, and compile every kernel a first
        # request needs, on every tensor-parallel rank too.
        if warms_up(self.device, graph_backend):
            warm_up(self.runner, graph_backend, config.max_num_seqs, table_width, num_ids)
        # One step at a time (steps mutate the shared cache), and a step planned
        # ahead only right after the step it names.
        self._step_done = threading.Condition()
        self._last_step: tuple[int, bool] | None = None  # (step id, succeeded) of the step run last
        if parallel is not None and parallel.rank == 0:
            parallel.wait_ready()  # every rank holds its shard and its part of the cache

    @property
    def graphs_enabled(self) -> bool:
        return self.runner.graphs is not None

    def step(self, step: StepInput) -> StepOutput:
        """Validates first (raising InvalidStep before anything is touched), then runs.
        A step planned ahead waits (briefly) for the step it names to run first,
        since gRPC may hand the two calls to threads in either order; StaleStep
        if that step is not the one run last. WorkerDown once the worker failed
        (a rank gone, a CUDA error); StepOutOfMemory for a step that did not fit."""
        if (reason := self.failed) is not None:
            raise WorkerDown(reason)
        if step.previous_step_masks is not None:  # before this step waits for the one that needs them
            if step.previous_step_id is None:
                raise InvalidStep("previous_step_masks", "needs the previous_step_id whose masks they are")
            self.deliver_masks(step.previous_step_id, step.previous_step_masks, "previous_step_masks")
        validate(step, self.limits)
        with self._step_done:
            if step.previous_step_id is not None:
                self._await_previous(step.previous_step_id)
            check_step_slots(step.seqs, self.lora)  # under the lock: no load or unload meanwhile
            ok = False
            try:
                if self.parallel is not None:
                    out = self.parallel.execute(self.execute, step)
                else:
                    out = self.execute(step)
                ok = True
                return out
            finally:
                self._last_step = (step.step_id, ok)
                self._step_done.notify_all()

    def execute(self, step: StepInput) -> StepOutput:
        """A validated step on this worker's device, on the calling thread (a gRPC
        pool thread, or a tensor-parallel rank's loop): the device is made current
        first. A CUDA error that kills the context fails the worker (WorkerDown);
        running out of memory fails only the step (StepOutOfMemory)."""
        use_device(self.device)
        if self._thread_plan is not None:
            use_threads(self._thread_plan, step)
        try:
            moved = self.offload.run(step.tiers) if self.offload is not None and len(step.tiers) else None
            out = self.runner.execute(step)
            if moved:
                out.timings_ms.update(moved)
            return out
        except Exception as exc:
            kind = classify_failure(exc)
            if kind == DEVICE_LOST:
                reason = f"{kind}: {type(exc).__name__}: {exc}"
                self._fail(reason)
                raise WorkerDown(reason) from exc
            if kind == OUT_OF_MEMORY:
                raise StepOutOfMemory(f"{type(exc).__name__}: {exc}") from exc
            raise

    @property
    def failed(self) -> str | None:
        """Why this worker cannot run steps any more (None: it can)."""
        if self._failed is None and self.parallel is not None:
            return self.parallel.failed
        return self._failed

    def on_failure(self, callback: Callable[[], None]) -> None:
        """`callback()` once the worker fails (at once if it has): the process must go down."""
        self._failure_callbacks.append(callback)
        if self.parallel is not None:
            self.parallel.on_failure(callback)
        if self._failed is not None:
            callback()

    def _fail(self, reason: str) -> None:
        if self._failed is not None:
            return
        self._failed = reason
        log.error("worker failed: the device cannot run steps any more, going down", reason=reason, fatal=True)
        for callback in self._failure_callbacks:
            callback()

    def load_adapter(self, slot: int, name: str, source: Path | dict[str, bytes]) -> LoraAdapter:
        """A PEFT adapter (a directory, or its files) into `slot`, replacing what it held.
        Read and checked first (AdapterRefused naming the field or tensor), then written
        between steps: under the step lock."""
        if self.lora is None:
            raise AdapterRefused("slot", "this worker runs without --enable-lora")
        self.lora.check_slot(slot)
        config_bytes, weight_bytes = read_files(source)
        adapter = read_adapter(name, config_bytes, weight_bytes, self.lora.spec, self.lora.max_rank)
        self._update_slot(SlotUpdate(slot, adapter))
        return adapter

    def unload_adapter(self, slot: int) -> None:
        if self.lora is None:
            raise AdapterRefused("slot", "this worker runs without --enable-lora")
        self.lora.check_slot(slot)
        self._update_slot(SlotUpdate(slot, None))

    def _update_slot(self, update: SlotUpdate) -> None:
        """Between steps (the step lock), on every tensor-parallel rank in step order."""
        assert self.lora is not None
        with self._step_done:
            if self.parallel is not None:
                self.parallel.execute(self.lora.apply, update)
            else:
                self.lora.apply(update)

    def run_on_rank(self, item: object) -> object:
        """A tensor-parallel rank's executor: the steps and slot updates rank 0 sends."""
        if isinstance(item, SlotUpdate):
            assert self.lora is not None
            self.lora.apply(item)
            return None
        assert isinstance(item, StepInput)
        return self.execute(item)

    def deliver_masks(self, step_id: int, masks: TokenMasks, field_name: str = "step_masks.masks") -> None:
        """The late masks of step `step_id`, from a StepMasks call or riding along with the next
        step (checked now; their rows when the step takes them at sampling). Never waits on the
        step lock: that step may be running, waiting for them."""
        validate_masks(field_name, masks, self.limits.vocab_size)
        self.runner.late_masks.put(step_id, masks, field_name)

    def close(self) -> None:
        """Stop the other tensor-parallel ranks (nothing to do for one rank)."""
        if self.parallel is not None and self.parallel.rank == 0:
            self.parallel.close()

    def _await_previous(self, previous: int) -> None:
        ran = lambda: self._last_step is not None and self._last_step[0] == previous
        if not self._step_done.wait_for(ran, timeout=PREVIOUS_STEP_WAIT_S) or self._last_step != (previous, True):
            raise StaleStep(
                f"previous_step_id: step {previous} is not the step this worker ran last "
                f"({self._last_step}); it restarted or that step failed"
            )


def group_spec(config: WorkerConfig) -> GroupSpec:
    return GroupSpec(config.tensor_parallel_size, config.device, config.num_threads)


def run_rank(config: WorkerConfig, rank: int, init_method: str, pipe: Connection) -> None:
    """A tensor-parallel rank's process (1..N-1; rank 0 started it, TensorParallelGroup.launch):
    the same Worker as rank 0 builds, on its shard and its part of the cache,
    running the steps rank 0 sends."""
    ignore_stop_signals()
    configure_logging(config.log_format, config.log_level)

    def build() -> Callable[[object], object]:
        group = TensorParallelGroup.join(group_spec(config), rank, init_method)
        return Worker(config, parallel=group).run_on_rank

    serve_rank(rank, pipe, build)


def architectures() -> str:
    """What --list-architectures prints: the registered families (models/families/)."""
    return listing()
