"""Virtual API keys: making them, recognising them, and where they live in the text (sans-IO).

A virtual key is ``sk-hr-`` and 43 URL-safe characters (256 random bits). The
policy never holds it: only ``hmac_sha256``, the HMAC-SHA256 of the whole key
under the cluster's key secret, which the control plane derives from the
cluster CA's private key and hands only to gateways over mutual TLS. A leaked
policy text (or ``hedgerow policy show``) therefore gives nobody a way to test
guesses offline, which a bare sha256 does for a low-entropy key.

The keys are part of the policy document, so every key change is a policy
version: history, ACKs and propagation to every gateway work as for any edit.
They sit in one block at the end of the text, after ``KEYS_MARKER``, one JSON
flow mapping a line (valid YAML), rewritten whole on every key change so the
operator's part above it, comments included, is never touched.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
from collections.abc import Sequence
from dataclasses import dataclass

import orjson

from hedgerow.errors import AuthenticationFailed, PermissionDenied
from policies.schema import Policy, VirtualKey

KEY_PREFIX = "sk-hr-"
KEYS_MARKER = "# --- hedgerow:keys"
_MARKER_LINE = (f"{KEYS_MARKER} --- managed by `hedgerow key`; a policy applied without "
                "a keys section keeps these keys\n")
_TOP_LEVEL_KEYS = re.compile(r"^keys\s*:", re.MULTILINE)
SECRET_INFO = b"hedgerow virtual api keys v1"


def new_key() -> str:
    """A fresh key: 256 bits from the OS's CSPRNG."""
    return KEY_PREFIX + secrets.token_urlsafe(32)


def new_key_id() -> str:
    return "key_" + secrets.token_hex(8)


def key_digest(secret: bytes, key: str) -> str:
    return hmac.new(secret, key.encode(), hashlib.sha256).hexdigest()


def derive_key_secret(root: bytes) -> bytes:
    """The key secret from a root secret the control plane already keeps (its CA
    key), so replicas sharing the CA agree on it without storing another secret."""
    return hmac.new(root, SECRET_INFO, hashlib.sha256).digest()


@dataclass(frozen=True)
class Keyring:
    """The virtual keys of one policy, by digest under one secret."""

    secret: bytes
    by_digest: dict[str, VirtualKey]

    @classmethod
    def of(cls, policy: Policy, secret: bytes) -> Keyring:
        return cls(secret, {key.hmac_sha256: key for key in policy.keys})

    def find(self, token: str) -> VirtualKey | None:
        # A dict lookup on an HMAC: the digest is unpredictable without the
        # secret, so the lookup's timing tells an attacker nothing useful.
        return self.by_digest.get(key_digest(self.secret, token))


def check_not_expired(key: VirtualKey, now: float) -> None:
    """``now``: seconds since the epoch."""
    if key.expires_at is not None and now >= key.expires_at:
        raise AuthenticationFailed("this API key has expired", code="expired_api_key")


def check_model_allowed(key: VirtualKey | None, model: str) -> None:
    """403 ``model_not_allowed`` for a model outside the key's allowlist.

    OpenAI answers a project key's missing model with a 404 that hides it;
    here the operator listed the models, the client holds a valid key and a
    404 would send its developer looking for a typo, so the refusal says why."""
    if key is None or not key.models or model in key.models:
        return
    raise PermissionDenied(f"this API key may not use model {model!r} (allowed: "
                           f"{', '.join(key.models)})", code="model_not_allowed", param="model")


# -- the managed block ---------------------------------------------------


def split_keys_block(text: str) -> tuple[str, str]:
    """(the operator's part, the keys block or "")."""
    at = text.find("\n" + KEYS_MARKER)
    if text.startswith(KEYS_MARKER):
        at = -1
    elif at < 0:
        return text, ""
    return text[:at + 1], text[at + 1:]


def has_keys_section(text: str) -> bool:
    """Whether a document says which keys it wants (the block, or a ``keys:`` of its own)."""
    return KEYS_MARKER in text or _TOP_LEVEL_KEYS.search(text) is not None


def render_keys_block(keys: Sequence[VirtualKey]) -> str:
    if not keys:
        return _MARKER_LINE + "keys: []\n"
    lines = [_MARKER_LINE, "keys:\n"]
    for key in keys:
        fields = key.model_dump(mode="json", exclude_defaults=True)
        lines.append(f"  - {orjson.dumps(fields).decode()}\n")
    return "".join(lines)


def with_keys(text: str, keys: Sequence[VirtualKey]) -> str:
    """``text`` with its keys block replaced by one listing ``keys``."""
    operator, _ = split_keys_block(text)
    if operator and not operator.endswith("\n"):
        operator += "\n"
    return operator + render_keys_block(keys)


def carry_keys(text: str, current: str) -> str:
    """A document applied without a keys section keeps the keys of ``current``:
    an operator re-applying their own YAML must not revoke every key."""
    if has_keys_section(text):
        return text
    _, block = split_keys_block(current)
    if not block:
        return text
    return (text if text.endswith("\n") or not text else text + "\n") + block
