"""Join tokens, who joined with which, and revocations: the control plane's
trust book. Sans-IO: every method takes ``now`` (seconds since the epoch);
``TrustBook.to_json`` / ``from_json`` are what the control plane persists.

A join token is ``hjt.<id>.<secret>``. Only a SHA-256 of the secret is kept,
and it is compared in constant time. A token buys certificates for one role
(``worker`` or ``gateway``) until it expires or is revoked; one token may
serve a fleet, as kubeadm's do, but each name is held by one joiner at a time.

Revocation works on identities: revoking ``worker/cpu-1`` makes every
certificate issued to it until now worthless at once, on every call, and its
renewals fail. It may join again only with a token created after the
revocation, so a leaked token cannot undo it. Revoking a token revokes it and
every identity that joined with it.
"""

from __future__ import annotations

import hashlib
import hmac
import math
import re
import secrets
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import orjson

from hedgerow.trust.identity import Identity, IdentityError, Role

TOKEN_PREFIX = "hjt"
JOINABLE_ROLES: tuple[Role, ...] = ("worker", "gateway")
MAX_LIVE_TOKENS = 1000
MAX_TTL_S = 90 * 24 * 3600.0
DEFAULT_TTL_S = 24 * 3600.0
FORGET_AFTER_S = 7 * 24 * 3600.0  # expired/revoked tokens are listed this long, then dropped
_TOKEN = re.compile(r"^hjt\.([a-z0-9]{12})\.([A-Za-z0-9_-]{43})$")


class JoinRefused(Exception):
    """A join or renewal the book refuses; ``status`` is the HTTP status to answer."""

    def __init__(self, message: str, status: int = 401) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class JoinToken:
    token_id: str
    secret_sha256: str
    role: Role
    created_at: float
    expires_at: float
    name: str | None = None  # the only name this token may join as; None: any
    description: str = ""
    revoked_at: float | None = None

    def public(self) -> dict[str, Any]:
        """What listing shows: everything but the secret's hash."""
        row = asdict(self)
        del row["secret_sha256"]
        return row


@dataclass(frozen=True)
class Holder:
    """Who holds an identity: the token it joined with, and until when its newest
    certificate is valid (after that the name is free for another joiner)."""

    token_id: str
    joined_at: float
    cert_expires_at: float


