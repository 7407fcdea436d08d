from __future__ import annotations

import asyncio
import os
import random
import shutil
import threading
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch

from app.errors import ConfigError, IntegrityError
from storage import codec
from storage.base import MISS, Status
from storage.codec import CodecOptions, EncodedBlob, blob_header
from storage.disk import dirs as disk_dirs
from storage.disk import files as disk_files
from storage.disk.adapter import DiskAdapter
from storage.disk.config import DiskAdapterConfig
from storage.disk.files import BlobFiles

pytestmark = pytest.mark.anyio

FP = b"layoutfp"
MiB = 1 << 20

MakeDisk = Callable[..., DiskAdapter]


def payload_for(key: str, size: int) -> bytes:
    return random.Random(key).randbytes(size)


def blob(key: str, size: int = 4000) -> EncodedBlob:
    return codec.encode(key, FP, payload_for(key, size), CodecOptions())


def decoded(data: bytes | memoryview | None, key: str, size: int) -> bytes:
    assert data is not None
    out = bytearray(size)
    codec.decode_into(data, key, FP, out)
    return bytes(out)


def blob_files(root: Path) -> list[Path]:
    return sorted(root.rglob(f"*{disk_dirs.BLOB_SUFFIX}"))


def exists(path: str | Path) -> bool:
    return os.path.exists(path)


def flip_byte(path: str, at: int) -> None:
    with open(path, "r+b") as f:
        f.seek(at)
        byte = f.read(1)[0]
        f.seek(at)
        f.write(bytes([byte ^ 0x40]))


@pytest.fixture
async def make_disk(tmp_path: Path) -> AsyncIterator[MakeDisk]:
    """Disk adapters over real directories under tmp_path; each gets its own executor."""
    made: list[DiskAdapter] = []

    def make(
        *, default_dir: Path | None = None, executor: ThreadPoolExecutor | None = None, **fields: Any
    ) -> DiskAdapter:
        config = DiskAdapterConfig.model_validate({"fsync": "never", **fields})
        executor = executor or ThreadPoolExecutor(config.io_threads, thread_name_prefix="test-disk-io")
        adapter = DiskAdapter(config, default_dir or tmp_path / "l2", executor, owns_executor=True)
        made.append(adapter)
        return adapter

    yield make
    for adapter in made:
        await adapter.close()


async def test_store_load_contains_delete_round_trip(make_disk: MakeDisk, tmp_path: Path) -> None:
    disk = make_disk(fsync="always")
    await disk.start()
    blobs = {f"key-{i}": blob(f"key-{i}", 1000 + i) for i in range(8)}
    results = await disk.store(list(blobs.items()))
    assert all(r.ok for r in results)
    assert len(blob_files(tmp_path / "l2")) == 8
    assert [r.status for r in await disk.contains(["key-3", "nope"])] == [Status.OK, Status.MISS]
    loaded = await disk.load(["key-7", "nope", "key-0"])
    assert [r.status for r in loaded] == [Status.OK, Status.MISS, Status.OK]
    assert decoded(loaded[0].data, "key-7", 1007) == payload_for("key-7", 1007)
    assert [r.status for r in await disk.delete(["key-7", "key-7"])] == [Status.OK, Status.MISS]
    assert len(blob_files(tmp_path / "l2")) == 7
    assert (await disk.load(["key-7"]))[0].status is Status.MISS
    usage = disk.usage()
    assert usage.objects == 7
    assert usage.bytes_used == sum(b.nbytes for k, b in blobs.items() if k != "key-7")
    assert disk.health().state == "ok"
    assert (disk.stats.stores, disk.stats.loads, disk.stats.misses) == (8, 2, 2)


async def test_overwrite_keeps_one_file_and_counts_once(make_disk: MakeDisk, tmp_path: Path) -> None:
    disk = make_disk()
    await disk.store([("k", blob("k", 100))])
    await disk.store([("k", blob("k", 300))])
    assert len(blob_files(tmp_path / "l2")) == 1
    assert disk.usage().bytes_used == blob("k", 300).nbytes
    (result,) = await disk.load(["k"])
    assert decoded(result.data, "k", 300) == payload_for("k", 300)


async def test_concurrent_stores_of_one_key_share_one_write(make_disk: MakeDisk, tmp_path: Path) -> None:
    disk = make_disk()
    answers = await asyncio.gather(*(disk.store([("same", blob("same"))]) for _ in range(5)))
    assert all(a[0].ok for a in answers)
    assert len(blob_files(tmp_path / "l2")) == 1


