"""CPU time and memory of a process tree, from the kernel's own accounting (Linux /proc).

``cpu_seconds(pid)`` is user + system time of ``pid`` and every live
descendant (an nginx master and its workers, say), read from
``/proc/PID/stat`` fields 14 and 15. Take it before and after a measured
interval: the difference is the CPU that tree spent in between, whatever it
was doing. The resolution is one clock tick (usually 10 ms), so divide a
delta over many requests, never judge one request by it.
"""

from __future__ import annotations

import os
from pathlib import Path

PROC = Path("/proc")
CLOCK_TICKS_PER_S = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of ``pid`` and its live descendants."""
    return sum(_own_cpu_ticks(member) for member in process_tree(pid)) / CLOCK_TICKS_PER_S


def own_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of ``pid`` alone (all its threads, no children)."""
    return _own_cpu_ticks(pid) / CLOCK_TICKS_PER_S


def rss_mb(pid: int) -> float:
    """Resident set size of ``pid`` alone (``VmRSS``), in MiB."""
    for line in (PROC / str(pid) / "status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024  # the kernel reports kB
    raise ValueError(f"process {pid} has no VmRSS (a zombie or kernel thread?)")


def process_tree(pid: int) -> list[int]:
    """``pid`` and every live descendant of it."""
    children: dict[int, list[int]] = {}
    for entry in PROC.iterdir():
        if entry.name.isdigit():
            parent = _parent_of(int(entry.name))
            if parent is not None:
                children.setdefault(parent, []).append(int(entry.name))
    tree, frontier = [pid], [pid]
    while frontier:
        found = children.get(frontier.pop(), [])
        tree.extend(found)
        frontier.extend(found)
    return tree


def _stat_fields(pid: int) -> list[str] | None:
    """Fields after the ``(comm)`` of /proc/PID/stat (field 3 onwards), or None if gone."""
    try:
        text = (PROC / str(pid) / "stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    return text[text.rindex(")") + 2:].split()  # comm may contain spaces and parentheses


def _parent_of(pid: int) -> int | None:
    fields = _stat_fields(pid)
    return int(fields[1]) if fields else None  # field 4: ppid


def _own_cpu_ticks(pid: int) -> int:
    fields = _stat_fields(pid)
    return int(fields[11]) + int(fields[12]) if fields else 0  # fields 14, 15: utime, stime
