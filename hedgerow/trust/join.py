"""A worker's or gateway's side of internal trust: join once, renew for ever.

``ensure_identity`` runs at start: credentials already in ``identity_dir``
and still current are used as they are; otherwise the join token buys them
from the control plane's join listener (``POST /v1/join``), which the process
trusts through ``--ca-file`` or, like kubeadm's discovery hash, ``--ca-pin``
(the CA is fetched and must match the pin before anything secret is sent).
The private key never leaves the process: only a CSR does.

``CertificateRenewer`` then renews over mutual TLS at two thirds of each
certificate's life and loads the new files into every live TLS context in
place, so open connections and their streams carry on. Operators' own
certificates (``--tls-cert``/``--tls-key``) are reloaded when their files change.
"""

from __future__ import annotations

import datetime
import fcntl
import logging
import ssl
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import anyio
import httpx
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec

from hedgerow.trust.ca import fingerprint, issued_at, make_csr
from hedgerow.trust.credentials import Credentials, CredentialsError, TlsContexts
from hedgerow.trust.identity import Identity
from hedgerow.trust.pem import cert_pem

log = logging.getLogger("hedgerow.trust")

DEFAULT_JOIN_PORT = 8501
RENEW_AT_FRACTION = 2 / 3
RETRY_MIN_S = 1.0
RETRY_MAX_S = 60.0
FILE_CHECK_S = 30.0
# Processes sharing one identity (gateway --processes N) renew one at a time.
RENEW_LOCK_POLL_S = 0.05
JOIN_TIMEOUT_S = 10.0
MAX_CA_BYTES = 64 * 1024


class JoinError(RuntimeError):
    """This process cannot obtain an identity: the message says what to do."""


@dataclass(frozen=True)
class JoinOptions:
    identity: Identity  # who this process wants to be
    identity_dir: Path
    control_plane: str  # https://HOST:8500
    join_url: str | None = None  # default: the control plane's host, port 8501
    token: str | None = None
    ca_file: Path | None = None
    ca_pin: str | None = None  # sha256:HEX of the CA certificate
    tls_cert: Path | None = None  # the operator's own PKI: used as given, never renewed
    tls_key: Path | None = None

    def join_endpoint(self) -> str:
        if self.join_url:
            return self.join_url.rstrip("/")
        parts = urlsplit(self.control_plane)
        return urlunsplit(("https", f"{_bracket(parts.hostname or '127.0.0.1')}:"
                           f"{DEFAULT_JOIN_PORT}", "", "", ""))


def renew_at(cert: x509.Certificate) -> datetime.datetime:
    """When to renew: two thirds into the certificate's life (sans-IO).

    The life counts from issuance, not from ``not_valid_before``, which the CA
    backdates by its clock-skew allowance: counted from there, a certificate
    shorter than about twice that allowance was due before it was issued and
    renewed in a loop."""
    end = cert.not_valid_after_utc
    start = min(issued_at(cert), end)
    return start + (end - start) * RENEW_AT_FRACTION


def ensure_identity(options: JoinOptions, now: datetime.datetime) -> Credentials:
    """Credentials for this process, joining if it has none that are current."""
    if options.tls_cert is not None or options.tls_key is not None:
        if not (options.tls_cert and options.tls_key and options.ca_file):
            raise JoinError("bring-your-own certificates need --tls-cert, --tls-key and "
                            "--ca-file together")
        given = Credentials.given(options.tls_cert, options.tls_key, options.ca_file)
        _check_identity(given, options.identity)
        return given
    creds = Credentials(options.identity_dir)
    if creds.exists():
        try:
            cert = creds.certificate()
            if creds.identity() == options.identity and now < cert.not_valid_after_utc:
                return creds
            log.warning("credentials in %s are for %s or expired; joining again",
                        options.identity_dir, creds.identity())
        except CredentialsError as error:
            log.warning("credentials in %s unusable (%s); joining again",
                        options.identity_dir, error)
    return join(options)


def join(options: JoinOptions) -> Credentials:
    if not options.token:
        raise JoinError(
            f"no credentials in {options.identity_dir} and no join token: an operator creates "
            f"one with `hedgerow token create --role {options.identity.role}`; pass it with "
            "--join-token-file FILE or $HEDGEROW_JOIN_TOKEN")
    endpoint = options.join_endpoint()
    ca_pem = _trusted_ca(options, endpoint)
    context = ssl.create_default_context(cadata=ca_pem.decode())
    key = ec.generate_private_key(ec.SECP256R1())
    body = {"token": options.token, "name": options.identity.name,
            "csr": make_csr(key, options.identity).decode()}
    try:
        reply = httpx.post(endpoint + "/v1/join", json=body, verify=context,
                           timeout=JOIN_TIMEOUT_S)
    except httpx.HTTPError as error:
        raise JoinError(f"cannot reach the control plane's join API at {endpoint}: "
                        f"{error}") from None
    if reply.status_code != 201:
        raise JoinError(f"the control plane refused to join {options.identity} "
                        f"({reply.status_code}): {_message(reply)}")
    issued = reply.json()
    creds = Credentials(options.identity_dir)
    creds.write(key, issued["certificate"].encode(), issued["ca"].encode())
    log.info("joined as %s (certificate valid until %s)", issued["identity"],
             creds.valid_until().isoformat(timespec="seconds"))
    return creds


