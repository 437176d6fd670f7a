"""Scheduler configuration: flags, env vars (PAGEDSERVE_SCHEDULER_*), validation, and the
settings derived from them. The flags of a topic with checks of its own live beside it:
access.py, lora/flags.py, speculative/flags.py, structured/flags.py."""

from __future__ import annotations

from dataclasses import dataclass, field

import structlog

from scheduler_svc.access import AccessFlags
from scheduler_svc.kv.free_queue import EVICTION_POLICIES
from scheduler_svc.lora.flags import LoraFlags
from scheduler_svc.planning.config import PlannerConfig
from scheduler_svc.planning.validation import SCHEDULING_POLICIES
from scheduler_svc.speculative.flags import SpeculativeFlags
from scheduler_svc.structured.flags import StructuredFlags
from svc_common.defaults import DEFAULT_MODEL, model_dir_check
from svc_common.log_setup import LOG_FORMATS
from svc_common.targets import Target, parse_targets, targets_check

log = structlog.get_logger(__name__)

# --max-num-batched-tokens and --chunk-size by default (a CPU worker's step budget is sized instead).
DEFAULT_STEP_TOKENS = 8192
# --max-num-seqs when neither the scheduler nor the worker says (vLLM's default).
DEFAULT_MAX_NUM_SEQS = 256
# Which worker gets a new request (engine/router.py implements each).
ROUTING_POLICIES = ("prefix", "round-robin", "least-loaded")


