"""The Redis adapter's two paths for one batch (storage/redis/adapter.py says which key takes
which): one bulk-lane command per key in the adapter's executor (`LanePath.call`, with its MOVED and
ASK handling), the other keys as one redis-py pipeline per node, both at once (`split`).

State: none of its own; LanePath holds the adapter's router, executor and its `backend_down`
(health "down"). Event loop; the lane commands run in the executor's threads.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any, TypeVar

from app.errors import BackendError
from storage.base import LoadResult, OpResult, Status
from storage.inflight import gather_all, settled
from storage.redis.cluster import parse_redirect
from storage.redis.lane import LaneCancelled, LaneDown, LaneJob
from storage.redis.router import RedisRouter

R = TypeVar("R", OpResult, LoadResult)


class LanePath:
    def __init__(
        self, name: str, router: RedisRouter, executor: ThreadPoolExecutor,
        redis_key: Callable[[str], bytes], backend_down: Callable[[str], None],
    ) -> None:  # fmt: skip
        self.name = name
        self.router = router
        self._executor = executor
        self._redis_key = redis_key
        self._backend_down = backend_down

    async def call(self, error: Callable[[str], R], key: str, fn: Callable[..., R], *args: Any) -> R | None:
        """One lane command (`fn(lane, job, redis key, *args)`) in the executor, on the lane of the
        key's node. LaneDown becomes an ERROR result (health "down" for a single Redis; in a
        cluster the node's keys fail and the slot map is read again); a cancellation goes
        through only once the thread is done with the caller's buffers. A MOVED reply sends the
        command once more to the slot's new node; None: an ASK reply (the caller sends it through
        redis-py, which follows ASK)."""
        rkey = self._redis_key(key)
        router = self.router
        for attempt in (0, 1):
            lane = router.lane_for(rkey)
            if lane is None:
                return error(f"redis {self.name}: no node serves this key")
            job = LaneJob(lane.epoch)
            try:
                result = await settled(
                    self._executor.submit(fn, lane, job, rkey, *args), interrupt=partial(lane.cancel, job)
                )
            except LaneDown as exc:
                if router.cluster:
                    router.refresh_soon()
                else:
                    self._backend_down(str(exc))
                return error(str(exc))
            except LaneCancelled:  # the lane closed under a command that was not itself cancelled
                return error("redis bulk lane closed")
            redirect = parse_redirect(result.message) if result.status is Status.ERROR else None
            if redirect is None or attempt == 1:
                return result
            if redirect.ask:
                router.refresh_soon()
                return None
            router.moved(redirect)
        raise AssertionError("unreachable")


async def split(
    count: int,
    on_lane: list[int],
    lane_call: Callable[[int], Awaitable[R]],
    pipelined: Callable[[list[int]], Awaitable[list[R]]],
    error: Callable[[str], R],
    *,
    backend_down: Callable[[str], None],
) -> list[R]:
    """The lane's keys one command each, the others as one pipeline, all concurrently. A failed
    pipeline fails its keys alone (health "down") while lane keys were answered; else it raises."""
    lane_set = set(on_lane)
    rest = [i for i in range(count) if i not in lane_set]

    async def lanes() -> list[R]:
        return await gather_all(lane_call(i) for i in on_lane)

    async def others() -> list[R]:
        if not rest:
            return []
        try:
            return await pipelined(rest)
        except BackendError as exc:
            if not on_lane:
                raise  # the whole batch failed with the backend
            backend_down(str(exc))
            return [error(str(exc))] * len(rest)

    lane_results, other_results = await gather_all([lanes(), others()])
    by_index = dict(zip(on_lane, lane_results, strict=True))
    by_index.update(zip(rest, other_results, strict=True))
    return [by_index[i] for i in range(count)]
