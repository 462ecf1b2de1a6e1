"""A parsed request against the policy's size limits (sans-IO).

``limits`` bounds what one request may ask of the system: how many messages,
how much text in one message and in all of them, and how many tokens it may
ask for; a priority class may lower ``max_tokens`` for its own requests
(``classes[].max_tokens``). Every violation is an ``InvalidRequest`` (400 with
the OpenAI error envelope) naming the parameter, checked before the request
is admitted, so an oversized request never costs a queue slot or a worker.
"""

from __future__ import annotations

from collections.abc import Sequence

from hedgerow.errors import InvalidRequest
from policies.schema import Policy


def token_cap(policy: Policy, priority_class: str) -> int:
    """The largest ``max_tokens`` a request of ``priority_class`` may ask for."""
    cap = policy.limits.max_tokens
    for klass in policy.classes:
        if klass.name == priority_class and klass.max_tokens is not None:
            return min(cap, klass.max_tokens)
    return cap


def check_request_limits(
    policy: Policy,
    priority_class: str,
    *,
    message_chars: Sequence[int],
    token_limit: int | None,
    chat: bool = True,
) -> None:
    """Raise ``InvalidRequest`` for the first limit the request exceeds.

    ``message_chars``: the text length of each chat message, or one entry,
    the prompt's length, for a text completion (``chat=False``).
    """
    limits = policy.limits
    if chat and len(message_chars) > limits.max_messages:
        raise InvalidRequest(f"too many messages: {len(message_chars)} > {limits.max_messages}",
                             param="messages", code="too_many_messages")
    for index, chars in enumerate(message_chars):
        if chars > limits.max_message_chars:
            param = f"messages.{index}.content" if chat else "prompt"
            raise InvalidRequest(f"{param} has {chars} characters; the limit is "
                                 f"{limits.max_message_chars}", param=param,
                                 code="message_too_long")
    total = sum(message_chars)
    if total > limits.max_prompt_chars:
        raise InvalidRequest(f"the prompt has {total} characters in all; the limit is "
                             f"{limits.max_prompt_chars}", param="messages" if chat else "prompt",
                             code="prompt_too_long")
    cap = token_cap(policy, priority_class)
    if token_limit is not None and token_limit > cap:
        raise InvalidRequest(f"max_tokens {token_limit} exceeds the limit of {cap} for the "
                             f"{priority_class!r} class", param="max_tokens",
                             code="max_tokens_too_large")
