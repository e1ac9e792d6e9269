"""The picker port's TLS: a mounted certificate and key, or a self-signed certificate made at start, as
the reference endpoint picker serves (a gateway connects to its picker over TLS without verifying it).
Plaintext only when asked (``--epp-plaintext``)."""

from __future__ import annotations

import datetime as dt
import ipaddress
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

SELF_SIGNED_DAYS = 365


def self_signed(host: str) -> tuple[bytes, bytes]:
    """A fresh P-256 key and a certificate for it (PEM), naming ``host`` and localhost."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "routerfleet-endpoint-picker")])
    now = dt.datetime.now(dt.UTC)
    names: list[x509.GeneralName] = [x509.DNSName("localhost")]
    if host and host not in ("localhost", "0.0.0.0", "::"):
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=SELF_SIGNED_DAYS))
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .sign(key, hashes.SHA256())
    )
    key_pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    return key_pem, cert.public_bytes(serialization.Encoding.PEM)


def server_identity(host: str, cert_file: str | None, key_file: str | None) -> tuple[bytes, bytes]:
    """The (certificate, key) PEM pair: the mounted one when given (both, vetted by the config), else a
    self-signed one."""
    if cert_file and key_file:
        return Path(cert_file).read_bytes(), Path(key_file).read_bytes()
    key, cert = self_signed(host)
    return cert, key
