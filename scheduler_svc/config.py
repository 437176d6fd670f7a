"""Scheduler configuration: flags, env vars (PAGEDSERVE_SCHEDULER_*), validation."""
from __future__ import annotations

from dataclasses import dataclass, field

from svc_common.log_setup import LOG_FORMATS


@dataclass
class SchedulerConfig:
    workers: str = field(default="127.0.0.1:50061", metadata={"help": "worker addresses, HOST:PORT[,HOST:PORT...]"})
    host: str = field(default="127.0.0.1", metadata={"help": "address to bind"})
    port: int = field(default=50051, metadata={"help": "port to bind; 0 lets the OS pick"})
    model: str = field(default="models/SmolLM2-135M-Instruct", metadata={"help": "model directory (tokenizer and generation config)"})
    tokenizer: str = field(default="", metadata={"help": "tokenizer directory; default: --model"})
    max_num_batched_tokens: int = field(default=8192, metadata={"help": "token budget of one step"})
    max_num_seqs: int = field(default=256, metadata={"help": "sequences in one step / running at once"})
    chunk_size: int = field(default=8192, metadata={"help": "largest prefill chunk of one request per step"})
    max_model_len: int = field(default=0, metadata={"help": "prompt + output limit; 0 = the worker's"})
    max_waiting: int = field(default=1024, metadata={"help": "queued requests before RESOURCE_EXHAUSTED"})
    prefix_caching: bool = field(default=True, metadata={"help": "share full prompt blocks through the prefix hash index"})
    default_max_tokens: int = field(default=16, metadata={"help": "max_tokens when a request leaves it unset"})
    connect_timeout_s: float = field(default=30.0, metadata={"help": "how long to wait for each worker at start-up"})
    worker_timeout_s: float = field(default=30.0, metadata={"help": "how long a lost worker may stay away before its requests fail with UNAVAILABLE"})
    max_message_mb: int = field(default=256, metadata={"help": "gRPC message size limit"})
    log_format: str = field(default="console", metadata={"help": "log line format", "choices": LOG_FORMATS})
    log_level: str = field(default="info", metadata={"help": "debug | info | warning | error"})
    ready_file: str = field(default="", metadata={"help": "write {host, port, pid} as JSON here once serving"})

    @property
    def worker_addresses(self) -> list[str]:
        return [a.strip() for a in self.workers.split(",") if a.strip()]

    @property
    def tokenizer_dir(self) -> str:
        return self.tokenizer or self.model

    def validate(self) -> None:
        checks = [
            (bool(self.worker_addresses), "--workers", "at least one HOST:PORT"),
            (all(_is_host_port(a) for a in self.worker_addresses), "--workers", "a comma-separated list of HOST:PORT"),
            (0 <= self.port <= 65535, "--port", "in 0..65535"),
            (self.max_num_batched_tokens >= 1, "--max-num-batched-tokens", ">= 1"),
            (self.max_num_seqs >= 1, "--max-num-seqs", ">= 1"),
            (self.chunk_size >= 1, "--chunk-size", ">= 1 (valid range [1, inf))"),
            (self.max_model_len >= 0, "--max-model-len", ">= 0"),
            (self.max_waiting >= 1, "--max-waiting", ">= 1"),
            (self.default_max_tokens >= 1, "--default-max-tokens", ">= 1"),
            (self.connect_timeout_s > 0, "--connect-timeout-s", "> 0"),
            (self.worker_timeout_s > 0, "--worker-timeout-s", "> 0"),
            (1 <= self.max_message_mb <= 2047, "--max-message-mb", "in 1..2047"),
        ]
        for ok, flag, valid in checks:
            if not ok:
                raise ValueError(f"{flag}: must be {valid}")


def _is_host_port(address: str) -> bool:
    host, _, port = address.rpartition(":")
    return bool(host) and port.isdigit() and 0 < int(port) < 65536
