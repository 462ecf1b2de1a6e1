"""How the gateway turns a request into a Ticket: deadlines, hedging, routing hints."""

from __future__ import annotations

import time
from typing import Any

import orjson
import pytest

from gateway.app import Asked, GatewayApp, _deadlines, prefix_key
from gateway.corridor.tickets import Ticket
from hedgerow import openai_api as oa
from hedgerow.errors import InvalidRequest
from hedgerow.latest import LatestValue
from hedgerow.wire import RegistrySnapshot
from policies.schema import load_policy
from policies.tenancy import Identity


def app() -> GatewayApp:
    return GatewayApp(load_policy(), LatestValue(RegistrySnapshot(version=0)),
                      scheduler=None, dispatcher=None)  # type: ignore[arg-type]


def chat(messages: list[dict[str, str]], **fields: Any) -> oa.ChatCompletionRequest:
    body = {"model": "smollm2", "messages": messages, **fields}
    return oa.parse_request(orjson.dumps(body), oa.ChatCompletionRequest)


HI = [{"role": "user", "content": "hi"}]
INTERACTIVE = Identity("local", "interactive")


def ticket(parsed: oa.ChatCompletionRequest, model: str = "m", deadline_header: str | None = None,
           ) -> Ticket:
    """The ticket the gateway builds for tenant ``local`` (class interactive)."""
    policy = load_policy()
    klass = policy.priority_class(INTERACTIVE.priority_class)
    deadline_ms, due_ms = _deadlines(klass, deadline_header)
    asked = Asked("r1", INTERACTIVE.tenant, model, policy, parsed,
                  observed=None)  # type: ignore[arg-type]
    return app()._ticket(asked, INTERACTIVE, klass, time.monotonic(), deadline_ms, due_ms)


def test_due_is_the_class_slo_and_deadline_the_class_deadline() -> None:
    made = ticket(chat(HI), "smollm2-135m-instruct")
    assert made.due is not None
    assert made.due - made.arrival == pytest.approx(1.0)  # ttft_slo_ms 1000
    assert made.deadline - made.arrival == pytest.approx(10.0)  # deadline_ms 10000
    assert made.hedgeable


def test_client_may_only_tighten_the_deadline() -> None:
    tight = ticket(chat(HI), deadline_header="300")
    assert tight.deadline - tight.arrival == pytest.approx(0.3)
    assert tight.due == tight.deadline
    loose = ticket(chat(HI), deadline_header="999999")
    assert loose.deadline - loose.arrival == pytest.approx(10.0)
    with pytest.raises(InvalidRequest):
        ticket(chat(HI), deadline_header="-5")


def test_stored_completions_are_refused_so_none_is_ever_hedged() -> None:
    # Hedgerow stores nothing; a side effect run on two workers would run twice.
    with pytest.raises(InvalidRequest) as refused:
        chat(HI, store=True)
    assert (refused.value.code, refused.value.param) == ("unsupported_parameter", "store")
    assert ticket(chat(HI, store=False)).hedgeable


def test_token_estimate_includes_max_tokens() -> None:
    made = ticket(chat(HI, max_tokens=100))
    assert made.estimated_tokens == made.route.prompt_tokens + 100


def test_prefix_key_is_the_same_for_every_turn_of_one_conversation() -> None:
    first = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "a"}]
    second = first + [{"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}]
    key = prefix_key("m", chat(first))
    assert key is not None and prefix_key("m", chat(second)) == key
    # Another conversation (other first question or system prompt) or model: another key.
    assert prefix_key("m", chat(first[:1] + [{"role": "user", "content": "z"}])) != key
    assert prefix_key("m", chat([{"role": "system", "content": "be long"}, first[1]])) != key
    assert prefix_key("other", chat(first)) != key
