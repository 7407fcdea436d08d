"""Prefetch from a real disk tier, whose I/O threads run the blob check right after each read: a
chunk whose file changed on disk (payload or header, MAC or checksum) is never served: a miss
that ends the request's hit there, counted (auth_failures too when the MAC failed), its file
deleted; a blob signed by a key this sidecar does not hold is a miss too, counted and kept. The
chunks before it come back with the bytes stored."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from pathlib import Path

import pytest

from engine.facade import CacheEngine
from engine.keys import ObjectKey
from engine.results import SlotStatus
from storage import codec
from storage.auth import BlobKeys
from storage.base import L2Adapter
from storage.codec import CodecOptions, blob_header
from storage.disk.adapter import DiskAdapter
from storage.disk.config import DiskAdapterConfig
from storage.registry import build_adapter
from tests.factories import l2_engine, seq, small_layout
from tests.integration.storage.test_storage_disk import flip_byte

pytestmark = pytest.mark.anyio

KEYS = BlobKeys([b"s" * 32])
CHUNK = 16


def builder(data_dir: Path) -> Callable[..., L2Adapter]:
    return lambda config: build_adapter(config, data_dir, KEYS)


def names(eng: CacheEngine, eid: int, toks: bytes) -> list[str]:
    ns = eng.registration(eid).namespace
    return [ObjectKey(ns, "", h).serialize() for h in eng.hasher.chunk_hashes(toks)]


def disk_of(eng: CacheEngine) -> DiskAdapter:
    assert eng.l2 is not None
    adapter = eng.l2.tiers.get("disk").adapter
    assert isinstance(adapter, DiskAdapter)
    return adapter


def exists(path: str) -> bool:
    return os.path.exists(path)


async def gone(path: str, timeout_s: float = 20.0) -> None:
    """Until `path` is deleted (by the task the prefetch spawned for it), bounded."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while exists(path):
        assert loop.time() < deadline, f"{path} still there after {timeout_s} s"
        await asyncio.sleep(0.02)


async def stored_then_cleared(eng: CacheEngine, eid: int, toks: bytes) -> list[bytes]:
    """`toks` stored, written behind to disk, L1 emptied; the bytes of each chunk."""
    assert eng.l2 is not None
    slots = eng.store(eid, "w", toks, "")
    assert all(s.status is SlotStatus.RESERVED for s in slots)
    for i, s in enumerate(slots):
        eng.arena.view(s.offset, s.size)[:] = bytes([i + 1]) * s.size
    assert all(eng.commit(eid, [s.oid for s in slots]))
    assert await eng.l2.store.wait_idle(10)
    eng.clear()
    return [bytes([i + 1]) * s.size for i, s in enumerate(slots)]


@pytest.mark.parametrize("authenticate", [True, False], ids=["mac", "checksum"])
@pytest.mark.parametrize("where", ["payload", "header"])
async def test_a_chunk_changed_on_disk_is_a_miss_counted_and_deleted(
    tmp_path: Path, authenticate: bool, where: str
) -> None:
    config = DiskAdapterConfig(name="disk", fsync="never", authenticate=authenticate)
    async with l2_engine(1 << 20, [config], builder(tmp_path), keys=KEYS) as (eng, _):
        assert eng.l2 is not None
        eid = eng.register("m", small_layout()).engine_id
        toks = seq(3, 0)
        payloads = await stored_then_cleared(eng, eid, toks)
        disk = disk_of(eng)
        key = names(eng, eid, toks)[1]
        path = str(disk.path_of(key))
        flip_byte(path, 30 if where == "header" else blob_header.header_size(key) + 100)

        assert eng.lookup(eid, "r", toks, "").pending_chunks == 3
        got = await eng.wait_prefetch(eid, "r")
        assert got.hit_chunks == 1  # the chunk before the changed one
        extents = eng.retrieve(eid, "r", 0, 1)
        assert bytes(eng.arena.view(extents[0].offset, extents[0].size)) == payloads[0]
        counters = eng.l2.prefetch.counters
        assert counters.integrity_failures == disk.stats.integrity_failures == 1
        assert counters.auth_failures == (1 if authenticate and where == "payload" else 0)
        await gone(path)
        assert disk.path_of(key) is None


async def test_a_blob_of_a_key_not_held_is_a_miss_and_kept(tmp_path: Path) -> None:
    config = DiskAdapterConfig(name="disk", fsync="never")
    async with l2_engine(1 << 20, [config], builder(tmp_path), keys=KEYS) as (eng, _):
        assert eng.l2 is not None
        eid = eng.register("m", small_layout()).engine_id
        toks = seq(1, 1)
        key = names(eng, eid, toks)[0]
        layout_fp = eng.registration(eid).namespace.layout_fp
        chunk = bytes(small_layout().chunk_bytes)
        foreign = codec.encode(key, layout_fp, chunk, CodecOptions(), BlobKeys([b"f" * 32]))
        disk = disk_of(eng)
        assert (await disk.store([(key, foreign)]))[0].ok

        assert eng.lookup(eid, "r", toks, "").pending_chunks == 1
        assert (await eng.wait_prefetch(eid, "r")).hit_chunks == 0
        counters = eng.l2.prefetch.counters
        assert (counters.integrity_failures, counters.auth_unknown_key) == (1, 1)
        assert disk.path_of(key) is not None  # another key list may verify it
