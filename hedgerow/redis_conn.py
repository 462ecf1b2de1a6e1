"""Opening Redis the way operators deploy it: TLS, an ACL user, a password kept out of logs.

Every Hedgerow process that uses Redis (the control plane's registry and
policy store, the gateway's shared limits and response cache) opens it here::

    rediss://USER:PASSWORD@HOST:PORT/DB   --redis-ca-file CA.pem
                                          [--redis-cert-file C.pem --redis-key-file C.key]

The server's certificate must chain to the CA file (or, without one, to the
system's trust store) and name HOST; a client certificate is presented when
given, for servers with ``tls-auth-clients yes``. A ``redis://`` URL is
plaintext: allowed (a Redis on loopback needs no TLS) but logged loudly when
the host is not a loopback address.

Faults are split in two. One that waiting cannot fix (a certificate the CA
does not vouch for, a refused client certificate, a wrong password, an ACL
that forbids what Hedgerow needs, a malformed URL or unreadable PEM file) is a
``RedisSetupError``: the process stops at start with a message that says
which flag to fix. Redis merely unreachable is an outage: each caller
already serves without it until it is back.

A password never reaches a log line or an error message: URLs are shown
through ``redact_url`` and error texts through ``scrub``.
"""

from __future__ import annotations

import inspect
import ipaddress
import logging
import os
import ssl
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, quote, unquote, urlencode, urlsplit, urlunsplit

import anyio
from redis.asyncio import Redis
from redis.asyncio.connection import AbstractConnection
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import (
    AuthenticationError,
    BusyLoadingError,
    NoPermissionError,
    RedisError,
    ResponseError,
)

from hedgerow.errors import HedgerowError

log = logging.getLogger("hedgerow.redis")

CA_FILE_ENV = "HEDGEROW_REDIS_CA_FILE"
CERT_FILE_ENV = "HEDGEROW_REDIS_CERT_FILE"
KEY_FILE_ENV = "HEDGEROW_REDIS_KEY_FILE"
SCHEMES = ("redis", "rediss", "unix")
CHECK_TIMEOUT_S = 5.0
HIDDEN = "***"

# What the ``hedgerow`` ACL user needs, and nothing more (docs/deployment.md
# shows it; tests/support/redis_tls.py runs Redis with exactly this). Every
# key Hedgerow writes is under ``hedgerow:`` (registry, policy versions, rate
# limit buckets, exact cache and its indexes, the semantic cache's stream);
# it uses no pub/sub. The commands are those the code and its Lua scripts
# call: scripts run through EVALSHA, loaded by SCRIPT LOAD after a NOSCRIPT
# (SCRIPT EXISTS for pipelines); SCAN only for a purge of the whole cache.
# Redis checks the keys of each call inside a script against ``~hedgerow:*``.
ACL_RULES = (
    "resetkeys ~hedgerow:* resetchannels -@all "
    "+ping +hello +auth +select +time "
    "+get +set +del +exists +expire +pexpire +pttl +incr +scan "
    "+hget +hset +hdel +hgetall +hkeys +hmget "
    "+sadd +srem +sinter +smembers +sismember +scard "
    "+xadd +xread +multi +exec +discard "
    "+evalsha +script|load +script|exists"
)

# A gateway needs only the response cache and the shared rate limits: give gateways a
# Redis user of their own with these rules, so a compromised gateway cannot write the
# registry, the policy or the trust book (which is sealed anyway: control_plane.shared_trust).
GATEWAY_ACL_RULES = ACL_RULES.replace(
    "resetkeys ~hedgerow:*", "resetkeys ~hedgerow:cache:* ~hedgerow:ratelimit:*")


class RedisSetupError(HedgerowError):
    """Redis is configured so that it can never work (TLS trust, credentials, ACL,
    URL, PEM files): the process stops at start instead of retrying forever."""

    default_code = "redis_setup"


@dataclass(frozen=True)
class RedisTls:
    """PEM files for a ``rediss://`` connection (None: not given)."""

    ca_file: Path | None = None
    cert_file: Path | None = None
    key_file: Path | None = None

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> RedisTls:
        def path(name: str) -> Path | None:
            value = environ.get(name)
            return Path(value) if value else None

        return cls(path(CA_FILE_ENV), path(CERT_FILE_ENV), path(KEY_FILE_ENV))

    @property
    def given(self) -> bool:
        return any(f is not None for f in (self.ca_file, self.cert_file, self.key_file))


