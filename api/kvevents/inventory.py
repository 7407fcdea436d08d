"""Inventory: the sidecar's complete holding per tier as NDJSON, in the block-hash terms of the KV
events, for a consumer whose gap is older than the replay buffer (`GET /inventory`).

Lines, in order:
  {"kind": "header", "incarnation": ..., "seq": S, "scheme": "kvdepot/kv-events/v1", "salt": mode}
  {"kind": "chunk", "medium": "CPU" | "<ADAPTER>", "model": m, "block_size": b, "block_hashes": [...]}
  ...
  {"kind": "end", "chunks": N}
`seq` is the sequence number of the last batch published before the listing began: a consumer
replaces what it knows of this sidecar with the listing and then applies the batches after `seq`
(a change made while the listing streams may appear in both; applying it twice is harmless).
A listing without its "end" line is incomplete (the connection broke).

Memory: the listing walks a snapshot of the tier's keys (one reference per chunk, no rendered
text), renders `PAGE` chunks at a time and yields to the loop between pages, so what is held in
rendered form is one page, whatever the size of the cache. Chunks of a layout no engine has
registered since the start cannot be expressed in blocks and are counted in the end line
(`unknown_layout`). L2 tiers list what their adapter holds (Redis: what this sidecar wrote and has
not seen go; keys Redis expired by TTL are listed until touched: shared-tier entries are hints).

Event loop only (reads the L1 cache and the L2 tiers between awaits).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterable

from api.kvevents.blocks import SCHEME, BlockNamer
from api.kvevents.publisher import KvEventPublisher
from engine.events import L1_TIER
from engine.facade import CacheEngine
from engine.keys import ObjectKey
from engine.l1.lifecycle import ObjectState

PAGE = 256


class Inventory:
    def __init__(self, engine: CacheEngine, namer: BlockNamer, publisher: KvEventPublisher) -> None:
        self.engine = engine
        self.namer = namer
        self.publisher = publisher

    def _l1_keys(self) -> Iterable[ObjectKey]:
        live = (ObjectState.READY, ObjectState.READ_LOCKED)
        for obj in self.engine.cache.objects():
            if obj.state in live and not obj.doomed:
                yield obj.key

    async def lines(self) -> AsyncIterator[bytes]:
        pub = self.publisher
        header = {
            "kind": "header", "incarnation": pub.incarnation, "seq": pub.last_seq,
            "scheme": SCHEME.decode(), "salt": self.namer.salt_mode,
        }  # fmt: skip
        yield _line(header)
        chunks = unknown = 0
        tiers: list[tuple[str, Iterable[ObjectKey]]] = [(L1_TIER, self._l1_keys())]
        l2 = self.engine.l2
        if l2 is not None:
            for tier in l2.tiers.active():
                tiers.append((tier.name, _parsed(tier.adapter.held_keys())))
        for tier_name, keys in tiers:
            medium = self.namer.medium(tier_name)
            page: list[bytes] = []
            for key in keys:
                sizes = self.namer.sizes(key.namespace.layout_fp)
                if sizes is None:
                    unknown += 1
                    continue
                hashes = self.namer.block_hashes(key, key.chunk_hash, sizes[1])
                entry = {
                    "kind": "chunk", "medium": medium, "model": key.namespace.model,
                    "block_size": sizes[0], "block_hashes": hashes,
                }  # fmt: skip
                page.append(_line(entry))
                chunks += 1
                if len(page) >= PAGE:
                    yield b"".join(page)
                    page = []
                    await asyncio.sleep(0)
            if page:
                yield b"".join(page)
        yield _line({"kind": "end", "chunks": chunks, "unknown_layout": unknown})


def _parsed(keys: list[str]) -> Iterable[ObjectKey]:
    for text in keys:
        try:
            yield ObjectKey.parse(text)
        except ValueError:
            continue


def _line(obj: object) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode() + b"\n"
