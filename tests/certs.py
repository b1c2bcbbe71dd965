"""A throwaway certificate authority for TLS tests (keys and certificates as PEM files)."""

from __future__ import annotations

import datetime
import ipaddress
from collections.abc import Sequence
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


def _subject_alternative_name(host: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(host))
    except ValueError:
        return x509.DNSName(host)


def _certificate(subject: str, key, issuer: str, issuer_key, *, ca: bool,
                 hosts: Sequence[str] = ("localhost", "127.0.0.1")) -> x509.Certificate:
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (x509.CertificateBuilder()
               .subject_name(_name(subject)).issuer_name(_name(issuer))
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5))
               .not_valid_after(now + datetime.timedelta(days=1))
               .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if not ca:
        builder = builder.add_extension(x509.SubjectAlternativeName(
            [_subject_alternative_name(host) for host in hosts]), critical=False)
    return builder.sign(issuer_key, hashes.SHA256())


class CertificateAuthority:
    """A fresh CA in ``directory`` (ca.pem) that issues certificates on demand."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._key = ec.generate_private_key(ec.SECP256R1())
        cert = _certificate("kvmesh test CA", self._key, "kvmesh test CA", self._key, ca=True)
        self.ca_file = _write_cert(cert, directory / "ca.pem")

    def issue(self, name: str, hosts: Sequence[str] = ("localhost", "127.0.0.1")) -> TlsConfig:
        """A certificate naming ``hosts`` (DNS names or IP addresses), its key
        and the CA: a TlsConfig to serve with (mutual TLS) or to dial with."""
        key = ec.generate_private_key(ec.SECP256R1())
        cert = _certificate(f"kvmesh {name}", key, "kvmesh test CA", self._key, ca=False,
                            hosts=hosts)
        return TlsConfig(_write_cert(cert, self.directory / f"{name}.pem"),
                         _write_key(key, self.directory / f"{name}.key"), self.ca_file)


def make_tls(directory: Path) -> tuple[TlsConfig, TlsConfig]:
    """(a server's TlsConfig, a client's), both issued by one fresh CA.

    Certificates name localhost and 127.0.0.1, so either config can serve
    or dial on loopback; both carry the CA, so servers require client
    certificates (mutual TLS).
    """
    ca = CertificateAuthority(directory)
    return ca.issue("server"), ca.issue("client")
