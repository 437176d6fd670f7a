"""The scheduler's callers and their credentials (svc_common/peer_auth.py checks them):

* serving.v1 (clients, the gateway): an API key (`--api-keys`, `--api-keys-file`),
  when any is configured;
* admin.v1 (operators, KV-aware routers): an admin key (`--admin-keys`,
  `--admin-keys-file`), never a client's key (the config refuses one in both).

Every method but grpc.health.v1 needs one; without it, or with a wrong one, the
call ends with UNAUTHENTICATED before the servicer runs (and before its request
is parsed).
"""

from __future__ import annotations

import structlog

from svc_common.peer_auth import BearerInterceptor, Credentials

log = structlog.get_logger(__name__)


def _log_refusal(method: str, why: str) -> None:
    log.warning("request refused", method=method, reason=why)


def api_key_interceptor(keys: frozenset[str]) -> BearerInterceptor:
    return BearerInterceptor(Credentials(keys, "API key"), _log_refusal)


def admin_key_interceptor(keys: frozenset[str]) -> BearerInterceptor:
    return BearerInterceptor(Credentials(keys, "admin key"), _log_refusal)
