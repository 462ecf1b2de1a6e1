"""A local development CA and a localhost server certificate.

``ensure_dev_certificate(state_dir)`` creates, on first use, a small CA and a
leaf certificate signed by it (EC P-256; SANs ``localhost``, ``127.0.0.1``,
``::1``) under ``state_dir/tls/``, and reuses them afterwards. Clients trust
``ca_cert`` (``curl --cacert``, aioquic ``cafile``,
``ssl.create_default_context(cafile=...)``), never the leaf.

A leaf close to expiry is reissued by the same CA, so clients that already
trust the CA keep working. Private keys are written with mode 0600, and every
file is written to a temporary name and renamed into place, so a reader never
sees half a file; a lock file makes concurrent first runs agree on one CA.
"""

from __future__ import annotations

import datetime
import fcntl
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from hedgerow.trust.pem import write_cert as _write_public
from hedgerow.trust.pem import write_key as _write_key

CA_LIFETIME = datetime.timedelta(days=3650)
LEAF_LIFETIME = datetime.timedelta(days=365)
# Reissue the leaf when less than this is left, rather than let it lapse mid-run.
LEAF_RENEW_BEFORE = datetime.timedelta(days=30)
BACKDATE = datetime.timedelta(hours=1)  # tolerate small clock skew between hosts
LEAF_DNS_NAMES = ("localhost",)
LEAF_IP_ADDRESSES = ("127.0.0.1", "::1")


@dataclass(frozen=True)
class DevCertificate:
    ca_cert: Path
    cert: Path
    key: Path


@dataclass(frozen=True)
class _Issuer:
    cert: x509.Certificate
    key: ec.EllipticCurvePrivateKey


def ensure_dev_certificate(
    state_dir: Path, *, now: datetime.datetime | None = None
) -> DevCertificate:
    now = now or datetime.datetime.now(datetime.UTC)
    tls_dir = state_dir / "tls"
    tls_dir.mkdir(parents=True, exist_ok=True)
    # Processes of one stack may start together; the first makes, the rest reuse.
    with open(tls_dir / ".lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return _ensure_in(tls_dir, now)


def _ensure_in(tls_dir: Path, now: datetime.datetime) -> DevCertificate:
    paths = DevCertificate(
        ca_cert=tls_dir / "ca.pem", cert=tls_dir / "cert.pem", key=tls_dir / "key.pem"
    )
    ca_key_path = tls_dir / "ca-key.pem"
    issuer = _load_issuer(paths.ca_cert, ca_key_path, now)
    if issuer is None:
        issuer = _create_issuer(now)
        _write_key(ca_key_path, issuer.key)
        _write_public(paths.ca_cert, issuer.cert)
    elif _leaf_is_current(paths, issuer, now):
        return paths
    leaf_key = ec.generate_private_key(ec.SECP256R1())
    _write_key(paths.key, leaf_key)
    _write_public(paths.cert, _issue_leaf(issuer, leaf_key, now))
    return paths


def _load_issuer(cert_path: Path, key_path: Path, now: datetime.datetime) -> _Issuer | None:
    if not (cert_path.is_file() and key_path.is_file()):
        return None
    try:
        cert = x509.load_pem_x509_certificate(cert_path.read_bytes())
        key = serialization.load_pem_private_key(key_path.read_bytes(), password=None)
    except ValueError:
        return None  # unreadable: start a new CA rather than fail to start
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        return None
    if now + LEAF_LIFETIME > cert.not_valid_after_utc:
        return None  # the CA could not back a fresh leaf for its whole life
    return _Issuer(cert=cert, key=key)


def _leaf_is_current(paths: DevCertificate, issuer: _Issuer, now: datetime.datetime) -> bool:
    if not (paths.cert.is_file() and paths.key.is_file()):
        return False
    try:
        leaf = x509.load_pem_x509_certificate(paths.cert.read_bytes())
        key = serialization.load_pem_private_key(paths.key.read_bytes(), password=None)
    except ValueError:
        return False  # unreadable: reissue
    return (
        leaf.issuer == issuer.cert.subject
        and leaf.public_key() == key.public_key()
        and leaf.not_valid_before_utc <= now
        and now + LEAF_RENEW_BEFORE < leaf.not_valid_after_utc
    )


def _create_issuer(now: datetime.datetime) -> _Issuer:
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, "Hedgerow development"),
            x509.NameAttribute(NameOID.COMMON_NAME, "Hedgerow development CA"),
        ]
    )
    public = key.public_key()
    cert = (
        _builder(name, name, public, now, CA_LIFETIME)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(_key_usage(digital_signature=False, cert_sign=True), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(public), critical=False)
        .sign(key, hashes.SHA256())
    )
    return _Issuer(cert=cert, key=key)


def _issue_leaf(
    issuer: _Issuer, key: ec.EllipticCurvePrivateKey, now: datetime.datetime
) -> x509.Certificate:
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    san = x509.SubjectAlternativeName(
        [x509.DNSName(name) for name in LEAF_DNS_NAMES]
        + [x509.IPAddress(ipaddress.ip_address(ip)) for ip in LEAF_IP_ADDRESSES]
    )
    return (
        _builder(issuer.cert.subject, subject, key.public_key(), now, LEAF_LIFETIME)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(_key_usage(digital_signature=True, cert_sign=False), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(san, critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(issuer.key.public_key()),
            critical=False,
        )
        .add_extension(
            x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False
        )
        .sign(issuer.key, hashes.SHA256())
    )


def _builder(
    issuer: x509.Name,
    subject: x509.Name,
    public: ec.EllipticCurvePublicKey,
    now: datetime.datetime,
    lifetime: datetime.timedelta,
) -> x509.CertificateBuilder:
    return (
        x509.CertificateBuilder()
        .issuer_name(issuer)
        .subject_name(subject)
        .public_key(public)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - BACKDATE)
        .not_valid_after(now + lifetime)
    )


def _key_usage(*, digital_signature: bool, cert_sign: bool) -> x509.KeyUsage:
    return x509.KeyUsage(
        digital_signature=digital_signature,
        content_commitment=False,
        key_encipherment=False,
        data_encipherment=False,
        key_agreement=False,
        key_cert_sign=cert_sign,
        crl_sign=cert_sign,
        encipher_only=False,
        decipher_only=False,
    )
