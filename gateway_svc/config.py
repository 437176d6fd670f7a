"""Gateway configuration: flags, env vars (PAGEDSERVE_GATEWAY_*), validation."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from svc_common.addresses import host_port_problem
from svc_common.defaults import DEFAULT_MODEL
from svc_common.log_setup import LOG_FORMATS

INT32_MAX = 2**31 - 1  # serving.v1's int32 fields (max_tokens, top_k, token ids)


@dataclass
class GatewayConfig:
    scheduler: str = field(
        default="127.0.0.1:50051", metadata={"help": "the scheduler's serving.v1 gRPC address, HOST:PORT"}
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
        default="", metadata={"help": "model id shown by /v1/models and in responses; default: --model-dir's name"}
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
    chat_max_tokens: int = field(
        default=0,
        metadata={
            "help": "max_tokens of a chat request that sets neither max_tokens nor max_completion_tokens; "
            "0 = no limit of ours: the answer runs to its end (EOS or a stop string) or until prompt + answer "
            "fill the scheduler's max_model_len (finish_reason 'length'), as OpenAI's chat API does. "
            "/v1/completions keeps the scheduler's --default-max-tokens (16, OpenAI's default there too)"
        },
    )
    max_n: int = field(default=16, metadata={"help": "largest n (samples per prompt) a request may ask for"})
    log_format: str = field(default="console", metadata={"help": "log line format", "choices": LOG_FORMATS})
    log_level: str = field(default="info", metadata={"help": "debug | info | warning | error"})
    ready_file: str = field(default="", metadata={"help": "write {host, port, pid} as JSON here once serving"})

    @property
    def model_id(self) -> str:
        if self.model_name:
            return self.model_name
        return Path(self.model_dir).name if self.model_dir else "pagedserve"

    def validate(self) -> None:
        checks = [
            (host_port_problem(self.scheduler) is None, "--scheduler", "HOST:PORT"),
            (0 <= self.port <= 65535, "--port", "in 0..65535"),
            (
                not self.model_dir or Path(self.model_dir).is_dir(),
                "--model-dir",
                "an existing directory (run `make model`, or pass --model-dir '' to serve completions only)",
            ),
            (self.request_timeout_s >= 0, "--request-timeout-s", ">= 0"),
            (self.health_timeout_s > 0, "--health-timeout-s", "> 0"),
            (0 <= self.chat_max_tokens <= INT32_MAX, "--chat-max-tokens", f"in 0..{INT32_MAX} (0 = up to the context)"),
            (1 <= self.max_n <= 128, "--max-n", "in 1..128"),
            (
                self.log_level.lower() in ("debug", "info", "warning", "error"),
                "--log-level",
                "debug, info, warning or error",
            ),
        ]
        for ok, flag, valid in checks:
            if not ok:
                raise ValueError(f"{flag}: must be {valid}")
