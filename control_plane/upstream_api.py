"""Admin HTTP API of external upstreams (servers the control plane probes).

    GET    /v1/upstreams         every upstream: source (policy | api), health, last error
    POST   /v1/upstreams         body: JSON with the policy's upstream fields → 202
    DELETE /v1/upstreams/{name}  forget an API-registered upstream → 200 | 404

A registered upstream appears in ``GET /v1/workers`` once its first probe
succeeds. Upstreams declared in the policy are changed by changing the policy.
"""

from __future__ import annotations

from dataclasses import dataclass

import orjson
from pydantic import ValidationError

from control_plane.admin_auth import ControlPlaneRoutes
from control_plane.policy_store import PolicyVersion
from control_plane.upstreams import (
    AddUpstream,
    ListUpstreams,
    RemoveUpstream,
    UpstreamBook,
    UpstreamProber,
)
from hedgerow.actors import ActorRef, Supervisor
from hedgerow.asgi import Request, send_json
from hedgerow.errors import InvalidRequest
from hedgerow.latest import LatestValue
from policies.loader import format_path
from policies.schema import Upstream

MAX_BODY = 64 * 1024
# The prober answers between probe rounds, which take at most one probe timeout.
ASK_TIMEOUT_S = 10.0


@dataclass
class UpstreamApi:
    prober: ActorRef

    def add_routes(self, routes: ControlPlaneRoutes) -> None:
        routes.admin("GET", "/v1/upstreams", self.list)
        routes.admin("POST", "/v1/upstreams", self.add)
        routes.admin("DELETE", "/v1/upstreams/{name}", self.remove)

    async def list(self, request: Request) -> None:
        rows = await self.prober.ask(ListUpstreams(), timeout=ASK_TIMEOUT_S)
        await send_json(request.send, 200, {"upstreams": rows})

    async def add(self, request: Request) -> None:
        spec = parse_upstream(await request.body(MAX_BODY))
        registration = await self.prober.ask(AddUpstream(spec), timeout=ASK_TIMEOUT_S)
        # 202: it is listed as a worker once a probe has found it healthy.
        await send_json(request.send, 202, {"upstream": spec.name, "health": "probing",
                                            "registration": registration.model_dump(mode="json")})

    async def remove(self, request: Request) -> None:
        name = request.path_params["name"]
        await self.prober.ask(RemoveUpstream(name), timeout=ASK_TIMEOUT_S)
        await send_json(request.send, 200, {"upstream": name, "removed": True})


async def start_upstream_service(
    supervisor: Supervisor, registry: ActorRef, policy: LatestValue[PolicyVersion], lease_s: float,
) -> UpstreamApi:
    # The book outlives prober restarts: API-registered upstreams are not lost.
    book = UpstreamBook()
    prober = await supervisor.spawn(lambda: UpstreamProber(book, registry, policy, lease_s),
                                    name="upstream-prober")
    return UpstreamApi(prober)


def parse_upstream(body: bytes) -> Upstream:
    """The upstream in a JSON body, validated like the policy's ``upstreams:`` entries."""
    try:
        return Upstream.model_validate(orjson.loads(body))
    except orjson.JSONDecodeError as error:
        raise InvalidRequest(f"body is not valid JSON: {error}") from None
    except ValidationError as error:
        problems = "; ".join(f"{format_path(tuple(e['loc']))}: {_message(e['msg'])}"
                             for e in error.errors(include_url=False)[:10])
        raise InvalidRequest(f"invalid upstream: {problems}") from None


def _message(text: str) -> str:
    return text.removeprefix("Value error, ")
