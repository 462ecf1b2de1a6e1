"""The cluster CA: the one root every internal certificate chains to.

The control plane holds it (created on first start in its state directory, or
given by the operator with ``--ca-cert``/``--ca-key``) and issues short-lived
certificates: to itself for its listeners, to an admin credential, and to each
worker and gateway that proves a join token (``issue_for_csr``). Every issued
certificate carries exactly one identity URI; only the control plane's own
carries DNS/IP names, so only it can pass a client's hostname check.
"""

from __future__ import annotations

import datetime
import fcntl
import hashlib
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.hazmat.primitives.asymmetric.types import (CertificateIssuerPrivateKeyTypes,
                                                           CertificatePublicKeyTypes)
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from hedgerow.trust.identity import Identity
from hedgerow.trust.pem import cert_pem, check_private_directory, write_cert, write_key

CA_LIFETIME = datetime.timedelta(days=3650)
# Tolerates this much clock skew between hosts; issuance time is not_before + SKEW.
SKEW = datetime.timedelta(minutes=1)
JOINED_PREFIX = "urn:hedgerow:joined:"
CA_FILE = "ca.pem"
CA_KEY_FILE = "ca-key.pem"


class CaError(ValueError):
    """A CA or certificate request that cannot be used."""


@dataclass(frozen=True)
class ClusterCA:
    cert: x509.Certificate
    key: CertificateIssuerPrivateKeyTypes

    @property
    def pem(self) -> bytes:
        return cert_pem(self.cert)

    @property
    def fingerprint(self) -> str:
        return fingerprint(self.cert)

    @classmethod
    def load(cls, cert_path: Path, key_path: Path) -> ClusterCA:
        """An operator's CA (bring your own PKI). Raises ``CaError`` if unusable."""
        try:
            cert = x509.load_pem_x509_certificate(cert_path.read_bytes())
            key = serialization.load_pem_private_key(key_path.read_bytes(), password=None)
        except (OSError, ValueError, TypeError) as error:
            raise CaError(f"cannot load the CA from {cert_path} and {key_path}: {error}") from None
        if not isinstance(key, (ec.EllipticCurvePrivateKey, rsa.RSAPrivateKey)):
            raise CaError(f"{key_path}: the CA key must be EC or RSA")
        if cert.public_key() != key.public_key():
            raise CaError(f"{key_path} is not the key of {cert_path}")
        try:
            basic = cert.extensions.get_extension_for_class(x509.BasicConstraints).value
        except x509.ExtensionNotFound:
            basic = None
        if basic is None or not basic.ca:
            raise CaError(f"{cert_path} is not a CA certificate (basicConstraints CA:TRUE)")
        return cls(cert, key)

    @classmethod
    def load_or_create(cls, directory: Path, now: datetime.datetime) -> ClusterCA:
        """The CA kept in ``directory``, made on first use (EC P-256, ten years)."""
        directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        try:
            check_private_directory(directory)
        except ValueError as error:
            raise CaError(str(error)) from None
        with open(directory / ".lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # replicas starting together agree on one CA
            cert_path, key_path = directory / CA_FILE, directory / CA_KEY_FILE
            if cert_path.is_file() and key_path.is_file():
                return cls.load(cert_path, key_path)
            ca = _create(now)
            assert isinstance(ca.key, ec.EllipticCurvePrivateKey)
            write_key(key_path, ca.key)
            write_cert(cert_path, ca.cert)
            return ca

    def issue(
        self,
        public_key: CertificatePublicKeyTypes,
        identity: Identity,
        *,
        lifetime: datetime.timedelta,
        now: datetime.datetime,
        dns_names: tuple[str, ...] = (),
        ip_addresses: tuple[str, ...] = (),
        joined_at: datetime.datetime | None = None,
    ) -> x509.Certificate:
        """``joined_at``: when this identity's lineage joined (a renewal carries its
        predecessor's): what revocation compares, so renewing cannot outrun it."""
        names: list[x509.GeneralName] = [x509.UniformResourceIdentifier(identity.uri)]
        names.append(x509.UniformResourceIdentifier(
            f"{JOINED_PREFIX}{(joined_at or now).timestamp():.3f}"))
        names += [x509.DNSName(n) for n in dns_names]
        names += [x509.IPAddress(ipaddress.ip_address(ip)) for ip in ip_addresses]
        not_after = min(now + lifetime, self.cert.not_valid_after_utc)
        subject = x509.Name([
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, "Hedgerow"),
            x509.NameAttribute(NameOID.ORGANIZATIONAL_UNIT_NAME, identity.role),
            x509.NameAttribute(NameOID.COMMON_NAME, identity.name[:64]),
        ])
        builder = (
            x509.CertificateBuilder()
            .issuer_name(self.cert.subject)
            .subject_name(subject)
            .public_key(public_key)
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - SKEW)
            .not_valid_after(not_after)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(_key_usage(leaf=True), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                                  ExtendedKeyUsageOID.CLIENT_AUTH]),
                           critical=False)
            .add_extension(x509.SubjectAlternativeName(names), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(
                self.key.public_key()), critical=False)
        )
        return builder.sign(self.key, hashes.SHA256())

    def issue_for_csr(self, csr_pem: bytes, identity: Identity, *,
                      lifetime: datetime.timedelta, now: datetime.datetime,
                      joined_at: datetime.datetime | None = None) -> x509.Certificate:
        """A certificate for the key in ``csr_pem``; the identity is ours to decide,
        whatever the request asks for. Raises ``CaError`` for a bad request."""
        public_key = csr_public_key(csr_pem)
        return self.issue(public_key, identity, lifetime=lifetime, now=now, joined_at=joined_at)


