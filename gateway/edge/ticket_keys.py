"""TLS session ticket keys for TCP (TLS 1.3 and 1.2), rotated on a schedule.

A TCP client resumes with a ticket the server sealed under its ticket key.
OpenSSL makes one random key per ``SSLContext`` and keeps it for the
context's life, which for the gateway is the process's: a key read from
memory (or a ticket recorded with a session) opens every resumed session of
the process's whole life, and nothing ever retires it. Here the key changes
every ``period_s``:

- ``TicketKeyRing`` (sans-IO, ``now`` injected): time is cut into periods
  (``floor(now / period_s)``, on the monotonic clock); each period has its own
  random key (16-byte name, AES-256 key, HMAC-SHA256 key), made when first
  needed. New tickets are sealed with the current period's key; a ticket is
  opened with its own period's key while that is the current or the previous
  period, so a ticket survives one rotation (resumption across it works) and
  not two. A ticket opened with the previous key is renewed (a new ticket
  under the current key). At most two keys are held.
- ``install_ticket_keys(context, ring)`` hands the ring to OpenSSL through
  ``SSL_CTX_set_tlsext_ticket_key_evp_cb``. Python's ``ssl`` module has no
  call for this, so it is made with ``ctypes`` on the ``SSL_CTX`` behind the
  context. That assumes CPython 3.11's ``PySSLContext`` layout (the ``SSL_CTX *``
  right after the object header) and OpenSSL 3.0's callback signature; both
  are checked when installing (the pointer must report the context's own
  options and verify mode, and ``_ssl`` must be linked to the ``libssl``
  loaded here), and where a check fails nothing is installed: OpenSSL's own
  one key serves, as before, and a warning says so.

QUIC tickets rotate on the same schedule (``gateway.edge.quic_tickets``).
"""

from __future__ import annotations

import ctypes
import logging
import math
import os
import ssl
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("hedgerow.gateway.tls")

DEFAULT_ROTATION_S = 3600.0  # a ticket is accepted for 1-2 h after it was issued
KEY_NAME_BYTES = 16
AES_KEY_BYTES = 32
HMAC_KEY_BYTES = 32

Clock = Callable[[], float]
Random = Callable[[int], bytes]


@dataclass(frozen=True)
class TicketKey:
    name: bytes
    aes_key: bytes
    hmac_key: bytes
    period: int


@dataclass(frozen=True)
class Opened:
    """The key that opens a presented ticket; ``renew``: seal a new one (it is the previous key)."""

    key: TicketKey
    renew: bool


class TicketKeyRing:
    """Ticket keys by period: seal with the current, open with the current or previous."""

    def __init__(self, period_s: float = DEFAULT_ROTATION_S, *,
                 random: Random = os.urandom) -> None:
        if not (period_s > 0 and math.isfinite(period_s)):
            raise ValueError(f"the ticket key rotation period must be > 0 s, not {period_s!r}")
        self.period_s = period_s
        self._random = random
        self._keys: dict[int, TicketKey] = {}  # period -> key; two at most
        self.rotations = 0
        self.sealed = 0
        self.opened = {"current": 0, "previous": 0, "unknown": 0}

    def _period(self, now: float) -> int:
        return math.floor(now / self.period_s)

    def _retire(self, now: float) -> int:
        """Drop keys older than the previous period; the current period."""
        period = self._period(now)
        for old in [p for p in self._keys if p < period - 1 or p > period]:
            del self._keys[old]  # (a key from "the future": the clock was reset)
        return period

    def sealing_key(self, now: float) -> TicketKey:
        """The key new tickets are sealed with at ``now``."""
        period = self._retire(now)
        key = self._keys.get(period)
        if key is None:
            key = TicketKey(self._random(KEY_NAME_BYTES), self._random(AES_KEY_BYTES),
                            self._random(HMAC_KEY_BYTES), period)
            self._keys[period] = key
            if len(self._keys) > 1 or self.sealed:
                self.rotations += 1
        self.sealed += 1
        return key

    def opening_key(self, name: bytes, now: float) -> Opened | None:
        """The key named ``name`` if it may still open tickets at ``now``; else None
        (the client does a full handshake)."""
        period = self._retire(now)
        for key in self._keys.values():
            if key.name == name:
                renew = key.period != period
                self.opened["previous" if renew else "current"] += 1
                return Opened(key, renew)
        self.opened["unknown"] += 1
        return None

    def stats(self) -> dict[str, Any]:
        return {"period_s": self.period_s, "rotations": self.rotations, "sealed": self.sealed,
                "opened": dict(self.opened)}


