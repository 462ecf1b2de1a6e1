"""The trust book: join tokens, holders and revocations (sans-IO, time injected)."""

from __future__ import annotations

import pytest

from hedgerow.trust.identity import Identity
from hedgerow.trust.tokens import JoinRefused, TrustBook

T0 = 1_800_000_000.0
HOUR = 3600.0


def book_with(role: str = "worker", **kw: object) -> tuple[TrustBook, str]:
    book = TrustBook()
    text, _ = book.create_token(role, T0, **kw)  # type: ignore[arg-type]
    return book, text


def test_a_token_buys_the_identity_of_its_role_under_the_name_asked() -> None:
    book, token = book_with("gateway")
    identity = book.redeem(token, "gw-1", T0 + 1, cert_expires_at=T0 + HOUR)
    assert identity == Identity("gateway", "gw-1")


@pytest.mark.parametrize("mangle", [
    lambda t: t[:-1] + ("A" if t[-1] != "A" else "B"),  # wrong secret
    lambda t: "hjt.zzzzzzzzzzzz." + t.split(".")[2],  # unknown id
    lambda t: "garbage",
    lambda t: "",
])
def test_a_wrong_token_is_refused_without_saying_why(mangle: object) -> None:
    book, token = book_with()
    with pytest.raises(JoinRefused) as refused:
        book.redeem(mangle(token), "w1", T0, cert_expires_at=T0 + HOUR)  # type: ignore[operator]
    assert refused.value.status == 401
    assert str(refused.value) == "invalid, expired or revoked join token"


def test_an_expired_token_is_refused() -> None:
    book, token = book_with(ttl_s=60)
    with pytest.raises(JoinRefused):
        book.redeem(token, "w1", T0 + 61, cert_expires_at=T0 + HOUR)


def test_tokens_are_only_for_workers_and_gateways() -> None:
    for role in ("admin", "control-plane"):
        with pytest.raises(ValueError):
            TrustBook().create_token(role, T0)


def test_a_name_held_by_another_joiner_is_refused_until_its_certificate_expires() -> None:
    book, first = book_with()
    second, _ = book.create_token("worker", T0)
    book.redeem(first, "cpu-1", T0, cert_expires_at=T0 + HOUR)
    with pytest.raises(JoinRefused) as refused:
        book.redeem(second, "cpu-1", T0 + 10, cert_expires_at=T0 + 10 + HOUR)
    assert refused.value.status == 409
    # Not even the holder's own token takes it again while it is held: a leaked
    # fleet token (or a name-bound one redeemed twice) cannot steal a live name.
    with pytest.raises(JoinRefused) as again:
        book.redeem(first, "cpu-1", T0 + 20, cert_expires_at=T0 + 20 + HOUR)
    assert again.value.status == 409
    # After the holder's certificate lapsed, the name is free.
    assert book.redeem(second, "cpu-1", T0 + 2 * HOUR, cert_expires_at=T0 + 3 * HOUR)


def test_a_token_bound_to_a_name_joins_only_as_that_name() -> None:
    book, token = book_with(name="edge-7")
    with pytest.raises(JoinRefused) as refused:
        book.redeem(token, "edge-8", T0, cert_expires_at=T0 + HOUR)
    assert refused.value.status == 403
    assert book.redeem(token, "edge-7", T0, cert_expires_at=T0 + HOUR).name == "edge-7"


def test_revoking_an_identity_kills_its_certificates_and_a_leaked_old_token_cannot_undo_it() -> None:
    book, token = book_with()
    identity = book.redeem(token, "w1", T0, cert_expires_at=T0 + HOUR)
    assert not book.is_revoked(identity, joined_at=T0)
    book.revoke_identity(identity, T0 + 100)
    assert book.is_revoked(identity, joined_at=T0)
    with pytest.raises(JoinRefused):
        book.renewed(identity, T0, T0 + 200, cert_expires_at=T0 + HOUR)
    with pytest.raises(JoinRefused) as refused:
        book.redeem(token, "w1", T0 + 300, cert_expires_at=T0 + HOUR)
    assert refused.value.status == 403
    fresh, _ = book.create_token("worker", T0 + 400)
    rejoined = book.redeem(fresh, "w1", T0 + 500, cert_expires_at=T0 + HOUR)
    assert not book.is_revoked(rejoined, joined_at=T0 + 500)


def test_revoking_a_token_revokes_everyone_who_joined_with_it() -> None:
    book, token = book_with()
    other, _ = book.create_token("worker", T0)
    a = book.redeem(token, "a", T0, cert_expires_at=T0 + HOUR)
    b = book.redeem(token, "b", T0, cert_expires_at=T0 + HOUR)
    c = book.redeem(other, "c", T0, cert_expires_at=T0 + HOUR)
    token_id = token.split(".")[1]
    assert sorted(book.revoke_token(token_id, T0 + 5)) == [a, b]
    assert book.is_revoked(a, T0) and book.is_revoked(b, T0) and not book.is_revoked(c, T0)
    with pytest.raises(JoinRefused):
        book.redeem(token, "d", T0 + 6, cert_expires_at=T0 + HOUR)


def test_the_book_survives_a_round_trip_through_its_json_and_keeps_no_secret() -> None:
    book, token = book_with()
    book.redeem(token, "w1", T0, cert_expires_at=T0 + HOUR)
    book.revoke_identity(Identity("worker", "x"), T0)
    data = book.to_json()
    assert token.split(".")[2] not in repr(data)
    again = TrustBook.from_json(data)
    assert again.redeem(token, "w2", T0 + 1, cert_expires_at=T0 + HOUR) == Identity("worker", "w2")
    assert "worker/w1" in again.holders
    assert again.is_revoked(Identity("worker", "x"), T0 - 1)


def test_a_renewed_lineage_stays_revoked_whenever_it_was_renewed() -> None:
    """Renewals carry the join time: a certificate renewed after the revocation
    (through another replica, say) is as revoked as the one it replaced."""
    book, token = book_with()
    identity = book.redeem(token, "w1", T0, cert_expires_at=T0 + HOUR)
    book.renewed(identity, T0, T0 + 100, cert_expires_at=T0 + 100 + HOUR)
    book.revoke_identity(identity, T0 + 200)
    assert book.is_revoked(identity, joined_at=T0)  # issued at T0 + 300 or not
    with pytest.raises(JoinRefused):
        book.renewed(identity, T0, T0 + 300, cert_expires_at=T0 + 300 + HOUR)


def test_a_non_finite_revocation_from_another_book_cannot_erase_one() -> None:
    ours, theirs = TrustBook(), TrustBook()
    ours.revoke_identity(Identity("admin", "root"), T0)
    theirs.revoked["admin/root"] = float("nan")
    ours.merge(theirs)
    assert ours.revoked["admin/root"] == T0


def test_names_with_a_trailing_newline_are_not_identities() -> None:
    book, token = book_with()
    with pytest.raises(JoinRefused) as refused:
        book.redeem(token, "cpu-7\n", T0, cert_expires_at=T0 + HOUR)
    assert refused.value.status == 400
