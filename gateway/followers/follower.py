"""Following the control plane's watch stream.

A supervised service: it connects to ``/v1/watch`` and publishes each
registry snapshot into a ``LatestValue`` that the request path reads. A
control plane that is down or restarting is the normal weather of a
distributed system, not a crash: the follower reconnects with capped backoff
and logs one line per outage, while the last known snapshot stays in force.
Anything else (a bug) propagates to the supervisor.
"""

from __future__ import annotations

import logging
import ssl

import anyio
import httpx
import orjson
from pydantic import ValidationError

from hedgerow.latest import LatestValue
from hedgerow.sse import SseOverflow, SseParser
from hedgerow.wire import RegistrySnapshot

log = logging.getLogger("hedgerow.gateway.follower")

RECONNECT_INITIAL_S = 0.1
RECONNECT_MAX_S = 2.0
# The control plane sends a keep-alive comment every 15 s; silence for longer
# means the connection is dead even if TCP has not noticed.
READ_TIMEOUT_S = 40.0


class RegistryFollower:
    def __init__(self, control_plane_url: str, directory: LatestValue[RegistrySnapshot],
                 verify: ssl.SSLContext | bool = True) -> None:
        """``verify``: the gateway's mutual-TLS client context."""
        self.url = control_plane_url.rstrip("/") + "/v1/watch"
        self.directory = directory
        self.verify = verify

    async def run(self) -> None:
        delay = RECONNECT_INITIAL_S
        outage = False
        while True:
            try:
                await self._follow()
            except (httpx.HTTPError, SseOverflow, ValidationError, ValueError) as error:
                if not outage:
                    log.warning("lost the registry watch at %s (%s: %s); keeping the last "
                                "known workers and reconnecting", self.url,
                                type(error).__name__, error)
                outage = True
                await anyio.sleep(delay)
                delay = min(delay * 2, RECONNECT_MAX_S)
                continue
            delay, outage = RECONNECT_INITIAL_S, False

    async def _follow(self) -> None:
        timeout = httpx.Timeout(connect=2.0, read=READ_TIMEOUT_S, write=5.0, pool=5.0)
        async with httpx.AsyncClient(timeout=timeout, verify=self.verify) as client:
            params = {"since": str(self.directory.version)}
            async with client.stream("GET", self.url, params=params) as response:
                response.raise_for_status()
                log.info("following the registry at %s", self.url)
                parser = SseParser()
                async for data in response.aiter_raw():
                    for event in parser.feed(data):
                        self._apply(RegistrySnapshot.model_validate(orjson.loads(event.data)))

    def _apply(self, snapshot: RegistrySnapshot) -> None:
        if snapshot.version < self.directory.version:
            log.warning("control plane restarted (registry version %d); adopting its view",
                        snapshot.version)
        self.directory.replace(snapshot, snapshot.version)
