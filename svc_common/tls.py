"""TLS credentials from PEM files, for both services.

Server side: a certificate and key, plus an optional client CA that turns on
mutual TLS (a client without a certificate signed by that CA is refused during
the handshake). Client side: the CA that signed the server's certificate, plus
an optional certificate and key to present for mutual TLS.
"""

from __future__ import annotations

import os

import grpc


def read_pem(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def server_credentials(cert: str, key: str, client_ca: str = "") -> grpc.ServerCredentials | None:
    """None when no certificate is configured (plaintext)."""
    if not cert:
        return None
    ca = read_pem(client_ca) if client_ca else None
    return grpc.ssl_server_credentials(
        [(read_pem(key), read_pem(cert))], root_certificates=ca, require_client_auth=ca is not None
    )


def channel_credentials(ca: str = "", cert: str = "", key: str = "") -> grpc.ChannelCredentials | None:
    """None when nothing is configured (plaintext). Without `ca` the system roots are used."""
    if not (ca or cert):
        return None
    return grpc.ssl_channel_credentials(
        root_certificates=read_pem(ca) if ca else None,
        private_key=read_pem(key) if key else None,
        certificate_chain=read_pem(cert) if cert else None,
    )


def file_checks(files: dict[str, str]) -> list[tuple[bool, str, str]]:
    """Config-validation rows (ok, flag, what it must be) for optional file flags (flag -> path)."""
    return [
        (not path or os.path.isfile(path), flag, f"an existing file (not found: {path!r})")
        for flag, path in files.items()
    ]


def pair_check(first: str, second: str, first_flag: str, second_flag: str) -> tuple[bool, str, str]:
    """A certificate needs its key and the other way round."""
    return bool(first) == bool(second), first_flag, f"given together with {second_flag}"
