"""A process's descendants, and whether they are gone, read from /proc: an engine's scheduler
and detokenizer are children of its fork server (rollout/engine/processes.py), grandchildren of
the process that started the engine."""

from __future__ import annotations

import os
import time


def _stat(pid: int) -> list[str] | None:
    """/proc/PID/stat's fields after the command name (state, ppid, ...); None once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except OSError:  # gone, or going
        return None


def children(pid: int) -> list[int]:
    found = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        stat = _stat(int(entry))
        if stat is not None and int(stat[1]) == pid:
            found.append(int(entry))
    return found


def descendants(pid: int) -> list[int]:
    """pid's children, theirs, and so on."""
    found, todo = [], [pid]
    while todo:
        kids = children(todo.pop())
        found += kids
        todo += kids
    return found


def alive(pid: int) -> bool:
    """Running: neither gone nor a zombie."""
    stat = _stat(pid)
    return stat is not None and stat[0] != "Z"


def unreaped(pid: int) -> bool:
    """Running, or a zombie its parent has not reaped (a reaped process is gone from /proc)."""
    return _stat(pid) is not None


def still_alive(pids: list[int], within_s: float, reaped: bool = False) -> list[int]:
    """Those of pids still alive (with reaped=True: not yet reaped) after waiting up to
    within_s for all of them to exit."""
    test = unreaped if reaped else alive
    deadline = time.monotonic() + within_s
    while any(test(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return [p for p in pids if test(p)]
