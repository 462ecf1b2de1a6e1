"""A request's settlement (budgets, a key's tokens) is the last thing it does:
whatever happens there, the client's answer stands and the request is logged.

The real gateway app over one in-memory fake worker (as in
``tests.integration.test_upstream_errors``); ``KeyGate.settle`` made to fail.
"""

from __future__ import annotations

import logging

import anyio
import pytest

from gateway.admin.access_log import LOGGER
from gateway.admin.usage_metrics import Usage
from tests.integration.test_upstream_errors import gateway
from tests.support.asgi_client import body
from tests.support.fake_workers import Behaviour

pytestmark = pytest.mark.anyio


@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "whole"])
async def test_a_failing_settlement_keeps_the_answer_and_its_access_log_line(
    stream: bool, caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO)
    async with gateway(Behaviour()) as gw:
        async def settle(request_id: str, usage: Usage | None) -> None:
            raise RuntimeError("injected: the budget store broke")

        gw.app.keys.settle = settle  # type: ignore[method-assign]
        client = await gw.stream(request=body(stream=stream))
        with anyio.fail_after(5):
            await client.finished.wait()
    assert client.status == 200
    request_id = client.header("x-request-id")
    assert request_id is not None
    access = [r.getMessage() for r in caplog.records if r.name == LOGGER]
    assert any(request_id in line for line in access), caplog.text
    failed = [r for r in caplog.records if r.name == "hedgerow.gateway.completions"]
    assert [r.getMessage() for r in failed] == [f"request {request_id}: settling its budgets failed"]
    assert failed[0].exc_info is not None  # the traceback is in the operator's log
