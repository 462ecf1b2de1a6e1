"""The policy actor and the watched-directory loop, in memory and in real (small) time."""

from __future__ import annotations

import logging
from pathlib import Path

import anyio
import pytest

from control_plane.policy_actor import ApplyPolicy, GetPolicy, PolicyActor, RollbackPolicy
from control_plane.policy_store import PolicyStore, PolicyVersion
from control_plane.policy_watch import PolicyDirectoryWatcher
from hedgerow.actors import ActorRef, Supervisor
from hedgerow.latest import LatestValue
from policies.loader import parse_policy_document
from policies.schema import PolicyError

pytestmark = pytest.mark.anyio


def doc(max_tokens: int) -> str:
    return f"limits:\n  max_tokens: {max_tokens}\n"


async def start(supervisor: Supervisor) -> tuple[ActorRef, LatestValue[PolicyVersion]]:
    store = PolicyStore(parse_policy_document(doc(100)), doc(100), source="boot")
    published: LatestValue[PolicyVersion] = LatestValue(store.current, store.current.version)
    actor = await supervisor.spawn(lambda: PolicyActor(store, published), name="policy")
    return actor, published


async def test_applied_versions_are_published_and_rejections_change_nothing() -> None:
    async with Supervisor() as supervisor:
        actor, published = await start(supervisor)
        applied = await actor.ask(ApplyPolicy(doc(200), "a.yaml"))
        assert applied.changed and published.version == 2
        assert published.value.policy.limits.max_tokens == 200
        with pytest.raises(PolicyError):
            await actor.ask(ApplyPolicy("limits: [", "bad.yaml"))
        assert published.version == 2  # and the actor carries on:
        rolled = await actor.ask(RollbackPolicy(1))
        assert (rolled.version.version, published.version) == (3, 3)
        assert (await actor.ask(GetPolicy())).text == doc(100)


async def test_watched_directory_applies_settled_files_and_logs_rejections(
    tmp_path: Path, caplog: pytest.LogCaptureFixture,
) -> None:
    (tmp_path / "old.yaml").write_text(doc(300))
    async with Supervisor() as supervisor:
        actor, published = await start(supervisor)
        watcher = PolicyDirectoryWatcher(tmp_path, actor, interval_s=0.01)
        await watcher.poll()
        assert published.value.source == str(tmp_path / "old.yaml")

        (tmp_path / "new.yaml").write_text(doc(400))
        await watcher.poll()  # seen once: it might still be being written
        assert published.version == 2
        await watcher.poll()
        assert published.version == 3 and published.value.policy.limits.max_tokens == 400

        caplog.set_level(logging.WARNING)
        (tmp_path / "new.yaml").write_text("limits:\n  max_tokenz: 1\n")
        await watcher.poll()
        await watcher.poll()
        assert published.version == 3
        assert f"{tmp_path / 'new.yaml'}:2:3: limits.max_tokenz: unknown key" in caplog.text

        (tmp_path / "new.yaml").write_bytes(b"limits:\n  max_tokens: \xff\n")
        await watcher.poll()
        await watcher.poll()
        assert published.version == 3
        assert f"{tmp_path / 'new.yaml'}:2:15: (document): not UTF-8" in caplog.text
        with anyio.fail_after(1):
            supervisor.run_service("watch", watcher.run)
            (tmp_path / "new.yaml").write_text(doc(500))
            while published.version < 4:
                await anyio.sleep(0.01)
