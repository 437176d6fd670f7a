"""The secrets a deployment needs, made in one command: a private CA, the
workers' certificate, the scheduler's client certificate (mutual TLS on
worker.v1), an admin key (admin.v1, the KV events) and an internal token (for
setups without TLS).

    # docker compose runs this itself (its `secrets` service); by hand:
    python -m tools.certs --out certs --names worker-0,worker-1,workers
    # Kubernetes: the Secrets deploy/kubernetes/base reads, applied in one line
    python -m tools.certs --kubernetes --namespace pagedserve | kubectl -n pagedserve apply -f -

Files (--out): ca.crt, ca.key (to issue more), worker.crt/.key (server and
client auth: the workers' own health check presents it; SANs: --names,
localhost, 127.0.0.1), scheduler-client.crt/.key (client auth, CN
pagedserve-scheduler), admin.key, internal.token. Keys are written 0600 and
never overwritten (--if-missing: an existing set is kept as is). With
--kubernetes the same material is printed as Secret manifests instead, in
cert-manager's layout (tls.crt, tls.key, ca.crt).
"""

from __future__ import annotations

import argparse
import base64
import datetime
import ipaddress
import json
import os
import secrets
import sys
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

SCHEDULER_CLIENT_NAME = "pagedserve-scheduler"  # what the workers' --tls-client-names lets call
WORKER_SERVICE = "pagedserve-worker"  # deploy/kubernetes/base: the workers' headless Service
FILES = ("ca.crt", "ca.key", "worker.crt", "worker.key", "scheduler-client.crt", "scheduler-client.key")


@dataclass(frozen=True)
class Issued:
    cert: bytes
    key: bytes


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


class CertificateAuthority:
    def __init__(self, days: int, name: str = "pagedserve-ca"):
        self.days = days
        self.key = ec.generate_private_key(ec.SECP256R1())
        self.name = _name(name)
        self.cert = (
            self._builder(self.name, self.key.public_key())
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(
                x509.KeyUsage(False, False, False, False, False, True, True, False, False), critical=True
            )  # certificate and CRL signing only
            .sign(self.key, hashes.SHA256())
        )

    def _builder(self, subject: x509.Name, public_key: ec.EllipticCurvePublicKey) -> x509.CertificateBuilder:
        now = datetime.datetime.now(datetime.UTC)
        return (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(self.name)
            .public_key(public_key)
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=self.days))
        )

    @property
    def issued(self) -> Issued:
        return Issued(self.cert.public_bytes(serialization.Encoding.PEM), _pem_key(self.key))

    def issue(self, cn: str, dns_names: list[str], server: bool) -> Issued:
        """A leaf for client auth, and server auth too when `server` (its SANs: dns_names, localhost, 127.0.0.1)."""
        key = ec.generate_private_key(ec.SECP256R1())
        usages = [ExtendedKeyUsageOID.CLIENT_AUTH] + ([ExtendedKeyUsageOID.SERVER_AUTH] if server else [])
        builder = self._builder(_name(cn), key.public_key()).add_extension(
            x509.ExtendedKeyUsage(usages), critical=False
        )
        if server:
            names: list[x509.GeneralName] = [x509.DNSName(n) for n in dict.fromkeys([*dns_names, "localhost"])]
            names.append(x509.IPAddress(ipaddress.ip_address("127.0.0.1")))
            builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
        cert = builder.sign(self.key, hashes.SHA256())
        return Issued(cert.public_bytes(serialization.Encoding.PEM), _pem_key(key))


def make(names: list[str], days: int) -> dict[str, bytes]:
    """Every file, name -> content."""
    ca = CertificateAuthority(days)
    worker = ca.issue(names[0] if names else WORKER_SERVICE, names, server=True)
    client = ca.issue(SCHEDULER_CLIENT_NAME, [], server=False)
    return {
        "ca.crt": ca.issued.cert,
        "ca.key": ca.issued.key,
        "worker.crt": worker.cert,
        "worker.key": worker.key,
        "scheduler-client.crt": client.cert,
        "scheduler-client.key": client.key,
        "admin.key": (secrets.token_hex(24) + "\n").encode(),
        "internal.token": (secrets.token_hex(24) + "\n").encode(),
    }


def write(out: Path, files: dict[str, bytes]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for name, content in files.items():
        private = not name.endswith(".crt")
        fd = os.open(out / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600 if private else 0o644)
        with os.fdopen(fd, "wb") as f:
            f.write(content)


def kubernetes_secrets(files: dict[str, bytes]) -> str:
    """The Secrets deploy/kubernetes/base mounts, as one YAML stream (JSON documents are YAML)."""

    def secret(name: str, data: dict[str, bytes]) -> str:
        encoded = {k: base64.b64encode(v).decode() for k, v in data.items()}
        manifest = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": name}, "type": "Opaque"}
        return json.dumps(manifest | {"data": encoded}, indent=2)

    ca = files["ca.crt"]
    docs = [
        secret("pagedserve-worker-tls", {"tls.crt": files["worker.crt"], "tls.key": files["worker.key"], "ca.crt": ca}),
        secret(
            "pagedserve-scheduler-client-tls",
            {"tls.crt": files["scheduler-client.crt"], "tls.key": files["scheduler-client.key"], "ca.crt": ca},
        ),
        secret("pagedserve-admin-key", {"admin-key": files["admin.key"].strip()}),
    ]
    return "\n---\n".join(docs) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="certs", help="directory to write the files to")
    parser.add_argument(
        "--names",
        default="",
        help="comma-separated DNS names of the workers (the names the scheduler dials); with --kubernetes the "
        "workers' headless Service in --namespace",
    )
    parser.add_argument("--kubernetes", action="store_true", help="print Secret manifests instead of writing files")
    parser.add_argument("--namespace", default="default", help="with --kubernetes: the namespace of the cell")
    parser.add_argument("--days", type=int, default=825, help="validity of the certificates")
    parser.add_argument("--if-missing", action="store_true", help="keep an existing set in --out (exit 0)")
    args = parser.parse_args(argv)
    names = [n.strip() for n in args.names.split(",") if n.strip()]
    if args.kubernetes:
        names = names or [f"{WORKER_SERVICE}.{args.namespace}.svc.cluster.local"]
        sys.stdout.write(kubernetes_secrets(make(names, args.days)))
        return 0
    out = Path(args.out)
    present = [n for n in (*FILES, "admin.key", "internal.token") if (out / n).exists()]
    if present:
        if args.if_missing and len(present) == len(FILES) + 2:
            print(f"{out}: secrets already there, kept", file=sys.stderr)
            return 0
        print(f"{out}: {', '.join(present)} already there: remove them first (never overwritten)", file=sys.stderr)
        return 1
    write(out, make(names, args.days))
    print(f"{out}: CA, worker and scheduler-client certificates, admin.key, internal.token", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
