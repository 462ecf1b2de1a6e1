"""The QUIC session-ticket store: bounded, expiring, single use."""

from __future__ import annotations

import datetime
from collections import OrderedDict

import pytest
from aioquic.tls import CipherSuite, SessionTicket
from hypothesis import given
from hypothesis import strategies as st

from gateway.edge.quic_tickets import QuicTicketStore

T0 = datetime.datetime(2026, 1, 1, tzinfo=datetime.UTC)
HOUR = datetime.timedelta(hours=1)


def make_ticket(label: bytes, *, lifetime: datetime.timedelta = 24 * HOUR) -> SessionTicket:
    return SessionTicket(
        age_add=0,
        cipher_suite=CipherSuite.AES_128_GCM_SHA256,
        not_valid_after=T0 + lifetime,
        not_valid_before=T0,
        resumption_secret=b"secret",
        server_name="localhost",
        ticket=label,
    )


def test_a_ticket_is_returned_once() -> None:
    store = QuicTicketStore()
    ticket = make_ticket(b"a")
    store.add(ticket, now=T0)

    assert store.pop(b"a", now=T0 + HOUR) is ticket
    assert store.pop(b"a", now=T0 + HOUR) is None
    assert len(store) == 0


def test_unknown_label_is_a_miss() -> None:
    store = QuicTicketStore()
    assert store.pop(b"nope", now=T0) is None
    assert store.statistics().missed == 1


def test_ticket_expires_at_its_own_lifetime() -> None:
    store = QuicTicketStore(max_age=48 * HOUR)
    store.add(make_ticket(b"a", lifetime=2 * HOUR), now=T0)
    store.add(make_ticket(b"b", lifetime=2 * HOUR), now=T0)

    assert store.pop(b"a", now=T0 + 2 * HOUR - datetime.timedelta(seconds=1)) is not None
    assert store.pop(b"b", now=T0 + 2 * HOUR) is None
    assert store.statistics().expired == 1


def test_store_caps_a_long_ticket_lifetime() -> None:
    store = QuicTicketStore(max_age=HOUR)
    store.add(make_ticket(b"a", lifetime=24 * HOUR), now=T0)

    assert store.pop(b"a", now=T0 + 2 * HOUR) is None


def test_oldest_ticket_is_evicted_beyond_the_bound() -> None:
    store = QuicTicketStore(max_tickets=2)
    for label in (b"a", b"b", b"c"):
        store.add(make_ticket(label), now=T0)

    assert store.pop(b"a", now=T0) is None
    assert store.pop(b"b", now=T0) is not None
    assert store.pop(b"c", now=T0) is not None
    assert store.statistics().evicted == 1


def test_prune_drops_only_expired_tickets() -> None:
    store = QuicTicketStore()
    store.add(make_ticket(b"short", lifetime=HOUR), now=T0)
    store.add(make_ticket(b"long", lifetime=3 * HOUR), now=T0)

    assert store.prune(now=T0 + 2 * HOUR) == 1
    assert store.pop(b"long", now=T0 + 2 * HOUR) is not None


def test_hooks_take_time_from_the_given_clock() -> None:
    store = QuicTicketStore()
    clock = [T0]
    hooks = store.hooks(lambda: clock[0])
    hooks.session_ticket_handler(make_ticket(b"a", lifetime=HOUR))
    hooks.session_ticket_handler(make_ticket(b"b", lifetime=HOUR))

    assert hooks.session_ticket_fetcher(b"a") is not None
    clock[0] = T0 + 2 * HOUR
    assert hooks.session_ticket_fetcher(b"b") is None


@pytest.mark.parametrize("max_tickets, max_age", [(0, HOUR), (1, datetime.timedelta(0))])
def test_bounds_must_be_positive(max_tickets: int, max_age: datetime.timedelta) -> None:
    with pytest.raises(ValueError):
        QuicTicketStore(max_tickets=max_tickets, max_age=max_age)


operations = st.lists(st.tuples(st.sampled_from(["add", "pop"]), st.integers(0, 5)), max_size=60)


@given(operations=operations, max_tickets=st.integers(1, 4))
def test_store_matches_a_bounded_lru_model(
    operations: list[tuple[str, int]], max_tickets: int
) -> None:
    store = QuicTicketStore(max_tickets=max_tickets)
    model: OrderedDict[bytes, SessionTicket] = OrderedDict()
    for operation, index in operations:
        label = bytes([index])
        if operation == "add":
            ticket = make_ticket(label)
            store.add(ticket, now=T0)
            model.pop(label, None)
            model[label] = ticket
            while len(model) > max_tickets:
                model.popitem(last=False)
        else:
            assert store.pop(label, now=T0) is model.pop(label, None)
        assert len(store) == len(model) <= max_tickets


def test_a_ticket_resumes_across_one_rotation_and_not_two() -> None:
    store = QuicTicketStore(max_age=48 * HOUR)
    store.rotate_every(HOUR)  # T0 is on an hour: periods start at T0, T0+1h, ...
    store.add(make_ticket(b"early"), now=T0 + datetime.timedelta(minutes=5))
    store.add(make_ticket(b"late"), now=T0 + datetime.timedelta(minutes=59))
    store.add(make_ticket(b"gone"), now=T0 + datetime.timedelta(minutes=59))
    # One rotation later (the next hour): both still resume, however early they came.
    assert store.pop(b"early", now=T0 + HOUR + datetime.timedelta(minutes=59)) is not None
    # Two rotations later: retired, even though its own lifetime has 22 h left.
    assert store.pop(b"late", now=T0 + 2 * HOUR) is None
    assert store.prune(now=T0 + 2 * HOUR) == 1  # "gone", retired by rotation
    stats = store.statistics()
    assert (stats.resumed, stats.rotated, stats.expired, stats.stored) == (1, 2, 0, 0)


def test_rotation_off_keeps_the_ticket_lifetime() -> None:
    store = QuicTicketStore(max_age=48 * HOUR)
    store.add(make_ticket(b"a"), now=T0)
    assert store.pop(b"a", now=T0 + 20 * HOUR) is not None
    with pytest.raises(ValueError):
        store.rotate_every(datetime.timedelta(0))