def redact_url(url: str) -> str:
    """``url`` with its password (in the userinfo or a ``password=`` query) as ``***``."""
    try:
        parts = urlsplit(url)
        host = parts.hostname or ""
        port = parts.port
    except ValueError:
        return f"{url.split(':', 1)[0]}://(unparseable URL)"
    query = parts.query
    if query:
        pairs = parse_qsl(query, keep_blank_values=True)
        query = urlencode([(k, HIDDEN if k.lower() == "password" else v) for k, v in pairs],
                          safe="*")
    if "@" not in parts.netloc:
        return urlunsplit(parts._replace(query=query))
    user = parts.username or ""
    userinfo = user if parts.password is None else f"{user}:{HIDDEN}"
    host = f"[{host}]" if ":" in host else host
    netloc = f"{userinfo}@{host}" + (f":{port}" if port is not None else "")
    return urlunsplit(parts._replace(netloc=netloc, query=query))


def scrub(text: str, url: str) -> str:
    """``text`` with the URL's password (raw or URL-decoded) replaced by ``***``."""
    for secret in _secrets(url):
        text = text.replace(secret, HIDDEN)
    return text


def _secrets(url: str) -> list[str]:
    try:
        parts = urlsplit(url)
        found = [parts.password or ""]
        found += [v for k, v in parse_qsl(parts.query) if k.lower() == "password"]
    except ValueError:
        return []
    return sorted({s for f in found if f for s in (f, unquote(f), quote(f, safe=""))},
                  key=len, reverse=True)


def is_plaintext_remote(url: str) -> bool:
    """A ``redis://`` URL whose host is not loopback: credentials and data cross the wire in clear."""
    parts = urlsplit(url)
    if parts.scheme != "redis":
        return False
    host = parts.hostname or "localhost"  # redis-py's default host
    if host == "localhost":
        return False
    try:
        return not ipaddress.ip_address(host).is_loopback
    except ValueError:
        return True  # a name: it may resolve anywhere


def warn_if_plaintext(url: str, what: str = "Redis") -> bool:
    """Log loudly (and say True) when ``url`` sends its password and data in clear
    to another host."""
    if not is_plaintext_remote(url):
        return False
    log.warning("!!! %s: %s is PLAINTEXT to a non-loopback host: its password and every "
                "key cross the network unencrypted; use rediss:// (docs/deployment.md, "
                "\"Redis with ACL and TLS\") !!!", what, redact_url(url))
    return True


def connection_options(url: str, tls: RedisTls) -> dict[str, Any]:
    """The TLS keyword arguments for ``Redis.from_url``, after checking that ``url``
    and ``tls`` make sense together and that the PEM files load."""
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 (raises ValueError for a bad port)
    except ValueError as error:
        raise RedisSetupError(f"--redis: not a Redis URL: {redact_url(url)}") from error
    if parts.scheme not in SCHEMES:
        raise RedisSetupError(f"--redis: {redact_url(url)} is not a Redis URL "
                              "(rediss://USER:PASSWORD@HOST:PORT/DB)")
    if parts.scheme != "rediss":
        if tls.given:
            raise RedisSetupError(
                f"--redis-ca-file/--redis-cert-file/--redis-key-file are given but "
                f"{redact_url(url)} is not TLS: use rediss://")
        return {}
    if tls.key_file is not None and tls.cert_file is None:
        raise RedisSetupError("--redis-key-file needs --redis-cert-file")
    _load_pem(tls)
    options: dict[str, Any] = {"ssl_cert_reqs": "required", "ssl_check_hostname": True,
                               "ssl_min_version": ssl.TLSVersion.TLSv1_2}
    if tls.ca_file is not None:
        options["ssl_ca_certs"] = str(tls.ca_file)
    if tls.cert_file is not None:
        options["ssl_certfile"] = str(tls.cert_file)
        options["ssl_keyfile"] = str(tls.key_file) if tls.key_file is not None else None
    return options


