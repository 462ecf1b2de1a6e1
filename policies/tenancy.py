"""Mapping an Authorization header to a tenant and its class (sans-IO).

Keys are compared as sha256 digests with ``hmac.compare_digest``. A request
that presents a key which matches no tenant is refused; it is never served
as the anonymous tenant.
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass

from hedgerow.errors import AuthenticationFailed
from policies.schema import Policy, hash_api_key


@dataclass(frozen=True)
class Identity:
    tenant: str
    priority_class: str


def identify(policy: Policy, authorization: str | None) -> Identity:
    if authorization is None or not authorization.strip():
        return _anonymous(policy)
    scheme, _, token = authorization.strip().partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise AuthenticationFailed("Authorization must be 'Bearer <api key>'")
    digest = hash_api_key(token.strip())
    for tenant in policy.tenants:
        if any(hmac.compare_digest(digest, known) for known in tenant.api_key_sha256):
            return Identity(tenant.name, tenant.class_)
    raise AuthenticationFailed("invalid API key")


def _anonymous(policy: Policy) -> Identity:
    if policy.anonymous_tenant is None:
        raise AuthenticationFailed("an API key is required (Authorization: Bearer <key>)")
    tenant = next(t for t in policy.tenants if t.name == policy.anonymous_tenant)
    return Identity(tenant.name, tenant.class_)
