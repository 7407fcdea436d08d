"""The slab adapter on real files with O_DIRECT: round trips, in-place loads (aligned or through the
bounce buffer), other encodings, refused sizes, eviction, sharding, tenants' accounting."""

from __future__ import annotations

from pathlib import Path

import pytest

from storage import codec
from storage.base import Status
from storage.codec import CodecOptions
from tests.integration.storage.slab_helpers import (
    FP,
    PAYLOAD,
    SLOT,
    KiB,
    MakeSlab,
    aligned,
    blob,
    decoded,
    payload_for,
    served,
)

pytestmark = pytest.mark.anyio

async def test_round_trip_with_in_place_loads(make_slab: MakeSlab, tmp_path: Path) -> None:
    slab = make_slab(fsync="always")
    blobs = {f"key-{i}": blob(f"key-{i}") for i in range(6)}
    assert all(r.ok for r in await slab.store(list(blobs.items())))
    assert (tmp_path / "slab0").stat().st_size == 4 * KiB + 16 * SLOT
    assert [r.status for r in await slab.contains(["key-3", "nope"])] == [Status.OK, Status.MISS]
    outs = [aligned(PAYLOAD) for _ in range(2)]
    results = await slab.load_into(["key-5", "key-0"], [memoryview(o) for o in outs])
    for key, result, out in zip(["key-5", "key-0"], results, outs, strict=True):
        assert result.status is Status.OK and result.in_place
        assert result.data is not None
        codec.verify_in_place(result.data, key, FP, memoryview(out))
        assert bytes(out) == payload_for(key)
    (whole,) = await slab.load(["key-2"])
    assert decoded(whole.data, "key-2") == payload_for("key-2")
    assert [r.status for r in await slab.delete(["key-2", "key-2"])] == [Status.OK, Status.MISS]
    assert await served(slab, "key-2") is None
    usage = slab.usage()
    assert (usage.objects, usage.bytes_used) == (5, sum(b.nbytes for k, b in blobs.items() if k != "key-2"))
    assert usage.capacity_bytes == 16 * SLOT
    assert slab.health().state == "ok"


async def test_unaligned_outputs_and_odd_sizes_go_through_the_bounce_buffer(make_slab: MakeSlab) -> None:
    slab = make_slab()
    sizes = {"odd": PAYLOAD - 1000, "tiny": 10, "aligned": PAYLOAD}
    assert all(r.ok for r in await slab.store([(k, blob(k, n)) for k, n in sizes.items()]))
    for key, size in sizes.items():
        backing = aligned(size + 4096)
        out = memoryview(backing)[100 : 100 + size]  # not page aligned
        (result,) = await slab.load_into([key], [out])
        assert result.status is Status.OK and result.in_place
        assert result.data is not None
        codec.verify_in_place(result.data, key, FP, out)
        assert bytes(out) == payload_for(key, size)
        assert await served(slab, key, size) == payload_for(key, size)


async def test_other_encodings_come_back_whole(make_slab: MakeSlab) -> None:
    slab = make_slab()
    text = b"kv " * (PAYLOAD // 3)
    packed = codec.encode("lz4", FP, text, CodecOptions(lz4=True))
    assert packed.payload.nbytes < len(text)
    await slab.store([("lz4", packed)])
    out = aligned(len(text))
    (result,) = await slab.load_into(["lz4"], [memoryview(out)[: len(text)]])
    assert result.status is Status.OK and not result.in_place
    back = bytearray(len(text))
    assert result.data is not None
    codec.decode_into(result.data, "lz4", FP, back)
    assert bytes(back) == text


async def test_a_blob_larger_than_a_slot_is_refused_and_counted(make_slab: MakeSlab) -> None:
    slab = make_slab()
    (result,) = await slab.store([("big", blob("big", SLOT))])
    assert result.status is Status.ERROR and "does not fit a slot" in result.message
    assert slab.stats.errors == 1
    assert await served(slab, "big", SLOT) is None


async def test_a_blob_longer_than_the_output_is_refused_unread(make_slab: MakeSlab) -> None:
    slab = make_slab()
    await slab.store([("k", blob("k"))])
    out = aligned(PAYLOAD)
    (result,) = await slab.load_into(["k"], [memoryview(out)[: PAYLOAD - 4096]])
    assert result.status is Status.MISS
    assert slab.stats.integrity_failures == 1
    assert (await slab.contains(["k"]))[0].status is Status.MISS


async def test_full_slab_evicts_least_recently_used(make_slab: MakeSlab) -> None:
    slab = make_slab()
    keys = [f"k{i}" for i in range(16)]
    for key in keys:
        assert (await slab.store([(key, blob(key))]))[0].ok
    assert await served(slab, "k0") == payload_for("k0")  # k0 becomes the most recently used
    for key in ["n0", "n1"]:
        assert (await slab.store([(key, blob(key))]))[0].ok
    assert slab.keys_lru()[:2] == ["k3", "k4"]
    assert [k for k in keys if (await slab.contains([k]))[0].status is Status.MISS] == ["k1", "k2"]
    assert slab.stats.evictions == 2
    await slab.set_capacity(4 * SLOT)
    assert slab.usage().objects == 4
    assert slab.keys_lru() == ["k15", "k0", "n0", "n1"]
    assert await served(slab, "n1") == payload_for("n1")


async def test_overwrite_moves_the_key_and_frees_the_old_slot(make_slab: MakeSlab) -> None:
    slab = make_slab()
    await slab.store([("k", blob("k", 1000))])
    first = slab.slot_of("k")
    await slab.store([("k", blob("k", 3000))])
    assert slab.slot_of("k") != first
    assert slab.usage().objects == 1 and slab.usage().bytes_used == blob("k", 3000).nbytes
    assert await served(slab, "k", 3000) == payload_for("k", 3000)


async def test_keys_are_sharded_over_several_files(make_slab: MakeSlab, tmp_path: Path) -> None:
    paths = [tmp_path / "a", tmp_path / "b", tmp_path / "c"]
    slab = make_slab(paths=paths)
    keys = [f"k{i}" for i in range(24)]
    await slab.store([(k, blob(k, 1000)) for k in keys])
    used = {slot[0] for k in keys if (slot := slab.slot_of(k)) is not None}
    assert used == {str(p) for p in paths}
    await slab.close()
    again = make_slab(paths=list(reversed(paths)))  # the index, not the order, says where a key is
    for key in keys:
        assert await served(again, key, 1000) == payload_for(key, 1000)


async def test_evict_salt_and_accounting_hook(make_slab: MakeSlab) -> None:
    slab = make_slab()
    reports: list[tuple[str, int, int, bool]] = []
    slab.bind_accounting(lambda key: key.split(":")[0], lambda *r: reports.append(r))
    await slab.store([(f"t1:{i}", blob(f"t1:{i}")) for i in range(3)] + [("t2:0", blob("t2:0"))])
    size = blob("t1:0").nbytes
    assert len(reports) == 4 and all(r[1:] == (size, 1, False) for r in reports)
    freed = await slab.evict_salt("t1", size + 1)
    assert freed == 2 * size
    assert reports[-2:] == [("t1:0", -size, -1, True), ("t1:1", -size, -1, True)]
    assert sorted(slab.keys_lru()) == ["t1:2", "t2:0"]
    assert await served(slab, "t1:0") is None
    assert slab.usage().bytes_used == 2 * size
