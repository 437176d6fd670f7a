"""Container health check without downloaded binaries (no grpc_health_probe):

    python healthcheck.py grpc 127.0.0.1:50061 [SERVICE]    # grpc.health.v1 Check == SERVING
    python healthcheck.py http http://127.0.0.1:8000/health  # HTTP 200

Exit 0 when healthy, 1 otherwise (what Docker's HEALTHCHECK / compose healthcheck
expect). A service serving TLS is checked over TLS when PAGEDSERVE_HEALTHCHECK_CA
is set (the CA that signed its certificate), presenting PAGEDSERVE_HEALTHCHECK_CERT
and PAGEDSERVE_HEALTHCHECK_KEY if it requires client certificates, and expecting
the name PAGEDSERVE_HEALTHCHECK_SERVER_NAME in its certificate (default: the host).
"""

from __future__ import annotations

import os
import sys

TIMEOUT_S = 5.0


def _channel(target: str):
    import grpc

    ca = os.environ.get("PAGEDSERVE_HEALTHCHECK_CA", "")
    if not ca:
        return grpc.insecure_channel(target)

    def read(path: str) -> bytes | None:
        if not path:
            return None
        with open(path, "rb") as f:
            return f.read()

    credentials = grpc.ssl_channel_credentials(
        read(ca),
        read(os.environ.get("PAGEDSERVE_HEALTHCHECK_KEY", "")),
        read(os.environ.get("PAGEDSERVE_HEALTHCHECK_CERT", "")),
    )
    options = []
    if name := os.environ.get("PAGEDSERVE_HEALTHCHECK_SERVER_NAME", ""):
        options.append(("grpc.ssl_target_name_override", name))
    return grpc.secure_channel(target, credentials, options=options)


def grpc_ok(target: str, service: str = "") -> bool:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with _channel(target) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=TIMEOUT_S
            )
        except grpc.RpcError as err:
            print(f"{target}: {err.code().name}: {err.details()}", file=sys.stderr)
            return False
    print(f"{target} {service or '(server)'}: {health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)}")
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def http_ok(url: str) -> bool:
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=TIMEOUT_S) as reply:
            print(f"{url}: {reply.status}")
            return reply.status == 200
    except (urllib.error.URLError, OSError) as err:
        print(f"{url}: {err}", file=sys.stderr)
        return False


def main(argv: list[str]) -> int:
    if len(argv) < 3 or argv[1] not in ("grpc", "http"):
        print(__doc__, file=sys.stderr)
        return 2
    try:
        ok = grpc_ok(*argv[2:4]) if argv[1] == "grpc" else http_ok(argv[2])
    except OSError as err:  # e.g. an unreadable certificate file
        print(f"health check failed: {err}", file=sys.stderr)
        return 1
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))
