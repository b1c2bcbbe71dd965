"""A gRPC health probe: ``python -m kvmesh.healthcheck HOST:PORT [--service NAME]``.

Exits 0 when the server answers SERVING for the service ("" = the whole
server), 1 otherwise (NOT_SERVING, unknown service, unreachable). Used by
docker-compose healthchecks, since grpc_health_probe is not installed.
"""

from __future__ import annotations

import argparse
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def check_health(address: str, service: str = "", timeout_s: float = 2.0) -> str:
    """The server's status name for ``service`` ("SERVING", "NOT_SERVING", ...),
    or "UNREACHABLE: <code>" when the call fails."""
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
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
    args = parser.parse_args(argv)
    status = check_health(args.address, args.service, args.timeout)
    print(status)
    return 0 if status == "SERVING" else 1


if __name__ == "__main__":
    sys.exit(main())
