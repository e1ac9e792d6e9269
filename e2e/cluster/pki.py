"""Certificates and keys for the test control plane (needs `cryptography`).

Everything is ECDSA P-256: fast to generate, accepted by etcd, kube-apiserver (serving, client CA,
ServiceAccount signing) and by kubectl and the Python client.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

VALIDITY = dt.timedelta(days=365)


def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.TraditionalOpenSSL,
        serialization.NoEncryption(),
    )


def _name(cn: str, orgs: tuple[str, ...] = ()) -> x509.Name:
    attrs = [x509.NameAttribute(NameOID.ORGANIZATION_NAME, o) for o in orgs]
    return x509.Name([*attrs, x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _write(path: Path, data: bytes, private: bool = False) -> Path:
    path.write_bytes(data)
    if private:
        path.chmod(0o600)
    return path


@dataclass(frozen=True)
class CertPair:
    cert: Path
    key: Path


class PKI:
    """A CA in `directory` that issues serving and client certificates, plus an SA key pair."""

    def __init__(self, directory: Path, ca_name: str = "routerfleet-e2e-ca"):
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        now = dt.datetime.now(dt.UTC)
        self._not_before = now - dt.timedelta(hours=1)
        self._ca_key = _key()
        name = _name(ca_name)
        self._ca_cert = (
            x509.CertificateBuilder()
            .subject_name(name)
            .issuer_name(name)
            .public_key(self._ca_key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(self._not_before)
            .not_valid_after(now + VALIDITY)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    key_cert_sign=True,
                    crl_sign=True,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(self._ca_key.public_key()), False)
            .sign(self._ca_key, hashes.SHA256())
        )
        self.ca_cert = _write(self.dir / "ca.crt", self._ca_cert.public_bytes(serialization.Encoding.PEM))
        self.ca_key = _write(self.dir / "ca.key", _key_pem(self._ca_key), private=True)

        sa = _key()
        self.sa_key = _write(self.dir / "sa.key", _key_pem(sa), private=True)
        self.sa_pub = _write(
            self.dir / "sa.pub",
            sa.public_key().public_bytes(
                serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
            ),
        )

    def issue(
        self,
        name: str,
        cn: str,
        orgs: tuple[str, ...] = (),
        *,
        server: bool = False,
        client: bool = True,
        dns: tuple[str, ...] = (),
        ips: tuple[str, ...] = (),
    ) -> CertPair:
        """Write `<name>.crt`/`<name>.key` signed by the CA and return their paths."""
        key = _key()
        usages = ([ExtendedKeyUsageOID.SERVER_AUTH] if server else []) + (
            [ExtendedKeyUsageOID.CLIENT_AUTH] if client else []
        )
        b = (
            x509.CertificateBuilder()
            .subject_name(_name(cn, orgs))
            .issuer_name(self._ca_cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(self._not_before)
            .not_valid_after(self._not_before + VALIDITY)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    key_cert_sign=False,
                    crl_sign=False,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
            .add_extension(
                x509.AuthorityKeyIdentifier.from_issuer_public_key(self._ca_key.public_key()), False
            )
        )
        if dns or ips:
            sans = [x509.DNSName(d) for d in dns] + [x509.IPAddress(ipaddress.ip_address(i)) for i in ips]
            b = b.add_extension(x509.SubjectAlternativeName(sans), critical=False)
        cert = b.sign(self._ca_key, hashes.SHA256())
        return CertPair(
            cert=_write(self.dir / f"{name}.crt", cert.public_bytes(serialization.Encoding.PEM)),
            key=_write(self.dir / f"{name}.key", _key_pem(key), private=True),
        )
