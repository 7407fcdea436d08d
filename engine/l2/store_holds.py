"""TenantHolds: the tenants whose write-behind is held off (a purge runs), and the tenants' chunks
being written now, so that a purge can wait until nothing of its tenant is on its way to L2.

State (event loop only): per tenant, how many holds (purges) are on it; per tenant, how many of its
chunks are in batches being written (from the worker's take to its done); the futures waiting for a
tenant's count to reach 0.

Primitives in call order:
  hold(salt) / unhold(salt)   a purge starts / ends (counted: two purges of one tenant nest)
  held(salt)                  the store controller refuses and drops the tenant's chunks while True
  writing(salts) / written(salts)
                              a batch of these chunks' tenants is being written / is done
  await settled(salt)         returns once no chunk of the tenant is being written
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable


class TenantHolds:
    __slots__ = ("_holds", "_waiters", "_writing")

    def __init__(self) -> None:
        self._holds: dict[str, int] = {}
        self._writing: dict[str, int] = {}
        self._waiters: dict[str, list[asyncio.Future[None]]] = {}

    def hold(self, salt: str) -> None:
        self._holds[salt] = self._holds.get(salt, 0) + 1

    def unhold(self, salt: str) -> None:
        left = self._holds.get(salt, 0) - 1
        if left > 0:
            self._holds[salt] = left
        else:
            self._holds.pop(salt, None)

    def held(self, salt: str) -> bool:
        return salt in self._holds

    def writing(self, salts: Iterable[str]) -> None:
        for salt in salts:
            self._writing[salt] = self._writing.get(salt, 0) + 1

    def written(self, salts: Iterable[str]) -> None:
        for salt in salts:
            left = self._writing.get(salt, 0) - 1
            if left > 0:
                self._writing[salt] = left
                continue
            self._writing.pop(salt, None)
            for fut in self._waiters.pop(salt, []):
                if not fut.done():
                    fut.set_result(None)

    async def settled(self, salt: str) -> None:
        if salt not in self._writing:
            return
        fut = asyncio.get_running_loop().create_future()
        self._waiters.setdefault(salt, []).append(fut)
        await fut
