"""Which addresses the scheduler may present its internal token to (issue 35: an
AddWorker to any listener handed that listener the token, and the token takes
worker Steps: every tenant's KV). A worker is trusted when the scheduler was
configured with it: a fixed --workers entry, an address a dns:/// entry resolves
to now, or one matching --worker-allow; with worker TLS (--worker-tls-ca) any
address, since the CA-checked handshake comes before the token is sent. With no
internal token there is nothing to leak and any address may join."""

from __future__ import annotations

import fnmatch

from scheduler_svc.config import SchedulerConfig
from svc_common.targets import Resolver


async def untrusted_worker(address: str, config: SchedulerConfig, resolver: Resolver) -> str | None:
    """Why `address` may not be sent the internal token (the rule it breaks), or None."""
    if not config.internal_token_file or config.worker_tls_ca:
        return None
    targets = config.worker_targets
    if any(not t.dns and t.address == address for t in targets):
        return None
    if any(fnmatch.fnmatchcase(address, pattern) for pattern in config.worker_allow_patterns):
        return None
    for target in (t for t in targets if t.dns):
        try:
            if address in await resolver(target.host, target.port):
                return None
        except OSError:
            continue  # an unresolvable name vouches for no one
    return (
        f"worker {address} is not one the scheduler trusts with its internal token: not in --workers, "
        "not a current address of its dns:/// names, not matched by --worker-allow, and worker TLS "
        "(--worker-tls-ca) is off"
    )
