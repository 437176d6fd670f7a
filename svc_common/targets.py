"""Peers given as fixed HOST:PORT addresses or as DNS names to re-resolve.

`--workers` (scheduler) and `--schedulers` (gateway) take a comma-separated
list of entries, each either `HOST:PORT` (one fixed peer) or gRPC's DNS target
`dns:///NAME:PORT`: every A/AAAA record of NAME is a peer at PORT, and the name
is resolved again periodically, so peers join and leave as the records change
(a Kubernetes headless Service has one record per ready pod).

Resolution goes through a `Resolver`, `(name, port) -> ["HOST:PORT", ...]`, so
tests can answer with a stub. The default one is `socket.getaddrinfo` run in the
event loop's thread pool: a slow DNS server never blocks the loop.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass

import structlog

from svc_common.addresses import host_port_problem

log = structlog.get_logger(__name__)

DNS_SCHEME = "dns:///"

# (name, port) -> the peers' addresses, HOST:PORT each. Raises OSError when the
# name cannot be resolved now (socket.gaierror is one).
Resolver = Callable[[str, int], Awaitable[list[str]]]


@dataclass(frozen=True, slots=True)
class Target:
    """One entry of a peer list: a fixed address, or a DNS name whose records are the peers."""

    host: str
    port: int
    dns: bool = False

    @property
    def address(self) -> str:
        """HOST:PORT (for a DNS target: the name, not a peer)."""
        return f"{self.host}:{self.port}"

    def __str__(self) -> str:
        return f"{DNS_SCHEME}{self.address}" if self.dns else self.address


def target_problem(entry: str) -> str | None:
    """None if `entry` is HOST:PORT or dns:///NAME:PORT, else what is wrong with it."""
    if entry.startswith(DNS_SCHEME):
        problem = host_port_problem(entry.removeprefix(DNS_SCHEME))
        return None if problem is None else f"must be dns:///NAME:PORT, got {entry!r}"
    if entry.startswith("dns:"):
        return f"must be dns:///NAME:PORT (no DNS server authority), got {entry!r}"
    return host_port_problem(entry)


def parse_targets(text: str) -> list[Target]:
    """A comma-separated list of HOST:PORT / dns:///NAME:PORT entries; ValueError says which entry is wrong."""
    targets = []
    for entry in (e.strip() for e in text.split(",")):
        if not entry:
            continue
        if (problem := target_problem(entry)) is not None:
            raise ValueError(problem)
        dns = entry.startswith(DNS_SCHEME)
        host, _, port = entry.removeprefix(DNS_SCHEME).rpartition(":")
        targets.append(Target(host, int(port), dns))
    return targets


def targets_check(text: str, flag: str) -> tuple[bool, str, str]:
    """A start-up check row (ok, flag, what it must be) for a peer list flag."""
    try:
        ok = bool(parse_targets(text))
    except ValueError as exc:
        return False, flag, f"a comma-separated list of HOST:PORT or dns:///NAME:PORT ({exc})"
    return ok, flag, "at least one HOST:PORT or dns:///NAME:PORT"


def format_address(host: str, port: int) -> str:
    """HOST:PORT, with an IPv6 literal in brackets (as gRPC targets write it)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


async def resolve_dns(name: str, port: int) -> list[str]:
    """Every A/AAAA record of `name`, as HOST:PORT, sorted. getaddrinfo runs in a thread."""
    infos = await asyncio.get_running_loop().getaddrinfo(name, port, type=socket.SOCK_STREAM)
    return sorted({format_address(str(sockaddr[0]), port) for *_, sockaddr in infos})


@dataclass(frozen=True, slots=True)
class Resolution:
    """Peer address -> the target it comes from (fixed targets as they are), and
    the DNS targets that could not be resolved this time."""

    peers: dict[str, Target]
    failed: list[Target]


async def resolve_targets(targets: Iterable[Target], resolver: Resolver) -> Resolution:
    """Resolve every DNS target at once. A failure is reported, not raised: the caller
    must then remove no peer (a DNS outage is not every peer leaving at once)."""
    targets = list(targets)
    dns_targets = [t for t in targets if t.dns]
    answers = await asyncio.gather(*(resolver(t.host, t.port) for t in dns_targets), return_exceptions=True)
    peers: dict[str, Target] = {t.address: t for t in targets if not t.dns}
    failed = []
    for target, answer in zip(dns_targets, answers):
        if isinstance(answer, BaseException):
            if not isinstance(answer, OSError):
                raise answer
            log.warning("DNS resolution failed", target=str(target), error=str(answer))
            failed.append(target)
        else:
            peers.update({address: target for address in answer if address not in peers})
    return Resolution(peers, failed)
