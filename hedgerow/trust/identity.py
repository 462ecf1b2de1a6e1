"""Who a certificate speaks for: a role and a name, as a SPIFFE-style URI SAN.

``spiffe://hedgerow/worker/cpu-1`` is the worker ``cpu-1``. The control plane
puts exactly one such URI in every certificate it issues and decides from it,
on every call, what the caller may do (a worker registers only itself). A peer
is identified by this URI alone, never by a DNS name: certificates bought with
a join token carry no DNS or IP names, so a worker's certificate can never pass
for the control plane's.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal, get_args

from cryptography import x509

Role = Literal["control-plane", "gateway", "worker", "admin"]
ROLES: tuple[Role, ...] = get_args(Role)
TRUST_DOMAIN = "hedgerow"
_PREFIX = f"spiffe://{TRUST_DOMAIN}/"
NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


class IdentityError(ValueError):
    """Not a Hedgerow identity (bad role, name or URI)."""


@dataclass(frozen=True, order=True)
class Identity:
    role: Role
    name: str

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise IdentityError(f"unknown role {self.role!r}: one of {', '.join(ROLES)}")
        if not isinstance(self.name, str) or not NAME_PATTERN.fullmatch(self.name):
            raise IdentityError(
                f"invalid name {self.name!r}: 1-128 characters of letters, digits, '.', '_' "
                "and '-', starting with a letter or digit")

    @property
    def uri(self) -> str:
        return f"{_PREFIX}{self.role}/{self.name}"

    def __str__(self) -> str:
        return f"{self.role}/{self.name}"

    @classmethod
    def parse(cls, text: str) -> Identity:
        """``worker/cpu-1`` or ``spiffe://hedgerow/worker/cpu-1``."""
        body = text[len(_PREFIX):] if text.startswith(_PREFIX) else text
        role, sep, name = body.partition("/")
        if not sep:
            raise IdentityError(f"not an identity: {text!r} (expected ROLE/NAME)")
        if role not in ROLES:
            raise IdentityError(f"unknown role {role!r}: one of {', '.join(ROLES)}")
        return cls(role, name)


def identity_of(cert: x509.Certificate) -> Identity | None:
    """The one Hedgerow identity in ``cert``'s URI SANs; None if it has none
    or more than one (an ambiguous certificate speaks for nobody)."""
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return None
    uris = [u for u in san.get_values_for_type(x509.UniformResourceIdentifier)
            if u.startswith(_PREFIX)]
    if len(uris) != 1:
        return None
    try:
        return Identity.parse(uris[0])
    except IdentityError:
        return None


def identity_of_der(der: bytes | None) -> Identity | None:
    if not der:
        return None
    try:
        return identity_of(x509.load_der_x509_certificate(der))
    except ValueError:
        return None
