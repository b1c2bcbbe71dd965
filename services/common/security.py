"""Who may talk to whom: TLS (mutual on the internal plane) and the cluster secret.

The scheduler's ``kvmesh.v1.EngineCore`` service is the internal plane:
frontends send other users' prompts through it and workers receive them, so
every call must carry the cluster's shared secret (metadata
``kvmesh-cluster-secret``), checked in constant time before any handler runs;
a call without it ends UNAUTHENTICATED. TLS, when configured, encrypts every
server and channel; with a CA the server also requires client certificates
(mTLS). Health checking and reflection stay open: probes carry no secret and
they reveal nothing about requests.
"""

from __future__ import annotations

import argparse
import hmac
import os
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import grpc

CLUSTER_SECRET_METADATA_KEY = "kvmesh-cluster-secret"
# Where services read the secret from when no file is given: never the
# command line, which any local user can read in the process list.
CLUSTER_SECRET_ENV = "KVMESH_CLUSTER_SECRET"
INTERNAL_SERVICE_PREFIX = "/kvmesh.v1.EngineCore/"


@dataclass(frozen=True, slots=True)
class TlsConfig:
    """PEM files: this peer's certificate and key, and the CA that signs its peers.

    On a server, ``ca_file`` turns on client-certificate checks (mTLS); on a
    channel it is the root the server's certificate must chain to (None: the
    system's roots) and ``cert_file``/``key_file`` are the client certificate.
    """

    cert_file: str | None = None
    key_file: str | None = None
    ca_file: str | None = None

    def __post_init__(self) -> None:
        if (self.cert_file is None) != (self.key_file is None):
            raise ValueError("tls cert_file and key_file must be given together")
        for name in ("cert_file", "key_file", "ca_file"):
            path = getattr(self, name)
            if path is not None and not Path(path).is_file():
                raise ValueError(f"tls {name} {path!r} is not a readable file")

    def server_credentials(self) -> grpc.ServerCredentials:
        if self.cert_file is None:
            raise ValueError("a TLS server needs cert_file and key_file")
        return grpc.ssl_server_credentials(
            [(_read(self.key_file), _read(self.cert_file))],
            root_certificates=_read(self.ca_file) if self.ca_file else None,
            require_client_auth=self.ca_file is not None,
        )

    def channel_credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(
            root_certificates=_read(self.ca_file) if self.ca_file else None,
            private_key=_read(self.key_file) if self.key_file else None,
            certificate_chain=_read(self.cert_file) if self.cert_file else None,
        )


def _read(path: str | None) -> bytes:
    assert path is not None
    return Path(path).read_bytes()


def bind(server: grpc.aio.Server, address: str, tls: TlsConfig | None) -> int:
    """Adds a listening port (TLS when configured); returns the port, 0 on failure."""
    if tls is None:
        return server.add_insecure_port(address)
    return server.add_secure_port(address, tls.server_credentials())


def aio_channel(address: str, tls: TlsConfig | None,
                options: Iterable[tuple[str, int | str]]) -> grpc.aio.Channel:
    """A grpc.aio channel to ``address``, over TLS when configured."""
    if tls is None:
        return grpc.aio.insecure_channel(address, options=tuple(options))
    return grpc.aio.secure_channel(address, tls.channel_credentials(), options=tuple(options))


def channel(address: str, tls: TlsConfig | None,
            options: Iterable[tuple[str, int]] = ()) -> grpc.Channel:
    """A synchronous channel to ``address``, over TLS when configured."""
    if tls is None:
        return grpc.insecure_channel(address, options=tuple(options))
    return grpc.secure_channel(address, tls.channel_credentials(), options=tuple(options))


def read_cluster_secret(path: str | None) -> str | None:
    """The secret from ``path``, else from $KVMESH_CLUSTER_SECRET, else None (no check).

    Raises ValueError for an empty secret: that would be no secret at all.
    """
    secret = Path(path).read_text().strip() if path else os.environ.get(CLUSTER_SECRET_ENV)
    if secret is not None and not secret.strip():
        raise ValueError("the cluster secret is empty")
    return secret.strip() if secret is not None else None


# Where services read the Redis URL from when ``--redis-url`` is not given: it may
# carry a password (``redis://:PASSWORD@host:port/0``, ``rediss://`` for TLS),
# which must stay out of the process list.
REDIS_URL_ENV = "KVMESH_REDIS_URL"


def read_redis_url(url: str | None) -> str | None:
    """``url`` if given ("" for none), else $KVMESH_REDIS_URL, else None (no Redis)."""
    if url is not None:
        return url or None
    return os.environ.get(REDIS_URL_ENV) or None


def redacted_url(url: str | None) -> str:
    """``url`` without its password, for logs."""
    if not url:
        return "none"
    scheme, sep, rest = url.partition("://")
    userinfo, at, host = rest.rpartition("@")
    if not at:
        return url
    user = userinfo.partition(":")[0]
    return f"{scheme}{sep}{user + ':' if user else ':'}***@{host}"


def secret_metadata(secret: str | None) -> tuple[tuple[str, str], ...]:
    """The call metadata that authenticates a peer on the internal plane."""
    return ((CLUSTER_SECRET_METADATA_KEY, secret),) if secret else ()


class ClusterSecretInterceptor(grpc.aio.ServerInterceptor):
    """Refuses internal-plane calls without the cluster secret (UNAUTHENTICATED)."""

    def __init__(self, secret: str) -> None:
        self._secret = secret.encode()

    async def intercept_service(
        self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None or not handler_call_details.method.startswith(INTERNAL_SERVICE_PREFIX):
            return handler
        metadata = dict(handler_call_details.invocation_metadata or ())
        given = str(metadata.get(CLUSTER_SECRET_METADATA_KEY, "")).encode()
        if hmac.compare_digest(given, self._secret):
            return handler
        return _refusing_handler(handler)


def _refusing_handler(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A handler of the same shape as ``handler`` that ends the call UNAUTHENTICATED."""

    async def refuse(request: object, context: grpc.aio.ServicerContext) -> None:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED,
                            "missing or wrong cluster secret for kvmesh.v1.EngineCore")

    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(refuse)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(refuse)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(refuse)
    return grpc.unary_unary_rpc_method_handler(refuse)


def add_security_args(parser: argparse.ArgumentParser) -> None:
    """``--tls-cert/--tls-key/--tls-ca`` and ``--cluster-secret-file``, shared by every service."""
    parser.add_argument("--tls-cert", default=None, help="PEM certificate (turns TLS on)")
    parser.add_argument("--tls-key", default=None, help="PEM private key of --tls-cert")
    parser.add_argument("--tls-ca", default=None,
                        help="PEM CA of the peers: mutual TLS on the internal plane")
    parser.add_argument("--cluster-secret-file", default=None,
                        help=f"file holding the internal plane's shared secret "
                             f"(default: ${CLUSTER_SECRET_ENV}; none: no check)")


def tls_from_args(args: argparse.Namespace) -> TlsConfig | None:
    """The TlsConfig the flags describe, or None when TLS is off."""
    if args.tls_cert is None and args.tls_key is None and args.tls_ca is None:
        return None
    return TlsConfig(args.tls_cert, args.tls_key, args.tls_ca)
