"""gRPC channel and server options: the one place they are built."""

from __future__ import annotations

GrpcOptions = list[tuple[str, int | str]]

# Steps carry whole block tables and prefill chunks: 256 sequences x 4k tokens
# is ~15 MB of packed ids, slots and tables, above gRPC's 4 MB default.
DEFAULT_MAX_MESSAGE_MB = 256

# Reconnect fast after a peer restarts: gRPC's default backoff grows to 120 s.
_FAST_RECONNECT: GrpcOptions = [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
]


def message_limits(max_message_mb: int = DEFAULT_MAX_MESSAGE_MB, max_receive_mb: int | None = None) -> GrpcOptions:
    """Both directions at max_message_mb, unless max_receive_mb caps what is received."""
    receive = max_message_mb if max_receive_mb is None else max_receive_mb
    return [
        ("grpc.max_send_message_length", max_message_mb * 2**20),
        ("grpc.max_receive_message_length", receive * 2**20),
    ]


def channel_options(
    max_message_mb: int = DEFAULT_MAX_MESSAGE_MB, fast_reconnect: bool = False, tls_server_name: str = ""
) -> GrpcOptions:
    """tls_server_name: the name the peer's certificate must carry when it differs from
    the dialled host (a peer found through DNS is dialled by its IP address)."""
    name: GrpcOptions = [("grpc.ssl_target_name_override", tls_server_name)] if tls_server_name else []
    return message_limits(max_message_mb) + (_FAST_RECONNECT if fast_reconnect else []) + name


def server_options(
    max_message_mb: int = DEFAULT_MAX_MESSAGE_MB, reuse_port: bool = True, max_receive_mb: int | None = None
) -> GrpcOptions:
    """max_receive_mb: a client-facing server's cap on requests, refused by gRPC before
    anything parses them (what a client sends is small; a worker's step is not)."""
    # Without SO_REUSEPORT a second server on a taken port fails to start instead
    # of silently sharing the port (and receiving half of the calls).
    limits = message_limits(max_message_mb, max_receive_mb)
    return limits + ([] if reuse_port else [("grpc.so_reuseport", 0)])
