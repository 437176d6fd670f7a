"""Gateway configuration: flags, env vars (PAGEDSERVE_GATEWAY_*), validation."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import grpc

from gateway_svc.chat_template import CONTENT_FORMATS, ChatTemplate
from gateway_svc.structured import Parsers
from svc_common.addresses import host_port_problem
from svc_common.defaults import DEFAULT_MODEL
from svc_common.log_setup import LOG_FORMATS
from svc_common.targets import targets_check
from svc_common.tls import channel_credentials, file_checks, pair_check

# How the gateway picks one of several schedulers (gateway_svc/prefix_routing.py).
SCHEDULER_ROUTING = ("prefix", "least-loaded", "random")


@dataclass
class GatewayConfig:
    scheduler: str = field(
        default="127.0.0.1:50051", metadata={"help": "the scheduler's serving.v1 gRPC address, HOST:PORT"}
    )
    schedulers: str = field(
        default="",
        metadata={
            "help": "several schedulers instead of --scheduler, comma-separated: HOST:PORT or dns:///NAME:PORT "
            "(every A/AAAA record is a scheduler, re-resolved every --scheduler-discovery-interval-s); "
            "each request goes to one of them (--scheduler-routing)"
        },
    )
    scheduler_routing: str = field(
        default="prefix",
        metadata={
            "help": "with --schedulers: prefix (consistent hashing of the prompt's first --routing-prefix-tokens "
            "tokens, bounded by --routing-load-factor; shorter prompts go to the least loaded), least-loaded, "
            "or random",
            "choices": SCHEDULER_ROUTING,
        },
    )
    routing_prefix_tokens: int = field(
        default=32,
        metadata={"help": "prefix routing: prompt tokens that make the key (32 = two 16-token KV blocks)"},
    )
    routing_load_factor: float = field(
        default=1.25,
        metadata={
            "help": "prefix routing: a scheduler takes a request only while its in-flight requests stay within "
            "this factor of the average; beyond it the next scheduler on the hash ring does"
        },
    )
    routing_load_slack: int = field(
        default=16,
        metadata={
            "help": "prefix routing: requests a scheduler may have in flight above the average before "
            "--routing-load-factor applies (0: the factor alone)"
        },
    )
    scheduler_health_interval_s: float = field(
        default=2.0, metadata={"help": "with --schedulers: how often each scheduler's health is checked"}
    )
    scheduler_discovery_interval_s: float = field(
        default=10.0, metadata={"help": "with --schedulers: how often its dns:/// names are resolved again"}
    )
    host: str = field(default="127.0.0.1", metadata={"help": "HTTP address to bind"})
    port: int = field(default=8000, metadata={"help": "HTTP port to bind; 0 lets the OS pick (see --ready-file)"})
    model_dir: str = field(
        default=DEFAULT_MODEL,
        metadata={
            "help": "model directory: its chat template (chat_template.jinja or tokenizer_config.json) "
            "and, unless --model-name, the model id; '' = completions only"
        },
    )
    model_name: str = field(
        default="",
        metadata={
            "help": "the model id: listed by /v1/models, named in responses; requests naming another model get 404 "
            "model_not_found; default: --model-dir's name",
            "aliases": ("--served-model-name",),
        },
    )
    api_key: str = field(
        default="",
        metadata={
            "help": "when set, callers must send 'Authorization: Bearer KEY' (prefer the env var: flags show in ps)"
        },
    )
    request_timeout_s: float = field(default=0.0, metadata={"help": "gRPC deadline of one Generate call; 0 = none"})
    health_timeout_s: float = field(
        default=2.0, metadata={"help": "deadline of the scheduler health check behind /health"}
    )
    scheduler_metrics: str = field(
        default="",
        metadata={
            "help": "the schedulers' Prometheus endpoints, HOST:PORT comma-separated (their --metrics-port): GET "
            "/metrics serves their engine and vllm:* series after the gateway's own ('' = the gateway's only)"
        },
    )
    drain_timeout_s: float = field(
        default=30.0,
        metadata={
            "help": "after SIGTERM / Ctrl-C: how long requests in flight may take to finish; then each stream "
            "ends with an error event and [DONE] (a non-streamed request: 503)"
        },
    )
    tool_call_parser: str = field(
        default="",
        metadata={
            "help": "how the model writes tool calls, turned into OpenAI tool_calls: hermes (Hermes, Qwen2.5, "
            "Qwen3: <tool_call>{...}</tool_call>) or llama3_json (Llama 3.x JSON calls); '' = tools are refused "
            "unless tool_choice is none. The model's chat template must write that format",
            "choices": ("", "hermes", "llama3_json"),
        },
    )
    enable_auto_tool_choice: bool = field(
        default=False,
        metadata={
            "help": "let the model choose whether to call tools (tool_choice auto, the default with tools), read by "
            "--tool-call-parser (vLLM's flag); without it auto is a 400, and tool_choice required or a named "
            "function work on any model (a JSON schema of the calls, or the parser's format)"
        },
    )
    chat_template: str = field(
        default="",
        metadata={
            "help": "a Jinja chat template replacing the model's: a file, or the template text itself (vLLM's flag)"
        },
    )
    chat_template_content_format: str = field(
        default="auto",
        metadata={
            "help": "how the chat template reads a message's content: string, or openai (a list of "
            "{type: text, text} parts); auto: openai when the template loops over a message's content",
            "choices": CONTENT_FORMATS,
        },
    )
    reasoning_parser: str = field(
        default="",
        metadata={
            "help": "a reasoning model's <think>...</think> as reasoning_content apart from content: qwen3 (the "
            "answer opens <think> itself) or deepseek_r1 (the template opens it); a structured-output constraint "
            "then starts after </think>. '' = off",
            "choices": ("", "qwen3", "deepseek_r1"),
        },
    )
    responses_store_size: int = field(
        default=1000,
        metadata={
            "help": "/v1/responses kept for GET and previous_response_id (store: true), the oldest dropped first; "
            "0 = none kept"
        },
    )
    responses_store_ttl_s: float = field(
        default=3600.0, metadata={"help": "how long a stored /v1/responses response lives (a later read is 404)"}
    )
    max_n: int = field(default=16, metadata={"help": "largest n (samples per prompt) a request may ask for"})
    max_prompts: int = field(
        default=1024, metadata={"help": "most prompts one /v1/completions request may batch (a 400 beyond)"}
    )
    max_parallel_per_request: int = field(
        default=16,
        metadata={
            "help": "Generate calls one HTTP request runs at once (its prompts x n): the rest start as these end, so a "
            "batch of many prompts is admitted piecewise and other requests interleave with it instead of queueing "
            "behind all of it"
        },
    )
    default_max_tokens: int = field(
        default=4096,
        metadata={
            "help": "a chat request that sets no max_tokens / max_completion_tokens generates at most this many "
            "tokens (still within the context, and within the scheduler's own --default-max-tokens); 0 = up to "
            "the context, as OpenAI's API. /v1/completions without max_tokens sends OpenAI's 16"
        },
    )
    max_stream_buffer_bytes: int = field(
        default=4 * 2**20,
        metadata={
            "help": "output of one request waiting for its client to read it, in bytes (serving.v1 messages) at most: "
            "a client that reads slower than its answer is generated is cut there, its stream ending with an "
            "error event (code stream_buffer_full), its generation stopped"
        },
    )
    max_request_bytes: int = field(
        default=8 * 2**20,
        metadata={
            "help": "largest request body in bytes: a larger one is refused with 413 before it is read (by its "
            "Content-Length) or as soon as that many bytes arrived"
        },
    )
    header_timeout_s: float = field(
        default=10.0,
        metadata={
            "help": "a request's head (its line and headers) must arrive within this many seconds of the connection "
            "opening (or of its first byte, on a kept-alive connection); else the connection is closed"
        },
    )
    body_timeout_s: float = field(
        default=15.0,
        metadata={
            "help": "a request body must keep arriving: each window of this many seconds must bring "
            "--body-min-rate x the window in bytes (or the rest of the body), else the request is cut with 408 "
            "and its buffer freed"
        },
    )
    body_min_rate: int = field(
        default=8192,
        metadata={"help": "the slowest a request body may arrive, in bytes per second (see --body-timeout-s)"},
    )
    max_connections: int = field(
        default=2048,
        metadata={
            "help": "open HTTP connections (or requests in flight) at most: a request beyond them is answered 503 "
            "at once (uvicorn's limit_concurrency)"
        },
    )
    cache_salt_from_api_key: bool = field(
        default=False,
        metadata={
            "help": "always give each caller's API key its own prefix cache (the request's cache salt is derived from "
            "the key, and its own cache_salt after it). Without this flag or --share-prefix-cache-across-keys the "
            "gateway does so whenever keys are in force (its --api-key, or the scheduler's --api-keys), so that "
            "cached_tokens and latency never tell a caller about another tenant's prompts"
        },
    )
    share_prefix_cache_across_keys: bool = field(
        default=False,
        metadata={
            "help": "let callers with different API keys share cached prompt blocks even where keys are in force "
            "(the operator's explicit choice: cached_tokens then says whether another tenant sent a prompt)"
        },
    )
    scheduler_tls_ca: str = field(
        default="",
        metadata={"help": "PEM CA that signed the schedulers' certificates (their --tls-cert): talk TLS to them"},
    )
    scheduler_tls_cert: str = field(
        default="",
        metadata={"help": "PEM client certificate to present to the schedulers (with --scheduler-tls-key); optional"},
    )
    scheduler_tls_key: str = field(default="", metadata={"help": "PEM private key for --scheduler-tls-cert"})
    scheduler_admin: str = field(
        default="",
        metadata={
            "help": "the scheduler's admin.v1 address, HOST:PORT (its --admin-port): serves vLLM's "
            "/v1/load_lora_adapter and /v1/unload_lora_adapter, the caller's key sent as the admin key that "
            "admin.v1 checks (a client key is refused there); unset: no such routes"
        },
    )
    log_format: str = field(default="console", metadata={"help": "log line format", "choices": LOG_FORMATS})
    log_level: str = field(default="info", metadata={"help": "debug | info | warning | error"})
    ready_file: str = field(default="", metadata={"help": "write {host, port, pid} as JSON here once serving"})

    def admin_credentials(self) -> grpc.ChannelCredentials | None:
        """--scheduler-admin's TLS: the schedulers' (admin.v1 listens with the client API's TLS)."""
        return channel_credentials(self.scheduler_tls_ca, self.scheduler_tls_cert, self.scheduler_tls_key)

    @property
    def tenant_salt_forced(self) -> bool | None:
        """True / False when a flag decides whether keys share the prefix cache; None: the keys in force do."""
        if self.cache_salt_from_api_key:
            return True
        return False if self.share_prefix_cache_across_keys else None

    @property
    def model_id(self) -> str:
        if self.model_name:
            return self.model_name
        return Path(self.model_dir).name if self.model_dir else "pagedserve"

    @property
    def tokenizer_path(self) -> Path:
        return Path(self.model_dir) / "tokenizer.json"

    def validate(self) -> None:
        checks = [
            (host_port_problem(self.scheduler) is None, "--scheduler", "HOST:PORT"),
            (
                not self.scheduler_admin or host_port_problem(self.scheduler_admin) is None,
                "--scheduler-admin",
                "HOST:PORT",
            ),
            targets_check(self.schedulers, "--schedulers") if self.schedulers else (True, "", ""),
            (self.routing_prefix_tokens >= 1, "--routing-prefix-tokens", ">= 1"),
            (self.routing_load_factor >= 1.0, "--routing-load-factor", ">= 1"),
            (self.routing_load_slack >= 0, "--routing-load-slack", ">= 0"),
            (self.scheduler_health_interval_s > 0, "--scheduler-health-interval-s", "> 0"),
            (self.scheduler_discovery_interval_s > 0, "--scheduler-discovery-interval-s", "> 0"),
            (
                not (self.schedulers and self.scheduler_routing == "prefix")
                or (bool(self.model_dir) and self.tokenizer_path.is_file()),
                "--model-dir",
                "a directory with tokenizer.json for --scheduler-routing prefix over --schedulers "
                "(the prompt's first tokens are the routing key)",
            ),
            (0 <= self.port <= 65535, "--port", "in 0..65535"),
            (
                not self.model_dir or Path(self.model_dir).is_dir(),
                "--model-dir",
                "an existing directory (run `make model`, or pass --model-dir '' to serve completions only)",
            ),
            (self.request_timeout_s >= 0, "--request-timeout-s", ">= 0"),
            (self.health_timeout_s > 0, "--health-timeout-s", "> 0"),
            (self.drain_timeout_s >= 0, "--drain-timeout-s", ">= 0"),
            (
                all(host_port_problem(t.strip()) is None for t in self.scheduler_metrics.split(",") if t.strip()),
                "--scheduler-metrics",
                "HOST:PORT, comma-separated",
            ),
            (1 <= self.max_n <= 128, "--max-n", "in 1..128"),
            (self.responses_store_size >= 0, "--responses-store-size", ">= 0"),
            (self.responses_store_ttl_s > 0, "--responses-store-ttl-s", "> 0"),
            (self.max_prompts >= 1, "--max-prompts", ">= 1"),
            (self.max_parallel_per_request >= 1, "--max-parallel-per-request", ">= 1"),
            (self.max_request_bytes >= 1024, "--max-request-bytes", ">= 1024"),
            (self.max_stream_buffer_bytes >= 65536, "--max-stream-buffer-bytes", ">= 65536"),
            (self.default_max_tokens >= 0, "--default-max-tokens", ">= 0 (0 = up to the context)"),
            (
                not (self.cache_salt_from_api_key and self.share_prefix_cache_across_keys),
                "--share-prefix-cache-across-keys",
                "left out with --cache-salt-from-api-key",
            ),
            (self.header_timeout_s > 0, "--header-timeout-s", "> 0"),
            (self.body_timeout_s > 0, "--body-timeout-s", "> 0"),
            (self.body_min_rate >= 0, "--body-min-rate", ">= 0"),
            (self.max_connections >= 1, "--max-connections", ">= 1"),
            pair_check(self.scheduler_tls_cert, self.scheduler_tls_key, "--scheduler-tls-cert", "--scheduler-tls-key"),
            (
                not self.scheduler_tls_cert or bool(self.scheduler_tls_ca),
                "--scheduler-tls-cert",
                "used with --scheduler-tls-ca",
            ),
            *file_checks(
                {
                    "--scheduler-tls-ca": self.scheduler_tls_ca,
                    "--scheduler-tls-cert": self.scheduler_tls_cert,
                    "--scheduler-tls-key": self.scheduler_tls_key,
                }
            ),
            (
                self.log_level.lower() in ("debug", "info", "warning", "error"),
                "--log-level",
                "debug, info, warning or error",
            ),
        ]
        for ok, flag, valid in checks:
            if not ok:
                raise ValueError(f"{flag}: must be {valid}")
        self.parsers()  # ValueError naming the flag

    def template(self) -> ChatTemplate | None:
        """The chat template: --chat-template's, or the model's (ValueError naming the flag)."""
        return ChatTemplate.from_flags(self.model_dir, self.chat_template, self.chat_template_content_format)

    def parsers(self) -> Parsers:
        """The tool-call and reasoning parsers the flags select (ValueError naming the flag)."""
        template = self.template() if self.chat_template else None
        source = template.source if template is not None else ""
        return Parsers.load(
            self.tool_call_parser, self.reasoning_parser, self.model_dir, self.enable_auto_tool_choice, source
        )
