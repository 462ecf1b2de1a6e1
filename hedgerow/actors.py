"""A small supervised-actor runtime on anyio (pykka's shape, structured concurrency).

    Supervisor                        async context manager owning one task group
    ├── spawn(factory, name=...)  ─►  ActorRef: bounded mailbox of Envelope(message, reply_to)
    │     each (re)start: factory() → on_start → [receive | on_tick]* → on_stop
    └── run_service(name, async_fn)   a plain long-running coroutine, same restarts

``tell`` sends without a reply; ``ask`` waits for receive()'s result. An error
while answering an ask goes to the asker and the actor carries on; an error
while handling a tell (or in on_start/on_tick) crashes the actor, and the
supervisor restarts a fresh instance after an exponential backoff decided by
the sans-IO ``RestartTracker``; too many crashes within a window: dead.
The mailbox belongs to the ref, so refs and queued messages survive restarts.
When an actor stops or dies its mailbox closes and every pending ask, queued or
in progress, fails with ``ActorDead``. Leaving the supervisor cancels every
child; ``on_stop`` then runs shielded and bounded by ``stop_timeout``.
"""

from __future__ import annotations

import enum
import logging
import math
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from functools import partial
from typing import Any, TypeVar

import anyio
from anyio.abc import TaskGroup, TaskStatus

from hedgerow.errors import ActorDead, AskTimeout, MailboxFull

logger = logging.getLogger("hedgerow.actors")

_Child = TypeVar("_Child", bound="SupervisedChild")
_MAILBOX_CLOSED = (anyio.ClosedResourceError, anyio.BrokenResourceError)


class Actor:
    """Subclass and implement ``receive``; the hooks are optional."""

    tick_interval: float | None = None  # seconds between on_tick calls; None: never

    async def on_start(self) -> None:
        pass

    async def on_stop(self) -> None:
        pass

    async def on_tick(self) -> None:
        pass

    async def receive(self, message: Any) -> Any:
        raise NotImplementedError(f"{type(self).__name__} must implement receive()")


class Reply:
    """A one-shot reply slot: resolved exactly once, awaited by one asker."""

    def __init__(self) -> None:
        self._done = anyio.Event()
        self._outcome: tuple[Any, BaseException | None] | None = None

    @property
    def resolved(self) -> bool:
        return self._outcome is not None

    def resolve(self, value: Any = None, *, error: BaseException | None = None) -> None:
        if self._outcome is not None:
            raise RuntimeError("reply already resolved")
        self._outcome = (value, error)
        self._done.set()

    async def wait(self) -> Any:
        await self._done.wait()
        assert self._outcome is not None
        value, error = self._outcome
        if error is not None:
            raise error
        return value


@dataclass(frozen=True)
class Envelope:
    message: Any
    reply_to: Reply | None = None


class ActorState(enum.Enum):
    STARTING = "starting"
    RUNNING = "running"
    RESTARTING = "restarting"
    STOPPED = "stopped"  # finished, or its supervisor shut down
    DEAD = "dead"  # gave up after too many crashes

    @property
    def is_final(self) -> bool:
        return self in (ActorState.STOPPED, ActorState.DEAD)


@dataclass(frozen=True)
class ChildStatistics:
    name: str
    state: ActorState
    restarts: int
    mailbox_used: int = 0
    mailbox_capacity: int = 0
    pending_asks: int = 0


