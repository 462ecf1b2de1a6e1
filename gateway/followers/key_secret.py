"""Fetching the cluster's key secret from the control plane.

Virtual keys are stored as HMACs under a secret the control plane keeps
(``policies.keys``). It never travels in the policy text, which operators
read and copy; a gateway asks for it on the internal channel, with its
client certificate (``GET /v1/keys/secret``, gateways only), once at start,
and retries with capped backoff until it has it. Until then a virtual key
gets 503 ``policy_unavailable`` with Retry-After; legacy digest keys and the
anonymous tenant are served meanwhile.
"""

from __future__ import annotations

import logging
import ssl

import anyio
import httpx

from gateway.corridor.key_gate import KeyGate

log = logging.getLogger("hedgerow.gateway.keys")

RETRY_INITIAL_S = 0.2
RETRY_MAX_S = 10.0
SECRET_BYTES = 32


class KeySecretFetcher:
    def __init__(self, control_plane_url: str, gate: KeyGate,
                 verify: ssl.SSLContext | bool = True) -> None:
        self.url = control_plane_url.rstrip("/") + "/v1/keys/secret"
        self.gate = gate
        self.verify = verify

    async def run(self) -> None:
        delay = RETRY_INITIAL_S
        told = False
        while self.gate.secret is None:
            try:
                self.gate.secret = await self._fetch()
                log.info("virtual keys: key secret received from the control plane")
                return
            except (httpx.HTTPError, ValueError, KeyError) as error:
                if not told:
                    log.warning("virtual keys: no key secret from %s yet (%s: %s); virtual "
                                "keys get 503 until it comes", self.url,
                                type(error).__name__, error)
                    told = True
            await anyio.sleep(delay)
            delay = min(delay * 2, RETRY_MAX_S)

    async def _fetch(self) -> bytes:
        timeout = httpx.Timeout(5.0)
        async with httpx.AsyncClient(timeout=timeout, verify=self.verify) as client:
            response = await client.get(self.url)
            response.raise_for_status()
            secret = bytes.fromhex(response.json()["secret"])
        if len(secret) != SECRET_BYTES:
            raise ValueError(f"a key secret has {SECRET_BYTES} bytes, not {len(secret)}")
        return secret
