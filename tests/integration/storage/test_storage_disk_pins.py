"""The disk adapter honours pins (storage/common.py `bind_pins`): eviction for capacity, for a
tenant's quota (evict_salt) and on a shrink never picks a key the bound predicate holds; a store
that finds no other room is NO_SPACE, and a key released is evicted like any other."""

from __future__ import annotations

from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from storage.base import Status
from storage.disk.adapter import DiskAdapter
from storage.disk.config import DiskAdapterConfig
from tests.integration.storage.test_storage_disk import blob, blob_files, decoded, payload_for

pytestmark = pytest.mark.anyio

SIZE = 4000


def salt_of(key: str) -> str:
    return key.split("-", maxsplit=1)[0]


@pytest.fixture
async def disk(tmp_path: Path) -> AsyncIterator[DiskAdapter]:
    one = blob("a-0", SIZE).nbytes
    config = DiskAdapterConfig.model_validate({"fsync": "never", "capacity_gb": 10 * one / (1 << 30)})
    adapter = DiskAdapter(config, tmp_path / "l2", ThreadPoolExecutor(2), owns_executor=True)
    adapter.bind_accounting(salt_of, lambda *_: None)
    yield adapter
    await adapter.close()


async def test_pinned_keys_survive_a_storm_and_are_served_after(disk: DiskAdapter, tmp_path: Path) -> None:
    pinned = {f"a-{i}" for i in range(4)}
    disk.bind_pins(pinned.__contains__)
    assert all(r.ok for r in await disk.store([(k, blob(k, SIZE)) for k in sorted(pinned)]))
    for i in range(60):  # six times the capacity, by two other tenants
        for salt in ("b", "c"):
            key = f"{salt}-{i}"
            assert (await disk.store([(key, blob(key, SIZE))]))[0].ok
    assert disk.stats.evictions >= 110
    assert disk.keys_lru()[0] not in pinned  # passed over by the scans: not at the head every time
    assert [r.status for r in await disk.contains(sorted(pinned))] == [Status.OK] * 4
    for key in sorted(pinned):
        (loaded,) = await disk.load([key])
        assert decoded(loaded.data, key, SIZE) == payload_for(key, SIZE)
    assert len(blob_files(tmp_path / "l2")) == disk.usage().objects >= 9  # at capacity, no more


async def test_only_pinned_left_is_no_space_and_a_release_makes_them_evictable(disk: DiskAdapter) -> None:
    pinned = {f"a-{i}" for i in range(10)}
    disk.bind_pins(lambda key: key in pinned)
    assert all(r.ok for r in await disk.store([(k, blob(k, SIZE)) for k in sorted(pinned)]))
    assert (await disk.store([("b-0", blob("b-0", SIZE))]))[0].status is Status.NO_SPACE
    await disk.set_capacity(disk.usage().capacity_bytes // 2)  # a shrink evicts nothing pinned
    assert disk.usage().objects == 10
    assert await disk.evict_salt("a", 1 << 30) == 0  # the tenant's quota evicts nothing pinned
    pinned.difference_update({"a-0", "a-1"})
    assert await disk.evict_salt("a", 1) == blob("a-0", SIZE).nbytes
    assert (await disk.store([("b-0", blob("b-0", SIZE))]))[0].status is Status.NO_SPACE  # still over
    pinned.clear()
    assert (await disk.store([("b-0", blob("b-0", SIZE))]))[0].ok
    assert disk.usage().bytes_used <= disk.usage().capacity_bytes