def _load_pem(tls: RedisTls) -> None:
    """Load the files once now, so that a typo fails at start naming the flag, not
    at the first connection as a vague TLS error."""
    context = ssl.create_default_context()
    try:
        if tls.ca_file is not None:
            context.load_verify_locations(cafile=str(tls.ca_file))
    except (OSError, ssl.SSLError) as error:
        raise RedisSetupError(f"--redis-ca-file {tls.ca_file}: {error}") from error
    try:
        if tls.cert_file is not None:
            context.load_cert_chain(str(tls.cert_file),
                                    str(tls.key_file) if tls.key_file is not None else None)
    except (OSError, ssl.SSLError) as error:
        raise RedisSetupError(
            f"--redis-cert-file {tls.cert_file} / --redis-key-file {tls.key_file}: "
            f"{error}") from error


def fail_fast_retry() -> Retry:
    """One immediate retry, then the error.

    A client built from a URL retries nothing: after Redis restarts, the first
    command on each pooled connection fails (the connection died with the old
    server) although Redis is back, and shows up as an outage: a 503 to a
    worker's heartbeat, a "redis unreachable" line. One retry on a fresh
    connection tells the truth. No more and no backoff: every caller has its own
    cadence (a tick, the next request) and a fallback (the last known state,
    local limits), and a command held for seconds would be an outage of its own."""
    return Retry(NoBackoff(), 1)


def open_redis(url: str, tls: RedisTls = RedisTls(), *, socket_timeout: float,
               connect_timeout: float, **options: Any) -> Redis:
    """A pooled asyncio client (it connects lazily and reconnects by itself) with the
    caller's timeouts and ``fail_fast_retry`` unless ``retry`` is given. Raises
    ``RedisSetupError`` for a bad URL or PEM file."""
    tls_options = connection_options(url, tls)
    options.setdefault("retry", fail_fast_retry())
    return Redis.from_url(url, socket_timeout=socket_timeout,
                          socket_connect_timeout=connect_timeout, **tls_options,
                          **_without_client_setinfo(), **options)


def _without_client_setinfo() -> dict[str, Any]:
    """redis-py names itself with CLIENT SETINFO on every new connection. The ACL
    leaves it out (Redis 7.0 cannot even name it in a rule), so on Redis 7.2+
    each connection would add a denial to the ACL LOG, burying real ones.
    redis-py 7 spells "don't" ``driver_info=None``; older ones ``lib_name=None``."""
    accepted = inspect.signature(AbstractConnection.__init__).parameters
    if "driver_info" in accepted:
        return {"driver_info": None}
    return {"lib_name": None, "lib_version": None}


async def check_redis(redis: Redis, url: str, tls: RedisTls = RedisTls(), *,
                      what: str = "Redis", timeout_s: float = CHECK_TIMEOUT_S) -> bool:
    """At start: one PING. True: Redis answered. False: unreachable (logged; the
    caller serves as in any outage). ``RedisSetupError``: a fault no retry fixes."""
    shown = redact_url(url)
    warn_if_plaintext(url, what)
    try:
        with anyio.fail_after(timeout_s):
            await _ping_with_alert_retries(redis, url, tls)
    except (RedisError, OSError, TimeoutError) as error:
        problem = setup_problem(error, url, tls)
        if problem is not None:
            raise RedisSetupError(f"{what} at {shown}: {problem}") from None
        log.warning("%s at %s is unreachable at start (%s); serving without it until it is "
                    "back%s", what, shown, scrub(_describe(error), url), _plaintext_hint(url))
        return False
    log.info("%s: %s (%s)", what, shown, _transport(url, tls))
    await warm_up(redis, timeout_s)
    return True


async def warm_up(redis: Redis, timeout_s: float = CHECK_TIMEOUT_S) -> None:
    """One PING through the client's pool, so that the first request finds a
    connection whose TLS handshake is done (a handshake can outlast the cache's
    50 ms budget). A fault is left to the caller's own fallback."""
    with anyio.move_on_after(timeout_s):
        try:
            await redis.ping()  # type: ignore[misc]
        except (RedisError, OSError):
            pass  # the request path counts and logs Redis faults itself


