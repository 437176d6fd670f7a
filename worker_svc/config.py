"""Worker configuration: flags, env vars (PAGEDSERVE_WORKER_*), validation."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from svc_common.defaults import DEFAULT_MODEL, model_dir_check
from svc_common.log_setup import LOG_FORMATS
from svc_common.peer_auth import is_loopback, token_file_problem
from svc_common.tls import file_checks, pair_check
from worker_svc.affinity import cores_problem as affinity_problem
from worker_svc.parallel.layout import layout_problem

DTYPES = ("auto", "float32", "bfloat16", "float16")
KV_ROLES = ("both", "prefill", "decode")  # --kv-role (disaggregation)
KV_DTYPES = ("auto", "fp16", "bf16", "fp32", "fp8", "int8")


@dataclass
class WorkerConfig:
    model: str = field(default=DEFAULT_MODEL, metadata={"help": "HF checkpoint directory"})
    host: str = field(default="127.0.0.1", metadata={"help": "address to bind"})
    port: int = field(
        default=50061, metadata={"help": "port to bind; 0 lets the OS pick (printed in the 'worker ready' log line)"}
    )
    num_blocks: int = field(default=0, metadata={"help": "KV blocks to allocate; 0 = size from --kv-cache-memory-mb"})
    kv_cache_memory_mb: int = field(
        default=0,
        metadata={
            "help": "KV pool size when --num-blocks is 0; 0 = auto: 512 on CPU, on CUDA what --gpu-memory-utilization leaves once the weights and a profiled step are counted (set: at most this)"
        },
    )
    gpu_memory_utilization: float = field(
        default=0.9,
        metadata={
            "help": "CUDA, as vLLM's flag: the fraction of the GPU's memory this worker may use (weights, the activations of a profiled --max-num-batched-tokens prefill and --max-num-seqs sampling step, CUDA graphs, the KV pool); per rank with --tensor-parallel-size"
        },
    )
    max_num_batched_tokens: int = field(
        default=8192,
        metadata={
            "help": "the most tokens a step holds (match the scheduler's --max-num-batched-tokens): a CUDA worker profiles a prefill this large before sizing its KV pool"
        },
    )
    block_size: int = field(default=16, metadata={"help": "tokens per KV block"})
    kv_layout: str = field(
        default="paged",
        metadata={
            "help": "paged = blocks of --block-size tokens shared on demand; contiguous = the baseline: one max-model-len slot per sequence, [layers, max_batch, kv_heads, max_seq_len, head_dim]",
            "choices": ("paged", "contiguous"),
        },
    )
    kv_offload_gb: float = field(
        default=0.0,
        metadata={
            "help": "a second KV tier under the prefix cache, this many GB: cached blocks the pool evicts are copied there and back up on a prefix hit; pinned host memory on CUDA, a file-backed pool under --kv-offload-dir on a CPU (0 = none)"
        },
    )
    kv_offload_dir: str = field(
        default="",
        metadata={
            "help": "directory for the file-backed second KV tier (required with --kv-offload-gb on a CPU, whose first tier is already host memory; on CUDA, set to put the tier on disk instead of pinned memory)"
        },
    )
    kv_offload_blocks: int = field(
        default=0, metadata={"help": "second KV tier size in blocks (overrides --kv-offload-gb; tests, benchmarks)"}
    )
    max_batch: int = field(
        default=0,
        metadata={"help": "contiguous layout: slots (sequences at once); 0 = as many as fit in --kv-cache-memory-mb"},
    )
    dtype: str = field(
        default="auto",
        metadata={
            "help": "weights/activations dtype; auto = bfloat16 on CUDA (float16 for a float16 checkpoint) and on a CPU that multiplies bf16 natively (AVX-512 BF16 or AMX), float32 on other CPUs (printed at start)",
            "choices": DTYPES,
        },
    )
    quant_activations: str = field(
        default="none",
        metadata={
            "help": "a GGUF model's linears: none = fp32 (or bf16) activations times the weights decoded exactly (token-exact with --dtype float32); int8 = activations quantized per 32-block as llama.cpp does, integer dot products with the weight blocks (faster on the CPU; the tokens move: bench/results/cpu_gguf_step.md); refused for a model without GGUF blocks",
            "choices": ("none", "int8"),
        },
    )
    kv_dtype: str = field(
        default="auto",
        metadata={
            "help": "KV cache dtype, independent of --dtype (auto = --dtype); fp8 = e4m3 and int8 = scale + zero point, per token and KV head (~half an fp16 pool plus scales); fp8 falls back to int8 on CUDA below compute capability 8.9",
            "choices": KV_DTYPES,
            "aliases": ("--kv-cache-dtype",),
        },
    )
    device: str = field(default="cpu", metadata={"help": "cpu | cuda | cuda:N"})
    tensor_parallel_size: int = field(
        default=1,
        metadata={
            "help": "split the model over this many ranks (torch.distributed: NCCL on cuda, each rank the next GPU after --device; gloo on cpu): attention heads, MLP columns and each KV block's heads are divided, the scheduler sees one worker"
        },
    )
    attention_backend: str = field(
        default="auto",
        metadata={
            "help": "auto = triton on CUDA; on CPU, cpu (C++ paged attention reading the blocks in place, built once per machine and source into the shared kernel cache, PAGEDSERVE_KERNEL_CACHE) where it builds, else torch; torch = the pure-torch reference ops",
            "choices": ("auto", "torch", "triton", "cpu"),
        },
    )
    max_model_len: int = field(
        default=0, metadata={"help": "longest sequence served; 0 = the model's max_position_embeddings"}
    )
    max_num_seqs: int = field(
        default=256,
        metadata={
            "help": "largest decode batch: memory is sized for it and, on CUDA, graphs of sizes 1, 2, 4, 8, then every 8 up to it are captured at start. The scheduler takes it from the worker's Info unless given its own --max-num-seqs, which may not be larger"
        },
    )
    enforce_eager: bool = field(
        default=False,
        metadata={
            "help": "no CUDA graphs (CUDA with the triton backend captures decode graphs by default; CPU is always eager)"
        },
    )
    prefill_attention: str = field(
        default="auto",
        metadata={
            "help": "prefill chunks that start at position 0: sdpa = torch scaled_dot_product_attention (flash on CUDA) over the chunk's own K/V where that is exact (KV dtype = --dtype, no sliding window shorter than the chunk), paged = the backend's paged prefill op; auto = sdpa on CUDA with the triton backend, paged elsewhere",
            "choices": ("auto", "paged", "sdpa"),
        },
    )
    max_message_mb: int = field(default=256, metadata={"help": "gRPC message size limit (send and receive)"})
    seed: int = field(default=-1, metadata={"help": "seed of the generator for unseeded sampling; -1 = random"})
    num_threads: int = field(
        default=0,
        metadata={
            "help": "torch CPU threads; 0 = on CPU per step: every core but one (at least one, the other left to the scheduler and gateway) for small decode steps, every core for steps of >= 16 tokens; on CUDA torch's default"
        },
    )
    cpu_cores: str = field(
        default="",
        metadata={
            "help": "CPU cores this worker runs on, e.g. 0 or 0-3,6 (sched_setaffinity at start-up, every thread); "
            "--num-threads 0 then counts these. Keeps two workers on one machine (prefill and decode) off each "
            "other's cores. '' = every core the process was given"
        },
    )
    drain_timeout_s: float = field(
        default=30.0, metadata={"help": "after SIGTERM: how long the step in flight may take to finish"}
    )
    tls_cert: str = field(
        default="", metadata={"help": "PEM certificate: serve TLS (with --tls-key); default plaintext"}
    )
    tls_key: str = field(default="", metadata={"help": "PEM private key for --tls-cert"})
    tls_client_ca: str = field(
        default="", metadata={"help": "PEM CA: require client certificates signed by it (mutual TLS)"}
    )
    tls_client_names: str = field(
        default="",
        metadata={
            "help": "with --tls-client-ca: only client certificates whose common name or a DNS name is one of these "
            "(comma-separated, e.g. pagedserve-scheduler) may call; another certificate of the same CA gets "
            "PERMISSION_DENIED. '' = any the CA signed"
        },
    )
    internal_token_file: str = field(
        default="",
        metadata={
            "help": "file holding the scheduler's internal token: every call but health must present it "
            "('authorization: Bearer TOKEN'; the scheduler's --internal-token-file names the same file). Beyond "
            "loopback (--host) the worker needs it or --tls-client-ca: whoever can run a step can rewrite any "
            "cached block"
        },
    )
    kv_role: str = field(
        default="both",
        metadata={
            "help": "disaggregation: prefill = the scheduler sends this worker prompts and moves each request, once its "
            "first token is sampled, to a decode worker, which pulls the KV blocks from here (worker.v1 ReadBlocks); "
            "decode = the worker requests move to; both = everything (the default: no disaggregation)",
            "choices": KV_ROLES,
        },
    )
    log_format: str = field(default="console", metadata={"help": "log line format", "choices": LOG_FORMATS})
    log_level: str = field(default="info", metadata={"help": "debug | info | warning | error"})
    ready_file: str = field(default="", metadata={"help": "write {host, port, pid} as JSON here once serving"})
    enable_lora: bool = field(
        default=False,
        metadata={
            "help": "as vLLM's flag: serve LoRA adapters (PEFT) beside the base model, loaded into --max-loras slots by the scheduler (worker.v1 LoadAdapter); every step row names its slot"
        },
    )
    max_loras: int = field(
        default=1, metadata={"help": "with --enable-lora: adapter slots, i.e. adapters resident at once"}
    )
    max_lora_rank: int = field(
        default=16,
        metadata={"help": "with --enable-lora: the largest adapter rank r served (every slot is padded to it)"},
    )
    list_architectures: bool = field(
        default=False,
        metadata={"help": "print the model types (config.json model_type) this worker serves, with examples, and exit"},
    )

    def validate(self) -> None:
        if self.list_architectures:  # serves nothing: no other flag matters
            return
        token_problem = token_file_problem(self.internal_token_file)
        cores_problem = affinity_problem(self.cpu_cores) if self.cpu_cores else None
        checks = [
            model_dir_check(self.model, "--model"),
            (self.block_size in (8, 16, 32, 64, 128), "--block-size", "one of 8, 16, 32, 64, 128"),
            (self.num_blocks >= 0, "--num-blocks", ">= 0"),
            (self.max_batch >= 0, "--max-batch", ">= 0"),
            (self.kv_offload_gb >= 0, "--kv-offload-gb", ">= 0"),
            (self.kv_offload_blocks >= 0, "--kv-offload-blocks", ">= 0"),
            *self._offload_checks(),
            (self.kv_cache_memory_mb >= 0, "--kv-cache-memory-mb", ">= 0"),
            (0 < self.gpu_memory_utilization <= 1, "--gpu-memory-utilization", "in (0, 1]"),
            (self.max_num_batched_tokens >= 1, "--max-num-batched-tokens", ">= 1"),
            (0 <= self.port <= 65535, "--port", "0..65535"),
            (self.max_model_len >= 0, "--max-model-len", ">= 0"),
            (self.max_num_seqs >= 1, "--max-num-seqs", ">= 1"),
            (1 <= self.max_message_mb <= 2047, "--max-message-mb", "1..2047"),
            (self.num_threads >= 0, "--num-threads", ">= 0"),
            (cores_problem is None, "--cpu-cores", str(cores_problem)),
            (self.device == "cpu" or self.device.startswith("cuda"), "--device", "cpu, cuda or cuda:N"),
            (self.drain_timeout_s >= 0, "--drain-timeout-s", ">= 0"),
            (self.tensor_parallel_size >= 1, "--tensor-parallel-size", ">= 1"),
            (self.max_loras >= 1, "--max-loras", ">= 1"),
            (self.max_lora_rank >= 1, "--max-lora-rank", ">= 1"),
            (
                self.quant_activations == "none" or self.tensor_parallel_size == 1,
                "--quant-activations",
                "none with --tensor-parallel-size > 1 (a GGUF model is served on one worker)",
            ),
            self._tensor_parallel_check(),
            (
                self.kv_role == "both" or (self.tensor_parallel_size == 1 and self.kv_layout == "paged"),
                "--kv-role",
                "both with --tensor-parallel-size > 1 or --kv-layout contiguous: blocks move only between "
                "one-rank paged workers",
            ),
            pair_check(self.tls_cert, self.tls_key, "--tls-cert", "--tls-key"),
            (not self.tls_client_ca or bool(self.tls_cert), "--tls-client-ca", "used with --tls-cert"),
            (not self.tls_client_names or bool(self.tls_client_ca), "--tls-client-names", "used with --tls-client-ca"),
            (token_problem is None, "--internal-token-file", str(token_problem)),
            (
                is_loopback(self.host) or bool(self.internal_token_file or self.tls_client_ca),
                "--internal-token-file",
                f"set (or --tls-client-ca) when --host {self.host} is not loopback: without it anyone who can "
                "connect can run steps and rewrite cached blocks",
            ),
            *file_checks(
                {"--tls-cert": self.tls_cert, "--tls-key": self.tls_key, "--tls-client-ca": self.tls_client_ca}
            ),
        ]
        for ok, flag, valid in checks:
            if not ok:
                raise ValueError(f"{flag}: must be {valid}")

    def _offload_checks(self) -> list[tuple[bool, str, str]]:
        if not (self.kv_offload_gb or self.kv_offload_blocks):
            return []
        return [
            (self.kv_layout == "paged", "--kv-offload-gb", "used with --kv-layout paged (a tier holds blocks)"),
            (
                bool(self.kv_offload_dir) or self.device != "cpu",
                "--kv-offload-dir",
                "set with --kv-offload-gb on a CPU worker (its first tier is already host memory)",
            ),
            (
                not self.kv_offload_dir or Path(self.kv_offload_dir).is_dir(),
                "--kv-offload-dir",
                f"an existing directory ({self.kv_offload_dir!r} is not)",
            ),
        ]

    def _tensor_parallel_check(self) -> tuple[bool, str, str]:
        """The model's heads and MLP width must split over the ranks (read from its config.json)."""
        path = Path(self.model) / "config.json"
        if self.tensor_parallel_size <= 1 or not path.is_file():
            return True, "", ""
        cfg = json.loads(path.read_text())
        cfg = cfg.get("text_config", cfg)
        heads = int(cfg.get("num_attention_heads", 1))
        problem = layout_problem(
            heads,
            int(cfg.get("num_key_value_heads") or heads),
            int(cfg.get("intermediate_size", 0)),
            self.tensor_parallel_size,
        )
        return problem is None, "--tensor-parallel-size", problem or ""
