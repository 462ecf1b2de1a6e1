"""Mapping an Authorization header to a tenant and its class (sans-IO).

Two kinds of key: a tenant's ``api_key_sha256`` entries (typed into the
policy; compared as sha256 digests with ``hmac.compare_digest``) and virtual
keys (``hedgerow key create``: ``policies.keys``, an HMAC under the cluster's
key secret, with an expiry, a model allowlist, limits and budgets). A request
that presents a key which matches neither is refused; it is never served as
the anonymous tenant.
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass

from hedgerow.errors import AuthenticationFailed, PolicyUnavailable
from policies.keys import KEY_PREFIX, Keyring, check_not_expired
from policies.schema import Policy, VirtualKey, hash_api_key

# A gateway that has not yet fetched the key secret asks the client to retry.
KEY_SECRET_RETRY_S = 2.0


@dataclass(frozen=True)
class Identity:
    tenant: str
    priority_class: str
    key: VirtualKey | None = None  # the virtual key it presented, if any


def identify(policy: Policy, authorization: str | None, keyring: Keyring | None = None,
             now: float = 0.0) -> Identity:
    """``keyring``: the policy's virtual keys under the key secret (None: not known
    yet); ``now``: seconds since the epoch, for expiry."""
    if authorization is None or not authorization.strip():
        return _anonymous(policy)
    scheme, _, token = authorization.strip().partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token:
        raise AuthenticationFailed("Authorization must be 'Bearer <api key>'")
    digest = hash_api_key(token)
    for tenant in policy.tenants:
        if any(hmac.compare_digest(digest, known) for known in tenant.api_key_sha256):
            return Identity(tenant.name, tenant.class_)
    if token.startswith(KEY_PREFIX) and policy.keys:
        if keyring is None:
            raise PolicyUnavailable("this gateway cannot check virtual keys yet; retry shortly",
                                    retry_after=KEY_SECRET_RETRY_S)
        key = keyring.find(token)
        if key is not None:
            check_not_expired(key, now)
            return Identity(key.tenant, policy.tenant(key.tenant).class_, key)
    raise AuthenticationFailed("invalid API key")


def _anonymous(policy: Policy) -> Identity:
    if policy.anonymous_tenant is None:
        raise AuthenticationFailed("an API key is required (Authorization: Bearer <key>)")
    tenant = next(t for t in policy.tenants if t.name == policy.anonymous_tenant)
    return Identity(tenant.name, tenant.class_)
