"""The slab adapter on real files with O_DIRECT: round trips, in-place loads, eviction, the index
rebuilt at start (with and without its checkpoint), damage that must be a miss, never wrong bytes,
and files it must refuse."""

from __future__ import annotations

import json
import mmap
import os
import random
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from app.errors import ConfigError, IntegrityError
from storage import codec, slabformat
from storage.base import Status
from storage.codec import CodecOptions, EncodedBlob
from storage.config import SlabAdapterConfig
from storage.slab import SlabAdapter

pytestmark = pytest.mark.anyio

FP = b"layoutfp"
KiB = 1 << 10
SLOT = 64 * KiB
PAYLOAD = 48 * KiB  # a raw blob of this payload fits a slot with its headers

MakeSlab = Callable[..., SlabAdapter]


def payload_for(key: str, size: int = PAYLOAD) -> bytes:
    return random.Random(key).randbytes(size)


def blob(key: str, size: int = PAYLOAD) -> EncodedBlob:
    return codec.encode(key, FP, payload_for(key, size), CodecOptions())


def aligned(size: int) -> mmap.mmap:
    return mmap.mmap(-1, size)


def decoded(data: bytes | memoryview | None, key: str, size: int = PAYLOAD) -> bytes:
    assert data is not None
    out = bytearray(size)
    codec.decode_into(data, key, FP, out)
    return bytes(out)


async def served(slab: SlabAdapter, key: str, size: int = PAYLOAD) -> bytes | None:
    """What a reader gets for `key` through load_into and the caller's checks: the payload, or None
    for a miss (a failed check included). Never anything else."""
    out = aligned(size)
    (result,) = await slab.load_into([key], [memoryview(out)])
    if result.status is not Status.OK:
        return None
    try:
        if result.in_place:
            assert result.data is not None
            codec.verify_in_place(result.data, key, FP, memoryview(out))
            return bytes(out)
        return decoded(result.data, key, size)
    except IntegrityError:
        await slab.delete([key])
        return None


def patch(path: Path, at: int, data: bytes) -> None:
    with open(path, "r+b") as f:
        f.seek(at)
        f.write(data)


def read_at(path: Path, at: int, length: int) -> bytes:
    with open(path, "rb") as f:
        f.seek(at)
        return f.read(length)


def flip(path: Path, at: int) -> None:
    with open(path, "r+b") as f:
        f.seek(at)
        byte = f.read(1)[0]
        f.seek(at)
        f.write(bytes([byte ^ 0x01]))


@pytest.fixture
async def make_slab(tmp_path: Path) -> AsyncIterator[MakeSlab]:
    made: list[SlabAdapter] = []

    def make(clock: Callable[[], float] = time.monotonic, **fields: Any) -> SlabAdapter:
        fields = {"paths": [tmp_path / "slab0"], "size_bytes": 4 * KiB + 16 * SLOT, "slot_bytes": SLOT,
                  "fsync": "never", "io_threads": 2, **fields}  # fmt: skip
        config = SlabAdapterConfig.model_validate(fields)
        executor = ThreadPoolExecutor(config.io_threads, thread_name_prefix="test-slab-io")
        adapter = SlabAdapter(
            config,
            tmp_path / "default.slab",
            tmp_path / "slab.index",
            executor,
            owns_executor=True,
            clock=clock,
        )
        made.append(adapter)
        return adapter

    yield make
    for adapter in made:
        await adapter.close()


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


async def test_restart_rebuilds_the_index_and_keeps_recency(make_slab: MakeSlab, tmp_path: Path) -> None:
    slab = make_slab()
    keys = [f"k{i}" for i in range(10)]
    for key in keys:
        await slab.store([(key, blob(key))])
    await served(slab, "k0")
    await slab.delete(["k5"])
    order = slab.keys_lru()
    await slab.close()
    assert (tmp_path / "slab.index").exists()

    again = make_slab()
    await again.start()
    assert again.startup is not None
    assert again.startup.checkpoint_used and again.startup.stale_checkpoint_entries == 0
    assert (again.startup.blobs, again.startup.empty_slots) == (9, 7)
    assert again.keys_lru() == order
    for key in keys:
        assert await served(again, key) == (None if key == "k5" else payload_for(key))