def _trusted_ca(options: JoinOptions, endpoint: str) -> bytes:
    if options.ca_file is not None:
        try:
            return options.ca_file.read_bytes()
        except OSError as error:
            raise JoinError(f"cannot read --ca-file {options.ca_file}: {error}") from None
    if not options.ca_pin:
        raise JoinError("to join, trust the cluster CA: --ca-file FILE, or --ca-pin sha256:HEX "
                        "(printed by `hedgerow token create`)")
    # Fetched without verification, then believed only if it matches the pin:
    # nothing secret is sent before that.
    unverified = ssl.create_default_context()
    unverified.check_hostname = False
    unverified.verify_mode = ssl.CERT_NONE
    try:
        # Unverified, so bounded: a CA certificate is a few KiB, not what a server says.
        with httpx.stream("GET", endpoint + "/v1/ca", verify=unverified,
                          timeout=JOIN_TIMEOUT_S) as reply:
            pem = b""
            for piece in reply.iter_bytes():
                pem += piece
                if len(pem) > MAX_CA_BYTES:
                    raise ValueError(f"the CA served is over {MAX_CA_BYTES} bytes")
        ca = x509.load_pem_x509_certificate(pem)
    except (httpx.HTTPError, ValueError) as error:
        raise JoinError(f"cannot fetch the cluster CA from {endpoint}: {error}") from None
    if fingerprint(ca) != options.ca_pin.strip().lower():
        raise JoinError(f"the CA served by {endpoint} ({fingerprint(ca)}) does not match "
                        f"--ca-pin {options.ca_pin}: refusing to join")
    return cert_pem(ca)


def _check_identity(creds: Credentials, wanted: Identity) -> None:
    try:
        held = creds.identity()
    except CredentialsError as error:
        raise JoinError(str(error)) from None
    if held != wanted:
        raise JoinError(f"the certificate {creds.cert_path} is for {held}, not {wanted}")


class CertificateRenewer:
    """Keeps ``contexts``' certificate current (a long-lived task of its process)."""

    def __init__(self, contexts: TlsContexts, control_plane: str) -> None:
        self.contexts = contexts
        self.url = control_plane.rstrip("/") + "/v1/certificates/renew"
        self.renewals = 0

    async def run(self) -> None:
        if not self.contexts.credentials.managed:
            await self._follow_files()
            return
        delay = RETRY_MIN_S
        while True:
            current = self.contexts.credentials.certificate()
            due = renew_at(current)
            wait = (due - datetime.datetime.now(datetime.UTC)).total_seconds()
            if wait > 0:
                await anyio.sleep(wait)
            try:
                await self.renew_once(current.serial_number)
                delay = RETRY_MIN_S
            except (httpx.HTTPError, JoinError, CredentialsError) as error:
                log.error("certificate renewal failed (%s); retrying in %.0f s", error, delay)
                await anyio.sleep(delay)
                delay = min(delay * 2, RETRY_MAX_S)

    async def renew_once(self, replacing: int | None = None) -> None:
        """Renew the certificate (serial ``replacing``), unless another process
        sharing these files (``hedgerow gateway --processes N``) already
        replaced it: then load what it wrote. The file lock keeps two renewals
        from interleaving their key and certificate writes."""
        creds = self.contexts.credentials
        async with _renewal_lock(creds.directory):
            if replacing is not None and creds.certificate().serial_number != replacing:
                self.contexts.reload()
                log.info("loaded %s's certificate renewed by another process (valid until %s)",
                         creds.identity(), creds.valid_until().isoformat(timespec="seconds"))
                return
            await self._renew(creds)

    async def _renew(self, creds: Credentials) -> None:
        identity = creds.identity()
        key = ec.generate_private_key(ec.SECP256R1())
        async with httpx.AsyncClient(verify=self.contexts.client(),
                                     timeout=JOIN_TIMEOUT_S) as client:
            reply = await client.post(self.url, json={"csr": make_csr(key, identity).decode()})
        if reply.status_code != 201:
            raise JoinError(f"the control plane refused to renew {identity} "
                            f"({reply.status_code}): {_message(reply)}")
        issued = reply.json()
        creds.write(key, issued["certificate"].encode(), issued["ca"].encode())
        self.contexts.reload()
        self.renewals += 1
        log.info("renewed %s's certificate (valid until %s)", identity,
                 creds.valid_until().isoformat(timespec="seconds"))

    async def _follow_files(self) -> None:
        """An operator's PKI rotates the files; load them when they change."""
        path = self.contexts.credentials.cert_path
        seen = path.stat().st_mtime_ns
        while True:
            await anyio.sleep(FILE_CHECK_S)
            try:
                mtime = path.stat().st_mtime_ns
                if mtime != seen:
                    self.contexts.reload()
                    seen = mtime
                    log.info("reloaded the certificate in %s", path)
            except (OSError, CredentialsError) as error:
                log.error("cannot reload %s: %s", path, error)


@asynccontextmanager
async def _renewal_lock(directory: Path) -> AsyncIterator[None]:
    """An exclusive ``flock`` on ``directory``/.renew.lock, polled (cancellable)."""
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    with open(directory / ".renew.lock", "a") as lock:
        while True:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                await anyio.sleep(RENEW_LOCK_POLL_S)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _message(reply: httpx.Response) -> str:
    try:
        return str(reply.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return reply.text[:200]


def _bracket(host: str) -> str:
    return f"[{host}]" if ":" in host else host
