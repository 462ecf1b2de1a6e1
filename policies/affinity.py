"""Prefix-affinity keys that every turn of one conversation shares (sans-IO).

Prompt reuse pays off only when a conversation's next turn reaches the worker
(and slot) that still holds the conversation's KV cache. Rendezvous hashing
(``policies.scoring``) sends equal keys to the same worker, so the key must
not change from turn to turn. Hashing "all messages but the last" does
change: turn 1 ``[system, user1]`` hashes ``[system]`` while turn 2
``[system, user1, assistant1, user2]`` hashes three messages, and the two
turns land on unrelated workers. ``conversation_key`` hashes what every turn
starts with: the model, the leading system messages and the first user
message.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence


def conversation_key(model: str, messages: Sequence[tuple[str, str]]) -> str | None:
    """A stable key for the conversation ``messages`` (role, text) belong to.

    None when there is no user message to anchor it.
    """
    anchor: list[tuple[str, str]] = []
    for role, text in messages:
        anchor.append((role, text))
        if role == "user":
            digest = hashlib.blake2b(json.dumps([model, anchor]).encode(), digest_size=16)
            return digest.hexdigest()
    return None
