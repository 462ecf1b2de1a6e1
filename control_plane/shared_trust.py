"""The trust book shared by control-plane replicas through Redis.

Each replica keeps its book in memory (and in its ``trust.json``) and, with
``--redis``, also in three hashes — ``hedgerow:trust:tokens`` (token id →
record, the secret's hash only), ``hedgerow:trust:holders`` (identity →
holder) and ``hedgerow:trust:revoked`` (identity → when). A change is written
entry by entry as it is made; every ``SYNC_S`` each replica reads the hashes
and merges them into its book (``TrustBook.merge``: revocations only ever
grow), so a token created through one replica joins through any, and an
identity revoked through one is refused by all within about a second.
While Redis is unreachable a replica keeps enforcing what it knows.

Redis is not trusted with trust: gateways may hold a Redis user too. Every
entry is sealed with an HMAC whose key is derived from the cluster CA's private
key, which only control-plane replicas hold; an entry that does not verify, or
does not validate (a role a token may not grant, a number that is not finite),
is skipped and logged. So write access to Redis can neither mint a token nor
undo a revocation.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import math
from dataclasses import asdict

import anyio
import orjson
from redis.asyncio import Redis
from redis.exceptions import RedisError

from hedgerow.trust.identity import Identity
from hedgerow.trust.tokens import JOINABLE_ROLES, Holder, JoinToken, TrustBook

log = logging.getLogger("hedgerow.control_plane.trust")

TOKENS, HOLDERS, REVOKED = ("hedgerow:trust:tokens", "hedgerow:trust:holders",
                            "hedgerow:trust:revoked")
SYNC_S = 1.0


def mac_key_for(ca_key_der: bytes) -> bytes:
    """The entries' HMAC key: only holders of the CA's private key can derive it."""
    return hashlib.sha256(b"hedgerow trust book v1\0" + ca_key_der).digest()


class SharedTrust:
    def __init__(self, redis: Redis, mac_key: bytes) -> None:
        self.redis = redis
        self._mac_key = mac_key
        self._outage = False
        self._refused_logged: set[tuple[str, str]] = set()

    async def read(self) -> TrustBook:
        book = TrustBook()
        for table in (TOKENS, HOLDERS, REVOKED):
            for raw_key, raw in (await self.redis.hgetall(table)).items():  # type: ignore[misc]
                key = _text(raw_key)
                try:
                    self._take(book, table, key, self._open(table, key, raw))
                except (ValueError, TypeError, KeyError) as error:
                    self._refuse(table, key, error)
        return book

    async def write(self, book: TrustBook, changed: list[tuple[str, str]]) -> None:
        """The entries ``changed`` (hash, key) as they now are in ``book``."""
        for table, key in changed:
            record: object
            if table == TOKENS and key in book.tokens:
                record = asdict(book.tokens[key])
            elif table == HOLDERS and key in book.holders:
                record = asdict(book.holders[key])
            elif table == REVOKED and key in book.revoked:
                record = book.revoked[key]
            else:
                continue
            await self.redis.hset(table, key, self._seal(table, key, record))  # type: ignore[misc]

    def _seal(self, table: str, key: str, record: object) -> str:
        # str, as redis-py's hset is typed; JSON is UTF-8, so Redis holds the same bytes
        body = orjson.dumps(record, option=orjson.OPT_SORT_KEYS)
        return orjson.dumps({"r": orjson.loads(body), "m": self._mac(table, key, body)}).decode()

    def _open(self, table: str, key: str, raw: bytes | str) -> object:
        sealed = orjson.loads(raw)
        record = sealed["r"]
        body = orjson.dumps(record, option=orjson.OPT_SORT_KEYS)
        if not hmac.compare_digest(str(sealed["m"]), self._mac(table, key, body)):
            raise ValueError("its seal does not verify (not written by a control plane)")
        return record

    def _mac(self, table: str, key: str, body: bytes) -> str:
        message = table.encode() + b"\0" + key.encode() + b"\0" + body
        return hmac.new(self._mac_key, message, hashlib.sha256).hexdigest()

    @staticmethod
    def _take(book: TrustBook, table: str, key: str, record: object) -> None:
        if table == TOKENS:
            token = JoinToken(**record)  # type: ignore[arg-type]
            if token.role not in JOINABLE_ROLES or token.token_id != key or not all(
                    _finite(v) for v in (token.created_at, token.expires_at)):
                raise ValueError("not a token this book can hold")
            book.tokens[key] = token
        elif table == HOLDERS:
            Identity.parse(key)
            holder = Holder(**record)  # type: ignore[arg-type]
            if not all(_finite(v) for v in (holder.joined_at, holder.cert_expires_at)):
                raise ValueError("times must be finite numbers")
            book.holders[key] = holder
        else:
            Identity.parse(key)
            if not _finite(record):
                raise ValueError("a revocation time must be a finite number")
            book.revoked[key] = float(record)  # type: ignore[arg-type]

    def _refuse(self, table: str, key: str, error: Exception) -> None:
        if (table, key) not in self._refused_logged and len(self._refused_logged) < 1000:
            self._refused_logged.add((table, key))
            log.error("ignoring %s entry %r in the shared trust book: %s", table, key[:80], error)

    async def sync_once(self, book: TrustBook) -> None:
        try:
            book.merge(await self.read())
        except (RedisError, OSError, ValueError) as error:
            if not self._outage:
                log.warning("cannot read the shared trust book (%s); enforcing what this "
                            "replica knows", error)
            self._outage = True
            return
        if self._outage:
            log.info("shared trust book readable again")
        self._outage = False

    async def follow(self, book: TrustBook) -> None:
        while True:
            await self.sync_once(book)
            await anyio.sleep(SYNC_S)


def _text(value: bytes | str) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else value


def _finite(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
