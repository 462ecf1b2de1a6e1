"""Numbers read from the network: plain ASCII digits of bounded length, or nothing."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gateway.corridor.relay import RelayOutcome, observe_chunk
from hedgerow.asgi import Message, Request
from hedgerow.decimal_text import MAX_DIGITS, parse_decimal
from hedgerow.errors import InvalidRequest, UpstreamFailed


@pytest.mark.parametrize("text", ["²", "٣", "１", "+1", "-1", " 1", "1 ", "1_0", "", "0x10",
                                  "1.0", "9" * (MAX_DIGITS + 1), "9" * 5000])
def test_anything_but_plain_ascii_digits_is_refused(text: str) -> None:
    assert parse_decimal(text) is None
    assert parse_decimal(text.encode()) is None


@given(st.integers(0, 10**MAX_DIGITS - 1))
def test_plain_digits_read_as_the_number_they_write(number: int) -> None:
    assert parse_decimal(str(number)) == number
    assert parse_decimal(b"%d" % number) == number


@given(st.text(max_size=25))
def test_it_never_raises_and_never_reads_what_int_would_not(text: str) -> None:
    number = parse_decimal(text)
    if number is not None:
        assert text.isascii() and text.isdigit() and number == int(text)


@pytest.mark.parametrize("usage", [{"prompt_tokens": "12"}, {"completion_tokens": 1.5},
                                   {"prompt_tokens": True}, {"prompt_tokens": -1},
                                   {"completion_tokens": 2**40}, "12"])
def test_a_workers_odd_token_count_is_a_malformed_upstream(usage: object) -> None:
    with pytest.raises(UpstreamFailed) as caught:
        observe_chunk(RelayOutcome(), {"choices": [], "usage": usage})
    assert caught.value.code == "upstream_malformed"


@pytest.mark.parametrize("chunk", [{"choices": ["x"]}, {"choices": [{"text": 5}]},
                                   {"choices": [{"delta": {"content": ["x"]}}]},
                                   {"choices": [{"text": "a", "finish_reason": 3}]}])
def test_a_workers_odd_choice_is_a_malformed_upstream(chunk: dict[str, object]) -> None:
    with pytest.raises(UpstreamFailed) as caught:
        observe_chunk(RelayOutcome(), chunk)
    assert caught.value.code == "upstream_malformed"


def test_a_workers_usage_is_read() -> None:
    outcome = RelayOutcome()
    assert observe_chunk(outcome, {"choices": [], "usage": {"prompt_tokens": 3,
                                                            "completion_tokens": 4}})
    assert outcome.total_tokens == 7


@pytest.mark.anyio
@pytest.mark.parametrize("declared", [b"\xb2", b"9" * 5000, b"+5", b"5_0", b"5 5"])
async def test_an_odd_request_content_length_is_a_400(declared: bytes) -> None:
    """h11 and h2 refuse these themselves; aioquic's HTTP/3 passes some through."""
    async def receive() -> Message:
        return {"type": "http.request", "body": b"{}", "more_body": False}

    async def send(message: Message) -> None:
        raise AssertionError("nothing is sent by body()")

    scope = {"type": "http", "http_version": "3", "headers": [(b"content-length", declared)]}
    with pytest.raises(InvalidRequest) as caught:
        await Request(scope, receive, send).body(1024)
    assert caught.value.status == 400 and caught.value.param == "content-length"
