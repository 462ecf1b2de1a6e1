"""One process's credentials on disk, and the TLS contexts built from them.

``Credentials`` is a directory holding ``key.pem``, ``cert.pem`` and
``ca.pem`` (the cluster CA). ``TlsContexts`` builds every ``SSLContext`` the
process uses from those files — the server side of its internal listener and
the client side of its calls — and ``reload()`` loads renewed files into all
of them in place: new handshakes use the new certificate, connections already
open (and the streams on them) carry on untouched.

Server contexts require a client certificate that chains to the cluster CA
(a plaintext or certificate-less connection fails in the handshake, before any
application code runs). Client contexts verify the server against the CA;
``check_hostname`` stays on for the control plane (whose certificate alone
carries DNS/IP names) and is off where the peer is checked by identity
instead (gateway → worker: see ``gateway.upstream.worker_http``).
"""

from __future__ import annotations

import datetime
import ssl
import weakref
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec

from hedgerow.trust.ca import issued_at
from hedgerow.trust.identity import Identity, identity_of
from hedgerow.trust.pem import PUBLIC_MODE, cert_pem, write_atomically, write_key

KEY_FILE, CERT_FILE, CA_FILE = "key.pem", "cert.pem", "ca.pem"


class CredentialsError(ValueError):
    """Credentials missing, unreadable or not a Hedgerow identity."""


@dataclass(frozen=True)
class Credentials:
    """Three PEM files: in one directory (joined and renewed by Hedgerow), or
    wherever an operator's own PKI puts them (``Credentials.given``)."""

    directory: Path
    key_file: Path | None = None
    cert_file: Path | None = None
    ca_file: Path | None = None

    @classmethod
    def given(cls, cert: Path, key: Path, ca: Path) -> Credentials:
        return cls(cert.parent, key_file=key, cert_file=cert, ca_file=ca)

    @property
    def managed(self) -> bool:
        """Whether Hedgerow renews these (False: the operator's PKI does)."""
        return self.cert_file is None

    @property
    def key_path(self) -> Path:
        return self.key_file or self.directory / KEY_FILE

    @property
    def cert_path(self) -> Path:
        return self.cert_file or self.directory / CERT_FILE

    @property
    def ca_path(self) -> Path:
        return self.ca_file or self.directory / CA_FILE

    def exists(self) -> bool:
        return all(p.is_file() for p in (self.key_path, self.cert_path, self.ca_path))

    def certificate(self) -> x509.Certificate:
        try:
            return x509.load_pem_x509_certificate(self.cert_path.read_bytes())
        except (OSError, ValueError) as error:
            raise CredentialsError(f"cannot read {self.cert_path}: {error}") from None

    def identity(self) -> Identity:
        identity = identity_of(self.certificate())
        if identity is None:
            raise CredentialsError(f"{self.cert_path} carries no spiffe://hedgerow/ identity")
        return identity

    def valid_until(self) -> datetime.datetime:
        return self.certificate().not_valid_after_utc

    def issued(self) -> datetime.datetime:
        return issued_at(self.certificate())

    def write(self, key: ec.EllipticCurvePrivateKey, cert: bytes, ca: bytes) -> None:
        """Key, certificate and CA, each replaced whole. The certificate goes last:
        a reader that sees the new one also sees its key."""
        self.directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        write_atomically(self.ca_path, ca, mode=PUBLIC_MODE)
        write_key(self.key_path, key)
        write_atomically(self.cert_path, cert, mode=PUBLIC_MODE)

    def write_issued(self, key: ec.EllipticCurvePrivateKey, cert: x509.Certificate,
                     ca: x509.Certificate) -> None:
        self.write(key, cert_pem(cert), cert_pem(ca))


class TlsContexts:
    """Every SSLContext built from one ``Credentials``, reloadable in place."""

    def __init__(self, credentials: Credentials) -> None:
        if not credentials.exists():
            raise CredentialsError(f"no credentials in {credentials.directory} "
                                   f"({KEY_FILE}, {CERT_FILE}, {CA_FILE})")
        self.credentials = credentials
        self._contexts: weakref.WeakSet[ssl.SSLContext] = weakref.WeakSet()

    def server(self, *, require_client_cert: bool = True) -> ssl.SSLContext:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.minimum_version = ssl.TLSVersion.TLSv1_3
        context.verify_mode = ssl.CERT_REQUIRED if require_client_cert else ssl.CERT_NONE
        context.set_alpn_protocols(["http/1.1"])
        return self._loaded(context)

    def client(self, *, check_hostname: bool = True) -> ssl.SSLContext:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        context.minimum_version = ssl.TLSVersion.TLSv1_3
        context.check_hostname = check_hostname
        context.verify_mode = ssl.CERT_REQUIRED
        return self._loaded(context)

    def reload(self) -> None:
        """Load the files again into every context made so far."""
        for context in list(self._contexts):
            self._load(context)

    def _loaded(self, context: ssl.SSLContext) -> ssl.SSLContext:
        self._load(context)
        self._contexts.add(context)
        return context

    def _load(self, context: ssl.SSLContext) -> None:
        creds = self.credentials
        try:
            context.load_cert_chain(creds.cert_path, creds.key_path)
            context.load_verify_locations(cafile=creds.ca_path)
        except (OSError, ssl.SSLError) as error:
            raise CredentialsError(f"cannot load the credentials in {creds.directory}: "
                                   f"{error}") from None