CLOSED_AFTER_HANDSHAKE_TRIES = 3


async def _ping_with_alert_retries(redis: Redis, url: str, tls: RedisTls) -> None:
    """``_ping_once``; but a TLS 1.3 server that wants a client certificate says so
    in an alert after the handshake, and closes: the alert can be lost to the reset
    of our first command, which then reads as a plain "connection closed". Closed
    that way ``CLOSED_AFTER_HANDSHAKE_TRIES`` times in a row, on a rediss:// URL with
    no client certificate given, is that refusal, not an outage."""
    for attempt in range(CLOSED_AFTER_HANDSHAKE_TRIES):
        try:
            await _ping_once(redis)
            return
        except RedisConnectionError as error:
            if not _closed_after_handshake(error, url, tls):
                raise
            if attempt == CLOSED_AFTER_HANDSHAKE_TRIES - 1:
                raise ssl.SSLError("the server closed every connection right after the TLS "
                                   "handshake (a client certificate is probably required)"
                                   ) from error
            await anyio.sleep(0.05)


def _closed_after_handshake(error: BaseException, url: str, tls: RedisTls) -> bool:
    if urlsplit(url).scheme != "rediss" or tls.cert_file is not None:
        return False
    if _ssl_cause(error) is not None:
        return False  # the alert itself arrived: setup_problem names it
    text = str(error).lower()
    return "closed by server" in text or "reset by peer" in text


async def _ping_once(redis: Redis) -> None:
    """Connect (TLS, AUTH, SELECT) and PING on one connection of the client's own
    settings, with no retry: the client's retries with backoff would turn a
    certificate error into a timeout, and the timeout into "unreachable"."""
    pool = redis.connection_pool
    connection = pool.connection_class(**{**pool.connection_kwargs,
                                          "retry": Retry(NoBackoff(), 0)})
    try:
        await connection.connect()  # type: ignore[no-untyped-call]
        await connection.send_command("PING")
        await connection.read_response()
    finally:
        await connection.disconnect()


def setup_problem(error: BaseException, url: str, tls: RedisTls) -> str | None:
    """What to fix when ``error`` is a fault no retry mends; None for an outage."""
    certificate = _ssl_cause(error)
    if isinstance(certificate, ssl.SSLCertVerificationError):
        trusted = (f"the CA in --redis-ca-file {tls.ca_file}" if tls.ca_file is not None
                   else "the system trust store (give --redis-ca-file)")
        return (f"the server's certificate is not trusted: {certificate.verify_message} "
                f"(checked against {trusted}; the certificate must also name the URL's host)")
    if certificate is not None:
        return (f"TLS handshake failed ({scrub(str(certificate), url)}); if the server has "
                "tls-auth-clients yes, give --redis-cert-file and --redis-key-file")
    if isinstance(error, AuthenticationError):
        return (f"authentication refused ({scrub(str(error), url)}): check the user and "
                "password in the URL (rediss://USER:PASSWORD@HOST:PORT/DB)")
    if isinstance(error, NoPermissionError):
        return (f"the ACL user may not do what Hedgerow needs ({scrub(str(error), url)}); "
                "see docs/deployment.md")
    if isinstance(error, ResponseError) and not isinstance(error, BusyLoadingError):
        return f"Redis refused: {scrub(str(error), url)}"
    return None


def _ssl_cause(error: BaseException) -> ssl.SSLError | None:
    """The TLS error under a redis-py ConnectionError (it keeps it as the context)."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        if isinstance(current, ssl.SSLError):
            return current
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return None


def _describe(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}" if str(error) else type(error).__name__


def _plaintext_hint(url: str) -> str:
    if urlsplit(url).scheme == "redis":
        return "; if that server only speaks TLS, the URL must be rediss://"
    return ""


def _transport(url: str, tls: RedisTls) -> str:
    if urlsplit(url).scheme != "rediss":
        return "plaintext"
    ca = f"CA {tls.ca_file}" if tls.ca_file is not None else "system CAs"
    client = ", client certificate" if tls.cert_file is not None else ""
    return f"TLS, {ca}{client}"