async def test_without_a_checkpoint_the_scan_alone_rebuilds_in_write_order(
    make_slab: MakeSlab, tmp_path: Path
) -> None:
    slab = make_slab()
    for key in ["a", "b", "c"]:
        await slab.store([(key, blob(key))])
    where = slab.slot_of("a")
    assert where is not None
    older = read_at(tmp_path / "slab0", where[1], SLOT)
    await slab.store([("a", blob("a"))])  # rewritten: newest; its older slot is zeroed
    await slab.close()
    assert read_at(tmp_path / "slab0", where[1], 4096) == bytes(4096)
    patch(tmp_path / "slab0", where[1], older)  # as if the process died before the zeroing
    (tmp_path / "slab.index").unlink()
    again = make_slab()
    await again.start()
    assert again.startup is not None and not again.startup.checkpoint_used
    assert again.keys_lru() == ["b", "c", "a"]
    assert again.startup.superseded == 1  # a's older generation: not indexed, zeroed now
    assert await served(again, "a") == payload_for("a")
    await again.wait_io()
    assert read_at(tmp_path / "slab0", where[1], 4096) == bytes(4096)


async def test_a_stale_checkpoint_is_checked_against_the_slots(make_slab: MakeSlab, tmp_path: Path) -> None:
    slab = make_slab()
    for key in ["a", "b", "c", "d"]:
        await slab.store([(key, blob(key))])
    await slab.close()
    old = (tmp_path / "slab.index").read_bytes()

    second = make_slab()
    await second.delete(["a"])  # its slot is zeroed
    await second.store([("c", blob("c", 2000))])  # c moves to another slot
    await second.store([("e", blob("e"))])  # e may take a's old slot
    await second.close()
    (tmp_path / "slab.index").write_bytes(old)  # the index as it was before those changes

    third = make_slab()
    await third.start()
    assert third.startup is not None and third.startup.stale_checkpoint_entries >= 2
    assert sorted(third.keys_lru()) == ["b", "c", "d", "e"]
    assert await served(third, "a") is None
    assert await served(third, "c", 2000) == payload_for("c", 2000)
    assert await served(third, "e") == payload_for("e")


async def test_a_torn_or_flipped_slot_is_a_miss_never_wrong_bytes(
    make_slab: MakeSlab, tmp_path: Path
) -> None:
    slab = make_slab()
    for key in ["flip", "garbage", "head", "fine"]:
        await slab.store([(key, blob(key))])
    places = {k: where for k in ["flip", "garbage", "head"] if (where := slab.slot_of(k)) is not None}
    path = tmp_path / "slab0"
    _, at, payload_at = places["flip"]
    flip(path, at + payload_at + 777)
    _, at, payload_at = places["garbage"]  # a torn write: the second half of the payload is other bytes
    patch(path, at + payload_at + 4096, os.urandom(PAYLOAD - 4096))
    _, at, _ = places["head"]
    flip(path, at + 20)  # inside the slot header
    assert await served(slab, "flip") is None
    assert await served(slab, "garbage") is None
    assert await served(slab, "head") is None  # the header no longer matches: stale, a miss
    assert await served(slab, "fine") == payload_for("fine")
    assert slab.stats.integrity_failures >= 1  # the stale head; the payload checks are the caller's
    await slab.close()
    again = make_slab()
    await again.start()
    assert again.startup is not None
    assert sorted(again.keys_lru()) == ["fine"]  # the damaged ones were deleted (zeroed) or fail the scan
    assert await served(again, "fine") == payload_for("fine")