# -- OpenSSL, through ctypes -------------------------------------------------------

_TICKET_CB = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.POINTER(ctypes.c_ubyte),
                              ctypes.POINTER(ctypes.c_ubyte), ctypes.c_void_p, ctypes.c_void_p,
                              ctypes.c_int)
_IV_BYTES = 16  # AES-CBC
_OSSL_PARAM_UTF8_STRING = 4
_OSSL_PARAM_OCTET_STRING = 5
_OSSL_PARAM_UNMODIFIED = ctypes.c_size_t(-1).value


class _OsslParam(ctypes.Structure):
    _fields_ = [("key", ctypes.c_char_p), ("data_type", ctypes.c_uint),
                ("data", ctypes.c_void_p), ("data_size", ctypes.c_size_t),
                ("return_size", ctypes.c_size_t)]


class _OpenSsl:
    """The few libssl/libcrypto calls used, from the libraries ``_ssl`` itself uses."""

    def __init__(self) -> None:
        import _ssl  # noqa: F401  -- maps _ssl's libssl and libcrypto into this process
        self.ssl = ctypes.CDLL(_mapped("libssl.so"))
        self.crypto = ctypes.CDLL(_mapped("libcrypto.so"))
        s, c = self.ssl, self.crypto
        s.SSL_CTX_get_options.restype = ctypes.c_uint64
        s.SSL_CTX_get_options.argtypes = [ctypes.c_void_p]
        s.SSL_CTX_get_verify_mode.restype = ctypes.c_int
        s.SSL_CTX_get_verify_mode.argtypes = [ctypes.c_void_p]
        s.SSL_CTX_set_tlsext_ticket_key_evp_cb.restype = ctypes.c_int
        s.SSL_CTX_set_tlsext_ticket_key_evp_cb.argtypes = [ctypes.c_void_p, _TICKET_CB]
        c.OpenSSL_version.restype = ctypes.c_char_p
        c.OpenSSL_version.argtypes = [ctypes.c_int]
        c.RAND_bytes.restype = ctypes.c_int
        c.RAND_bytes.argtypes = [ctypes.POINTER(ctypes.c_ubyte), ctypes.c_int]
        c.EVP_aes_256_cbc.restype = ctypes.c_void_p
        c.EVP_aes_256_cbc.argtypes = []
        for init in (c.EVP_EncryptInit_ex, c.EVP_DecryptInit_ex):
            init.restype = ctypes.c_int
            init.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_char_p,
                             ctypes.POINTER(ctypes.c_ubyte)]
        c.EVP_MAC_CTX_set_params.restype = ctypes.c_int
        c.EVP_MAC_CTX_set_params.argtypes = [ctypes.c_void_p, ctypes.POINTER(_OsslParam)]

    def check(self, context: ssl.SSLContext) -> int | None:
        """The context's ``SSL_CTX *`` if every layout check passes; else None (logged)."""
        if not isinstance(context, ssl.SSLContext):  # else the memory read below is not one
            _refuse(f"not an ssl.SSLContext: {type(context).__name__}")
            return None
        version = self.crypto.OpenSSL_version(0).decode()
        if sys.implementation.name != "cpython" or sys.version_info[:2] != (3, 11):
            _refuse(f"assumes CPython 3.11's ssl layout, not {sys.version.split()[0]}")
            return None
        if version != ssl.OPENSSL_VERSION or not version.startswith("OpenSSL 3."):
            _refuse(f"libssl here is {version!r}, _ssl is built on "
                    f"{ssl.OPENSSL_VERSION!r}")
            return None
        pointer = ctypes.c_void_p.from_address(id(context) + object.__basicsize__).value
        if not pointer:
            _refuse("no SSL_CTX where CPython 3.11 keeps it")
            return None
        if (self.ssl.SSL_CTX_get_options(pointer) != context.options
                or self.ssl.SSL_CTX_get_verify_mode(pointer) != _openssl_verify(context)):
            _refuse("the SSL_CTX found does not report the context's own settings")
            return None
        return pointer

    def seal_with(self, key: TicketKey, name_out: Any, iv: Any, cipher_ctx: int,
                  mac_ctx: int) -> int:
        ctypes.memmove(name_out, key.name, KEY_NAME_BYTES)
        if self.crypto.RAND_bytes(iv, _IV_BYTES) != 1:
            return -1
        if self.crypto.EVP_EncryptInit_ex(cipher_ctx, self.crypto.EVP_aes_256_cbc(), None,
                                          key.aes_key, iv) != 1:
            return -1
        return 1 if self._mac_key(mac_ctx, key) else -1

    def open_with(self, key: TicketKey, iv: Any, cipher_ctx: int, mac_ctx: int) -> bool:
        return (self.crypto.EVP_DecryptInit_ex(cipher_ctx, self.crypto.EVP_aes_256_cbc(), None,
                                               key.aes_key, iv) == 1
                and self._mac_key(mac_ctx, key))

    def _mac_key(self, mac_ctx: int, key: TicketKey) -> bool:
        digest = ctypes.create_string_buffer(b"SHA256")
        secret = ctypes.create_string_buffer(key.hmac_key, HMAC_KEY_BYTES)
        params = (_OsslParam * 3)(
            _OsslParam(b"digest", _OSSL_PARAM_UTF8_STRING, ctypes.cast(digest, ctypes.c_void_p),
                       len(b"SHA256"), _OSSL_PARAM_UNMODIFIED),
            _OsslParam(b"key", _OSSL_PARAM_OCTET_STRING, ctypes.cast(secret, ctypes.c_void_p),
                       HMAC_KEY_BYTES, _OSSL_PARAM_UNMODIFIED),
            _OsslParam(None, 0, None, 0, 0))
        return bool(self.crypto.EVP_MAC_CTX_set_params(mac_ctx, params) == 1)


