"""A process of ``--processes N`` starts accepting once it has its first policy
and registry snapshot (``gateway.main._first_view``), so the connections the
kernel hands its already-listening socket wait in the backlog instead of being
answered 503 ``no_healthy_worker``; a control plane that never answers delays
it by the bound only, and the log says what is missing."""

from __future__ import annotations

import logging

import anyio
import pytest

from gateway.main import _first_view
from hedgerow.latest import LatestValue
from hedgerow.wire import RegistrySnapshot

pytestmark = pytest.mark.anyio


def _directory() -> LatestValue[RegistrySnapshot]:
    return LatestValue(RegistrySnapshot(version=0), -1)  # as run_gateway makes it


async def test_it_returns_once_both_the_snapshot_and_the_policy_arrived() -> None:
    directory, policy = _directory(), anyio.Event()
    returned_at: list[str] = []

    async def wait() -> None:
        await _first_view(directory, policy, bound_s=10.0)
        returned_at.append("returned")

    async with anyio.create_task_group() as tg:
        tg.start_soon(wait)
        await anyio.sleep(0.05)
        directory.replace(RegistrySnapshot(version=0), 0)  # the first snapshot is version 0
        await anyio.sleep(0.05)
        assert returned_at == [], "returned with a snapshot but no policy"
        policy.set()
        with anyio.fail_after(1):
            while not returned_at:
                await anyio.sleep(0.01)


async def test_a_silent_control_plane_delays_it_by_the_bound_only(
        caplog: pytest.LogCaptureFixture) -> None:
    directory, policy = _directory(), anyio.Event()
    policy.set()
    caplog.set_level(logging.WARNING, "hedgerow.gateway")
    started = anyio.current_time()
    await _first_view(directory, policy, bound_s=0.2)
    assert 0.2 <= anyio.current_time() - started < 1.0
    assert "serving without a registry snapshot" in caplog.text


async def test_a_missing_policy_is_named_in_the_log(caplog: pytest.LogCaptureFixture) -> None:
    directory = _directory()
    directory.replace(RegistrySnapshot(version=3), 3)
    caplog.set_level(logging.WARNING, "hedgerow.gateway")
    await _first_view(directory, anyio.Event(), bound_s=0.1)
    assert "serving without a policy" in caplog.text