@dataclass
class TrustBook:
    tokens: dict[str, JoinToken] = field(default_factory=dict)
    holders: dict[str, Holder] = field(default_factory=dict)  # str(identity) → holder
    revoked: dict[str, float] = field(default_factory=dict)  # str(identity) → when

    def create_token(self, role: str, now: float, *, ttl_s: float = DEFAULT_TTL_S,
                     name: str | None = None, description: str = "") -> tuple[str, JoinToken]:
        """A new token: its text (shown once) and its record. ``role`` is as an
        operator typed it; anything but a joinable role is a ValueError."""
        joining = _joinable(role)
        if not 0 < ttl_s <= MAX_TTL_S:
            raise ValueError(f"ttl must be between 1 s and {MAX_TTL_S / 86400:.0f} days")
        if name is not None:
            Identity(joining, name)  # validates the name
        self.forget_old(now)
        if sum(1 for t in self.tokens.values() if _live(t, now)) >= MAX_LIVE_TOKENS:
            raise ValueError(f"{MAX_LIVE_TOKENS} live tokens already: revoke some first")
        token_id = "".join(secrets.choice("abcdefghijklmnopqrstuvwxyz0123456789")
                           for _ in range(12))
        secret = secrets.token_urlsafe(32)
        record = JoinToken(token_id=token_id, secret_sha256=_digest(secret), role=joining,
                           created_at=now, expires_at=now + ttl_s, name=name,
                           description=description[:200])
        self.tokens[token_id] = record
        return f"{TOKEN_PREFIX}.{token_id}.{secret}", record

    def redeem(self, token_text: str, name: str, now: float, *,
               cert_expires_at: float) -> Identity:
        """The identity a valid token buys under ``name``; records the holder.
        Raises ``JoinRefused`` (401 for any token problem, never saying which)."""
        token = self._check(token_text, now)
        if token.name is not None and token.name != name:
            raise JoinRefused(f"this token joins only as {token.role}/{token.name}", 403)
        try:
            identity = Identity(token.role, name)
        except IdentityError as error:
            raise JoinRefused(str(error), 400) from None
        key = str(identity)
        revoked_at = self.revoked.get(key)
        if revoked_at is not None and token.created_at <= revoked_at:
            raise JoinRefused(f"{identity} was revoked: join it again with a token created "
                              "after the revocation", 403)
        holder = self.holders.get(key)
        holder_revoked = (self._token_revoked(holder.token_id) if holder else False) or (
            holder is not None and revoked_at is not None and revoked_at >= holder.joined_at)
        # Whatever the token (the same fleet token, or a name-bound one redeemed
        # again): a live holder keeps its name, so a leaked token cannot take it.
        if holder is not None and holder.cert_expires_at > now and not holder_revoked:
            raise JoinRefused(f"{identity} is held by a joiner until its certificate "
                              "expires; pick another name or revoke it first", 409)
        self.holders[key] = Holder(token.token_id, now, cert_expires_at)
        return identity

    def renewed(self, identity: Identity, joined_at: float, now: float, *,
                cert_expires_at: float) -> None:
        """Record a renewal by a caller whose certificate descends from a join at
        ``joined_at``. Raises ``JoinRefused`` if that lineage is revoked."""
        if self.is_revoked(identity, joined_at):
            raise JoinRefused(f"{identity} is revoked", 403)
        key = str(identity)
        holder = self.holders.get(key)
        if holder is not None:
            self.holders[key] = replace(holder, cert_expires_at=cert_expires_at)

    def is_revoked(self, identity: Identity, joined_at: float) -> bool:
        """Whether a certificate of ``identity`` whose lineage began with a join at
        ``joined_at`` is revoked. Renewals carry the join time forward (a URI in
        the certificate), so a revoked identity cannot outrun its revocation by
        renewing, through this replica or another."""
        key = str(identity)
        revoked_at = self.revoked.get(key)
        if revoked_at is not None and joined_at <= revoked_at:
            return True
        holder = self.holders.get(key)
        return holder is not None and joined_at <= self._token_revoked_at(holder.token_id)

    def revoke_identity(self, identity: Identity, now: float) -> None:
        self.revoked[str(identity)] = now

    def revoke_token(self, token_id: str, now: float) -> list[Identity]:
        """Revoke a token and every identity that joined with it; those identities."""
        token = self.tokens.get(token_id)
        if token is None:
            raise KeyError(token_id)
        if token.revoked_at is None:
            self.tokens[token_id] = replace(token, revoked_at=now)
        joined = [Identity.parse(key) for key, h in self.holders.items() if h.token_id == token_id]
        for identity in joined:
            self.revoke_identity(identity, now)
        return joined

    def merge(self, other: TrustBook) -> None:
        """Take in another replica's view: unknown tokens and holders are added, a
        revocation anywhere wins, the newer of two holders stays, and revocation
        times only ever move later (a revocation is never undone by a merge)."""
        for token_id, theirs in other.tokens.items():
            ours = self.tokens.get(token_id)
            if ours is None:
                self.tokens[token_id] = theirs
            elif ours.revoked_at is None and theirs.revoked_at is not None:
                self.tokens[token_id] = replace(ours, revoked_at=theirs.revoked_at)
        for key, theirs_holder in other.holders.items():
            mine = self.holders.get(key)
            if mine is None or (theirs_holder.joined_at, theirs_holder.cert_expires_at) > (
                    mine.joined_at, mine.cert_expires_at):
                self.holders[key] = theirs_holder
        for key, when in other.revoked.items():
            if math.isfinite(when):  # a NaN would make max() forget a revocation
                self.revoked[key] = max(when, self.revoked.get(key, when))

    def forget_old(self, now: float) -> None:
        for token_id, token in list(self.tokens.items()):
            ended = token.revoked_at if token.revoked_at is not None else token.expires_at
            if ended + FORGET_AFTER_S < now and not any(
                    h.token_id == token_id for h in self.holders.values()):
                del self.tokens[token_id]

    def digest(self) -> str:
        """A short fingerprint of the whole book (to notice a change)."""
        return hashlib.sha256(orjson.dumps(self.to_json(), option=orjson.OPT_SORT_KEYS)).hexdigest()

    def to_json(self) -> dict[str, Any]:
        return {"tokens": [asdict(t) for t in self.tokens.values()],
                "holders": {k: asdict(h) for k, h in self.holders.items()},
                "revoked": dict(self.revoked)}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> TrustBook:
        tokens = {t["token_id"]: JoinToken(**t) for t in data.get("tokens", [])}
        holders = {k: Holder(**h) for k, h in data.get("holders", {}).items()}
        revoked = {k: float(v) for k, v in data.get("revoked", {}).items()}
        return cls(tokens, holders, revoked)

    def _check(self, token_text: str, now: float) -> JoinToken:
        refused = JoinRefused("invalid, expired or revoked join token")
        match = _TOKEN.match(token_text.strip())
        if match is None:
            raise refused
        token = self.tokens.get(match.group(1))
        # Hash and compare even for an unknown id: the answer takes as long either way.
        expected = token.secret_sha256 if token is not None else _digest("")
        valid = hmac.compare_digest(_digest(match.group(2)), expected)
        if token is None or not valid or not _live(token, now):
            raise refused
        return token

    def _token_revoked(self, token_id: str) -> bool:
        token = self.tokens.get(token_id)
        return token is not None and token.revoked_at is not None

    def _token_revoked_at(self, token_id: str) -> float:
        token = self.tokens.get(token_id)
        if token is None or token.revoked_at is None:
            return float("-inf")
        return token.revoked_at


def _joinable(role: str) -> Role:
    for joinable in JOINABLE_ROLES:
        if role == joinable:
            return joinable
    raise ValueError(f"join tokens are for {' or '.join(JOINABLE_ROLES)}, not {role!r}")


def _live(token: JoinToken, now: float) -> bool:
    return token.revoked_at is None and now < token.expires_at


def _digest(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()
