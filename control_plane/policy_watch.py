"""A watched policy directory: edit a ``*.yaml`` file there and it is applied.

``PolicyDirectory`` decides (sans-IO) which files to apply from successive
listings of ``name → FileStamp``. A file is applied once its stamp (mtime,
size) differs from the last one handled and has held still for one poll, so a
file caught half-written is read only after the writer has finished. On the
first listing the newest file is applied: the directory, not the process
start, says which policy is in force. Deleting a file changes nothing.

``PolicyDirectoryWatcher`` is the I/O loop around it: list, stat and read off
the event loop, ask the policy actor to apply, log rejections as
``file:line:column: path: message``. Whatever is rejected, the last good
policy stays active.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import anyio

from control_plane.policy_actor import Applied, ApplyPolicy
from hedgerow.actors import ActorRef
from policies.loader import decode_policy_bytes
from policies.schema import PolicyError

log = logging.getLogger("hedgerow.control_plane.policy")

POLL_INTERVAL_S = 0.5
ASK_TIMEOUT_S = 10.0
MAX_FILE_BYTES = 4 * 1_048_576
MAX_FILES = 1000
SUFFIXES = (".yaml", ".yml")


@dataclass(frozen=True)
class FileStamp:
    mtime_ns: int
    size: int


class PolicyDirectory:
    def __init__(self) -> None:
        self._previous: dict[str, FileStamp] | None = None
        self._handled: dict[str, FileStamp] = {}

    def changed(self, listing: Mapping[str, FileStamp]) -> list[str]:
        """Names to apply now, oldest change first."""
        if self._previous is None:
            ready = _newest(listing)
            self._handled = dict(listing)
        else:
            ready = [name for name, stamp in listing.items()
                     if self._handled.get(name) != stamp and self._previous.get(name) == stamp]
            self._handled = {n: s for n, s in self._handled.items() if n in listing}
            self._handled.update((name, listing[name]) for name in ready)
        self._previous = dict(listing)
        return sorted(ready, key=lambda name: (listing[name].mtime_ns, name))


def _newest(listing: Mapping[str, FileStamp]) -> list[str]:
    if not listing:
        return []
    return [max(listing, key=lambda name: (listing[name].mtime_ns, name))]


def is_policy_file(name: str) -> bool:
    # Editors' lock and backup files (".#x.yaml", "#x.yaml#", "x.yaml~") never count.
    return name.endswith(SUFFIXES) and not name.startswith((".", "#"))


def list_policy_files(directory: Path) -> dict[str, FileStamp]:
    """Blocking: run it in a worker thread."""
    listing: dict[str, FileStamp] = {}
    for entry in sorted(directory.iterdir())[:MAX_FILES]:
        if not is_policy_file(entry.name):
            continue
        try:
            stat = entry.stat()
        except FileNotFoundError:
            continue  # removed between listing and stat
        if entry.is_file():
            listing[entry.name] = FileStamp(stat.st_mtime_ns, stat.st_size)
    return listing


class PolicyDirectoryWatcher:
    """Created once, so a restarted loop keeps knowing what it already applied."""

    def __init__(self, directory: Path, policies: ActorRef,
                 interval_s: float = POLL_INTERVAL_S) -> None:
        self.directory = directory
        self.policies = policies
        self.interval_s = interval_s
        self._decisions = PolicyDirectory()

    async def run(self) -> None:
        while True:
            await anyio.sleep(self.interval_s)
            await self.poll()

    async def poll(self) -> None:
        try:
            listing = await anyio.to_thread.run_sync(list_policy_files, self.directory)
        except OSError as error:
            log.warning("cannot list policy directory %s: %s", self.directory, error)
            return
        for name in self._decisions.changed(listing):
            await self._apply(self.directory / name)

    async def _apply(self, path: Path) -> None:
        text = await _read_policy_text(path)
        if text is None:
            return
        try:
            applied: Applied = await self.policies.ask(ApplyPolicy(text, str(path)),
                                                       timeout=ASK_TIMEOUT_S)
        except PolicyError:
            return  # the policy actor has logged every issue; the last good policy stays
        if not applied.changed:
            log.info("policy file %s has the content of the active v%d; nothing to do",
                     path, applied.version.version)


async def _read_policy_text(path: Path) -> str | None:
    try:
        data = await anyio.to_thread.run_sync(_read_bounded, path)
        return decode_policy_bytes(data, str(path))
    except OSError as error:
        log.warning("cannot read policy file %s: %s", path, error)
    except PolicyError as error:
        log.warning("policy file rejected; the active policy stays:\n%s", error)
    return None


def _read_bounded(path: Path) -> bytes:
    with path.open("rb") as file:
        data = file.read(MAX_FILE_BYTES + 1)
    if len(data) > MAX_FILE_BYTES:
        raise OSError(f"larger than {MAX_FILE_BYTES} bytes")
    return data
