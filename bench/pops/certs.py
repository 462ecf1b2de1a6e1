"""A throwaway CA and one server certificate for every PoP's client-facing address.

The gateways' development certificate names only loopback; clients in the
simulation dial ``10.78.k.1``, so the harness issues its own leaf for those
addresses and the clients trust its CA.
"""

from __future__ import annotations

import datetime
import ipaddress
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

LIFETIME = datetime.timedelta(days=2)


@dataclass(frozen=True)
class Certificates:
    ca: Path
    cert: Path
    key: Path


def issue(directory: Path, addresses: Sequence[str]) -> Certificates:
    directory.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "hedgerow pops bench CA")])
    ca = (_builder(ca_name, ca_name, ca_key.public_key(), now)
          .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
          .sign(ca_key, hashes.SHA256()))
    key = ec.generate_private_key(ec.SECP256R1())
    san = x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address(a)) for a in addresses])
    leaf = (_builder(ca_name, x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "gateway")]),
                     key.public_key(), now)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(san, critical=False)
            .sign(ca_key, hashes.SHA256()))
    out = Certificates(directory / "ca.pem", directory / "cert.pem", directory / "key.pem")
    out.ca.write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    out.cert.write_bytes(leaf.public_bytes(serialization.Encoding.PEM))
    out.key.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                          serialization.PrivateFormat.PKCS8,
                                          serialization.NoEncryption()))
    out.key.chmod(0o600)
    return out


def _builder(issuer: x509.Name, subject: x509.Name, public: ec.EllipticCurvePublicKey,
             now: datetime.datetime) -> x509.CertificateBuilder:
    return (x509.CertificateBuilder().issuer_name(issuer).subject_name(subject)
            .public_key(public).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(hours=1))
            .not_valid_after(now + LIFETIME))