def csr_public_key(csr_pem: bytes) -> ec.EllipticCurvePublicKey:
    try:
        csr = x509.load_pem_x509_csr(csr_pem)
    except ValueError as error:
        raise CaError(f"not a PEM certificate request: {error}") from None
    if not csr.is_signature_valid:
        raise CaError("the certificate request's signature does not verify")
    key = csr.public_key()
    if not isinstance(key, ec.EllipticCurvePublicKey) or key.curve.name not in (
            "secp256r1", "secp384r1"):
        raise CaError("the certificate request must hold an EC P-256 or P-384 key")
    return key


def make_csr(key: ec.EllipticCurvePrivateKey, identity: Identity) -> bytes:
    csr = (x509.CertificateSigningRequestBuilder()
           .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, identity.name[:64])]))
           .sign(key, hashes.SHA256()))
    return csr.public_bytes(serialization.Encoding.PEM)


def issued_at(cert: x509.Certificate) -> datetime.datetime:
    return cert.not_valid_before_utc + SKEW


def joined_at(cert: x509.Certificate) -> datetime.datetime:
    """When the certificate's lineage joined (its ``urn:hedgerow:joined:`` URI);
    a certificate without one (an operator's own) counts from its issue."""
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return issued_at(cert)
    for uri in san.get_values_for_type(x509.UniformResourceIdentifier):
        if uri.startswith(JOINED_PREFIX):
            try:
                value = float(uri[len(JOINED_PREFIX):])
            except ValueError:
                break
            if value == value and abs(value) < 1e11:  # finite and sane
                return datetime.datetime.fromtimestamp(value, datetime.UTC)
            break
    return issued_at(cert)


def fingerprint(cert: x509.Certificate) -> str:
    """``sha256:<hex>`` of the DER certificate: what ``--ca-pin`` compares."""
    der = cert.public_bytes(serialization.Encoding.DER)
    return "sha256:" + hashlib.sha256(der).hexdigest()


def _create(now: datetime.datetime) -> ClusterCA:
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "Hedgerow"),
                      x509.NameAttribute(NameOID.COMMON_NAME, "Hedgerow cluster CA")])
    public = key.public_key()
    cert = (
        x509.CertificateBuilder().issuer_name(name).subject_name(name).public_key(public)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - SKEW).not_valid_after(now + CA_LIFETIME)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(_key_usage(leaf=False), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(public), critical=False)
        .sign(key, hashes.SHA256())
    )
    return ClusterCA(cert, key)


def _key_usage(*, leaf: bool) -> x509.KeyUsage:
    return x509.KeyUsage(
        digital_signature=leaf, content_commitment=False, key_encipherment=False,
        data_encipherment=False, key_agreement=False, key_cert_sign=not leaf,
        crl_sign=not leaf, encipher_only=False, decipher_only=False)
