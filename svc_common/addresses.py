"""HOST:PORT addresses: the one check every flag and RPC that takes one uses."""

from __future__ import annotations


def host_port_problem(address: str) -> str | None:
    """None if `address` is a usable HOST:PORT, else what is wrong with it."""
    if not address or address != address.strip() or "," in address or "/" in address:
        return f"must be HOST:PORT, got {address!r}"
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        return f"must be HOST:PORT with a port in 1..65535, got {address!r}"
    return None
