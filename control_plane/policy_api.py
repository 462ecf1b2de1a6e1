"""Admin HTTP API of operator policy: show, history, validate, apply, rollback.

    GET  /v1/policy                     the current version: metadata and YAML text
    GET  /v1/policy/{version}           one retained version, same shape
    GET  /v1/policy/history             retained versions, oldest first (no text)
    POST /v1/policy/validate            body: YAML → 200 {checksum} | 400 issues
    POST /v1/policy                     body: YAML → 201 new version | 200 unchanged | 400 issues
    POST /v1/policy/rollback/{version}  → 201 new version with that content | 200 unchanged | 404

``?source=NAME`` names the document in error locations (the CLI sends the file
name). A 400 for a policy carries the OpenAI error envelope plus ``issues``:
``[{source, line, column, path, message}]``; the active policy is unchanged.
"""

from __future__ import annotations

import dataclasses
import logging
import time
import unicodedata
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass, field
from urllib.parse import unquote_plus

import anyio
import orjson

from control_plane.policy_actor import (
    Applied,
    ApplyPolicy,
    GetPolicy,
    GetPolicyHistory,
    RollbackPolicy,
)
from control_plane.admin_auth import ControlPlaneRoutes
from control_plane.gateways import GatewayAnswer, GatewayBook
from control_plane.policy_store import PolicyVersion
from hedgerow.actors import ActorRef
from hedgerow.asgi import SSE_HEADERS, Request, send_json, sse_of_latest, stream_until_disconnect
from hedgerow.decimal_text import parse_decimal
from hedgerow.errors import InvalidRequest, PermissionDenied
from hedgerow.latest import LatestValue
from hedgerow.trust.peer import PEER, Peer
from hedgerow.wire import PolicyApplied, PolicyHistory, PolicyValidated
from policies.loader import MAX_POLICY_CHARS, decode_policy_bytes, parse_policy_document, policy_checksum
from policies.schema import PolicyError

log = logging.getLogger("hedgerow.control_plane.policy")

WATCH_KEEPALIVE_S = 15.0
REVOCATION_CHECK_S = 1.0
MAX_ANSWER_BODY = 16 * 1024
MAX_POLICY_BODY = 4 * MAX_POLICY_CHARS  # UTF-8 bytes; the loader bounds characters
ASK_TIMEOUT_S = 5.0
MAX_SOURCE_CHARS = 200