@dataclass
class SchedulerFlags:
    """The serving flags: workers, model, step budget, queue, timeouts, routing, logs."""

    workers: str = field(
        default="127.0.0.1:50061",
        metadata={
            "help": "workers, comma-separated: HOST:PORT (a fixed worker) or dns:///NAME:PORT (every A/AAAA record "
            "of NAME is a worker; re-resolved every --worker-discovery-interval-s: workers join and are drained as "
            "the records change, e.g. a Kubernetes headless Service)"
        },
    )
    worker_allow: str = field(
        default="",
        metadata={
            "help": "more addresses admin.v1 AddWorker may add when the scheduler holds an internal token and "
            "worker TLS is off, comma-separated HOST:PORT patterns with * and ? (e.g. 10.0.3.*:50061); --workers "
            "and the current addresses of its dns:/// names are trusted already. Any other address is refused: it "
            "would be sent the internal token"
        },
    )
    worker_discovery_interval_s: float = field(
        default=10.0, metadata={"help": "how often the dns:/// names in --workers are resolved again"}
    )
    host: str = field(default="127.0.0.1", metadata={"help": "address to bind"})
    port: int = field(default=50051, metadata={"help": "port to bind; 0 lets the OS pick"})
    model: str = field(default=DEFAULT_MODEL, metadata={"help": "model directory (tokenizer and generation config)"})
    tokenizer: str = field(default="", metadata={"help": "tokenizer directory; default: --model"})
    runner: str = field(
        default="generate",
        metadata={
            "help": "generate: completions (serving.v1 Generate); pooling (or embed, vLLM's --task embed): "
            "the model serves embeddings only (serving.v1 Embed), pooled as its sentence-transformers config "
            "says, else the last token, normalised",
            "choices": ("generate", "pooling", "embed"),
            "aliases": ("--task",),
        },
    )
    classifier_from_token: str = field(
        default="",
        metadata={
            "help": "with --runner pooling: serve a causal LM as a yes/no reranker (vLLM's classifier_from_token, "
            "as Qwen3-Reranker is served): NO,YES, two tokens of the vocabulary (e.g. no,yes); a prompt's score "
            "is YES's softmax probability against NO at its last position (serving.v1 Embed with score; the "
            "gateway's /v1/score and /v1/rerank). Empty: the model embeds"
        },
    )
    max_num_batched_tokens: int = field(
        default=DEFAULT_STEP_TOKENS,
        metadata={"help": "token budget of one step (left at its default on a CPU worker: see --step-target-ms)"},
    )
    max_num_seqs: int = field(
        default=0,
        metadata={
            "help": f"sequences in one step / running at once; 0 = the worker's --max-num-seqs (from its Info; {DEFAULT_MAX_NUM_SEQS} for a worker that does not say). A value above a worker's is refused"
        },
    )
    chunk_size: int = field(
        default=DEFAULT_STEP_TOKENS,
        metadata={
            "help": "largest prefill chunk of one request per step (vLLM's --long-prefill-token-threshold); one "
            "above --max-num-batched-tokens is clamped to it (logged)"
        },
    )
    step_target_ms: float = field(
        default=1000.0,
        metadata={
            "help": "CPU workers, with --max-num-batched-tokens and --chunk-size left at their defaults: size each "
            "step's token budget from the worker's measured prefill speed so that its forward takes about this "
            "long (a running stream's gap between tokens), one request's chunk at most half of it; 0 = off"
        },
    )
    dynamic_chunking: bool = field(
        default=False,
        metadata={
            "help": "shrink prefill chunks from --dynamic-chunk-max to --dynamic-chunk-min as free KV blocks run out"
        },
    )
    dynamic_chunk_min: int = field(default=512, metadata={"help": "smallest dynamic prefill chunk"})
    dynamic_chunk_max: int = field(default=2048, metadata={"help": "largest dynamic prefill chunk"})
    max_model_len: int = field(default=0, metadata={"help": "prompt + output limit; 0 = the worker's (from its Info)"})
    max_waiting: int = field(default=1024, metadata={"help": "queued requests before RESOURCE_EXHAUSTED"})
    scheduling_policy: str = field(
        default="fcfs",
        metadata={
            "help": "fcfs: requests are admitted in arrival order and the newest running one is preempted first; priority: by the request's `priority` (lower first, then arrival) both ways, as vLLM's. With fcfs a priority other than 0 is refused",
            "choices": SCHEDULING_POLICIES,
        },
    )
    max_prompt_chars: int = field(
        default=0,
        metadata={
            "help": "longest text prompt (Generate, PinPrefix, Tokenize) in characters, refused before it is tokenized; 0 = what can fit the context: max_model_len x the longest token's characters"
        },
    )
    max_request_mb: int = field(
        default=16,
        metadata={
            "help": "largest serving.v1 / admin.v1 request message in MiB, refused by gRPC before it is parsed (steps to the workers use --max-message-mb)"
        },
    )
    prefix_caching: bool = field(
        default=True, metadata={"help": "share full prompt blocks through the prefix hash index"}
    )
    eviction_policy: str = field(
        default="lru",
        metadata={
            "help": "which free cached block is reused first: lru, or priority (shared prefixes and pins outlive the rest)",
            "choices": EVICTION_POLICIES,
        },
    )
    async_scheduling: bool = field(
        default=True,
        metadata={
            "help": "plan and send step N+1 while step N runs on the worker (overlapped scheduling); --no-async-scheduling: strict alternation"
        },
    )
    max_pinned_blocks: int = field(
        default=-1, metadata={"help": "blocks PinPrefix may hold per worker; -1 = half of the worker's pool"}
    )
    max_pin_share_per_key: float = field(
        default=0.125,
        metadata={
            "help": "share of each worker's KV blocks the pins of one API key may hold (PinPrefix; an open API is "
            "one key); within --max-pinned-blocks for all keys together"
        },
    )
    pin_ttl_s: float = field(
        default=3600.0,
        metadata={"help": "a pin lasts this long after its key last pinned it, then is unpinned; 0 = until unpinned"},
    )
    default_max_tokens: int = field(
        default=0,
        metadata={
            "help": "cap on max_tokens for a request that leaves it unset; 0 = none: it generates up to the context (prompt + output = max_model_len). A request's own max_tokens with prompt + max_tokens > max_model_len is refused"
        },
    )
    connect_timeout_s: float = field(
        default=30.0,
        metadata={
            "help": "how long to wait at start-up for each fixed worker, or with dns:/// workers only for the first "
            "of them, and for a worker that joins later (AddWorker, DNS)"
        },
    )
    worker_timeout_s: float = field(
        default=30.0,
        metadata={"help": "how long a lost worker may stay away before its requests fail with UNAVAILABLE"},
    )
    health_interval_s: float = field(
        default=1.0,
        metadata={"help": "how often an idle scheduler probes each worker, to notice one that died or restarted"},
    )
    drain_timeout_s: float = field(
        default=30.0,
        metadata={
            "help": "after SIGTERM: how long accepted requests may take to finish before they end with UNAVAILABLE"
        },
    )
    max_message_mb: int = field(default=256, metadata={"help": "gRPC message size limit"})
    routing: str = field(
        default="prefix",
        metadata={
            "help": "which worker gets a new request: prefix (longest cached prompt prefix, then load), round-robin, or least-loaded",
            "choices": ROUTING_POLICIES,
        },
    )
    routing_affinity_ttl_s: float = field(
        default=10.0,
        metadata={
            "help": "prefix routing: how long a prompt prefix routed to a worker keeps drawing requests with the same prefix there before that worker has computed it; 0 = off"
        },
    )
    metrics_port: int = field(
        default=0, metadata={"help": "serve Prometheus metrics on http://HOST:PORT/metrics (HOST = --host); 0 = off"}
    )
    log_format: str = field(default="console", metadata={"help": "log line format", "choices": LOG_FORMATS})
    log_level: str = field(default="info", metadata={"help": "debug | info | warning | error"})
    ready_file: str = field(
        default="", metadata={"help": "write {host, port, pid, admin_port} as JSON here once serving"}
    )


