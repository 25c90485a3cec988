"""Which API key's role ("admin" or "user") sent each running request that has a client-given
rid, so that a user key can abort only its own requests.

Only client-given rids are tracked: a request sent without one has an engine-made rid that no
client can know. With n > 1 the engine runs rid "r" as "r-0", "r-1", ...: those count as r's.
An OpenAI stream of several choices runs each as a request of its own ("r-0", "r-1", ...): they
are claimed as the group "r", which abort_request("r") ends whole (`members`).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Iterator
from contextlib import contextmanager
from typing import TypeVar

T = TypeVar("T")


class RequestOwners:
    def __init__(self) -> None:
        self._roles: dict[str, str] = {}
        self._groups: dict[str, set[str]] = {}  # a group's rid -> its running members' rids

    @contextmanager
    def claim(
        self, rid: str | list[str] | None, role: str, group: str | None = None
    ) -> Iterator[None]:
        """Records `role` as the owner of these rids while the block runs, as members of
        `group` if given. A rid already held by a running request stays its owner's (the engine
        rejects the duplicate request)."""
        rids = [] if rid is None else [rid] if isinstance(rid, str) else rid
        mine = [r for r in dict.fromkeys(rids) if isinstance(r, str) and r not in self._roles]
        for r in mine:
            self._roles[r] = role
        if group is not None:
            self._groups.setdefault(group, set()).update(mine)
        try:
            yield
        finally:
            for r in mine:
                self._roles.pop(r, None)
            if group is not None and group in self._groups:
                self._groups[group].difference_update(mine)
                if not self._groups[group]:
                    del self._groups[group]

    def members(self, rid: str) -> list[str]:
        """The running members of group `rid` (none when it is no group)."""
        return sorted(self._groups.get(rid, ()))

    async def stream(
        self, stream: Awaitable[AsyncIterator[T]], rid: str | list[str] | None, role: str,
        group: str | None = None,
    ) -> AsyncIterator[T]:  # fmt: skip
        """The items of `stream` (awaited on the first item), claimed while it runs. Start it at
        once (first_item does): a started async generator that is dropped still gets closed
        (the event loop's asyncgen hook), which releases the claim."""
        with self.claim(rid, role, group):
            async for item in await stream:
                yield item

    def may_abort(self, rid: str, role: str) -> bool:
        """The admin may abort anything; another role only a running request it sent."""
        if role == "admin":
            return True
        owners = {self._roles.get(rid)} | {self._roles.get(m) for m in self.members(rid)}
        base, _, index = rid.rpartition("-")
        if base and index.isdigit() and base in self._roles:
            owners.add(self._roles[base])
        owners.discard(None)
        return owners == {role}