async def test_a_damaged_slot_found_at_start_is_invalid_not_indexed(
    make_slab: MakeSlab, tmp_path: Path
) -> None:
    slab = make_slab()
    await slab.store([("a", blob("a")), ("b", blob("b"))])
    where = slab.slot_of("a")
    assert where is not None
    await slab.close()
    (tmp_path / "slab.index").unlink()
    flip(tmp_path / "slab0", where[1] + slabformat.SLOT_HEADER_SIZE + 3)  # inside the blob header
    again = make_slab()
    await again.start()
    assert again.startup is not None and again.startup.invalid_slots == 1
    assert again.keys_lru() == ["b"]
    assert again.stats.integrity_failures == 1


async def test_foreign_and_wrongly_sized_files_are_refused(make_slab: MakeSlab, tmp_path: Path) -> None:
    foreign = tmp_path / "foreign"
    foreign.write_bytes(b"my precious data" * 70_000)
    with pytest.raises(ConfigError, match=r"not a kvdepot slab.*refusing to overwrite"):
        await make_slab(paths=[foreign], size_bytes=4096 + 17 * SLOT).start()
    assert foreign.read_bytes() == b"my precious data" * 70_000

    slab = make_slab()
    await slab.store([("k", blob("k"))])
    await slab.close()
    with pytest.raises(ConfigError, match="size_bytes says"):
        await make_slab(size_bytes=4 * KiB + 32 * SLOT).start()
    with pytest.raises(ConfigError, match="formatted with slot_bytes 65536; the config says 131072"):
        await make_slab(slot_bytes=2 * SLOT).start()
    again = make_slab()
    assert await served(again, "k") == payload_for("k")


async def test_a_file_has_one_owner(make_slab: MakeSlab) -> None:
    first = make_slab()
    await first.start()
    with pytest.raises(ConfigError, match="in use by another adapter"):
        await make_slab().start()


async def test_o_direct_is_required(make_slab: MakeSlab) -> None:
    path = Path("/dev/shm") / f"kvdepot-slab-test-{os.getpid()}"
    try:
        os.close(os.open(path, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600))
    except OSError:
        path.unlink(missing_ok=True)
    else:
        path.unlink()
        pytest.skip("this kernel's tmpfs does O_DIRECT (Linux 6.6 and later)")
    try:
        with pytest.raises(ConfigError, match="does not support O_DIRECT"):
            await make_slab(paths=[path]).start()
    finally:
        path.unlink(missing_ok=True)


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


async def test_the_index_is_checkpointed_periodically_not_only_at_close(
    make_slab: MakeSlab, tmp_path: Path
) -> None:
    now = [0.0]
    slab = make_slab(clock=lambda: now[0], checkpoint_s=10)
    index = tmp_path / "slab.index"
    await slab.store([("a", blob("a"))])
    assert not index.exists() and slab.checkpoints == 0  # too soon after start
    now[0] = 11.0
    await slab.store([("b", blob("b"))])
    await slab.wait_io()  # the checkpoint is written in the executor
    assert slab.checkpoints == 1
    assert [e[0] for e in json.loads(index.read_bytes())["entries"]] == ["a", "b"]
    now[0] = 12.0
    await slab.store([("c", blob("c"))])  # within checkpoint_s of the last one: not written
    await slab.close()  # but at close it is
    assert slab.checkpoints == 2
    assert [e[0] for e in json.loads(index.read_bytes())["entries"]] == ["a", "b", "c"]


async def test_a_deleted_key_stays_deleted_after_restart_even_when_it_was_rewritten(
    make_slab: MakeSlab,
) -> None:
    slab = make_slab()
    await slab.store([("k", blob("k", 1000))])
    await slab.store([("k", blob("k", 2000))])  # the first slot still held k's older generation
    await slab.store([("other", blob("other"))])
    await slab.evict_salt("", 1)  # the oldest entry: k
    await slab.delete(["other"])
    await slab.close()
    again = make_slab()
    await again.start()
    assert again.keys_lru() == []
    assert await served(again, "k", 2000) is None and await served(again, "k", 1000) is None
