"""tests/netns.py itself: hosts reach each other by name on their own addresses,
a partition cuts one off and healing brings it back, and closing leaves no
namespace, veth or hosts file behind."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.netns import VirtualNetwork, namespaces, netns_unavailable_reason

pytestmark = pytest.mark.skipif(netns_unavailable_reason() is not None,
                                reason=str(netns_unavailable_reason()))

# Connects to HOST:PORT and prints the hostname the server sent, or the error.
_CLIENT = """
import socket, sys
try:
    with socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=1.0) as s:
        print(s.recv(64).decode())
except OSError as e:
    print(type(e).__name__)
"""
# Accepts connections and sends each its own hostname (until killed).
_SERVER = """
import socket
server = socket.create_server(("0.0.0.0", 7000))
while True:
    connection, _ = server.accept()
    connection.sendall(socket.gethostname().encode())
    connection.close()
"""


def _run(host, code: str, *args: str) -> str:
    argv = host.command([sys.executable, "-c", code, *args])
    return subprocess.run(argv, capture_output=True, text=True, timeout=30).stdout.strip()


def test_hosts_by_name_partition_heal_and_cleanup():
    with VirtualNetwork("selftest") as network:
        server = network.add_host("server", hostname="server-0")
        client = network.add_host("client")
        network.write_hosts_files({"both.test": [server.ip, client.ip]})
        listening = subprocess.Popen(server.command([sys.executable, "-c", _SERVER]))
        try:
            for _ in range(50):  # until it listens
                if _run(client, _CLIENT, "server-0", "7000") == "server-0":
                    break
            assert _run(client, _CLIENT, "server-0", "7000") == "server-0"
            assert _run(client, _CLIENT, server.ip, "7000") == "server-0"
            # One name, both addresses, as a headless Service resolves.
            resolved = _run(client, "import socket; print(sorted({a[4][0] for a in "
                                    "socket.getaddrinfo('both.test', 1, socket.AF_INET)}))")
            assert resolved == str(sorted([server.ip, client.ip]))
            network.partition(server)
            assert _run(client, _CLIENT, "server-0", "7000") in ("TimeoutError", "timeout")
            network.heal(server)
            assert _run(client, _CLIENT, "server-0", "7000") == "server-0"
            names = {h.netns for h in network.hosts.values()}
        finally:
            listening.kill()
            listening.wait()
    assert not names & set(namespaces())
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    assert network._tag not in links
