"""Who may reach the scheduler and what it presents: TLS on the client API and to the
workers, the client API keys, the internal token, the admin.v1 service and the KV
events (both show every tenant's prompts) and the keys that guard them. SchedulerConfig
inherits these flags; their checks refuse an exposure no key guards."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from svc_common.peer_auth import is_loopback, load_keys, read_token_file, token_file_problem
from svc_common.tls import file_checks, pair_check
from svc_common.zmq_endpoints import ZMQ_ENDPOINTS, zmq_bind_is_local, zmq_binds, zmq_endpoint_ok


@dataclass
class AccessFlags:
    tls_cert: str = field(
        default="", metadata={"help": "PEM certificate for TLS on the client API (with --tls-key); default plaintext"}
    )
    tls_key: str = field(default="", metadata={"help": "PEM private key for --tls-cert"})
    api_keys: str = field(
        default="",
        metadata={
            "help": "comma-separated API keys; clients send 'authorization: Bearer KEY' (health stays open). "
            "Prefer the env var or --api-keys-file: flags show in ps"
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
    admin_host: str = field(
        default="127.0.0.1",
        metadata={"help": "address to bind the admin.v1 service (AddWorker, DrainWorker, ListWorkers)"},
    )
    admin_port: int = field(
        default=0,
        metadata={
            "help": "port of the admin.v1 service; 0 = --port + 1 (the OS picks when --port is 0), so schedulers "
            "on different ports never collide; -1 = no admin service"
        },
    )
    kv_events_buffer_steps: int = field(
        default=1024,
        metadata={
            "help": "KV-event batches (one per engine step that changed the prefix index) kept per worker for "
            "subscribers that reconnect (admin.v1 SubscribeKvEvents, the ZMQ replay socket)"
        },
    )
    kv_events_zmq: str = field(
        default="",
        metadata={
            "help": "also publish KV events as vLLM does (ZMQ PUB, msgpack KVEventBatch), e.g. tcp://*:5557; "
            "worker of rank r on port + r. '' = off"
        },
    )
    kv_events_zmq_replay: str = field(
        default="",
        metadata={
            "help": "vLLM's ZMQ replay socket (ROUTER) for --kv-events-zmq, e.g. tcp://*:5657; worker of rank r "
            "on port + r. '' = none"
        },
    )
    kv_events_zmq_topic: str = field(default="", metadata={"help": "ZMQ topic of the KV-event messages"})

    @property
    def client_keys(self) -> frozenset[str]:
        """The API keys serving.v1 callers present (none: the client API is open)."""
        return load_keys(self.api_keys, self.api_keys_file)

    @property
    def admin_key_set(self) -> frozenset[str]:
        """The keys admin.v1 callers and ZMQ KV-event subscribers present."""
        return load_keys(self.admin_keys, self.admin_keys_file)

    def internal_token(self) -> str | None:
        """What the scheduler presents to its workers, if it has one."""
        return read_token_file(self.internal_token_file) if self.internal_token_file else None

    def access_checks(self) -> list[tuple[bool, str, str]]:
        """(ok, flag, what it must be), as SchedulerConfig.validate reads them."""
        return [
            (
                -1 <= self.admin_port <= 65535,
                "--admin-port",
                "in 1..65535, 0 for --port + 1, or -1 for no admin service",
            ),
            (self.kv_events_buffer_steps >= 1, "--kv-events-buffer-steps", ">= 1"),
            (zmq_endpoint_ok(self.kv_events_zmq), "--kv-events-zmq", ZMQ_ENDPOINTS),
            (zmq_endpoint_ok(self.kv_events_zmq_replay), "--kv-events-zmq-replay", ZMQ_ENDPOINTS),
            (
                not self.kv_events_zmq_replay or bool(self.kv_events_zmq),
                "--kv-events-zmq-replay",
                "used with --kv-events-zmq",
            ),
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

    def credential_checks(self) -> list[tuple[bool, str, str]]:
        """Who may reach admin.v1 and the KV events (they show every tenant's prompts): an admin key,
        never a client's; without admin keys only loopback, and only while clients need no key either."""
        if not all(path == "" or os.path.isfile(path) for path in (self.api_keys_file, self.admin_keys_file)):
            return []  # access_checks' file checks name the missing file
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