async def test_capacity_evicts_in_lru_order_and_deletes_files(make_disk: MakeDisk, tmp_path: Path) -> None:
    disk = make_disk()
    one = blob("k0").nbytes
    await disk.set_capacity(3 * one)
    for key in ("k0", "k1", "k2"):
        await disk.store([(key, blob(key))])
    await disk.load(["k0"])
    await disk.contains(["k1"])  # a lookup is not a use
    await disk.store([("k3", blob("k3"))])
    assert disk.keys_lru() == ["k2", "k0", "k3"]
    assert (await disk.contains(["k1"]))[0].status is Status.MISS
    assert len(blob_files(tmp_path / "l2")) == 3
    await disk.set_capacity(one)
    assert disk.keys_lru() == ["k3"]
    assert len(blob_files(tmp_path / "l2")) == 1
    assert (disk.stats.evictions, disk.stats.evicted_bytes) == (3, 3 * one)
    too_big = blob("big", 2 * 4000)
    assert (await disk.store([("big", too_big)]))[0].status is Status.NO_SPACE
    assert disk.stats.no_space == 1


async def test_a_full_tier_takes_a_whole_batch_by_evicting(make_disk: MakeDisk, tmp_path: Path) -> None:
    """Write-behind hands a full tier batches whose blobs are written together: each makes room
    for itself, and none is refused for room another write of the batch took."""
    disk = make_disk()
    one = blob("old-0-0").nbytes  # every key below is as long: every blob is this size
    await disk.set_capacity(8 * one)
    assert all(r.ok for r in await disk.store([(f"old-0-{i}", blob(f"old-0-{i}")) for i in range(8)]))
    for round_ in range(3):
        batch = [(f"new-{round_}-{i}", blob(f"new-{round_}-{i}")) for i in range(6)]
        results = await disk.store(batch)
        assert [r.status for r in results] == [Status.OK] * 6, [r.message for r in results]
        assert disk.usage().bytes_used <= 8 * one
    assert disk.stats.no_space == 0 and disk.stats.evictions == 18
    assert len(blob_files(tmp_path / "l2")) == 8
    assert sorted(disk.keys_lru()[-6:]) == [f"new-2-{i}" for i in range(6)]  # in the order written


async def test_index_is_rebuilt_from_the_files(make_disk: MakeDisk, tmp_path: Path) -> None:
    first = make_disk()
    keys = [f"key-{i}" for i in range(20)]
    for key in keys:  # one at a time, so file mtimes follow the store order
        await first.store([(key, blob(key))])
    usage = first.usage()
    await first.close()

    second = make_disk()
    await second.start()
    assert second.startup is not None
    assert second.startup.blobs == 20
    assert second.usage() == usage
    assert sorted(second.keys_lru()) == sorted(keys)
    loaded = await second.load(keys)
    assert all(decoded(r.data, k, 4000) == payload_for(k, 4000) for k, r in zip(keys, loaded, strict=True))


async def test_start_removes_temp_files_and_deletes_bad_files(make_disk: MakeDisk, tmp_path: Path) -> None:
    first = make_disk()
    for key in ("good", "truncated", "bad-header", "bad-payload"):
        await first.store([(key, blob(key))])
    paths = {key: Path(str(first.path_of(key))) for key in first.keys_lru()}
    await first.close()

    leftover = paths["good"].with_name("crashed-mid-write" + disk_dirs.TMP_SUFFIX)
    leftover.write_bytes(b"half a blob")
    os.truncate(paths["truncated"], paths["truncated"].stat().st_size - 1)
    with paths["bad-header"].open("r+b") as f:
        f.seek(10)
        f.write(b"\xff")
    with paths["bad-payload"].open("r+b") as f:  # only the payload: the header still checks out
        f.seek(-5, os.SEEK_END)
        f.write(b"\x00\x01\x02\x03\x04")

    second = make_disk()
    await second.start()
    assert second.startup is not None
    assert (second.startup.temp_removed, second.startup.corrupt_removed) == (1, 2)
    assert second.stats.integrity_failures == 2
    assert not leftover.exists()
    assert not paths["truncated"].exists()
    assert not paths["bad-header"].exists()
    statuses = [r.status for r in await second.load(["good", "truncated", "bad-header"])]
    assert statuses == [Status.OK, Status.MISS, Status.MISS]
    (damaged,) = await second.load(["bad-payload"])  # header-only scan: the codec catches the rest
    with pytest.raises(IntegrityError):
        decoded(damaged.data, "bad-payload", 4000)


