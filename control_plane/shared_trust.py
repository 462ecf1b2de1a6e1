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
"""

from __future__ import annotations

import logging
from dataclasses import asdict

import anyio
import orjson
from redis.asyncio import Redis
from redis.exceptions import RedisError

from hedgerow.trust.tokens import Holder, JoinToken, TrustBook

log = logging.getLogger("hedgerow.control_plane.trust")

TOKENS, HOLDERS, REVOKED = ("hedgerow:trust:tokens", "hedgerow:trust:holders",
                            "hedgerow:trust:revoked")
SYNC_S = 1.0


class SharedTrust:
    def __init__(self, redis: Redis) -> None:
        self.redis = redis
        self._outage = False

    async def read(self) -> TrustBook:
        tokens, holders, revoked = await self.redis.hgetall(TOKENS), \
            await self.redis.hgetall(HOLDERS), await self.redis.hgetall(REVOKED)
        return TrustBook(
            {_text(k): JoinToken(**orjson.loads(v)) for k, v in tokens.items()},
            {_text(k): Holder(**orjson.loads(v)) for k, v in holders.items()},
            {_text(k): float(v) for k, v in revoked.items()})

    async def write(self, book: TrustBook, changed: list[tuple[str, str]]) -> None:
        """The entries ``changed`` (hash, key) as they now are in ``book``."""
        for table, key in changed:
            if table == TOKENS and key in book.tokens:
                await self.redis.hset(TOKENS, key, orjson.dumps(asdict(book.tokens[key])))
            elif table == HOLDERS and key in book.holders:
                await self.redis.hset(HOLDERS, key, orjson.dumps(asdict(book.holders[key])))
            elif table == REVOKED and key in book.revoked:
                await self.redis.hset(REVOKED, key, repr(book.revoked[key]))

    async def sync_once(self, book: TrustBook) -> None:
        try:
            book.merge(await self.read())
        except (RedisError, OSError) as error:
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
    return value.decode() if isinstance(value, bytes) else value
