"""Ports a launcher is about to hand its services, checked before anything starts:
a taken port is one clear line naming the setting that moves it, not a worker
that loads its model for 20 s and then dies inside a traceback."""

from __future__ import annotations

import errno
import socket
from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class PortUse:
    port: int
    what: str  # "the gateway's HTTP port"
    setting: str  # how to pick another: "GATEWAY_PORT=... (make) or --gateway-port"


class PortTaken(Exception):
    """One line for the user: which port, whose, and how to choose another."""


def bindable(host: str, port: int) -> bool:
    """Whether a service could bind host:port now (as the services bind: SO_REUSEADDR on)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            if exc.errno in (errno.EADDRINUSE, errno.EACCES):
                return False
            raise
    return True


def check_ports(host: str, uses: Iterable[PortUse]) -> None:
    """Raise PortTaken for the first port (> 0) that is taken or given twice."""
    seen: dict[int, PortUse] = {}
    for use in uses:
        if use.port <= 0:
            continue  # the OS picks one
        if use.port in seen:
            raise PortTaken(f"port {use.port} is given twice ({seen[use.port].what} and {use.what}): set {use.setting}")
        seen[use.port] = use
        if not bindable(host, use.port):
            raise PortTaken(f"port {use.port} on {host} ({use.what}) is in use: choose another with {use.setting}")


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on now, for a service that must be told its port."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
        sock.bind((host, 0))
        port: int = sock.getsockname()[1]
        return port