async def test_newest_file_of_a_key_wins_at_start(make_disk: MakeDisk, tmp_path: Path) -> None:
    first = make_disk()
    await first.store([("k", blob("k", 100))])
    old_path = Path(str(first.path_of("k")))
    old_copy = old_path.with_suffix(".copy")
    os.link(old_path, old_copy)
    await first.store([("k", blob("k", 200))])
    await first.close()
    os.rename(old_copy, old_path)  # an older file of the same key, as after a crash
    os.utime(old_path, (1_000_000, 1_000_000))

    second = make_disk()
    await second.start()
    assert second.startup is not None
    assert second.startup.duplicates_removed == 1
    assert not exists(old_path)
    (result,) = await second.load(["k"])
    assert decoded(result.data, "k", 200) == payload_for("k", 200)


async def test_files_changed_behind_the_adapters_back_are_misses(make_disk: MakeDisk) -> None:
    disk = make_disk()
    await disk.store([("gone", blob("gone")), ("short", blob("short"))])
    os.unlink(str(disk.path_of("gone")))
    short_path = str(disk.path_of("short"))
    os.truncate(short_path, 100)
    results = await disk.load(["gone", "short"])
    assert [r.status for r in results] == [Status.MISS, Status.MISS]
    assert disk.usage().objects == 0
    assert not exists(short_path)
    assert disk.stats.integrity_failures == 1


async def test_a_removed_subdirectory_is_recreated(make_disk: MakeDisk, tmp_path: Path) -> None:
    disk = make_disk()
    await disk.start()
    shutil.rmtree(Path(disk.path_for("k")).parent)
    assert (await disk.store([("k", blob("k"))]))[0].ok
    assert (await disk.load(["k"]))[0].ok


async def test_keys_spread_over_several_directories(make_disk: MakeDisk, tmp_path: Path) -> None:
    roots = [tmp_path / f"d{i}" for i in range(3)]
    disk = make_disk(paths=roots)
    keys = [f"key-{i}" for i in range(60)]
    assert all(r.ok for r in await disk.store([(k, blob(k, 200)) for k in keys]))
    counts = [len(blob_files(root)) for root in roots]
    assert sum(counts) == 60
    assert min(counts) > 5
    await disk.close()

    again = make_disk(paths=roots)
    loaded = await again.load(keys)
    assert all(decoded(r.data, k, 200) == payload_for(k, 200) for k, r in zip(keys, loaded, strict=True))


async def test_a_directory_has_one_owner(make_disk: MakeDisk) -> None:
    first = make_disk()
    await first.start()
    second = make_disk()
    with pytest.raises(ConfigError, match="in use"):
        await second.start()
    assert (await second.load(["k"]))[0].status is Status.ERROR
    await first.close()
    await second.start()  # free again


@pytest.mark.parametrize("size", [1, 4096, 9 * MiB + 123])
async def test_o_direct_round_trip(make_disk: MakeDisk, size: int) -> None:
    disk = make_disk(o_direct=True, fsync="always")
    assert (await disk.store([("k", blob("k", size))]))[0].ok
    (result,) = await disk.load(["k"])
    assert decoded(result.data, "k", size) == payload_for("k", size)
    assert disk.direct_fallback is None  # this filesystem accepts O_DIRECT


class RefusingDirectIO(BlobFiles):
    """A filesystem that answers EINVAL to O_DIRECT (as some do) at open time."""

    def _write_file(self, tmp: str, segments: Any, *, direct: bool) -> None:
        if direct:
            raise disk_files._DirectRefused
        super()._write_file(tmp, segments, direct=direct)


def test_o_direct_falls_back_silently_and_says_why(tmp_path: Path) -> None:
    files = RefusingDirectIO(fsync=False, direct=True)
    target = tmp_path / "blob.kvd"
    files.write_atomic(str(target), [b"header", memoryview(b"payload")])
    assert target.read_bytes() == b"headerpayload"
    assert files.direct_fallback is not None
    assert not files.direct
    assert list(tmp_path.iterdir()) == [target]


