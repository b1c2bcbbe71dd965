"""Hosts with addresses of their own: Linux network namespaces on a private bridge.

A ``VirtualNetwork`` is a switch and the hosts plugged into it:

- the switch is a bridge inside a namespace of its own, so neither the
  machine's firewall nor Docker's rules ever see its traffic;
- each host is a namespace with one veth pair (its end holds the host's
  address, the other end is a port on the bridge) and its own UTS namespace,
  so its hostname is its own (a pod's hostname is its name);
- this process joins the subnet through one more veth (the gateway address),
  as a node's kubelet reaches its pods: tests probe and call hosts directly;
- names resolve through a hosts file per namespace (/etc/netns/<ns>/hosts,
  which ``ip netns exec`` bind-mounts over /etc/hosts), with an empty
  resolv.conf, so nothing asks a DNS server and a name may list several
  addresses (a headless Service);
- ``partition(host)`` takes the host's switch port down: packets vanish both
  ways, without a reset, as when a machine drops off the network.

``close()`` deletes every namespace (their veths and the bridge go with them)
and hosts file, even after a failed test; a run killed before it could is
cleaned up by the next one (namespace names carry the owning pid).
Needs root and iproute2; ``netns_unavailable_reason()`` says why not.
"""

from __future__ import annotations

import ipaddress
import json
import os
import random
import re
import shutil
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

_NETNS_PREFIX = "kvmesh-test"
_NETNS_CONFIG_DIR = Path("/etc/netns")
_STALE_NETNS = re.compile(rf"^{_NETNS_PREFIX}-(\d+)-")
_GATEWAY_HOST = 1
_FIRST_HOST = 10
_MAX_HOSTS = 200
_SUBNET_TRIES = 20
_CLEANUP_WAIT_S = 5.0


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], check=check, capture_output=True, text=True)


def netns_unavailable_reason() -> str | None:
    """Why hosts cannot be made here (not root, no iproute2 or util-linux,
    namespaces refused), or None."""
    if os.geteuid() != 0:
        return "network namespaces need root (ip netns add)"
    for tool, package in (("ip", "iproute2"), ("unshare", "util-linux"),
                          ("hostname", "hostname")):
        if shutil.which(tool) is None:
            return f"`{tool}` is not installed (Debian package {package})"
    probe = f"{_NETNS_PREFIX}-{os.getpid()}-probe"
    created = _ip("netns", "add", probe, check=False)
    if created.returncode != 0:
        return f"`ip netns add` failed: {created.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


@dataclass
class Host:
    """One machine on the network: its namespace, address and hostname."""

    name: str
    netns: str
    ip: str
    hostname: str
    switch_port: str  # its veth's end on the bridge, in the switch namespace

    def connected_peers(self, port: int) -> set[str]:
        """The addresses of the established TCP connections to ``port`` on this host."""
        out = subprocess.run(["ip", "netns", "exec", self.netns, "ss", "-Htn", "state",
                              "established", f"( sport = :{port} )"],
                             capture_output=True, text=True, check=True).stdout
        peers = set()
        for line in out.splitlines():
            address = ipaddress.ip_address(line.split()[-1].rsplit(":", 1)[0].strip("[]"))
            peers.add(str(getattr(address, "ipv4_mapped", None) or address))  # [::ffff:10.x]
        return peers

    def command(self, argv: list[str]) -> list[str]:
        """``argv`` run on this host: in its network namespace (and its hosts
        file), with its own hostname."""
        return ["ip", "netns", "exec", self.netns, "unshare", "--uts", "--",
                "sh", "-c", 'hostname "$0" && exec "$@"', self.hostname, *argv]