def _mapped(prefix: str) -> str:
    """The path of the library named ``prefix``* this process has loaded (``_ssl``'s)."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            path = line.rsplit(None, 1)[-1]
            if os.path.basename(path).startswith(prefix):
                return path
    return prefix + ".3"  # not Linux /proc: the usual soname


def _openssl_verify(context: ssl.SSLContext) -> int:
    # SSL_VERIFY_NONE 0, PEER 1, FAIL_IF_NO_PEER_CERT 2 (what _ssl sets for each mode)
    return {ssl.CERT_NONE: 0, ssl.CERT_OPTIONAL: 1, ssl.CERT_REQUIRED: 3}[context.verify_mode]


def _refuse(why: str) -> None:
    log.warning("TLS ticket keys are not rotated (OpenSSL's one key per process serves): %s",
                why)
    return None


_OPENSSL: _OpenSsl | None = None


def install_ticket_keys(context: ssl.SSLContext, ring: TicketKeyRing,
                        clock: Clock = time.monotonic) -> bool:
    """Seal and open this context's session tickets with ``ring``'s keys; False (and
    a warning) where this Python or OpenSSL is not the one the layout was checked on."""
    global _OPENSSL
    try:
        if _OPENSSL is None:
            _OPENSSL = _OpenSsl()
        openssl = _OPENSSL
    except (OSError, AttributeError) as error:
        _refuse(f"libssl not usable through ctypes ({error})")
        return False
    pointer = openssl.check(context)
    if pointer is None:
        return False

    def callback(_ssl: int, name: Any, iv: Any, cipher_ctx: int, mac_ctx: int,
                 seal: int) -> int:
        # Runs inside OpenSSL's handshake (ctypes takes the GIL). An exception here
        # must not cross into C: a failed seal issues no ticket, a failed open is
        # a full handshake.
        try:
            now = clock()
            if seal:
                return openssl.seal_with(ring.sealing_key(now), name, iv, cipher_ctx, mac_ctx)
            opened = ring.opening_key(ctypes.string_at(name, KEY_NAME_BYTES), now)
            if opened is None or not openssl.open_with(opened.key, iv, cipher_ctx, mac_ctx):
                return 0
            return 2 if opened.renew else 1
        except Exception:  # noqa: BLE001 -- logged; the handshake goes on without the ticket
            log.exception("TLS ticket key callback failed")
            return -1 if seal else 0

    c_callback = _TICKET_CB(callback)
    if openssl.ssl.SSL_CTX_set_tlsext_ticket_key_evp_cb(pointer, c_callback) != 1:
        _refuse("SSL_CTX_set_tlsext_ticket_key_evp_cb failed")
        return False
    # The C side holds only a raw pointer: the callback lives as long as the context.
    context._hedgerow_ticket_callback = c_callback  # type: ignore[attr-defined]
    return True
