"""Keeping the virtual keys across a control-plane restart without Redis.

Without Redis the policy versions live in this process's memory and a restart
starts again from ``--policy FILE``: every key would be gone. So the keys
block of the active version (``policies.keys``: digests, never keys) is saved
in the state directory whenever it changes, and at start it is applied on top
of the policy file (a version "keys restored from …"). With Redis the shared
store keeps every version and this is not used.
"""

from __future__ import annotations

import logging
from pathlib import Path

from control_plane.policy_actor import ApplyPolicy
from control_plane.policy_store import PolicyVersion
from hedgerow.actors import ActorRef
from hedgerow.latest import LatestValue
from hedgerow.trust.pem import write_atomically
from policies.keys import carry_keys, split_keys_block
from policies.schema import PolicyError

log = logging.getLogger("hedgerow.control_plane.keys")

ASK_TIMEOUT_S = 10.0
FILE_MODE = 0o600


async def restore_keys(policies: ActorRef, published: LatestValue[PolicyVersion],
                       path: Path) -> None:
    """Apply the saved keys block over the starting version (if it has none of its own)."""
    try:
        saved = path.read_text()
    except FileNotFoundError:
        return
    current = published.value
    restored = carry_keys(current.text, saved)
    if restored == current.text:
        return
    try:
        await policies.ask(ApplyPolicy(restored, f"keys restored from {path}"),
                           timeout=ASK_TIMEOUT_S)
    except PolicyError as error:
        # e.g. a key's tenant left the policy file: start without the keys, say why.
        log.error("the saved keys in %s do not fit the policy; starting without them:\n%s",
                  path, error)


async def save_keys(published: LatestValue[PolicyVersion], path: Path) -> None:
    """Write the active version's keys block to ``path`` whenever it changes."""
    version, current = published.version, published.value
    saved = _block(path)
    while True:
        block = split_keys_block(current.text)[1]
        if block and block != saved:
            write_atomically(path, block.encode(), mode=FILE_MODE)
            saved = block
        version, current = await published.wait_newer(version)


def _block(path: Path) -> str:
    try:
        return path.read_text()
    except FileNotFoundError:
        return ""