class SupervisedChild:
    """What a supervisor knows about one child: its name, state and restarts."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.state = ActorState.STARTING
        self.restarts = 0

    def statistics(self) -> ChildStatistics:
        return ChildStatistics(self.name, self.state, self.restarts)

    def _terminate(self, state: ActorState) -> None:
        if not self.state.is_final:
            self.state = state


class ActorRef(SupervisedChild):
    """The address of an actor; valid across restarts, never exposes the actor."""

    def __init__(self, name: str, mailbox_size: int) -> None:
        if mailbox_size < 1:
            raise ValueError("mailbox_size must be at least 1")
        super().__init__(name)
        self._send, self._receive = anyio.create_memory_object_stream[Envelope](mailbox_size)
        self._pending: set[Reply] = set()

    def tell_nowait(self, message: Any) -> None:
        try:
            self._send.send_nowait(Envelope(message))
        except anyio.WouldBlock:
            capacity = self._send.statistics().max_buffer_size
            raise MailboxFull(f"mailbox of actor {self.name!r} is full ({capacity:g} messages)") from None
        except _MAILBOX_CLOSED:
            raise self._dead_error() from None

    async def tell(self, message: Any) -> None:
        await self._post(Envelope(message))

    async def ask(self, message: Any, *, timeout: float = 5.0) -> Any:
        reply = Reply()
        self._pending.add(reply)
        try:
            # move_on_after, not fail_after: a TimeoutError raised by receive() is the answer.
            with anyio.move_on_after(timeout):
                await self._post(Envelope(message, reply))
                return await reply.wait()
        finally:
            self._pending.discard(reply)
        raise AskTimeout(f"actor {self.name!r} did not answer {type(message).__name__} within {timeout:g}s")

    def statistics(self) -> ChildStatistics:
        mailbox = self._send.statistics()
        return ChildStatistics(
            self.name, self.state, self.restarts,
            mailbox_used=mailbox.current_buffer_used,
            mailbox_capacity=int(mailbox.max_buffer_size),
            pending_asks=len(self._pending),
        )

    async def _post(self, envelope: Envelope) -> None:
        try:
            await self._send.send(envelope)
        except _MAILBOX_CLOSED:
            raise self._dead_error() from None

    async def _next_envelope(self, deadline: float) -> Envelope | None:
        with anyio.move_on_at(deadline):
            return await self._receive.receive()
        return None

    def _dead_error(self) -> ActorDead:
        return ActorDead(f"actor {self.name!r} is {self.state.value}")

    def _terminate(self, state: ActorState) -> None:
        if self.state.is_final:
            return
        super()._terminate(state)
        self._receive.close()  # senders blocked on a full mailbox wake with ActorDead
        self._send.close()
        for reply in self._pending:
            if not reply.resolved:
                reply.resolve(error=self._dead_error())


@dataclass(frozen=True)
class RestartPolicy:
    backoff_initial: float = 0.1
    backoff_max: float = 30.0
    backoff_factor: float = 2.0
    reset_after: float = 60.0  # an instance up this long resets the backoff
    max_restarts: int = 5  # more crashes than this within `window` seconds: dead
    window: float = 60.0


class RestartTracker:
    """Sans-IO restart decisions for one child: backoff delay, or give up (None)."""

    def __init__(self, policy: RestartPolicy) -> None:
        self._policy = policy
        self._crash_times: deque[float] = deque()
        self._next_delay = policy.backoff_initial

    def on_crash(self, *, now: float, started_at: float) -> float | None:
        policy = self._policy
        if now - started_at >= policy.reset_after:
            self._next_delay = policy.backoff_initial
        self._crash_times.append(now)
        while self._crash_times[0] <= now - policy.window:
            self._crash_times.popleft()
        if len(self._crash_times) > policy.max_restarts:
            return None
        delay = self._next_delay
        self._next_delay = min(delay * policy.backoff_factor, policy.backoff_max)
        return delay


class _Readiness:
    """Signals task_group.start() once, on the first successful start only."""

    def __init__(self, task_status: TaskStatus[None]) -> None:
        self._task_status: TaskStatus[None] | None = task_status

    def signal(self) -> None:
        if self._task_status is not None:
            task_status, self._task_status = self._task_status, None
            task_status.started()


_Attempt = Callable[[Callable[[], None]], Awaitable[None]]  # one run; calls ready() once up


class Supervisor:
    """Owns a task group of children; restarts crashed ones; stops all on exit."""

    def __init__(self, restart_policy: RestartPolicy = RestartPolicy(), *, stop_timeout: float = 5.0) -> None:
        self.restart_policy = restart_policy
        self.stop_timeout = stop_timeout
        self._task_group: TaskGroup | None = None
        self._children: dict[str, SupervisedChild] = {}

    async def __aenter__(self) -> Supervisor:
        self._task_group = anyio.create_task_group()
        await self._task_group.__aenter__()
        return self

    async def __aexit__(self, *exc_info: Any) -> bool | None:
        task_group, self._task_group = self._require_running(), None
        task_group.cancel_scope.cancel()  # leaving the block stops every child
        return await task_group.__aexit__(*exc_info)

    async def spawn(
        self, factory: Callable[[], Actor], *, name: str, mailbox_size: int = 64,
        restart_policy: RestartPolicy | None = None,
    ) -> ActorRef:
        """Start an actor; returns once an on_start has completed (a failing one is a
        crash, retried with backoff; ActorDead if the supervisor gives up first)."""
        task_group = self._require_running()
        ref = self._register(ActorRef(name, mailbox_size))
        attempt = partial(self._run_actor, ref, factory)
        await task_group.start(self._supervise, ref, attempt, restart_policy)
        if ref.state is ActorState.DEAD:
            raise ActorDead(f"actor {name!r} never started: it crashed too often")
        return ref

    def run_service(
        self, name: str, service: Callable[[], Awaitable[None]], *, restart_policy: RestartPolicy | None = None
    ) -> SupervisedChild:
        """Supervise a plain coroutine: restarted on crash, done when it returns."""
        child = self._register(SupervisedChild(name))

        async def attempt(ready: Callable[[], None]) -> None:
            child.state = ActorState.RUNNING
            ready()
            await service()

        self._require_running().start_soon(self._supervise, child, attempt, restart_policy, name=name)
        return child

    def statistics(self) -> list[ChildStatistics]:
        return [child.statistics() for child in self._children.values()]

    def _require_running(self) -> TaskGroup:
        if self._task_group is None:
            raise RuntimeError("supervisor is not running; use `async with Supervisor()`")
        return self._task_group

    def _register(self, child: _Child) -> _Child:
        if child.name in self._children:
            raise ValueError(f"a child named {child.name!r} already exists")
        self._children[child.name] = child
        return child

    async def _supervise(
        self, child: SupervisedChild, attempt: _Attempt, policy: RestartPolicy | None,
        *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
    ) -> None:
        readiness = _Readiness(task_status)
        tracker = RestartTracker(policy or self.restart_policy)
        try:
            while not child.state.is_final:
                started_at = anyio.current_time()
                try:
                    await attempt(readiness.signal)
                    child._terminate(ActorState.STOPPED)
                except Exception as error:
                    delay = tracker.on_crash(now=anyio.current_time(), started_at=started_at)
                    await self._after_crash(child, error, delay)
        finally:
            child._terminate(ActorState.STOPPED)
        readiness.signal()  # spawn() must return even if the child never started

    async def _after_crash(self, child: SupervisedChild, error: Exception, delay: float | None) -> None:
        if delay is None:
            logger.error("%r crashed too often; giving up, it is now dead", child.name, exc_info=error)
            child._terminate(ActorState.DEAD)
            return
        child.restarts += 1
        child.state = ActorState.RESTARTING
        logger.warning("%r crashed; restart #%d in %.3gs", child.name, child.restarts, delay, exc_info=error)
        await anyio.sleep(delay)

    async def _run_actor(self, ref: ActorRef, factory: Callable[[], Actor], ready: Callable[[], None]) -> None:
        actor = factory()
        await actor.on_start()
        ref.state = ActorState.RUNNING
        ready()
        try:
            await _serve(actor, ref)
        except anyio.get_cancelled_exc_class():
            ref._terminate(ActorState.STOPPED)  # fail pending asks before the slow on_stop
            raise
        finally:
            await self._stop_actor(actor, ref.name)

    async def _stop_actor(self, actor: Actor, name: str) -> None:
        with anyio.move_on_after(self.stop_timeout, shield=True) as scope:
            try:
                await actor.on_stop()
            except Exception:
                logger.exception("on_stop of %r failed", name)
        if scope.cancelled_caught:
            logger.error("on_stop of %r did not finish within %gs", name, self.stop_timeout)


async def _serve(actor: Actor, ref: ActorRef) -> None:
    """Handle messages one at a time; tick on schedule, also between messages."""
    period = math.inf if actor.tick_interval is None else actor.tick_interval
    next_tick = anyio.current_time() + period
    while True:
        if anyio.current_time() >= next_tick:
            await actor.on_tick()
            next_tick = anyio.current_time() + period
        envelope = await ref._next_envelope(next_tick)
        if envelope is not None:
            await _deliver(actor, envelope)


async def _deliver(actor: Actor, envelope: Envelope) -> None:
    if envelope.reply_to is None:
        await actor.receive(envelope.message)  # raising here crashes the actor
        return
    try:
        result = await actor.receive(envelope.message)
    except Exception as error:  # the asker gets it; the actor carries on
        envelope.reply_to.resolve(error=error)
    else:
        envelope.reply_to.resolve(result)
