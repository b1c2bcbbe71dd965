"""Where the schedulers (cells) are: a list of addresses, or a DNS name with several.

``--scheduler-address`` on frontends and workers takes ``HOST:PORT[,HOST:PORT...]``.
A host name stands for one scheduler per IP address it resolves to (a
Kubernetes headless Service over the scheduler StatefulSet, compose's name of
a scaled service); callers resolve again from time to time, so cells that come
and go are seen. That holds for a name with one address too: a scaled name
answers with one address while a replica restarts, and dialing it by name
then would open a second stream to the same scheduler, counted as another
cell. A name that does not resolve (yet) is dialed by name: gRPC resolves it
itself and retries.
"""

from __future__ import annotations

import ipaddress
import socket
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class SchedulerTarget:
    """One scheduler to dial: ``address`` (HOST:PORT) and, for an address resolved
    from a DNS name, that name, which TLS checks the certificate against."""

    address: str
    server_name: str | None = None

    def channel_options(self) -> tuple[tuple[str, str], ...]:
        """gRPC channel options that keep the DNS name as the TLS target and authority."""
        if self.server_name is None:
            return ()
        return (("grpc.ssl_target_name_override", self.server_name),
                ("grpc.default_authority", self.server_name))


def split_host_port(address: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[v6]:PORT`` too) -> (host, port); ValueError naming the address."""
    host, sep, port_text = address.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise ValueError(f"scheduler address {address!r} is not HOST:PORT with a port in 1..65535")
    return host, int(port_text)


def parse_scheduler_addresses(text: str) -> list[str]:
    """The comma-separated addresses of ``text``, each checked, duplicates dropped."""
    addresses = [a.strip() for a in text.split(",") if a.strip()]
    if not addresses:
        raise ValueError("scheduler_address is empty; give HOST:PORT[,HOST:PORT...]")
    for address in addresses:
        split_host_port(address)
    return list(dict.fromkeys(addresses))


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def _format(ip: str, port: int) -> str:
    return f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"


def resolve_scheduler_targets(addresses: list[str]) -> list[SchedulerTarget]:
    """One target per scheduler, in a stable order (blocks on DNS: run on a thread).

    IP literals and ``localhost`` stay as given; a name becomes one target per
    IPv4/IPv6 address it resolves to (TLS checks each against the name); a name
    that does not resolve stays a name.
    """
    targets: dict[str, SchedulerTarget] = {}
    for address in addresses:
        host, port = split_host_port(address)
        ips: list[str] = []
        if not _is_ip(host) and host != "localhost":
            try:
                infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
            except OSError:
                infos = []  # not resolvable yet: gRPC keeps trying the name
            ips = sorted({str(info[4][0]) for info in infos})
        if ips:
            for ip in ips:
                target = SchedulerTarget(_format(ip, port), host)
                targets.setdefault(target.address, target)
        else:
            targets.setdefault(address, SchedulerTarget(address))
    return list(targets.values())
