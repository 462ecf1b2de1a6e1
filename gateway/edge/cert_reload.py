"""The public certificate and key, reloaded when they change, without a restart.

A certificate from an ACME client is renewed every few weeks by replacing its
files; a gateway that read them only at start would serve the old one until
it expires. ``CertificateReloader`` watches ``--certfile``/``--keyfile``
(polling their inode, size and mtime every ``poll_s``, and at once on
SIGHUP) and loads a changed pair into the contexts already serving:

- TCP: ``SSLContext.load_cert_chain`` on hypercorn's one context, in place.
  OpenSSL copies a context's certificate into each connection when the
  connection is made, so connections already open (and their streams) keep
  the certificate they started with; every handshake after the reload gets
  the new one.
- QUIC: the certificate, chain and key of hypercorn's ``QuicConfiguration``
  (one per UDP listener) are replaced; aioquic reads them when a connection
  starts its handshake, so the same holds.

A pair is checked before anything serving is touched: both files are read
once, parsed into a scratch context (a key that does not match the
certificate fails there) and only then loaded, from those same bytes, into
the live ones. A pair caught half-replaced (new certificate, old key) is
refused, the old one keeps serving, and it is tried again when the files next
change (or on SIGHUP). Replace the files by rename to avoid the window.

How the contexts are found without forking hypercorn: ``serve`` puts the
reloader in ``ACTIVE_CERTIFICATES`` (a context variable, like the connection
cap); ``TlsConfig.create_ssl_context`` registers the TCP context it builds,
and ``install_quic_certificate_registry`` registers each ``QuicProtocol``'s
configuration (hypercorn 0.18.0 builds it in ``QuicProtocol.__init__``;
``hedgerow.http_stack.quic_certificates``).
"""

from __future__ import annotations

import logging
import os
import signal
import ssl
import tempfile
import weakref
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
from aioquic.quic.configuration import QuicConfiguration
from cryptography import x509
from cryptography.hazmat.primitives.serialization import load_pem_private_key

from hedgerow.http_stack import quic_certificates

log = logging.getLogger("hedgerow.gateway.certificates")

DEFAULT_POLL_S = 5.0

Stamp = tuple[int, int, int, int, int, int]  # (inode, size, mtime_ns) of the cert, then the key


def file_stamp(certfile: Path, keyfile: Path) -> Stamp | None:
    """What tells a changed pair from an unchanged one; None: a file is missing."""
    try:
        cert, key = certfile.stat(), keyfile.stat()
    except OSError:
        return None
    return (cert.st_ino, cert.st_size, cert.st_mtime_ns, key.st_ino, key.st_size, key.st_mtime_ns)


class ReloadDecision:
    """When to try a reload (sans-IO): the files' stamp differs from the one last
    tried, or an operator asked (SIGHUP). A pair that failed is not retried
    until it changes again: a broken pair is logged once, not every poll."""

    def __init__(self, loaded: Stamp | None) -> None:
        self._tried = loaded

    def due(self, stamp: Stamp | None, asked: bool) -> bool:
        if stamp is None:
            return False  # mid-replacement, or gone: keep serving what is loaded
        return asked or stamp != self._tried

    def tried(self, stamp: Stamp | None) -> None:
        self._tried = stamp


@dataclass(frozen=True)
class Pair:
    """A certificate chain and its key, read once and checked to match."""

    chain_pem: bytes
    key_pem: bytes
    not_after: float  # POSIX seconds


def read_pair(certfile: Path, keyfile: Path) -> Pair:
    """Read and check a pair; raises ``ValueError``/``OSError``/``ssl.SSLError`` if unusable."""
    chain_pem, key_pem = certfile.read_bytes(), keyfile.read_bytes()
    certificates = x509.load_pem_x509_certificates(chain_pem)
    with _pem_file(chain_pem, key_pem) as combined:
        # A scratch context: OpenSSL checks that the key matches the certificate.
        ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(combined)
    return Pair(chain_pem, key_pem, certificates[0].not_valid_after_utc.timestamp())


class _pem_file:
    """The pair as one PEM file in a private temporary directory, removed after use
    (``load_cert_chain`` takes only paths)."""

    def __init__(self, chain_pem: bytes, key_pem: bytes) -> None:
        self._data = chain_pem.rstrip(b"\n") + b"\n" + key_pem

    def __enter__(self) -> str:
        self._dir = tempfile.TemporaryDirectory(prefix="hedgerow-cert-")  # mode 0700
        path = os.path.join(self._dir.name, "pair.pem")
        with open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "wb") as out:
            out.write(self._data)
        return path

    def __exit__(self, *_: object) -> None:
        self._dir.cleanup()


