"""The control plane's side of internal trust: its CA, its trust book (join
tokens, holders, revocations, persisted in its state directory), the
certificates it issues, and the check every internal route makes of its caller.

State directory (``--state-dir``, default ``.hedgerow/control-plane``)::

    ca/ca.pem, ca/ca-key.pem   the cluster CA (unless --ca-cert/--ca-key give one)
    identity/                  the control plane's own serving certificate
    admin/                     an admin credential for the CLI on this host
    trust.json                 join tokens (hashes only), holders, revocations
"""

from __future__ import annotations

import datetime
import logging
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import anyio
import orjson
from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from redis.exceptions import RedisError

from control_plane.shared_trust import (HOLDERS, REVOKED, SYNC_S, TOKENS, SharedTrust,
                                        mac_key_for)
from hedgerow.errors import AuthenticationFailed, PermissionDenied
from hedgerow.trust.ca import CaError, ClusterCA, csr_public_key
from hedgerow.trust.credentials import Credentials
from hedgerow.trust.identity import Identity, Role
from hedgerow.trust.peer import PEER, Peer
from hedgerow.trust.pem import KEY_MODE, cert_pem, check_private_directory, write_atomically
from hedgerow.trust.tokens import TrustBook

log = logging.getLogger("hedgerow.control_plane.trust")

DEFAULT_CERT_TTL_S = 3600.0
ADMIN_CERT_TTL = datetime.timedelta(days=30)
SERVING_CERT_TTL = datetime.timedelta(days=30)
SERVING_RENEW_BEFORE = datetime.timedelta(days=10)
MAX_REVOKED_SENT = 1000
ANY_ROLE: tuple[Role, ...] = ("control-plane", "gateway", "worker", "admin")


@dataclass(frozen=True)
class Issued:
    identity: Identity
    certificate: x509.Certificate
    ca: x509.Certificate

    def json(self) -> dict[str, object]:
        return {"identity": str(self.identity), "uri": self.identity.uri,
                "certificate": cert_pem(self.certificate).decode(),
                "ca": cert_pem(self.ca).decode(),
                "not_after": self.certificate.not_valid_after_utc.timestamp()}


