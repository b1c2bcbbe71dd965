"""A throwaway certificate authority for TLS tests (keys and certificates as PEM files)."""

from __future__ import annotations

import datetime
import ipaddress
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from services.common.security import TlsConfig


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _write_key(key: ec.EllipticCurvePrivateKey, path: Path) -> str:
    path.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                       serialization.PrivateFormat.PKCS8,
                                       serialization.NoEncryption()))
    return str(path)


def _write_cert(cert: x509.Certificate, path: Path) -> str:
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return str(path)


def _certificate(subject: str, key, issuer: str, issuer_key, *, ca: bool) -> x509.Certificate:
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (x509.CertificateBuilder()
               .subject_name(_name(subject)).issuer_name(_name(issuer))
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5))
               .not_valid_after(now + datetime.timedelta(days=1))
               .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if not ca:
        builder = builder.add_extension(x509.SubjectAlternativeName(
            [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False)
    return builder.sign(issuer_key, hashes.SHA256())


def make_tls(directory: Path) -> tuple[TlsConfig, TlsConfig]:
    """(a server's TlsConfig, a client's), both issued by one fresh CA.

    Certificates name localhost and 127.0.0.1, so either config can serve
    or dial on loopback; both carry the CA, so servers require client
    certificates (mutual TLS).
    """
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_cert = _certificate("kvmesh test CA", ca_key, "kvmesh test CA", ca_key, ca=True)
    ca_file = _write_cert(ca_cert, directory / "ca.pem")
    configs = []
    for role in ("server", "client"):
        key = ec.generate_private_key(ec.SECP256R1())
        cert = _certificate(f"kvmesh {role}", key, "kvmesh test CA", ca_key, ca=False)
        configs.append(TlsConfig(_write_cert(cert, directory / f"{role}.pem"),
                                 _write_key(key, directory / f"{role}.key"), ca_file))
    return configs[0], configs[1]
