"""SCAN of every key under a prefix, on a single Redis or every primary of a Redis Cluster, at a
bounded rate: what the fleet ledger's reconcile and a tenant purge walk.

Primitives: scan_names(router, prefix, keys_per_s, what) -> async batches of key names (without the
prefix), one per SCAN reply; Pace (the rate); glob_escape (a prefix as a literal MATCH pattern);
as_text(value) (a reply's key as str).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from app.errors import BackendError

if TYPE_CHECKING:  # redis-py loads only where a Redis tier is configured
    from storage.redis.router import RedisRouter


def glob_escape(text: str) -> str:
    return "".join("\\" + c if c in "*?[]\\" else c for c in text)


def as_text(value: object) -> str:
    if isinstance(value, bytes):
        return value.decode("utf-8")
    return str(value)


class Pace:
    """At most `keys_per_s` keys examined a second: each SCAN asks for `count` (<= 200) keys of the
    whole keyspace (matching or not) and is followed by the sleep that keeps the rate."""

    def __init__(self, keys_per_s: int) -> None:
        self.count = max(1, min(200, keys_per_s))
        self.keys_per_s = keys_per_s
        self.examined = 0
        self.started = time.monotonic()

    async def step(self) -> None:
        self.examined += self.count
        ahead = self.examined / self.keys_per_s - (time.monotonic() - self.started)
        if ahead > 0:
            await asyncio.sleep(ahead)


async def scan_names(
    router: RedisRouter, prefix: str, keys_per_s: int, what: str
) -> AsyncIterator[list[str]]:
    """The names of the keys under `prefix` (the prefix cut off), a batch per SCAN reply (possibly
    empty), from every node of a cluster, at most `keys_per_s` keys examined a second.
    BackendError, starting with `what`, when a node does not answer."""
    await router.start()
    smap = router.slot_map
    nodes = [router.first] if smap is None else [router.node_at(n) for n in smap.nodes]
    pattern = glob_escape(prefix) + "*"
    pace = Pace(keys_per_s)
    for node in nodes:
        cursor = 0
        while True:
            try:
                cursor, names = await node.client.scan(cursor, match=pattern, count=pace.count)
            except Exception as exc:
                raise BackendError(f"{what} {node.describe}: {type(exc).__name__}: {exc}") from exc
            yield [n[len(prefix) :] for n in map(as_text, names)]
            await pace.step()
            if int(cursor) == 0:
                break