class TrustService:
    def __init__(self, state_dir: Path, ca: ClusterCA, *,
                 cert_ttl_s: float = DEFAULT_CERT_TTL_S,
                 clock: Callable[[], float] = time.time) -> None:
        self.state_dir = state_dir
        self.ca = ca
        self.cert_lifetime = datetime.timedelta(seconds=cert_ttl_s)
        self.clock = clock
        self._book_path = state_dir / "trust.json"
        self.book = self._load_book()
        self.revocations = 0  # bumped on every revocation; watch streams poll it
        # With --redis: the book shared with the other replicas (control_plane.shared_trust).
        self.shared: SharedTrust | None = None
        self._changed: list[tuple[str, str]] = []
        self._saved_digest = self.book.digest()

    @classmethod
    def open(cls, state_dir: Path, *, ca_cert: Path | None = None, ca_key: Path | None = None,
             cert_ttl_s: float = DEFAULT_CERT_TTL_S) -> TrustService:
        state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        try:
            check_private_directory(state_dir)  # before any key in it is believed
        except ValueError as error:
            raise CaError(str(error)) from None
        now = datetime.datetime.now(datetime.UTC)
        if ca_cert is not None and ca_key is not None:
            ca = ClusterCA.load(ca_cert, ca_key)
        else:
            ca = ClusterCA.load_or_create(state_dir / "ca", now)
        return cls(state_dir, ca, cert_ttl_s=cert_ttl_s)

    def _now(self) -> datetime.datetime:
        return datetime.datetime.fromtimestamp(self.clock(), datetime.UTC)

    # --- certificates -------------------------------------------------------

    def join(self, token: str, name: str, csr_pem: bytes) -> Issued:
        """Redeem a join token for a certificate. Raises ``JoinRefused`` or ``CaError``."""
        now = self._now()
        public_key = csr_public_key(csr_pem)  # a bad request costs no token state
        not_after = (now + self.cert_lifetime).timestamp()
        identity = self.book.redeem(token, name, now.timestamp(), cert_expires_at=not_after)
        cert = self.ca.issue(public_key, identity, lifetime=self.cert_lifetime, now=now)
        self._changed.append((HOLDERS, str(identity)))
        self._save_book()
        log.info("issued %s a certificate (join, serial %x)", identity, cert.serial_number)
        return Issued(identity, cert, self.ca.cert)

    def renew(self, peer: Peer, csr_pem: bytes) -> Issued:
        now = self._now()
        public_key = csr_public_key(csr_pem)
        lifetime = self.cert_lifetime if peer.identity.role != "admin" else ADMIN_CERT_TTL
        self.book.renewed(peer.identity, peer.joined_at.timestamp(), now.timestamp(),
                          cert_expires_at=(now + lifetime).timestamp())
        # The renewal keeps its lineage's join time: a revocation keeps covering it.
        cert = self.ca.issue(public_key, peer.identity, lifetime=lifetime, now=now,
                             joined_at=peer.joined_at)
        self._changed.append((HOLDERS, str(peer.identity)))
        self._save_book()
        log.info("renewed %s's certificate (serial %x)", peer.identity, cert.serial_number)
        return Issued(peer.identity, cert, self.ca.cert)

    def ensure_credentials(self, directory: Path, identity: Identity, *,
                           lifetime: datetime.timedelta, renew_before: datetime.timedelta,
                           dns_names: tuple[str, ...] = (),
                           ip_addresses: tuple[str, ...] = ()) -> Credentials:
        """Credentials issued straight from the CA (the control plane's own serving
        certificate, the local admin credential): reused while current."""
        creds = Credentials(directory)
        now = self._now()
        if creds.exists():
            try:
                cert = creds.certificate()
                if (_issued_by(cert, self.ca.cert) and creds.identity() == identity
                        and now + renew_before < cert.not_valid_after_utc
                        and _names(cert) >= set(dns_names) | set(ip_addresses)):
                    return creds
            except ValueError:
                pass  # unreadable: issue again
        key = ec.generate_private_key(ec.SECP256R1())
        cert = self.ca.issue(key.public_key(), identity, lifetime=lifetime, now=now,
                             dns_names=dns_names, ip_addresses=ip_addresses)
        creds.write_issued(key, cert, self.ca.cert)
        return creds

    # --- who may call -------------------------------------------------------

    def caller(self, roles: tuple[Role, ...]) -> Identity:
        """The verified identity of the current connection's peer, if it holds one
        of ``roles`` and is not revoked; else AuthenticationFailed / PermissionDenied."""
        peer = PEER.get()
        if peer is None:
            raise AuthenticationFailed(
                "an internal listener: present a client certificate from the cluster CA",
                code="client_certificate_required")
        if self.book.is_revoked(peer.identity, peer.joined_at.timestamp()):
            raise AuthenticationFailed(f"{peer.identity} is revoked", code="identity_revoked")
        if peer.identity.role not in roles:
            raise PermissionDenied(f"{peer.identity} may not call this "
                                   f"(only {', '.join(roles)})")
        return peer.identity

    def revoked_callers(self) -> dict[str, float]:
        """Revoked gateway and admin identities (newest first, bounded): what workers
        must refuse though the certificates still verify."""
        rows = [(k, v) for k, v in self.book.revoked.items()
                if k.startswith(("gateway/", "admin/"))]
        rows.sort(key=lambda row: row[1], reverse=True)
        return dict(rows[:MAX_REVOKED_SENT])

    def revoked(self, peer: Peer | None) -> bool:
        return peer is not None and self.book.is_revoked(peer.identity,
                                                          peer.joined_at.timestamp())

    # --- operators ----------------------------------------------------------

    def create_token(self, role: str, *, ttl_s: float, name: str | None,
                     description: str) -> tuple[str, dict[str, object]]:
        text, record = self.book.create_token(role, self.clock(), ttl_s=ttl_s, name=name,
                                              description=description)
        self._changed.append((TOKENS, record.token_id))
        self._save_book()
        log.info("join token %s created for role %s", record.token_id, role)
        return text, record.public()

    def revoke_token(self, token_id: str) -> list[Identity]:
        identities = self.book.revoke_token(token_id, self.clock())
        self._changed += [(TOKENS, token_id), *((REVOKED, str(i)) for i in identities)]
        self._revoked()
        log.warning("join token %s revoked, with %s", token_id,
                    ", ".join(map(str, identities)) or "no identity")
        return identities

    def revoke_identity(self, identity: Identity) -> None:
        self.book.revoke_identity(identity, self.clock())
        self._changed.append((REVOKED, str(identity)))
        self._revoked()
        log.warning("identity %s revoked", identity)

    def book_mac_key(self) -> bytes:
        """The shared book's HMAC key, derived from the CA's private key."""
        der = self.ca.key.private_bytes(serialization.Encoding.DER,
                                        serialization.PrivateFormat.PKCS8,
                                        serialization.NoEncryption())
        return mac_key_for(der)

    async def refresh(self) -> None:
        """Take in the other replicas' tokens and revocations now (before a join)."""
        if self.shared is not None:
            await self.shared.sync_once(self.book)
            self.save_if_changed()

    def save_if_changed(self) -> None:
        """Keep what merges brought in (others' revocations) in trust.json too, so a
        restart with Redis emptied does not forget them."""
        seen = self.book.digest()
        if seen != self._saved_digest:
            self._save_book()

    async def follow_shared(self) -> None:
        """Every SYNC_S: the other replicas' changes, merged and kept."""
        while True:
            await self.refresh()
            await anyio.sleep(SYNC_S)

    async def flush(self) -> None:
        """Write this replica's changes to the shared book (no-op without Redis)."""
        changed, self._changed = self._changed, []
        if self.shared is None or not changed:
            return
        try:
            await self.shared.write(self.book, changed)
        except (RedisError, OSError) as error:
            log.error("could not share %d trust change(s) with the other replicas: %s "
                      "(kept here; revocations made here are enforced here)", len(changed), error)

    def _revoked(self) -> None:
        self.revocations += 1
        self._save_book()

    def _load_book(self) -> TrustBook:
        try:
            return TrustBook.from_json(orjson.loads(self._book_path.read_bytes()))
        except FileNotFoundError:
            return TrustBook()

    def _save_book(self) -> None:
        write_atomically(self._book_path, orjson.dumps(self.book.to_json()), mode=KEY_MODE)
        self._saved_digest = self.book.digest()


def serving_names(hosts: tuple[str, ...]) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """DNS and IP names for the control plane's serving certificate: the hosts it
    binds and is reached by, plus loopback and this machine's name."""
    import ipaddress

    dns: list[str] = ["localhost", socket.gethostname()]
    ips: list[str] = ["127.0.0.1", "::1"]
    for host in hosts:
        try:
            address = ipaddress.ip_address(host)
        except ValueError:
            dns.append(host)
            continue
        if not address.is_unspecified:
            ips.append(str(address))
    return tuple(dict.fromkeys(dns)), tuple(dict.fromkeys(ips))


def _issued_by(cert: x509.Certificate, ca: x509.Certificate) -> bool:
    """Signed by this CA's key (two CAs may share a name: a made one and a BYO one)."""
    try:
        cert.verify_directly_issued_by(ca)
    except (ValueError, TypeError, InvalidSignature):
        return False
    return True


def _names(cert: x509.Certificate) -> set[str]:
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return set()
    return {*san.get_values_for_type(x509.DNSName),
            *(str(ip) for ip in san.get_values_for_type(x509.IPAddress))}
