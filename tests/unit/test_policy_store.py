"""The versioned policy store and the watched-directory decisions (both sans-IO)."""

from __future__ import annotations

import pytest

from control_plane.policy_store import PolicyStore
from control_plane.policy_watch import FileStamp, PolicyDirectory, is_policy_file
from hedgerow.errors import UnknownPolicyVersion
from policies.loader import parse_policy_document, policy_checksum
from policies.schema import PolicyError

BASE = "limits: {max_tokens: 100}\n"


def doc(max_tokens: int) -> str:
    return f"limits: {{max_tokens: {max_tokens}}}\n"


def new_store(keep: int = 100) -> PolicyStore:
    return PolicyStore(parse_policy_document(BASE), BASE, source="boot", now=1.0, keep=keep)


def test_the_initial_policy_is_version_one() -> None:
    store = new_store()
    assert store.current.version == 1
    assert store.current.source == "boot" and store.current.text == BASE
    assert store.current.checksum == policy_checksum(store.current.policy)


def test_each_accepted_policy_gets_the_next_version() -> None:
    store = new_store()
    v2 = store.apply(doc(200), "a.yaml", now=2.0)
    v3 = store.apply(doc(300), "b.yaml", now=3.0)
    assert (v2.version, v3.version) == (2, 3)
    assert store.current is v3
    assert store.current.policy.limits.max_tokens == 300
    assert (v3.applied_at, v3.source) == (3.0, "b.yaml")


def test_identical_content_is_a_no_op_whatever_its_formatting() -> None:
    store = new_store()
    same = store.apply("# reformatted\nlimits:\n  max_tokens: 100\n", "c.yaml", now=2.0)
    assert same.version == 1 and same.source == "boot"
    assert len(store.history()) == 1


def test_a_rejected_policy_keeps_the_last_good_one() -> None:
    store = new_store()
    store.apply(doc(200), "a.yaml", now=2.0)
    with pytest.raises(PolicyError) as caught:
        store.apply("limits: {max_tokenz: 5}\n", "bad.yaml", now=3.0)
    assert str(caught.value.issues[0]).startswith("bad.yaml:1:10: limits.max_tokenz:")
    assert store.current.version == 2
    assert store.current.policy.limits.max_tokens == 200
    assert [v.version for v in store.history()] == [1, 2]


def test_rollback_creates_a_new_version_with_the_old_content() -> None:
    store = new_store()
    store.apply(doc(200), "a.yaml", now=2.0)
    rolled = store.rollback(1, now=3.0)
    assert rolled.version == 3
    assert rolled.checksum == store.get(1).checksum
    assert rolled.text == BASE and rolled.source == "rollback to v1"
    assert store.current.policy.limits.max_tokens == 100
    assert store.get(2).policy.limits.max_tokens == 200  # history is never rewritten


def test_rollback_to_the_current_content_changes_nothing() -> None:
    store = new_store()
    store.apply(doc(200), "a.yaml", now=2.0)
    assert store.rollback(2, now=3.0).version == 2


def test_unknown_versions_are_404s() -> None:
    store = new_store()
    with pytest.raises(UnknownPolicyVersion) as caught:
        store.rollback(7, now=2.0)
    assert caught.value.status == 404
    assert store.current.version == 1


def test_history_is_bounded_and_versions_keep_increasing() -> None:
    store = new_store(keep=3)
    for tokens in range(101, 111):
        store.apply(doc(tokens), "a.yaml", now=float(tokens))
    assert [v.version for v in store.history()] == [9, 10, 11]
    with pytest.raises(UnknownPolicyVersion, match="versions 9..11 are kept"):
        store.get(8)
    assert store.apply(doc(5), "a.yaml", now=200.0).version == 12


# -- the watched directory ----------------------------------------------------------


def stamp(mtime: int, size: int = 10) -> FileStamp:
    return FileStamp(mtime_ns=mtime, size=size)


def test_on_start_only_the_newest_file_is_applied() -> None:
    directory = PolicyDirectory()
    assert directory.changed({"a.yaml": stamp(5), "b.yaml": stamp(9), "c.yaml": stamp(1)}) == ["b.yaml"]
    assert directory.changed({"a.yaml": stamp(5), "b.yaml": stamp(9), "c.yaml": stamp(1)}) == []


def test_an_empty_directory_applies_nothing() -> None:
    assert PolicyDirectory().changed({}) == []


def test_a_change_is_applied_once_it_has_held_still_for_one_poll() -> None:
    directory = PolicyDirectory()
    directory.changed({"a.yaml": stamp(1)})
    assert directory.changed({"a.yaml": stamp(2, size=3)}) == []  # being written
    assert directory.changed({"a.yaml": stamp(3, size=8)}) == []  # still being written
    assert directory.changed({"a.yaml": stamp(3, size=8)}) == ["a.yaml"]
    assert directory.changed({"a.yaml": stamp(3, size=8)}) == []  # applied once


def test_new_files_are_applied_oldest_change_first() -> None:
    directory = PolicyDirectory()
    directory.changed({})
    listing = {"z.yaml": stamp(4), "a.yaml": stamp(7)}
    directory.changed(listing)
    assert directory.changed(listing) == ["z.yaml", "a.yaml"]


def test_deleting_a_file_applies_nothing_and_recreating_it_applies_it() -> None:
    directory = PolicyDirectory()
    directory.changed({"a.yaml": stamp(1)})
    assert directory.changed({}) == []
    directory.changed({"a.yaml": stamp(1)})
    assert directory.changed({"a.yaml": stamp(1)}) == ["a.yaml"]


@pytest.mark.parametrize("name, counts", [
    ("policy.yaml", True), ("edge.yml", True), (".#policy.yaml", False),
    ("#policy.yaml#", False), ("policy.yaml~", False), ("policy.yaml.swp", False),
    ("notes.txt", False),
])
def test_only_policy_files_count(name: str, counts: bool) -> None:
    assert is_policy_file(name) is counts