async def test_close_with_operations_in_flight(make_disk: MakeDisk) -> None:
    executor = ThreadPoolExecutor(1, thread_name_prefix="test-disk-io")
    disk = make_disk(executor=executor)
    await disk.store([("old", blob("old"))])
    stuck = threading.Event()
    executor.submit(stuck.wait, 10)  # a slow disk: every file operation now queues behind this
    answers: list[list[Status]] = []

    async def store(i: int) -> None:
        answers.append([r.status for r in await disk.store([(f"k{i}", blob(f"k{i}", 2 * MiB))])])

    async def load() -> None:
        answers.append([r.status for r in await disk.load(["old", "old"])])

    out = bytearray(4000)

    async def load_into() -> None:
        answers.append([r.status for r in await disk.load_into(["old"], [memoryview(out)])])

    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            for i in range(6):
                tg.start_soon(store, i)
            tg.start_soon(load)
            tg.start_soon(load_into)
            await anyio.wait_all_tasks_blocked()
            await disk.close()
    stuck.set()
    assert out == bytes(4000)  # its read never ran
    assert len(answers) == 8
    assert {s for a in answers for s in a} == {Status.ERROR}
    assert (await disk.store([("late", blob("late"))]))[0].status is Status.ERROR


async def test_large_blobs(make_disk: MakeDisk) -> None:
    disk = make_disk()
    big = blob("big", 32 * MiB)
    assert (await disk.store([("big", big)]))[0].ok
    (result,) = await disk.load(["big"])
    assert result.data is not None
    assert len(result.data) == big.nbytes
    out = bytearray(32 * MiB)
    codec.decode_into(result.data, "big", FP, out)
    assert out == big.payload


# --- load_into ----------------------------------------------------------------------------------


@pytest.mark.parametrize("o_direct", [False, True], ids=["buffered", "o_direct"])
@pytest.mark.parametrize("size", [1, 4096, 9 * MiB + 123])
async def test_load_into_reads_raw_payloads_in_place(make_disk: MakeDisk, o_direct: bool, size: int) -> None:
    disk = make_disk(o_direct=o_direct)
    stored = blob("k", size)
    assert (await disk.store([("k", stored)]))[0].ok
    out = bytearray(size)
    (result,) = await disk.load_into(["k"], [memoryview(out)])
    assert result.ok
    assert result.in_place
    assert result.data == stored.header
    assert out == payload_for("k", size)
    codec.verify_in_place(result.data, "k", FP, out)
    assert disk.stats.load_bytes == stored.nbytes
    assert disk.direct_fallback is None


@pytest.mark.parametrize("o_direct", [False, True], ids=["buffered", "o_direct"])
async def test_load_into_returns_other_blobs_whole(make_disk: MakeDisk, o_direct: bool) -> None:
    disk = make_disk(o_direct=o_direct)
    packed = codec.encode("lz4", FP, bytes(MiB), CodecOptions(lz4=True))
    # FP8 over float16 runs of 4 elements is exactly as long as the raw blob: only its header
    # tells that it cannot be read in place
    raw_kv = bytes(torch.randn(8192, 2, 4).to(torch.float16).view(torch.uint8).numpy())
    same_len = codec.encode("fp8", FP, raw_kv, CodecOptions(fp8_values=True, dtype="float16", run_elems=4))
    assert same_len.nbytes == blob_header.header_size("fp8") + len(raw_kv)
    plain = blob("plain", 5000)
    await disk.store([("lz4", packed), ("fp8", same_len), ("plain", plain)])
    outs = [bytearray(MiB), bytearray(len(raw_kv)), bytearray(5001)]
    results = await disk.load_into(["lz4", "fp8", "plain"], [memoryview(o) for o in outs])
    assert [(r.ok, r.in_place) for r in results] == [(True, False)] * 3
    assert [r.data for r in results] == [packed.to_bytes(), same_len.to_bytes(), plain.to_bytes()]
    assert outs[1] == bytes(len(raw_kv))  # nothing was read into it
    assert results[0].data is not None
    codec.decode_into(results[0].data, "lz4", FP, outs[0])
    assert outs[0] == bytes(MiB)


