"""A gRPC health probe: ``python -m kvmesh.healthcheck HOST:PORT [--service NAME]``.

Exits 0 when the server answers SERVING for the service ("" = the whole
server, "liveness" = the process itself), 1 otherwise (NOT_SERVING, unknown
service, unreachable). Used by docker-compose healthchecks, since
grpc_health_probe is not installed. ``--tls-ca`` (and ``--tls-cert/--tls-key``
for a server that wants client certificates) probe a TLS server.
"""

from __future__ import annotations

import argparse
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.security import TlsConfig, channel


def check_health(address: str, service: str = "", timeout_s: float = 2.0,
                 tls: TlsConfig | None = None) -> str:
    """The server's status name for ``service`` ("SERVING", "NOT_SERVING", ...),
    or "UNREACHABLE: <code>" when the call fails; over TLS when ``tls`` is given."""
    with channel(address, tls) as health_channel:
        stub = health_pb2_grpc.HealthStub(health_channel)
        try:
            response = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout_s)
        except grpc.RpcError as e:
            return f"UNREACHABLE: {e.code().name}"
    return health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvmesh.healthcheck", description=__doc__)
    parser.add_argument("address", help="HOST:PORT of a gRPC server")
    parser.add_argument("--service", default="", help='service name ("" = the whole server)')
    parser.add_argument("--timeout", type=float, default=2.0, help="seconds")
    parser.add_argument("--tls-ca", default=None, help="PEM CA of the server: probe over TLS")
    parser.add_argument("--tls-cert", default=None, help="PEM client certificate (mutual TLS)")
    parser.add_argument("--tls-key", default=None, help="PEM private key of --tls-cert")
    args = parser.parse_args(argv)
    tls = None
    if args.tls_ca or args.tls_cert:
        tls = TlsConfig(args.tls_cert, args.tls_key, args.tls_ca)
    status = check_health(args.address, args.service, args.timeout, tls)
    print(status)
    return 0 if status == "SERVING" else 1


if __name__ == "__main__":
    sys.exit(main())
