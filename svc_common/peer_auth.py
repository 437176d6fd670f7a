"""Who may call a gRPC service: a bearer credential checked before the servicer runs.

One rule for the three services that take one: the scheduler's client API
(API keys), its admin.v1 listener (admin keys) and the worker (the internal
token the scheduler holds). A call sends `authorization: Bearer CREDENTIAL`;
without one, or with one the service does not know, it ends with
UNAUTHENTICATED before its request is even parsed. grpc.health.v1 stays open so
that probes (the kubelet, Docker) need no secret.

`BearerInterceptor` is for grpc.aio servers (the scheduler's), and
`SyncBearerInterceptor` for the worker's thread-pool server; both ask the same
`Credentials` and answer alike. With mutual TLS, `SyncPeerNameInterceptor`
narrows the worker's callers to the certificates that name its scheduler.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import grpc

OPEN_METHOD_PREFIXES = ("/grpc.health.v1.Health/",)
# A credential file's secret must not be guessable: 16 characters at least
# (`secrets.token_hex(24)`, what the launchers write, has 48).
MIN_TOKEN_CHARS = 16
LOOPBACK_NAMES = ("localhost",)

Metadata = Iterable[tuple[str, str | bytes]] | None


def is_loopback(host: str) -> bool:
    """True for an address only this machine can reach (127.0.0.0/8, ::1, localhost)."""
    if host in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def load_keys(keys: str = "", keys_file: str = "") -> frozenset[str]:
    """Comma-separated keys plus a file with one key per line (blank lines and # comments skipped)."""
    found = [k.strip() for k in keys.split(",")]
    if keys_file:
        lines = Path(keys_file).read_text().splitlines()
        found += [line.strip() for line in lines if not line.lstrip().startswith("#")]
    return frozenset(k for k in found if k)


_TOKEN_RULE = f"one token of at least {MIN_TOKEN_CHARS} printable characters, no spaces"
_TOKEN_HINT = "python -c 'import secrets; print(secrets.token_hex(24))' > FILE"


def read_token_file(path: str) -> str:
    """The one secret in a token file (surrounding whitespace dropped); ValueError if it is not one."""
    token = Path(path).read_text().strip()
    if len(token) < MIN_TOKEN_CHARS or any(c.isspace() for c in token) or not token.isprintable():
        raise ValueError(f"{path} must hold {_TOKEN_RULE} (e.g. {_TOKEN_HINT})")
    return token


def token_file_problem(path: str) -> str | None:
    """None if `path` is empty (no token) or a good token file; else what it must be, for a flag's check."""
    if not path:
        return None
    try:
        read_token_file(path)
    except OSError as exc:
        return f"a readable file ({exc.strerror}: {path!r})"
    except ValueError:
        return f"a file holding {_TOKEN_RULE}, e.g. {_TOKEN_HINT} ({path!r} is not)"
    return None


def bearer_token(metadata: Metadata) -> str | None:
    for key, value in metadata or ():
        if key == "authorization" and isinstance(value, str):
            scheme, _, token = value.partition(" ")
            if scheme.lower() == "bearer" and token.strip():
                return token.strip()
    return None


def bearer_metadata(token: str | None) -> tuple[tuple[str, str], ...] | None:
    """The call metadata that presents `token` (None: nothing to present)."""
    return (("authorization", f"Bearer {token}"),) if token else None


class Credentials:
    """The secrets a service accepts, and `what` they are called in its refusals."""

    def __init__(self, secrets: Iterable[str], what: str):
        secrets = frozenset(secrets)
        if not secrets:
            raise ValueError(f"no {what} to check against")
        self.what = what
        # Compare digests of equal length in constant time, against every secret, so
        # neither timing nor an early exit tells a caller how close a guess was.
        self._digests = [hashlib.sha256(s.encode()).digest() for s in secrets]

    def allows(self, token: str | None) -> bool:
        digest = hashlib.sha256((token or "").encode()).digest()
        matches = [hmac.compare_digest(digest, d) for d in self._digests]
        return token is not None and any(matches)

    def refusal(self, method: str, metadata: Metadata) -> str | None:
        """None if the call may go on; else why it is refused."""
        if method.startswith(OPEN_METHOD_PREFIXES):
            return None
        token = bearer_token(metadata)
        if self.allows(token):
            return None
        if token is None:
            return f"missing 'authorization: Bearer <{self.what}>' metadata"
        return f"invalid {self.what}"


class _BearerCheck:
    """What both interceptors do with a handler: pass it on, or swap it for a refusal."""

    def __init__(self, credentials: Credentials, on_refusal: Callable[[str, str], None] | None = None):
        self.credentials = credentials
        self._on_refusal = on_refusal

    def _decide(self, handler: grpc.RpcMethodHandler | None, details: Any, aio: bool) -> Any:
        if handler is None:
            return None
        why = self.credentials.refusal(details.method, details.invocation_metadata)
        if why is None:
            return handler
        if self._on_refusal is not None:
            self._on_refusal(details.method, why)
        return _refusing_handler(handler, why, aio)


class BearerInterceptor(_BearerCheck, grpc.aio.ServerInterceptor):  # type: ignore[misc]  # grpc.aio is untyped
    """For grpc.aio servers."""

    async def intercept_service(self, continuation: Any, details: Any) -> Any:
        return self._decide(await continuation(details), details, aio=True)


class SyncBearerInterceptor(_BearerCheck, grpc.ServerInterceptor):  # type: ignore[misc]  # grpc is untyped
    """For grpc's thread-pool servers (the worker's)."""

    def intercept_service(self, continuation: Any, details: Any) -> Any:
        return self._decide(continuation(details), details, aio=False)


class SyncPeerNameInterceptor(grpc.ServerInterceptor):  # type: ignore[misc]  # grpc is untyped
    """Mutual TLS narrowed to named peers: a call (health aside) goes on only when the
    client certificate's common name or one of its DNS names is in `names`; another
    certificate of the same CA (another service's) gets PERMISSION_DENIED. The handshake
    has checked the CA already; this names who, of those it signed, may call."""

    def __init__(self, names: Iterable[str], on_refusal: Callable[[str, str], None] | None = None):
        self.names = frozenset(names)
        self._on_refusal = on_refusal

    def refusal(self, auth_context: dict[str, list[bytes]]) -> str | None:
        presented = [
            v.decode(errors="replace")
            for key in ("x509_common_name", "x509_subject_alternative_name")
            for v in auth_context.get(key, [])
        ]
        if self.names & set(presented):
            return None
        return f"client certificate names {sorted(presented) or 'nothing'}, not one of {sorted(self.names)}"

    def intercept_service(self, continuation: Any, details: Any) -> Any:
        handler = continuation(details)
        if handler is None or details.method.startswith(OPEN_METHOD_PREFIXES):
            return handler
        return _guarded_handler(handler, details.method, self)

    def _check(self, method: str, context: Any) -> None:
        why = self.refusal(context.auth_context())
        if why is not None:
            if self._on_refusal is not None:
                self._on_refusal(method, why)
            context.abort(grpc.StatusCode.PERMISSION_DENIED, why)


def _guarded_handler(
    handler: grpc.RpcMethodHandler, method: str, peers: SyncPeerNameInterceptor
) -> grpc.RpcMethodHandler:
    """`handler` with the peer check first (the peer's certificate is only in the call's context)."""
    kind = (
        ("stream" if handler.request_streaming else "unary")
        + "_"
        + ("stream" if handler.response_streaming else "unary")
    )
    behaviour = getattr(handler, kind)

    def guarded(request: Any, context: Any) -> Any:
        peers._check(method, context)
        return behaviour(request, context)

    factory = getattr(grpc, f"{kind}_rpc_method_handler")
    wrapped: grpc.RpcMethodHandler = factory(
        guarded, request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer
    )
    return wrapped


def _refusing_handler(handler: grpc.RpcMethodHandler, why: str, aio: bool) -> grpc.RpcMethodHandler:
    """A handler of the same shape as `handler` that ends the call with UNAUTHENTICATED.
    It has no request deserializer: an unauthenticated payload is never parsed."""
    code = grpc.StatusCode.UNAUTHENTICATED

    async def refuse_aio(request: Any, context: Any) -> None:
        await context.abort(code, why)

    async def refuse_aio_stream(request: Any, context: Any) -> AsyncIterator[None]:
        await context.abort(code, why)
        yield  # never reached: makes this an async generator, as streaming handlers are

    def refuse(request: Any, context: Any) -> None:
        context.abort(code, why)

    def refuse_stream(request: Any, context: Any) -> Iterator[None]:
        context.abort(code, why)
        yield  # never reached

    kind = (
        ("stream" if handler.request_streaming else "unary")
        + "_"
        + ("stream" if handler.response_streaming else "unary")
    )
    if aio:
        behaviour: Callable[..., Any] = refuse_aio_stream if handler.response_streaming else refuse_aio
    else:
        behaviour = refuse_stream if handler.response_streaming else refuse
    factory = getattr(grpc, f"{kind}_rpc_method_handler")
    refusing: grpc.RpcMethodHandler = factory(behaviour, response_serializer=handler.response_serializer)
    return refusing


def peer_interceptors(
    token_file: str, client_names: str, on_refusal: Callable[[str, str], None] | None = None
) -> list[grpc.ServerInterceptor]:
    """What a thread-pool server installs to take calls only from its peer: the internal token
    in `token_file` ('' = none), and a client certificate naming one of `client_names`
    (comma-separated; '' = any the CA signed)."""
    interceptors: list[grpc.ServerInterceptor] = []
    if token_file:
        token = Credentials([read_token_file(token_file)], "internal token")
        interceptors.append(SyncBearerInterceptor(token, on_refusal))
    if names := [n.strip() for n in client_names.split(",") if n.strip()]:
        interceptors.append(SyncPeerNameInterceptor(names, on_refusal))
    return interceptors
