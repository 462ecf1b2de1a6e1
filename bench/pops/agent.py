"""A helper process inside one namespace: the harness's hands there.

The harness itself runs outside every namespace it builds, so whatever must
happen inside one (probe a control plane on the PoP's loopback, drive load at
a PoP's gateway from its client namespace) is asked of an agent started there
with ``ip netns exec``. One JSON command per stdin line, one JSON answer per
stdout line:

``{"op": "get", "url": U, "ca": PATH|null, "identity": DIR|null}``
    → ``{"status": 200, "json": ...}`` or ``{"error": "..."}``
    (``identity``: a directory with cert.pem and key.pem, presented as the client
    certificate — the control plane's admin credential for its admin routes)
``{"op": "load", "url": U, "ca": PATH|null, "rate": R, "duration": S, "seed": N, "tag": T}``
    → ``{"records": [{"tag", "ok", "ttft_s", "status", "error", "detail", "worker"}...]}``
    (open-loop Poisson load from ``bench.loadgen``, latency from the intended send)
"""

from __future__ import annotations

import random
import ssl
import sys
from pathlib import Path
from typing import Any

import anyio
import httpx
import orjson

from bench.loadgen import OpenLoop, RequestSpec, Target, run_load

MODEL = "smollm2-135m-instruct"
PROMPT = "Summarise the following note in one line: " + "the hedge is green and tall. " * 6
MAX_TOKENS = 10


def _factory(tag: str) -> Any:
    def factory(index: int, rng: random.Random) -> RequestSpec:
        body = {"model": MODEL, "stream": True, "max_tokens": MAX_TOKENS,
                "messages": [{"role": "user", "content": f"{PROMPT} ({tag} {index})"}]}
        return RequestSpec(tag, body)
    return factory


def _verify(command: dict[str, Any]) -> Any:
    """httpx's ``verify``: the CA to trust, and the client certificate if any."""
    ca, identity = command.get("ca"), command.get("identity")
    if not identity:
        return ca or True
    context = ssl.create_default_context(cafile=ca)
    context.load_cert_chain(Path(identity) / "cert.pem", Path(identity) / "key.pem")
    return context


async def _get(command: dict[str, Any]) -> dict[str, Any]:
    try:
        # Inside the try: a credential the control plane has not written yet is
        # an answer ("not yet"), not the end of the agent.
        verify = _verify(command)
        async with httpx.AsyncClient(verify=verify, timeout=5.0) as client:
            response = await client.get(command["url"])
        try:
            body = response.json()
        except ValueError:
            body = None
        return {"status": response.status_code, "json": body}
    except (httpx.HTTPError, OSError) as error:  # ssl.SSLError is an OSError
        return {"error": f"{type(error).__name__}: {error}"}


async def _load(command: dict[str, Any]) -> dict[str, Any]:
    ca = command.get("ca")
    target = Target(command["url"], ca_file=Path(ca) if ca else None, request_timeout_s=60.0)
    load = OpenLoop(rate_per_s=float(command["rate"]), duration_s=float(command["duration"]),
                    max_in_flight=2000)
    result = await run_load(target, load, _factory(command["tag"]), seed=int(command["seed"]))
    return {"records": [
        {"tag": r.tag, "ok": r.ok, "ttft_s": r.ttft_s, "status": r.status, "error": r.error,
         "detail": r.error_detail, "worker": r.headers.get("x-hedgerow-worker"),
         "intended_s": r.intended_s}
        for r in result.records]}


async def _serve() -> None:
    stdin = anyio.wrap_file(sys.stdin)
    print(orjson.dumps({"ready": True}).decode(), flush=True)
    async for line in stdin:
        command = orjson.loads(line)
        if command["op"] == "get":
            answer = await _get(command)
        elif command["op"] == "load":
            answer = await _load(command)
        else:
            answer = {"error": f"unknown op {command['op']!r}"}
        print(orjson.dumps(answer).decode(), flush=True)


if __name__ == "__main__":
    anyio.run(_serve)
