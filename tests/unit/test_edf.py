from __future__ import annotations

import math

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from policies.edf import EdfHandle, EdfQueue


def test_pops_earliest_deadline_first_and_ties_fifo() -> None:
    queue: EdfQueue[str] = EdfQueue(capacity=10)
    queue.push("batch", deadline=600.0, now=0.0)
    queue.push("chat-1", deadline=5.0, now=0.0)
    queue.push("chat-2", deadline=5.0, now=0.0)
    queue.push("soon", deadline=2.0, now=0.0)
    assert [queue.pop(1.0) for _ in range(5)] == ["soon", "chat-1", "chat-2", "batch", None]


def test_expired_items_are_never_popped_and_come_back_from_expire() -> None:
    queue: EdfQueue[str] = EdfQueue(capacity=10)
    queue.push("late", deadline=1.0, now=0.0)
    queue.push("fine", deadline=9.0, now=0.0)
    assert queue.pop(now=1.0) == "fine"  # expiry at now >= deadline
    assert len(queue) == 1
    assert queue.pop(now=1.0) is None
    assert queue.expire(now=1.0) == ["late"]
    assert len(queue) == 0 and queue.expire(now=5.0) == []


def test_expire_returns_in_deadline_order_and_keeps_the_rest() -> None:
    queue: EdfQueue[int] = EdfQueue(capacity=10)
    for deadline in (3.0, 1.0, 7.0, 2.0):
        queue.push(int(deadline), deadline, now=0.0)
    assert queue.expire(now=3.0) == [1, 2, 3]
    assert queue.next_deadline() == 7.0
    assert queue.pop(now=3.0) == 7


def test_lower_class_is_not_starved_its_deadline_comes_due() -> None:
    queue: EdfQueue[str] = EdfQueue(capacity=100)
    queue.push("batch", deadline=10.0, now=0.0)
    served = []
    for tick in range(20):  # one slot frees per second; interactive work, 1 s deadlines
        now = float(tick)
        queue.push(f"chat{tick}", deadline=now + 1.0, now=now)
        served.append(queue.pop(now))
    # At t=9 the batch request's deadline (10) ties the newest chat's and it was
    # queued first: it runs, while its deadline can still be met.
    assert served.index("batch") == 9
    assert served[:9] == [f"chat{t}" for t in range(9)]


def test_push_on_full_queue_returns_none_and_queues_nothing() -> None:
    queue: EdfQueue[str] = EdfQueue(capacity=2)
    assert queue.push("a", 1.0, now=0.0) is not None
    assert queue.push("b", 2.0, now=0.0) is not None
    assert queue.push("c", 0.5, now=0.0) is None
    assert len(queue) == 2
    assert queue.pop(now=0.0) == "a"
    assert queue.push("c", 0.5, now=0.0) is not None


def test_cancel_removes_exactly_that_item_once() -> None:
    queue: EdfQueue[str] = EdfQueue(capacity=5)
    a = queue.push("a", 1.0, now=0.0)
    queue.push("b", 2.0, now=0.0)
    assert a is not None
    assert queue.cancel(a)
    assert not queue.cancel(a)
    assert len(queue) == 1
    assert queue.next_deadline() == 2.0
    assert queue.pop(now=0.0) == "b"
    assert not queue.cancel(EdfHandle(999))


def test_cancel_of_a_popped_or_expired_item_is_harmless() -> None:
    queue: EdfQueue[str] = EdfQueue(capacity=5)
    popped = queue.push("p", 5.0, now=0.0)
    expired = queue.push("e", 1.0, now=0.0)
    assert popped is not None and expired is not None
    assert queue.pop(now=2.0) == "p"
    assert not queue.cancel(popped)
    assert queue.cancel(expired)  # set aside by pop, still queued until expire
    assert queue.expire(now=2.0) == []


def test_next_deadline_includes_items_pop_set_aside() -> None:
    queue: EdfQueue[str] = EdfQueue(capacity=5)
    assert queue.next_deadline() is None
    queue.push("old", 1.0, now=0.0)
    queue.push("new", 8.0, now=0.0)
    assert queue.pop(now=2.0) == "new"
    assert queue.next_deadline() == 1.0  # the timer says: expire now


def test_many_cancellations_stay_bounded() -> None:
    queue: EdfQueue[int] = EdfQueue(capacity=4)
    for i in range(1000):
        handle = queue.push(i, deadline=1e6 - i, now=0.0)
        assert handle is not None and queue.cancel(handle)
    assert len(queue._order) + len(queue._expiry) <= 2 * (2 * queue.capacity + 1)
    for i in range(1000):  # expired items stepped over by pop, then shed
        queue.push(i, deadline=float(i), now=float(i))
        assert queue.pop(now=float(i)) is None
        assert queue.expire(now=float(i)) == [i]
    assert len(queue._order) + len(queue._expiry) + len(queue._overdue) <= 3 * (2 * queue.capacity + 1)


