"""Scheduler configuration: flags, env vars (PAGEDSERVE_SCHEDULER_*), validation."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import structlog

from scheduler_svc.kv.free_queue import EVICTION_POLICIES
from scheduler_svc.lora.flags import LoraFlags
from scheduler_svc.planning.config import PlannerConfig
from scheduler_svc.planning.validation import SCHEDULING_POLICIES
from scheduler_svc.speculative.flags import SPECULATIVE_CONFIG_KEYS, speculative_options
from scheduler_svc.speculative.ngram import NgramConfig
from scheduler_svc.structured.compiler import DEFAULT_COMPILE_TIMEOUT_S
from scheduler_svc.structured.limits import DEFAULT_MAX_CHARS, DEFAULT_MAX_DEPTH, DEFAULT_MAX_RULES, GrammarLimits
from scheduler_svc.structured.sandbox import DEFAULT_MEMORY_MB
from svc_common.defaults import DEFAULT_MODEL, model_dir_check
from svc_common.log_setup import LOG_FORMATS
from svc_common.peer_auth import is_loopback, load_keys, read_token_file, token_file_problem
from svc_common.targets import Target, parse_targets, targets_check
from svc_common.tls import file_checks, pair_check
from svc_common.zmq_endpoints import ZMQ_ENDPOINTS, zmq_bind_is_local, zmq_binds, zmq_endpoint_ok

log = structlog.get_logger(__name__)

# --max-num-batched-tokens and --chunk-size by default (a CPU worker's step budget is sized instead).
DEFAULT_STEP_TOKENS = 8192
# --max-num-seqs when neither the scheduler nor the worker says (vLLM's default).
DEFAULT_MAX_NUM_SEQS = 256
# Which worker gets a new request (engine/router.py implements each).
ROUTING_POLICIES = ("prefix", "round-robin", "least-loaded")
_NGRAM = NgramConfig()  # the speculative flags' defaults


@dataclass
class SchedulerConfig(LoraFlags):
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
    speculative_method: str = field(
        default="",
        metadata={
            "help": "speculative decoding (vLLM's method names): ngram = decodes carry up to "
            "--num-speculative-tokens drafts found by prompt lookup (n-grams of --ngram-min..--ngram-max tokens), "
            "verified by the worker in the same forward; '' = off"
        },
    )
    speculative_config: str = field(
        default="",
        metadata={
            "help": "vLLM's JSON form of the speculative flags, instead of them: "
            '\'{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}\' '
            "(also disable_by_batch_size); a key left out takes its flag's default; an unknown method or key is "
            "refused"
        },
    )
    num_speculative_tokens: int = field(
        default=_NGRAM.num_speculative_tokens, metadata={"help": "drafts per decode (vLLM's meaning)"}
    )
    ngram_min: int = field(default=_NGRAM.ngram_min, metadata={"help": "shortest n-gram matched (prompt_lookup_min)"})
    ngram_max: int = field(default=_NGRAM.ngram_max, metadata={"help": "longest n-gram matched (prompt_lookup_max)"})
    speculative_disable_by_batch_size: int = field(
        default=_NGRAM.disable_by_batch_size,
        metadata={"help": "no drafts while more requests than this run (vLLM's meaning): past it, overlap pays more"},
    )
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
    constrained_ahead: bool = field(
        default=True,
        metadata={
            "help": "structured outputs with async scheduling: plan a constrained request's next token ahead like any "
            "other, its token mask sent after it once the token it follows is known (late masks); "
            "--no-constrained-ahead: such a request is not planned ahead (it decodes every other step)"
        },
    )
    max_grammar_chars: int = field(
        default=DEFAULT_MAX_CHARS,
        metadata={"help": "longest structured-output constraint (JSON schema, regex, grammar, choices) in characters"},
    )
    max_grammar_rules: int = field(
        default=DEFAULT_MAX_RULES,
        metadata={
            "help": "most rules and terminals in a structured-output grammar (the compiler recurses through them: "
            "a 3,000-rule chain overflows its stack)"
        },
    )
    max_grammar_depth: int = field(
        default=DEFAULT_MAX_DEPTH,
        metadata={
            "help": "deepest nesting of (), [] and {} in a structured-output grammar, regex or JSON schema "
            "(a schema level is two: the object and its properties)"
        },
    )
    grammar_compile_timeout_s: float = field(
        default=DEFAULT_COMPILE_TIMEOUT_S,
        metadata={
            "help": "longest a new constraint may take to compile, in the compile sandbox and then again in the "
            "scheduler (a cold compile runs in both)"
        },
    )
    grammar_compile_memory_mb: int = field(
        default=DEFAULT_MEMORY_MB,
        metadata={"help": "address-space limit of the compile sandbox's child process (the vocabulary included)"},
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
    tls_cert: str = field(
        default="", metadata={"help": "PEM certificate for TLS on the client API (with --tls-key); default plaintext"}
    )
    tls_key: str = field(default="", metadata={"help": "PEM private key for --tls-cert"})
    api_keys: str = field(
        default="",
        metadata={
            "help": "comma-separated API keys; clients send 'authorization: Bearer KEY' (health stays open). Prefer the env var or --api-keys-file: flags show in ps"
        },
    )
    api_keys_file: str = field(
        default="", metadata={"help": "file with one API key per line (# comments); adds to --api-keys"}
    )
    worker_tls_ca: str = field(
        default="", metadata={"help": "PEM CA that signed the workers' certificates: talk TLS to workers"}
    )
    worker_tls_cert: str = field(
        default="", metadata={"help": "PEM client certificate for mutual TLS with the workers (with --worker-tls-key)"}
    )
    worker_tls_key: str = field(default="", metadata={"help": "PEM private key for --worker-tls-cert"})
    internal_token_file: str = field(
        default="",
        metadata={
            "help": "file holding the internal token the scheduler presents to its workers (their "
            "--internal-token-file names the same file); with or instead of mutual TLS"
        },
    )
    admin_keys: str = field(
        default="",
        metadata={
            "help": "comma-separated admin keys: admin.v1 callers (AddWorker, DrainWorker, ListWorkers, "
            "SubscribeKvEvents) and ZMQ KV-event subscribers present one ('authorization: Bearer KEY'; ZMQ PLAIN "
            "password); never a client's key. Needed when --api-keys is set or --admin-host is not loopback. "
            "Prefer --admin-keys-file or the env var: flags show in ps"
        },
    )
    admin_keys_file: str = field(
        default="", metadata={"help": "file with one admin key per line (# comments); adds to --admin-keys"}
    )
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
    admin_host: str = field(
        default="127.0.0.1",
        metadata={"help": "address to bind the admin.v1 service (AddWorker, DrainWorker, ListWorkers)"},
    )
    admin_port: int = field(
        default=0,
        metadata={
            "help": "port of the admin.v1 service; 0 = --port + 1 (the OS picks when --port is 0), so schedulers on different ports never collide; -1 = no admin service"
        },
    )
    metrics_port: int = field(
        default=0, metadata={"help": "serve Prometheus metrics on http://HOST:PORT/metrics (HOST = --host); 0 = off"}
    )
    kv_events_buffer_steps: int = field(
        default=1024,
        metadata={
            "help": "KV-event batches (one per engine step that changed the prefix index) kept per worker for subscribers that reconnect (admin.v1 SubscribeKvEvents, the ZMQ replay socket)"
        },
    )
    kv_events_zmq: str = field(
        default="",
        metadata={
            "help": "also publish KV events as vLLM does (ZMQ PUB, msgpack KVEventBatch), e.g. tcp://*:5557; worker of rank r on port + r. '' = off"
        },
    )
    kv_events_zmq_replay: str = field(
        default="",
        metadata={
            "help": "vLLM's ZMQ replay socket (ROUTER) for --kv-events-zmq, e.g. tcp://*:5657; worker of rank r on port + r. '' = none"
        },
    )
    kv_events_zmq_topic: str = field(default="", metadata={"help": "ZMQ topic of the KV-event messages"})
    log_format: str = field(default="console", metadata={"help": "log line format", "choices": LOG_FORMATS})
    log_level: str = field(default="info", metadata={"help": "debug | info | warning | error"})
    ready_file: str = field(
        default="", metadata={"help": "write {host, port, pid, admin_port} as JSON here once serving"}
    )

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
                -1 <= self.admin_port <= 65535,
                "--admin-port",
                "in 1..65535, 0 for --port + 1, or -1 for no admin service",
            ),
            (
                self.admin_port != 0 or self.port < 65535,
                "--admin-port",
                "set when --port is 65535 (--port + 1 is no port)",
            ),
            (0 <= self.metrics_port <= 65535, "--metrics-port", "in 1..65535, or 0 for no metrics endpoint"),
            (self.kv_events_buffer_steps >= 1, "--kv-events-buffer-steps", ">= 1"),
            (zmq_endpoint_ok(self.kv_events_zmq), "--kv-events-zmq", ZMQ_ENDPOINTS),
            (zmq_endpoint_ok(self.kv_events_zmq_replay), "--kv-events-zmq-replay", ZMQ_ENDPOINTS),
            (
                not self.kv_events_zmq_replay or bool(self.kv_events_zmq),
                "--kv-events-zmq-replay",
                "used with --kv-events-zmq",
            ),
            model_dir_check(self.tokenizer_dir, "--tokenizer" if self.tokenizer else "--model"),
            (self.max_model_len == 0 or self.max_model_len >= 2, "--max-model-len", "0 (the worker's) or >= 2"),
            (not self.classifier_from_token or self.pooling_runner, "--classifier-from-token", "with --runner pooling"),
            (self.max_num_seqs >= 0, "--max-num-seqs", ">= 1, or 0 for the worker's"),
            (self.max_grammar_chars >= 1, "--max-grammar-chars", ">= 1"),
            (self.max_grammar_rules >= 1, "--max-grammar-rules", ">= 1"),
            (self.max_grammar_depth >= 1, "--max-grammar-depth", ">= 1"),
            (self.grammar_compile_timeout_s > 0, "--grammar-compile-timeout-s", "> 0"),
            (self.grammar_compile_memory_mb >= 256, "--grammar-compile-memory-mb", ">= 256"),
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
            pair_check(self.tls_cert, self.tls_key, "--tls-cert", "--tls-key"),
            pair_check(self.worker_tls_cert, self.worker_tls_key, "--worker-tls-cert", "--worker-tls-key"),
            (not self.worker_tls_cert or bool(self.worker_tls_ca), "--worker-tls-cert", "used with --worker-tls-ca"),
            (
                token_file_problem(self.internal_token_file) is None,
                "--internal-token-file",
                str(token_file_problem(self.internal_token_file)),
            ),
            *file_checks(
                {
                    "--tls-cert": self.tls_cert,
                    "--tls-key": self.tls_key,
                    "--api-keys-file": self.api_keys_file,
                    "--admin-keys-file": self.admin_keys_file,
                    "--worker-tls-ca": self.worker_tls_ca,
                    "--worker-tls-cert": self.worker_tls_cert,
                    "--worker-tls-key": self.worker_tls_key,
                }
            ),
        ]
        for ok, flag, valid in checks + self.lora_checks() + self._credential_checks():
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
    def client_keys(self) -> frozenset[str]:
        """The API keys serving.v1 callers present (none: the client API is open)."""
        return load_keys(self.api_keys, self.api_keys_file)

    @property
    def admin_key_set(self) -> frozenset[str]:
        """The keys admin.v1 callers and ZMQ KV-event subscribers present."""
        return load_keys(self.admin_keys, self.admin_keys_file)

    @property
    def sized_step_target_ms(self) -> float:
        """A CPU worker's step target (engine/step_budget.py); 0 where the operator set the budget flags."""
        defaults = self.max_num_batched_tokens == self.chunk_size == DEFAULT_STEP_TOKENS
        return self.step_target_ms if defaults else 0.0

    @property
    def grammar_limits(self) -> GrammarLimits:
        return GrammarLimits(self.max_grammar_chars, self.max_grammar_rules, self.max_grammar_depth)

    def internal_token(self) -> str | None:
        """What the scheduler presents to its workers, if it has one."""
        return read_token_file(self.internal_token_file) if self.internal_token_file else None

    def _credential_checks(self) -> list[tuple[bool, str, str]]:
        """Who may reach admin.v1 and the KV events (they show every tenant's prompts): an admin key,
        never a client's; without admin keys only loopback, and only while clients need no key either."""
        if not all(path == "" or os.path.isfile(path) for path in (self.api_keys_file, self.admin_keys_file)):
            return []  # the file checks above name the missing file
        client, admin = self.client_keys, self.admin_key_set
        open_admin = self.admin_port >= 0 and not admin
        zmq_open = bool(self.kv_events_zmq) and not admin
        or_off = "(or --admin-port -1: no admin service)"
        return [
            (not client & admin, "--admin-keys", "distinct from every --api-keys key: a client must not administer"),
            (
                not open_admin or is_loopback(self.admin_host),
                "--admin-keys-file",
                f"set when --admin-host {self.admin_host} is not loopback {or_off}",
            ),
            (
                not open_admin or not client,
                "--admin-keys-file",
                "set when --api-keys is: otherwise any local process could drain workers and read every tenant's "
                f"prompts from the KV events {or_off}",
            ),
            *(
                (
                    not zmq_open or (zmq_bind_is_local(endpoint) and not client),
                    flag,
                    "a loopback, ipc:// or inproc:// endpoint, with no --api-keys, unless --admin-keys-file is set "
                    "(subscribers then present an admin key as their ZMQ PLAIN password)",
                )
                for flag, endpoint in (
                    ("--kv-events-zmq", self.kv_events_zmq),
                    ("--kv-events-zmq-replay", self.kv_events_zmq_replay),
                )
                if endpoint and zmq_binds(endpoint)
            ),
        ]

    def speculative(self) -> NgramConfig | None:
        """The drafts' options, from the flags or --speculative-config; None: off (speculative/flags.py)."""
        defaults = SchedulerConfig()
        return speculative_options(
            {name: getattr(self, name) for name in SPECULATIVE_CONFIG_KEYS.values()},
            {name: getattr(defaults, name) for name in SPECULATIVE_CONFIG_KEYS.values()},
            self.speculative_config,
        )

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
