"""How the gateway turns a request into a Ticket: deadlines, hedging, routing hints."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from gateway.app import GatewayApp, prefix_key
from hedgerow import openai_api as oa
from hedgerow.asgi import Request
from hedgerow.errors import InvalidRequest
from hedgerow.latest import LatestValue
from hedgerow.wire import RegistrySnapshot
from policies.schema import load_policy
from policies.tenancy import Identity


def app() -> GatewayApp:
    return GatewayApp(load_policy(), LatestValue(RegistrySnapshot(version=0)),
                      scheduler=None, dispatcher=None)  # type: ignore[arg-type]


def request(**headers: str) -> Request:
    scope: dict[str, Any] = {
        "type": "http", "method": "POST", "path": "/v1/chat/completions",
        "headers": [(k.replace("_", "-").encode(), v.encode()) for k, v in headers.items()],
        "hedgerow.request_id": "r1",
    }
    return Request(scope, None, None)  # type: ignore[arg-type]


def chat(messages: list[dict[str, str]], **fields: Any) -> oa.ChatCompletionRequest:
    body = {"model": "smollm2", "messages": messages, **fields}
    return oa.parse_request(orjson.dumps(body), oa.ChatCompletionRequest)


HI = [{"role": "user", "content": "hi"}]
INTERACTIVE = Identity("local", "interactive")


def test_due_is_the_class_slo_and_deadline_the_class_deadline() -> None:
    ticket = app()._ticket(load_policy(), request(), INTERACTIVE, chat(HI), "smollm2-135m-instruct")
    assert ticket.due is not None
    assert ticket.due - ticket.arrival == pytest.approx(1.0)  # ttft_slo_ms 1000
    assert ticket.deadline - ticket.arrival == pytest.approx(10.0)  # deadline_ms 10000
    assert ticket.hedgeable


def test_client_may_only_tighten_the_deadline() -> None:
    tight = app()._ticket(load_policy(), request(x_hedgerow_deadline_ms="300"), INTERACTIVE, chat(HI), "m")
    assert tight.deadline - tight.arrival == pytest.approx(0.3)
    assert tight.due == tight.deadline
    loose = app()._ticket(load_policy(), request(x_hedgerow_deadline_ms="999999"), INTERACTIVE, chat(HI), "m")
    assert loose.deadline - loose.arrival == pytest.approx(10.0)
    with pytest.raises(InvalidRequest):
        app()._ticket(load_policy(), request(x_hedgerow_deadline_ms="-5"), INTERACTIVE, chat(HI), "m")


def test_stored_completions_are_never_hedged() -> None:
    ticket = app()._ticket(load_policy(), request(), INTERACTIVE, chat(HI, store=True), "m")
    assert not ticket.hedgeable


def test_token_estimate_includes_max_tokens() -> None:
    ticket = app()._ticket(load_policy(), request(), INTERACTIVE, chat(HI, max_tokens=100), "m")
    assert ticket.estimated_tokens == ticket.route.prompt_tokens + 100


def test_prefix_key_follows_the_conversation_so_far() -> None:
    first = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "a"}]
    second = first + [{"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}]
    assert prefix_key("m", chat(HI)) is None
    key = prefix_key("m", chat(first))
    assert key is not None and key == prefix_key("m", chat(first[:1] + [{"role": "user", "content": "z"}]))
    assert prefix_key("m", chat(second)) != key
    assert prefix_key("other", chat(first)) != key