@dataclass
class PolicyApi:
    policies: ActorRef
    # The active version, for followers (the policy watch stream).
    published: LatestValue[PolicyVersion]
    gateways: GatewayBook = field(default_factory=GatewayBook)
    # Whether a watcher's certificate was revoked since it connected (the control
    # plane's trust sets it): its stream is then cut within REVOCATION_CHECK_S.
    is_revoked: Callable[[Peer | None], bool] = field(default=lambda peer: False)

    def add_routes(self, routes: ControlPlaneRoutes) -> None:
        """The operator's routes on the admin side, behind the admin token; the
        gateways' watch stream and ACK/NACK stay open (gateways hold no admin token)."""
        # history before {version}: the router takes the first pattern that matches.
        routes.admin("GET", "/v1/policy", self.show_current)
        routes.admin("POST", "/v1/policy", self.apply)
        routes.admin("GET", "/v1/policy/history", self.history)
        routes.admin("POST", "/v1/policy/validate", self.validate)
        routes.admin("POST", "/v1/policy/rollback/{version}", self.rollback)
        routes.internal("GET", "/v1/policy/watch", self.watch, roles=("gateway", "admin"))
        routes.internal("POST", "/v1/gateways/{gateway_id}/policy", self.gateway_answer,
                        roles=("gateway",))
        routes.admin("GET", "/v1/policy/{version}", self.show_version)

    async def watch(self, request: Request) -> None:
        """SSE: the current version at once, then every new one (whole text)."""
        await stream_until_disconnect(request, 200, list(SSE_HEADERS),
                                      self._versions(PEER.get()))

    def _versions(self, peer: Peer | None) -> AsyncGenerator[bytes, None]:
        return sse_of_latest(
            self.published, -1, lambda current: {"version": current.version,
                                                 "checksum": current.checksum,
                                                 "text": current.text},
            keepalive_s=WATCH_KEEPALIVE_S, check_s=REVOCATION_CHECK_S,
            still_allowed=lambda: not self.is_revoked(peer))

    async def gateway_answer(self, request: Request) -> None:
        """A gateway's ACK or NACK of one version (a gateway answers only for itself)."""
        peer = PEER.get()
        gateway_id = request.path_params["gateway_id"]
        if peer is not None and peer.identity.role == "gateway" and peer.identity.name != gateway_id:
            raise PermissionDenied(f"{peer.identity} may answer only for gateway "
                                   f"{peer.identity.name!r}", code="identity_mismatch")
        body = await request.body(MAX_ANSWER_BODY)
        expected = InvalidRequest("expected {version: integer, accepted: boolean, checksum?, "
                                  "error?}")
        try:
            data = orjson.loads(body)
            version, accepted = data["version"], data["accepted"]
            answer = GatewayAnswer(
                gateway_id=request.path_params["gateway_id"][:128],
                version=version, accepted=accepted,
                checksum=data.get("checksum"), error=(data.get("error") or None),
                at=time.monotonic())
        except (orjson.JSONDecodeError, KeyError, TypeError, ValueError):
            raise expected from None
        # Strict: bool("false") is True, and int() reads "٣" as 3.
        if type(version) is not int or version < 0 or type(accepted) is not bool:
            raise expected
        if not answer.accepted:
            log.warning("gateway %s rejected policy version %d: %s",
                        answer.gateway_id, answer.version, answer.error)
        self.gateways.record(answer)
        await send_json(request.send, 200, {"recorded": True})

    async def show_current(self, request: Request) -> None:
        version = await self.policies.ask(GetPolicy(), timeout=ASK_TIMEOUT_S)
        await send_json(request.send, 200, version.with_text().model_dump(mode="json"))

    async def show_version(self, request: Request) -> None:
        number = _version_param(request)
        version = await self.policies.ask(GetPolicy(number), timeout=ASK_TIMEOUT_S)
        await send_json(request.send, 200, version.with_text().model_dump(mode="json"))

    async def history(self, request: Request) -> None:
        versions = await self.policies.ask(GetPolicyHistory(), timeout=ASK_TIMEOUT_S)
        history = PolicyHistory(current=versions[-1].version, versions=tuple(versions))
        await send_json(request.send, 200, history.model_dump(mode="json"))

    async def validate(self, request: Request) -> None:
        source = _source_param(request)
        try:
            text = await _policy_text(request, source)
            policy = await anyio.to_thread.run_sync(parse_policy_document, text, source)
        except PolicyError as error:
            await send_policy_error(request, error)
            return
        reply = PolicyValidated(checksum=policy_checksum(policy))
        await send_json(request.send, 200, reply.model_dump(mode="json"))

    async def apply(self, request: Request) -> None:
        source = _source_param(request)
        try:
            text = await _policy_text(request, source)
            applied = await self.policies.ask(ApplyPolicy(text, source), timeout=ASK_TIMEOUT_S)
        except PolicyError as error:
            await send_policy_error(request, error)
            return
        await _send_applied(request, applied)

    async def rollback(self, request: Request) -> None:
        number = _version_param(request)
        applied = await self.policies.ask(RollbackPolicy(number), timeout=ASK_TIMEOUT_S)
        await _send_applied(request, applied)


async def send_policy_error(request: Request, error: PolicyError) -> None:
    payload = error.envelope() | {
        "issues": [dataclasses.asdict(issue) for issue in error.issues],
        "omitted": error.omitted,
    }
    await send_json(request.send, error.status, payload)


async def _send_applied(request: Request, applied: Applied) -> None:
    info = applied.version.info()
    reply = PolicyApplied(**info.model_dump(), changed=applied.changed)
    await send_json(request.send, 201 if applied.changed else 200, reply.model_dump(mode="json"))


async def _policy_text(request: Request, source: str) -> str:
    return decode_policy_bytes(await request.body(MAX_POLICY_BODY), source)


def _version_param(request: Request) -> int:
    raw = request.path_params["version"]
    version = parse_decimal(raw)
    if version is None or version < 1:
        raise InvalidRequest(f"policy version must be a positive integer, got {raw[:40]!r}")
    return version


def _source_param(request: Request) -> str:
    """The document's name for messages and history; printable, bounded."""
    raw = unquote_plus(request.query().get("source", "")).strip()
    printable = "".join(c for c in raw if unicodedata.category(c)[0] != "C")
    return printable[:MAX_SOURCE_CHARS] or "api"
