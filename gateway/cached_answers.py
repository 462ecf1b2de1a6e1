"""The response cache on a completion's way: lookup, and replay of a hit.

A request's cache keys are computed once (``ResponseCache.keys``) and carried
in its ``Caching`` to the lookup, the single-flight table and the store. A hit
is replayed from the cache entry straight into a stream log, event by event
with its kind (``Hit.events``), never rendered to SSE and parsed back. A
miss's answer is stored as its flight's last step (``Flights._cache_store``).
"""

from __future__ import annotations

import time
from typing import Any

import orjson

from gateway.cache import Hit
from gateway.cache.keys import bypasses_lookup, cacheable
from gateway.flights import Flights
from gateway.request_terms import Asked, Caching, answer_headers
from gateway.corridor.stream_log import StreamLog
from hedgerow import tracing
from hedgerow.asgi import Request, cancel_on_disconnect, send_bytes


class CachedAnswers(Flights):
    """The response cache on a completion's way: lookup and replay."""

    async def _cache_lookup(self, request: Request, asked: Asked,
                            request_json: dict[str, Any]) -> Hit | Caching | None:
        """A cached answer; else how to share and store this one (None: not cacheable)."""
        cache = self.cache
        if cache is None:
            return None
        headers = request.scope["headers"]
        # As asked and, where routing resolved another model, as resolved: an
        # alias may differ from its model in opt-in.
        if not (cacheable(asked.tenant, request_json, asked.policy)
                and (asked.model == request_json.get("model")
                     or cacheable(asked.tenant, {**request_json, "model": asked.model},
                                  asked.policy))):
            self.metrics.cache_lookup("uncacheable")
            return None
        # Computed once, carried to the lookup, the flight and the store.
        keys = cache.keys(asked.tenant, asked.model, request_json)
        with tracing.span("cache lookup") as span:
            hit = await cache.lookup(asked.tenant, asked.model, request_json, headers, keys=keys)
            if hit is not None:
                self.metrics.cache_lookup(hit.kind)
                span.set_attribute("hedgerow.cache.result", hit.kind)
                return hit
            bypass = bypasses_lookup({"cache-control": request.header("cache-control") or ""})
            self.metrics.cache_lookup("bypass" if bypass else "miss")
            span.set_attribute("hedgerow.cache.result", "bypass" if bypass else "miss")
        # A client that asked for a fresh answer never joins someone else's.
        return Caching(keys.exact, keys, request_json, headers, share=not bypass)

    async def _replay(self, request: Request, asked: Asked, hit: Hit) -> None:
        """Answer from the cache: the same SSE events (with ids) or JSON body as live."""
        parsed, request_id = asked.parsed, asked.request_id
        asked.observed.responded(200)
        asked.observed.used(hit.entry.prompt_tokens, hit.entry.completion_tokens,
                            cached=hit.kind)
        if not parsed.stream:
            body = orjson.dumps(hit.json(request_id, model=parsed.model))
            await send_bytes(request.send, 200, body, answer_headers(
                request_id, None, hit.kind.encode(), hedged=False))
            return
        settings = asked.policy.streams
        stream = StreamLog(request_id, asked.tenant, settings.max_buffer_bytes,
                           include_usage=parsed.include_usage())
        now = time.monotonic()
        # Straight from the entry into the log: nothing rendered to SSE is parsed back.
        for kind, event in hit.events(request_id, model=parsed.model,
                                      include_usage=parsed.include_usage()):
            stream.append(kind, event, now)
        stream.open("", hedged=False)
        stream.finish(now)
        self.streams.add(stream, now)
        with stream.reading():
            await cancel_on_disconnect(request, lambda: self._answer_stream(
                request, stream, 0, asked.observed, cache=hit.kind.encode()))