@dataclass
class VirtualNetwork:
    """A /24 of hosts on one bridge; use as a context manager (see the module doc)."""

    name: str = "net"
    hosts: dict[str, Host] = field(default_factory=dict)
    names: dict[str, list[str]] = field(default_factory=dict)  # beyond the hostnames

    def __post_init__(self) -> None:
        remove_stale_namespaces()
        self._prefix = f"{_NETNS_PREFIX}-{os.getpid()}-{self.name}"
        self._tag = f"kv{random.getrandbits(16):04x}"  # veth names: 15 characters at most
        self.subnet = _free_subnet()
        self.gateway_ip = str(self.subnet.network_address + _GATEWAY_HOST)
        self._switch = f"{self._prefix}-switch"
        self._gateway = f"{self._tag}gw"
        try:
            _ip("netns", "add", self._switch)
            _ip("-n", self._switch, "link", "add", "br0", "type", "bridge")
            _ip("-n", self._switch, "link", "set", "br0", "up")
            self._plug(self._gateway, None, self.gateway_ip)
        except BaseException:
            self.close()
            raise

    def _plug(self, veth: str, netns: str | None, ip: str) -> str:
        """A veth pair: ``veth`` with ``ip`` in ``netns`` (None: this one), its
        peer a port of the bridge. Returns the port's name."""
        port = f"{veth}s"
        _ip("link", "add", veth, "type", "veth", "peer", "name", port)
        _ip("link", "set", port, "netns", self._switch)
        _ip("-n", self._switch, "link", "set", port, "master", "br0", "up")
        where = ["-n", netns] if netns else []
        if netns:
            _ip("link", "set", veth, "netns", netns)
            _ip(*where, "link", "set", "lo", "up")
        _ip(*where, "addr", "add", f"{ip}/{self.subnet.prefixlen}", "dev", veth)
        _ip(*where, "link", "set", veth, "up")
        return port

    def add_host(self, name: str, hostname: str | None = None) -> Host:
        """A new host named ``name`` (its hostname defaults to the name)."""
        index = len(self.hosts)
        if index >= _MAX_HOSTS:
            raise ValueError(f"a network holds at most {_MAX_HOSTS} hosts")
        netns = f"{self._prefix}-{index}"
        ip = str(self.subnet.network_address + _FIRST_HOST + index)
        _ip("netns", "add", netns)
        port = self._plug(f"{self._tag}h{index}", netns, ip)
        host = Host(name, netns, ip, hostname or name, port)
        self.hosts[name] = host
        self.write_hosts_files(self.names)
        return host

    def write_hosts_files(self, names: dict[str, list[str]]) -> None:
        """Every host's /etc/hosts: localhost, each host's hostname, and ``names``
        (a name with several addresses resolves to all of them); kept for hosts
        added later. Running processes see the new file (same inode)."""
        self.names = dict(names)
        lines = ["127.0.0.1 localhost"]
        lines += [f"{h.ip} {h.hostname}" for h in self.hosts.values()]
        lines += [f"{ip} {name}" for name, ips in names.items() for ip in ips]
        for host in self.hosts.values():
            directory = _NETNS_CONFIG_DIR / host.netns
            directory.mkdir(parents=True, exist_ok=True)
            (directory / "hosts").write_text("\n".join(lines) + "\n")
            (directory / "resolv.conf").write_text("# names come from /etc/hosts alone\n")

    def partition(self, host: Host) -> None:
        """Cuts ``host`` off the network (its switch port down)."""
        _ip("-n", self._switch, "link", "set", host.switch_port, "down")

    def heal(self, host: Host) -> None:
        _ip("-n", self._switch, "link", "set", host.switch_port, "up")

    def close(self) -> None:
        """Deletes every namespace, veth and hosts file this network made."""
        _ip("link", "del", self._gateway, check=False)
        for host in self.hosts.values():
            _delete_netns(host.netns)
        _delete_netns(self._switch)
        self.hosts.clear()
        _wait_gone(self._gateway)

    def __enter__(self) -> VirtualNetwork:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _delete_netns(netns: str) -> None:
    _ip("netns", "del", netns, check=False)
    shutil.rmtree(_NETNS_CONFIG_DIR / netns, ignore_errors=True)


def _wait_gone(link: str) -> None:
    """A deleted namespace's devices go asynchronously; wait so none outlives the test."""
    deadline = time.monotonic() + _CLEANUP_WAIT_S
    while _ip("link", "show", link, check=False).returncode == 0:
        if time.monotonic() > deadline:
            raise RuntimeError(f"veth {link} still exists {_CLEANUP_WAIT_S}s after cleanup")
        time.sleep(0.05)


def namespaces() -> list[str]:
    """Every network namespace's name."""
    listed = _ip("netns", "list", check=False).stdout.splitlines()
    return [line.split()[0] for line in listed if line.strip()]


def remove_stale_namespaces() -> None:
    """Deletes the namespaces of test runs whose process is gone."""
    for netns in namespaces():
        match = _STALE_NETNS.match(netns)
        if match and not Path(f"/proc/{match.group(1)}").exists():
            _delete_netns(netns)


def _free_subnet() -> ipaddress.IPv4Network:
    """A 10.x.y.0/24 that no route of this machine overlaps."""
    routes = json.loads(_ip("-j", "-4", "route", "show", "table", "all").stdout or "[]")
    taken = [ipaddress.ip_network(r["dst"], strict=False) for r in routes
             if r.get("dst") not in (None, "default")]
    for _ in range(_SUBNET_TRIES):
        subnet = ipaddress.ip_network(f"10.{random.randint(100, 250)}.{random.randint(0, 255)}.0/24")
        if not any(subnet.overlaps(t) for t in taken):
            return subnet
    raise RuntimeError("no free 10.x.y.0/24 subnet for the test network")
