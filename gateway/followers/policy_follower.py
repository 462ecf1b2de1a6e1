"""Following the control plane's policy versions, xDS style.

A supervised service: it follows ``/v1/policy/watch`` (SSE, one event per
version: ``{"version", "checksum", "text"}``), validates each version again
here, swaps it in atomically when it is good, and answers every version with
an ACK or a NACK (``POST /v1/gateways/{id}/policy``) so operators can see,
with ``hedgerow status``, which gateway runs which version. A rejected version
leaves the last good policy in force. Losing the control plane is not an
error: the gateway keeps its policy and reconnects with capped backoff.
"""

from __future__ import annotations

import logging
import ssl
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import anyio
import httpx
import orjson
from pydantic import BaseModel, ValidationError

from hedgerow.sse import SseOverflow, SseParser
from policies.loader import parse_policy_document, policy_checksum
from policies.schema import Policy, PolicyError

log = logging.getLogger("hedgerow.gateway.policy")

RECONNECT_INITIAL_S = 0.1
RECONNECT_MAX_S = 2.0
READ_TIMEOUT_S = 40.0  # the control plane sends a keep-alive every 15 s


class PolicyEvent(BaseModel):
    version: int
    checksum: str
    text: str


class PolicyAck(BaseModel):
    """What a gateway answers for one policy version."""

    gateway_id: str
    version: int
    accepted: bool
    checksum: str | None = None
    error: str | None = None


@dataclass
class RunningPolicy:
    version: int
    checksum: str


Apply = Callable[[Policy], Awaitable[None]]


class PolicyFollower:
    def __init__(self, control_plane_url: str, gateway_id: str, apply: Apply,
                 running: RunningPolicy, verify: ssl.SSLContext | bool = True) -> None:
        """``verify``: the gateway's mutual-TLS client context."""
        self.verify = verify
        self.base = control_plane_url.rstrip("/")
        self.gateway_id = gateway_id
        self.apply = apply
        self.running = running

    async def run(self) -> None:
        delay = RECONNECT_INITIAL_S
        outage = False
        while True:
            try:
                await self._follow()
            except (httpx.HTTPError, SseOverflow, ValidationError, ValueError) as error:
                if not outage:
                    log.warning("lost the policy watch at %s (%s: %s); keeping version %d",
                                self.base, type(error).__name__, error, self.running.version)
                outage = True
                await anyio.sleep(delay)
                delay = min(delay * 2, RECONNECT_MAX_S)
                continue
            delay, outage = RECONNECT_INITIAL_S, False

    async def _follow(self) -> None:
        timeout = httpx.Timeout(connect=2.0, read=READ_TIMEOUT_S, write=5.0, pool=5.0)
        async with httpx.AsyncClient(timeout=timeout, verify=self.verify) as client:
            url = f"{self.base}/v1/policy/watch"
            async with client.stream("GET", url) as response:
                response.raise_for_status()
                parser = SseParser()
                async for data in response.aiter_raw():
                    for event in parser.feed(data):
                        update = PolicyEvent.model_validate(orjson.loads(event.data))
                        await self._ack(client, await self.consider(update))

    async def consider(self, update: PolicyEvent) -> PolicyAck:
        """Validate one version here and swap it in when it is good."""
        if update.checksum == self.running.checksum:
            self.running.version = update.version
            return self._accepted(update)
        try:
            policy = parse_policy_document(update.text, f"policy v{update.version}")
        except PolicyError as error:
            log.error("rejected policy version %d: %s", update.version, error)
            return PolicyAck(gateway_id=self.gateway_id, version=update.version,
                             accepted=False, error=str(error)[:2000])
        checksum = policy_checksum(policy)
        await self.apply(policy)
        self.running.version, self.running.checksum = update.version, checksum
        log.info("policy version %d in force (checksum %s)", update.version, checksum[:12])
        return self._accepted(update)

    def _accepted(self, update: PolicyEvent) -> PolicyAck:
        return PolicyAck(gateway_id=self.gateway_id, version=update.version, accepted=True,
                         checksum=self.running.checksum)

    async def _ack(self, client: httpx.AsyncClient, ack: PolicyAck) -> None:
        url = f"{self.base}/v1/gateways/{self.gateway_id}/policy"
        response = await client.post(url, json=ack.model_dump(mode="json"))
        if response.status_code >= 300:
            log.warning("control plane refused our policy %s (%d)",
                        "ACK" if ack.accepted else "NACK", response.status_code)
