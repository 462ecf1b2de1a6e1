"""Versioned operator policy as a sans-IO store (xDS-style snapshots).

Every accepted document becomes a new, immutable ``PolicyVersion`` with a
monotonically increasing number and the checksum of its canonical form. A
document that fails validation raises ``PolicyError`` and changes nothing: the
last good version stays current. Applying content identical to the current
version (same checksum, whatever the formatting) is a no-op. A rollback never
rewrites history; it creates a new version with an old version's content.
Only the newest ``keep`` versions are retained.

Virtual keys (``hedgerow key``) live in a block at the end of the text
(``policies.keys``): a document applied without a keys section keeps the keys
in force, and a rollback brings back an old version's configuration with
today's keys, so it can never revive a revoked key nor drop a new one.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from hedgerow.errors import UnknownPolicyVersion
from hedgerow.wire import PolicyVersionInfo, PolicyVersionText
from policies.keys import carry_keys, split_keys_block
from policies.loader import parse_policy_document, policy_checksum
from policies.schema import Policy

DEFAULT_KEEP = 100


@dataclass(frozen=True)
class PolicyVersion:
    version: int
    checksum: str
    applied_at: float  # seconds since the epoch, as given by the caller
    source: str
    text: str
    policy: Policy

    def info(self) -> PolicyVersionInfo:
        return PolicyVersionInfo(version=self.version, checksum=self.checksum,
                                 applied_at=self.applied_at, source=self.source)

    def with_text(self) -> PolicyVersionText:
        return PolicyVersionText(version=self.version, checksum=self.checksum,
                                 applied_at=self.applied_at, source=self.source, text=self.text)


class PolicyStore:
    def __init__(
        self, initial: Policy, text: str, *, source: str = "initial", now: float = 0.0,
        keep: int = DEFAULT_KEEP,
    ) -> None:
        if keep < 1:
            raise ValueError("keep must be at least 1")
        first = PolicyVersion(1, policy_checksum(initial), now, source, text, initial)
        self._versions: deque[PolicyVersion] = deque([first], maxlen=keep)

    @property
    def current(self) -> PolicyVersion:
        return self._versions[-1]

    def apply(self, text: str, source: str, now: float) -> PolicyVersion:
        """Validate and activate ``text``; raises ``PolicyError`` (nothing changes)."""
        text = carry_keys(text, self.current.text)
        policy = parse_policy_document(text, source)
        return self._activate(policy, text, source, now)

    def rollback(self, version: int, now: float) -> PolicyVersion:
        """A new version carrying the content of ``version`` (a no-op if current
        already has that content)."""
        old = self.get(version)
        source = f"rollback to v{version}"
        text = carry_keys(split_keys_block(old.text)[0], self.current.text)
        if text == old.text:
            return self._activate(old.policy, old.text, source, now)
        return self._activate(parse_policy_document(text, source), text, source, now)

    def get(self, version: int) -> PolicyVersion:
        for candidate in self._versions:
            if candidate.version == version:
                return candidate
        oldest, newest = self._versions[0].version, self.current.version
        raise UnknownPolicyVersion(
            f"no policy version {version}; versions {oldest}..{newest} are kept")

    def history(self) -> list[PolicyVersionInfo]:
        """The retained versions, oldest first."""
        return [version.info() for version in self._versions]

    def _activate(self, policy: Policy, text: str, source: str, now: float) -> PolicyVersion:
        checksum = policy_checksum(policy)
        if checksum == self.current.checksum:
            return self.current
        accepted = PolicyVersion(self.current.version + 1, checksum, now, source, text, policy)
        self._versions.append(accepted)
        return accepted
