"""The disk adapter's load_into with the caller's check (codec.BlobCheck), run in the I/O thread
that read each blob, on real files: intact blobs come back `checked` (raw payloads verified in
place, other blobs decoded into out); a blob that fails the check, whatever part of it changed,
is a MISS carrying its IntegrityError and never `checked`, and the file stays for the caller to
judge (an unknown key's blob must survive)."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from app.errors import AuthenticationError, IntegrityError, UnknownKey
from storage import codec
from storage.auth import BlobKeys
from storage.base import Status
from storage.codec import BlobCheck, CodecOptions, EncodedBlob, blob_header
from storage.disk.adapter import DiskAdapter
from storage.disk.config import DiskAdapterConfig
from tests.integration.storage.test_storage_disk import flip_byte

pytestmark = pytest.mark.anyio

FP = b"layoutfp"
MiB = 1 << 20
KEYS = BlobKeys([b"k" * 32])
OTHER = BlobKeys([b"o" * 32])

MakeDisk = Callable[..., DiskAdapter]


def payload(key: str, size: int) -> bytes:
    return bytes((hash(key) + i) % 251 for i in range(256)) * (size // 256) + bytes(size % 256)


def signed(key: str, size: int, *, signer: BlobKeys | None = KEYS, lz4: bool = False) -> EncodedBlob:
    return codec.encode(key, FP, payload(key, size), CodecOptions(lz4=lz4), signer)


def exists(path: str) -> bool:
    return os.path.exists(path)


@pytest.fixture
async def make_disk(tmp_path: Path) -> AsyncIterator[MakeDisk]:
    made: list[DiskAdapter] = []

    def make(**fields: Any) -> DiskAdapter:
        config = DiskAdapterConfig.model_validate({"fsync": "never", **fields})
        executor = ThreadPoolExecutor(config.io_threads, thread_name_prefix="test-disk-io")
        adapter = DiskAdapter(config, tmp_path / "l2", executor, owns_executor=True)
        made.append(adapter)
        return adapter

    yield make
    for adapter in made:
        await adapter.close()


@pytest.mark.parametrize("o_direct", [False, True], ids=["buffered", "o_direct"])
async def test_intact_blobs_come_back_checked_raw_in_place_others_decoded(
    make_disk: MakeDisk, o_direct: bool
) -> None:
    disk = make_disk(o_direct=o_direct)
    size = 5 * MiB  # past codec.MAC_THREADS_MIN: the MAC on the thread's share of the cores
    await disk.store([("raw", signed("raw", size)), ("lz4", signed("lz4", size, lz4=True))])
    outs = [bytearray(size), bytearray(size)]
    results = await disk.load_into(["raw", "lz4"], [memoryview(o) for o in outs], BlobCheck(FP, KEYS))
    assert [(r.status, r.checked, r.in_place) for r in results] == [
        (Status.OK, True, True),
        (Status.OK, True, False),
    ]
    assert [r.failed_check for r in results] == [None, None]
    assert outs == [payload("raw", size), payload("lz4", size)]


@pytest.mark.parametrize("o_direct", [False, True], ids=["buffered", "o_direct"])
@pytest.mark.parametrize(
    ("where", "error"),
    [("payload", AuthenticationError), ("header", IntegrityError), ("lz4 payload", AuthenticationError)],
)
async def test_a_changed_byte_is_a_miss_carrying_the_failure(
    make_disk: MakeDisk, o_direct: bool, where: str, error: type[IntegrityError]
) -> None:
    disk = make_disk(o_direct=o_direct)
    size = 5 * MiB
    stored = signed("k", size, lz4=where.startswith("lz4"))
    await disk.store([("k", stored)])
    path = str(disk.path_of("k"))
    flip_byte(path, 20 if where == "header" else stored.nbytes - 3)
    (result,) = await disk.load_into(["k"], [memoryview(bytearray(size))], BlobCheck(FP, KEYS))
    assert result.status is Status.MISS
    assert not result.checked
    assert isinstance(result.failed_check, error)
    assert exists(path)  # the caller's to delete (or keep: an unknown key's)


async def test_the_checksum_path_catches_what_the_mac_would(make_disk: MakeDisk) -> None:
    """A tier that does not authenticate: unsigned blobs, checked by their xxh3 checksum."""
    disk = make_disk(authenticate=False)
    await disk.store([("good", signed("good", MiB, signer=None)), ("bad", signed("bad", MiB, signer=None))])
    flip_byte(str(disk.path_of("bad")), blob_header.header_size("bad") + 1000)
    outs = [bytearray(MiB), bytearray(MiB)]
    good, bad = await disk.load_into(["good", "bad"], [memoryview(o) for o in outs], BlobCheck(FP, None))
    assert (good.status, good.checked, bytes(outs[0])) == (Status.OK, True, payload("good", MiB))
    assert bad.status is Status.MISS
    assert isinstance(bad.failed_check, IntegrityError)
    assert "checksum" in str(bad.failed_check)


async def test_unsigned_and_foreign_blobs_fail_the_mac_check(make_disk: MakeDisk) -> None:
    disk = make_disk()
    await disk.store(
        [("plain", signed("plain", MiB, signer=None)), ("foreign", signed("foreign", MiB, signer=OTHER))]
    )
    outs = [memoryview(bytearray(MiB)), memoryview(bytearray(MiB))]
    plain, foreign = await disk.load_into(["plain", "foreign"], outs, BlobCheck(FP, KEYS))
    assert plain.status is Status.MISS
    assert isinstance(plain.failed_check, AuthenticationError)
    assert foreign.status is Status.MISS
    assert isinstance(foreign.failed_check, UnknownKey)


async def test_without_a_check_nothing_is_checked(make_disk: MakeDisk) -> None:
    """load_into without a check answers as it always did: the caller checks, nothing says checked."""
    disk = make_disk()
    await disk.store([("k", signed("k", MiB))])
    flip_byte(str(disk.path_of("k")), blob_header.header_size("k") + 7)
    out = bytearray(MiB)
    (result,) = await disk.load_into(["k"], [memoryview(out)])
    assert (result.status, result.checked, result.in_place) == (Status.OK, False, True)
    assert result.data is not None
    with pytest.raises(AuthenticationError):
        codec.verify_in_place(result.data, "k", FP, out, KEYS)
