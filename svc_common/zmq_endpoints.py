"""KV-event ZMQ endpoints (--kv-events-zmq): which the scheduler binds, which only this
machine can reach, which are well formed."""

from __future__ import annotations

from svc_common.peer_auth import is_loopback

ZMQ_ENDPOINTS = "'', tcp://HOST:PORT (HOST may be *), ipc://PATH or inproc://NAME"
_WILDCARDS = ("*", "0.0.0.0", "::", "[::]")


def zmq_binds(endpoint: str) -> bool:
    """A KV-event endpoint the scheduler binds (subscribers connect to it): a wildcard or loopback
    host, ipc:// or inproc://. Any other host is a proxy it connects to (vLLM's rule, loopback added)."""
    if endpoint.startswith(("ipc://", "inproc://")):
        return True
    host = endpoint.removeprefix("tcp://").rpartition(":")[0]
    return host in _WILDCARDS or is_loopback(host)


def zmq_bind_is_local(endpoint: str) -> bool:
    """Only this machine can subscribe: a loopback host, ipc:// (file permissions) or inproc://."""
    return endpoint.startswith(("ipc://", "inproc://")) or is_loopback(
        endpoint.removeprefix("tcp://").rpartition(":")[0]
    )


def zmq_endpoint_ok(endpoint: str) -> bool:
    """'' (off) or an endpoint whose port (tcp) or name can be offset per worker rank."""
    scheme, sep, rest = endpoint.partition("://")
    if not endpoint:
        return True
    if scheme == "tcp":
        host, colon, port = rest.rpartition(":")
        return bool(host and colon and port.isdigit() and 0 < int(port) <= 65535)
    return bool(sep and rest) and scheme in ("ipc", "inproc")