class CertificateReloader:
    """Holds the serving contexts and reloads the pair into them when it changes."""

    def __init__(self, certfile: Path, keyfile: Path, *, poll_s: float = DEFAULT_POLL_S) -> None:
        self.certfile, self.keyfile, self.poll_s = certfile, keyfile, poll_s
        # Weak: the contexts belong to hypercorn and go when its listeners go.
        self._tls: weakref.WeakSet[ssl.SSLContext] = weakref.WeakSet()
        # A dataclass compares by value and is unhashable: held by weak reference.
        self._quic: list[weakref.ref[QuicConfiguration]] = []
        self._decision = ReloadDecision(file_stamp(certfile, keyfile))
        self.reloads = 0
        self.failures = 0
        self.not_after: float | None = None

    def register_tls(self, context: ssl.SSLContext) -> None:
        self._tls.add(context)

    def register_quic(self, configuration: QuicConfiguration) -> None:
        self._quic = [ref for ref in self._quic if ref() is not None]
        self._quic.append(weakref.ref(configuration))

    def check(self, *, asked: bool = False) -> bool | None:
        """Reload if due: True (loaded), False (refused, old pair kept), None (not due)."""
        stamp = file_stamp(self.certfile, self.keyfile)
        if not self._decision.due(stamp, asked):
            return None
        self._decision.tried(stamp)
        try:
            pair = read_pair(self.certfile, self.keyfile)
        except (OSError, ValueError, ssl.SSLError) as error:
            self.failures += 1
            log.error("certificate %s / key %s not reloaded (still serving the previous "
                      "one): %s", self.certfile, self.keyfile, error)
            return False
        self.apply(pair)
        return True

    def apply(self, pair: Pair) -> None:
        """Load a checked pair into every serving context (on the event loop's thread)."""
        with _pem_file(pair.chain_pem, pair.key_pem) as combined:
            for context in list(self._tls):
                context.load_cert_chain(combined)
        certificates = x509.load_pem_x509_certificates(pair.chain_pem)
        key = load_pem_private_key(pair.key_pem, password=None)
        quic = [c for c in (ref() for ref in self._quic) if c is not None]
        for configuration in quic:
            configuration.certificate = certificates[0]
            configuration.certificate_chain = certificates[1:]
            configuration.private_key = key
        self.reloads += 1
        self.not_after = pair.not_after
        log.info("certificate reloaded from %s (%d TCP and %d QUIC listener(s)); new "
                 "connections get it, open ones keep theirs", self.certfile,
                 len(self._tls), len(quic))

    def stats(self) -> dict[str, Any]:
        return {"reloads": self.reloads, "failures": self.failures, "not_after": self.not_after}

    async def run(self) -> None:
        """Poll every ``poll_s`` (0: never); on SIGHUP at once (where this thread
        may take signals: the main one)."""
        hangup = anyio.Event()

        async def on_sighup() -> None:
            try:
                with anyio.open_signal_receiver(signal.SIGHUP) as signals:
                    async for _ in signals:
                        log.info("SIGHUP: reloading the certificate")
                        hangup.set()
            except (ValueError, NotImplementedError, RuntimeError) as error:
                log.info("no SIGHUP reload here (%s)", error)

        async with anyio.create_task_group() as tg:
            tg.start_soon(on_sighup)
            while True:
                with anyio.move_on_after(self.poll_s if self.poll_s > 0 else float("inf")):
                    await hangup.wait()
                asked, hangup = hangup.is_set(), anyio.Event()
                self.check(asked=asked)


ACTIVE_CERTIFICATES: ContextVar[CertificateReloader | None] = ContextVar(
    "hedgerow_certificates", default=None)


def register_tls_context(context: ssl.SSLContext) -> None:
    reloader = ACTIVE_CERTIFICATES.get()
    if reloader is not None:
        reloader.register_tls(context)


def install_quic_certificate_registry() -> None:
    """Let the reloader in force find each ``QuicProtocol``'s configuration
    (``hedgerow.http_stack.quic_certificates``); idempotent."""
    quic_certificates.install(_register_quic)


def _register_quic(configuration: QuicConfiguration) -> None:
    reloader = ACTIVE_CERTIFICATES.get()
    if reloader is not None:
        reloader.register_quic(configuration)