@pytest.mark.parametrize("o_direct", [False, True], ids=["buffered", "o_direct"])
async def test_load_into_refuses_a_file_longer_than_any_blob_of_the_chunk(
    make_disk: MakeDisk, o_direct: bool
) -> None:
    disk = make_disk(o_direct=o_direct)
    await disk.store([("big", blob("big", 64 * 1024))])
    path = str(disk.path_of("big"))
    out = bytearray(4096)  # the chunk is 4 KiB: no blob of it is 64 KiB long
    (result,) = await disk.load_into(["big"], [memoryview(out)])
    assert result.status is Status.MISS
    assert disk.stats.integrity_failures == 1
    assert not exists(path)
    assert await disk.contains(["big"]) == [MISS]


@pytest.mark.parametrize("o_direct", [False, True], ids=["buffered", "o_direct"])
async def test_load_into_truncated_or_vanished_files_are_misses(make_disk: MakeDisk, o_direct: bool) -> None:
    disk = make_disk(o_direct=o_direct)
    short = blob("short", 9000)
    await disk.store([("gone", blob("gone", 9000)), ("short", short)])
    os.unlink(str(disk.path_of("gone")))
    short_path = str(disk.path_of("short"))
    os.truncate(short_path, short.nbytes - 1)
    outs = [memoryview(bytearray(9000)), memoryview(bytearray(9000))]
    results = await disk.load_into(["gone", "short"], outs)
    assert [r.status for r in results] == [Status.MISS, Status.MISS]
    assert disk.usage().objects == 0
    assert not exists(short_path)
    assert disk.stats.integrity_failures == 1


@pytest.mark.parametrize("o_direct", [False, True], ids=["buffered", "o_direct"])
async def test_load_into_corruption_is_caught(make_disk: MakeDisk, o_direct: bool) -> None:
    disk = make_disk(o_direct=o_direct)
    size = 3 * MiB
    await disk.store([("payload", blob("payload", size)), ("header", blob("header", size))])
    flip_byte(str(disk.path_of("payload")), blob_header.header_size("payload") + 2 * MiB)
    flip_byte(str(disk.path_of("header")), 20)
    outs = [bytearray(size), bytearray(size)]
    results = await disk.load_into(["payload", "header"], [memoryview(o) for o in outs])
    assert all(r.ok for r in results)
    for key, result, out in zip(["payload", "header"], results, outs, strict=True):
        assert result.data is not None
        check = codec.verify_in_place if result.in_place else codec.decode_into
        with pytest.raises(IntegrityError):
            check(result.data, key, FP, out)
    assert results[0].in_place


async def test_evict_salt_removes_the_tenants_lru_files_and_a_restart_reports_what_it_found(
    make_disk: MakeDisk,
) -> None:
    def tenant_of(key: str) -> str:
        return key.split(":", 1)[0]

    reported: list[tuple[str, int, int, bool]] = []

    def hook(key: str, delta_bytes: int, delta_objects: int, evicted: bool) -> None:
        reported.append((key, delta_bytes, delta_objects, evicted))

    first = make_disk()
    first.bind_accounting(tenant_of, hook)
    for k in ("a:0", "b:0", "a:1", "a:2", "b:1"):  # one at a time: the writes of a batch finish in any order
        await first.store([(k, blob(k, 1000))])
    one = blob("a:0", 1000).nbytes
    await first.load(["a:0"])  # a's least recently used: a:1, a:2, then a:0
    paths = {k: first.path_of(k) for k in first.keys_lru()}
    assert await first.evict_salt("a", one + 1) == 2 * one
    assert first.keys_lru() == ["b:0", "b:1", "a:0"]
    assert not exists(str(paths["a:1"])) and not exists(str(paths["a:2"]))
    assert exists(str(paths["b:0"])) and exists(str(paths["a:0"]))
    assert [r for r in reported if r[3]] == [("a:1", -one, -1, True), ("a:2", -one, -1, True)]
    await first.store([("b:0", blob("b:0", 1500))])  # again, larger: the difference, no new object
    assert reported[-1] == ("b:0", blob("b:0", 1500).nbytes - one, 0, False)
    await first.close()

    found: list[tuple[str, int, int, bool]] = []
    second = make_disk()
    second.bind_accounting(tenant_of, lambda *change: found.append(change))
    await second.start()
    assert sorted(found) == sorted(
        [("a:0", one, 1, False), ("b:0", blob("b:0", 1500).nbytes, 1, False), ("b:1", one, 1, False)]
    )
    assert second.held_per_salt() == {"a": (one, 1), "b": (one + blob("b:0", 1500).nbytes, 2)}
