"""Where a worker or an external upstream is: a base URL, checked and rebuilt.

A worker tells the control plane its URL, and every gateway then sends
requests there. So the URL is untrusted input twice over: a registration may
not carry anything that makes a gateway call another host or another path
than ``<origin><the route's own path>`` — no userinfo (``http://a@b``), no
query or fragment (``http://h:1/?x=`` or ``http://h:1#`` would swallow the
path appended to it), no path of its own, no whitespace or control bytes (a
request line or header of their choosing), and a bounded length.

``parse_endpoint`` is the one parser; ``Endpoint.url_for`` rebuilds a request
URL from the parsed parts, never by gluing strings onto what was registered.
Workers registering themselves are held to the strict form (``strict=True``:
an explicit port, no path). External upstreams, which only an operator
declares (policy or admin API), may omit the port and carry a path prefix
(``https://api.example.com/openai``).
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass
from urllib.parse import urlsplit

MAX_URL_CHARS = 256
# A DNS name or a dotted IPv4 address: labels of letters, digits and inner hyphens.
_HOSTNAME = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
                       r"(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*\.?")
# RFC 3986 path characters (pchar and "/"), percent escapes included.
_PATH = re.compile(r"(?:/(?:[A-Za-z0-9._~!$&'()*+,;=:@-]|%[0-9A-Fa-f]{2})*)*")


class BadEndpoint(ValueError):
    """The URL is not an acceptable worker or upstream base URL (the message says why)."""


@dataclass(frozen=True)
class Endpoint:
    scheme: str  # http | https
    host: str  # as written in a URL: an IPv6 literal keeps its brackets
    port: int
    prefix: str = ""  # "" or a path prefix without a trailing "/" (upstreams only)

    @property
    def origin(self) -> str:
        return f"{self.scheme}://{self.host}:{self.port}"

    def url_for(self, path: str) -> str:
        """The URL of ``path`` (absolute, chosen by Hedgerow) at this endpoint."""
        if not path.startswith("/") or not _PATH.fullmatch(path):
            raise BadEndpoint(f"not a plain absolute path: {path!r}")
        return self.origin + self.prefix + path


def parse_endpoint(url: str, *, strict: bool) -> Endpoint:
    """The endpoint ``url`` names; BadEndpoint when it is not acceptable.

    ``strict``: what a worker may register (explicit port, no path beyond "/").
    """
    if len(url) > MAX_URL_CHARS:
        raise BadEndpoint(f"must be at most {MAX_URL_CHARS} characters")
    if not url.isascii() or any(c <= " " or c == "\x7f" for c in url):
        raise BadEndpoint("must be ASCII without spaces or control characters")
    if "?" in url or "#" in url:
        raise BadEndpoint("must not have a query or a fragment")
    try:
        parts = urlsplit(url)
    except ValueError as error:  # e.g. an IPv4 address in brackets
        raise BadEndpoint(f"is not a URL: {error}") from None
    if parts.scheme not in ("http", "https"):
        raise BadEndpoint("must be an http:// or https:// URL")
    if "@" in parts.netloc:
        raise BadEndpoint("must not carry a user or password")
    host = _host(parts.netloc)
    port = _port(parts.netloc, parts.scheme, strict=strict)
    prefix = parts.path.rstrip("/")
    if prefix and strict:
        raise BadEndpoint("must not have a path (the gateway appends /v1/...)")
    if prefix and (not _PATH.fullmatch(prefix) or any(s in (".", "..")
                                                     for s in prefix.split("/"))):
        raise BadEndpoint("has a path with characters or segments a URL path may not have")
    return Endpoint(parts.scheme, host, port, prefix)


def normalized(url: str) -> str:
    """A worker's URL checked strictly and written canonically (``scheme://host:port``)."""
    return parse_endpoint(url, strict=True).origin


def _host(netloc: str) -> str:
    if netloc.startswith("["):
        literal, bracket, _ = netloc[1:].partition("]")
        try:
            if not bracket or ipaddress.ip_address(literal).version != 6:
                raise ValueError(literal)
        except ValueError:
            raise BadEndpoint("has a malformed IPv6 address") from None
        return f"[{literal}]"
    host = netloc.rpartition(":")[0] if ":" in netloc else netloc
    if not host:
        raise BadEndpoint("must name a host")
    if not _HOSTNAME.fullmatch(host):
        raise BadEndpoint("has a host that is not a DNS name or an IP address")
    return host


def _port(netloc: str, scheme: str, *, strict: bool) -> int:
    after_host = netloc.rpartition("]")[2] if netloc.startswith("[") else netloc
    _, colon, digits = after_host.rpartition(":")
    if not colon:
        if strict:
            raise BadEndpoint("must give an explicit port (http://HOST:PORT)")
        return 443 if scheme == "https" else 80
    if not digits.isdigit() or not 1 <= int(digits) <= 65535 or len(digits) > 5:
        raise BadEndpoint("has a port that is not a number from 1 to 65535")
    return int(digits)