def test_service_key_orders_while_deadline_expires() -> None:
    """A batch item may be served after its due time, until its later hard deadline."""
    queue: EdfQueue[str] = EdfQueue(capacity=8)
    queue.push("batch", 5.0, now=0.0, key=10.0)  # due at 10, given up at 5
    queue.push("interactive", 0.5, now=0.1, key=0.5)
    assert queue.count_ahead(0.6) == 1
    assert queue.pop(now=0.2) == "interactive"
    assert queue.pop(now=4.0) == "batch"
    queue.push("late", 5.0, now=0.0, key=10.0)
    assert queue.pop(now=6.0) is None
    assert queue.expire(now=6.0) == ["late"]


def test_count_ahead_counts_earlier_and_equal_deadlines() -> None:
    queue: EdfQueue[str] = EdfQueue(capacity=10)
    for deadline in (1.0, 5.0, 5.0, 9.0):
        queue.push("x", deadline, now=0.0)
    assert queue.count_ahead(0.5) == 0
    assert queue.count_ahead(5.0) == 3
    assert queue.count_ahead(math.inf) == 4


def test_nan_deadline_is_rejected() -> None:
    with pytest.raises(ValueError):
        EdfQueue[str](capacity=1).push("x", math.nan, now=0.0)


class EdfMachine(RuleBasedStateMachine):
    """Any interleaving of push / pop / cancel / expire with time moving forward."""

    def __init__(self) -> None:
        super().__init__()
        self.queue: EdfQueue[int] = EdfQueue(capacity=8)
        self.now = 0.0
        self.next_id = 0
        self.queued: dict[int, float] = {}  # id -> deadline, the model of the queue
        self.handles: dict[int, EdfHandle] = {}
        self.left: dict[int, str] = {}  # id -> how it left
        self.last_pop: float | None = None  # deadline of the last pop since a push

    @rule(offset=st.floats(-2, 20, allow_nan=False))
    def push(self, offset: float) -> None:
        item = self.next_id
        self.next_id += 1
        handle = self.queue.push(item, self.now + offset, self.now)
        if len(self.queued) >= 8:
            assert handle is None
            return
        assert handle is not None
        self.queued[item] = self.now + offset
        self.handles[item] = handle
        self.last_pop = None

    @rule(step=st.floats(0, 5, allow_nan=False))
    def advance(self, step: float) -> None:
        self.now += step

    @rule()
    def pop(self) -> None:
        item = self.queue.pop(self.now)
        live = {i: d for i, d in self.queued.items() if d > self.now}
        if item is None:
            assert not live
            return
        deadline = self.queued.pop(item)
        assert deadline > self.now, "an expired item was popped"
        assert (deadline, item) == min((d, i) for i, d in live.items()), "not EDF/FIFO"
        assert self.last_pop is None or deadline >= self.last_pop
        self.last_pop = deadline
        self._left(item, "popped")

    @rule()
    def expire(self) -> None:
        items = self.queue.expire(self.now)
        due = sorted((d, i) for i, d in self.queued.items() if d <= self.now)
        assert items == [i for _, i in due]
        for item in items:
            del self.queued[item]
            self._left(item, "expired")

    @precondition(lambda self: bool(self.handles))
    @rule(data=st.data())
    def cancel(self, data: st.DataObject) -> None:
        item = data.draw(st.sampled_from(sorted(self.handles)))
        removed = self.queue.cancel(self.handles[item])
        assert removed == (item in self.queued)
        if removed:
            del self.queued[item]
            self._left(item, "cancelled")

    def _left(self, item: int, how: str) -> None:
        assert item not in self.left, f"{item} left twice: {self.left[item]} and {how}"
        self.left[item] = how

    @invariant()
    def length_and_next_deadline_match(self) -> None:
        assert len(self.queue) == len(self.queued)
        assert self.queue.next_deadline() == min(self.queued.values(), default=None)

    def teardown(self) -> None:
        for item in self.queue.expire(math.inf):
            self._left(item, "expired")
        assert set(self.left) == set(self.handles), "an item was lost"


EdfMachine.TestCase.settings = settings(max_examples=300, stateful_step_count=60, deadline=None)
test_edf_under_any_interleaving = EdfMachine.TestCase