@dataclass
class SchedulerConfig(AccessFlags, LoraFlags, StructuredFlags, SpeculativeFlags, SchedulerFlags):
    """Every flag, and what is derived from them. Dataclass fields run from the last base to
    the first: --help and the flags page list the serving flags first, access last."""

    @property
    def worker_targets(self) -> list[Target]:
        return parse_targets(self.workers)

    @property
    def worker_allow_patterns(self) -> list[str]:
        return [p.strip() for p in self.worker_allow.split(",") if p.strip()]

    @property
    def admin_bind_port(self) -> int:
        """The admin port to bind: --admin-port, or derived from --port (0: the OS picks)."""
        if self.admin_port != 0:
            return self.admin_port
        return self.port + 1 if self.port else 0

    @property
    def pooling_runner(self) -> bool:
        return self.runner in ("pooling", "embed")

    @property
    def tokenizer_dir(self) -> str:
        return self.tokenizer or self.model

    def validate(self) -> None:
        checks = [
            targets_check(self.workers, "--workers"),
            (
                all(":" in p for p in self.worker_allow_patterns),
                "--worker-allow",
                "HOST:PORT patterns (* and ? match any text / character), comma-separated",
            ),
            (self.worker_discovery_interval_s > 0, "--worker-discovery-interval-s", "> 0"),
            (0 <= self.port <= 65535, "--port", "in 0..65535"),
            (self.routing_affinity_ttl_s >= 0, "--routing-affinity-ttl-s", ">= 0"),
            (
                self.admin_port != 0 or self.port < 65535,
                "--admin-port",
                "set when --port is 65535 (--port + 1 is no port)",
            ),
            (0 <= self.metrics_port <= 65535, "--metrics-port", "in 1..65535, or 0 for no metrics endpoint"),
            model_dir_check(self.tokenizer_dir, "--tokenizer" if self.tokenizer else "--model"),
            (self.max_model_len == 0 or self.max_model_len >= 2, "--max-model-len", "0 (the worker's) or >= 2"),
            (not self.classifier_from_token or self.pooling_runner, "--classifier-from-token", "with --runner pooling"),
            (self.max_num_seqs >= 0, "--max-num-seqs", ">= 1, or 0 for the worker's"),
            (self.step_target_ms >= 0, "--step-target-ms", ">= 0 (0 = off)"),
            (self.max_pinned_blocks >= -1, "--max-pinned-blocks", ">= 0, or -1 for half the pool"),
            (0 <= self.max_pin_share_per_key <= 1, "--max-pin-share-per-key", "in 0..1"),
            (self.pin_ttl_s >= 0, "--pin-ttl-s", ">= 0 (0 = until unpinned)"),
            (self.default_max_tokens >= 0, "--default-max-tokens", ">= 0 (0 = up to the context)"),
            (self.connect_timeout_s > 0, "--connect-timeout-s", "> 0"),
            (self.worker_timeout_s > 0, "--worker-timeout-s", "> 0"),
            (self.health_interval_s > 0, "--health-interval-s", "> 0"),
            (self.drain_timeout_s >= 0, "--drain-timeout-s", ">= 0"),
            (1 <= self.max_message_mb <= 2047, "--max-message-mb", "in 1..2047"),
            (1 <= self.max_request_mb <= 2047, "--max-request-mb", "in 1..2047"),
            (self.max_prompt_chars >= 0, "--max-prompt-chars", ">= 1, or 0 for what fits the context"),
        ]
        checks += self.structured_checks() + self.access_checks() + self.lora_checks() + self.credential_checks()
        for ok, flag, valid in checks:
            if not ok:
                raise ValueError(f"{flag}: must be {valid}")
        if self.chunk_size > self.max_num_batched_tokens >= 1:  # one request's chunk never outgrows a step
            log.info(
                "--chunk-size clamped to --max-num-batched-tokens",
                chunk_size=self.chunk_size,
                max_num_batched_tokens=self.max_num_batched_tokens,
            )
            self.chunk_size = self.max_num_batched_tokens
        # The planner's own options are checked where they are used, once.
        self.planner_config(max(self.max_model_len, 2), 1, self.max_num_seqs or DEFAULT_MAX_NUM_SEQS).validate()

    @property
    def sized_step_target_ms(self) -> float:
        """A CPU worker's step target (engine/step_budget.py); 0 where the operator set the budget flags."""
        defaults = self.max_num_batched_tokens == self.chunk_size == DEFAULT_STEP_TOKENS
        return self.step_target_ms if defaults else 0.0

    def planner_config(self, max_model_len: int, block_size: int, max_num_seqs: int) -> PlannerConfig:
        """The planner's options for a worker holding `max_model_len` tokens per request in
        `block_size` blocks, running up to `max_num_seqs` sequences at once."""
        return PlannerConfig(
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_num_seqs=max_num_seqs,
            chunk_size=self.chunk_size,
            max_model_len=max_model_len,
            max_waiting=self.max_waiting,
            block_size=block_size,
            dynamic_chunking=self.dynamic_chunking,
            dynamic_chunk_min=self.dynamic_chunk_min,
            dynamic_chunk_max=self.dynamic_chunk_max,
            speculative=self.speculative(),
            constrained_ahead=self.constrained_ahead,
            scheduling_policy=self.scheduling_policy,
        )
