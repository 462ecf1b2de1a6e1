"""One process's internal TLS (``InternalTls``): what a worker or gateway talks to
the control plane and to its peers with.

``contexts`` None is ``--insecure-internal``: plain HTTP, nothing verified.
The flags that build it are ``hedgerow.cli_flags``' (the command line stays
out of the runtime).
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass

from hedgerow.trust.credentials import TlsContexts
from hedgerow.trust.identity import Identity
from hedgerow.trust.join import CertificateRenewer


@dataclass(frozen=True)
class InternalTls:
    """``contexts`` None: --insecure-internal."""

    contexts: TlsContexts | None
    control_plane: str

    @property
    def enabled(self) -> bool:
        return self.contexts is not None

    @property
    def scheme(self) -> str:
        return "https" if self.contexts is not None else "http"

    def server(self) -> ssl.SSLContext | None:
        return self.contexts.server() if self.contexts is not None else None

    def client(self, *, check_hostname: bool = True) -> ssl.SSLContext | bool:
        """For httpx's ``verify`` (True: plain HTTP needs nothing)."""
        if self.contexts is None:
            return True
        return self.contexts.client(check_hostname=check_hostname)

    def renewer(self) -> CertificateRenewer | None:
        if self.contexts is None:
            return None
        return CertificateRenewer(self.contexts, self.control_plane)

    @property
    def identity(self) -> Identity | None:
        return self.contexts.credentials.identity() if self.contexts is not None else None
