"""The disk adapter's files are the service user's alone (0600 in 0700 directories), and a blob
that fsync=always says is written survives a crash: its file and then its directory are synced."""

from __future__ import annotations

import os
import stat
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from storage import codec
from storage.codec import CodecOptions
from storage.disk import dirs as disk_dirs
from storage.disk.adapter import DiskAdapter
from storage.disk.config import DiskAdapterConfig

pytestmark = pytest.mark.anyio

FP = b"layoutfp"
MakeDisk = Callable[..., DiskAdapter]


def mode(path: str | Path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


@pytest.fixture
async def make_disk() -> AsyncIterator[MakeDisk]:
    made: list[DiskAdapter] = []

    def make(default_dir: Path, **kwargs: Any) -> DiskAdapter:
        config = DiskAdapterConfig.model_validate({"fsync": "always", **kwargs.pop("config", {})})
        executor = ThreadPoolExecutor(2, thread_name_prefix="test-disk-io")
        adapter = DiskAdapter(config, default_dir, executor, owns_executor=True, **kwargs)
        made.append(adapter)
        return adapter

    yield make
    for adapter in made:
        await adapter.close()


async def test_blob_files_are_0600_in_0700_directories_even_under_a_permissive_umask(
    make_disk: MakeDisk, tmp_path: Path
) -> None:
    old_umask = os.umask(0o002)  # a umask under which plain creation would be group-writable
    try:
        root = tmp_path / "data" / "l2-disk"  # neither exists yet: both are created by the adapter
        disk = make_disk(root)
        blob = codec.encode("k", FP, os.urandom(8192), CodecOptions())
        assert (await disk.store([("k", blob)]))[0].ok
    finally:
        os.umask(old_umask)
    path = disk.path_of("k")
    assert path is not None
    assert mode(path) == 0o600
    assert mode(os.path.dirname(path)) == 0o700
    assert mode(root) == 0o700
    assert mode(root.parent) == 0o700
    assert mode(root / disk_dirs.LOCK_NAME) == 0o600
    assert all(mode(root / sub) == 0o700 for sub in disk_dirs.SUBDIRS)


async def test_an_existing_open_directory_is_made_private(make_disk: MakeDisk, tmp_path: Path) -> None:
    root = tmp_path / "shared"
    root.mkdir()
    root.chmod(0o755)
    (root / "00").mkdir()
    (root / "00").chmod(0o777)
    disk = make_disk(root)
    await disk.start()
    assert mode(root) == 0o700
    assert mode(root / "00") == 0o700


async def test_the_directory_is_fsynced_after_the_rename(make_disk: MakeDisk, tmp_path: Path) -> None:
    synced: list[tuple[str, bool, list[str]]] = []  # (what, is a directory, blob files there then)

    def record(fd: int) -> None:
        target = os.readlink(f"/proc/self/fd/{fd}")
        is_dir = os.path.isdir(target)
        listing = sorted(os.listdir(target)) if is_dir else []
        synced.append((target, is_dir, listing))
        os.fsync(fd)

    disk = make_disk(tmp_path / "l2", sync_fd=record)
    blob = codec.encode("k", FP, os.urandom(4096), CodecOptions())
    assert (await disk.store([("k", blob)]))[0].ok
    path = disk.path_of("k")
    assert path is not None
    # the temp file first, then its directory once the blob's final name is in it
    assert [is_dir for _, is_dir, _ in synced] == [False, True]
    assert synced[0][0].endswith(disk_dirs.TMP_SUFFIX)
    assert synced[1][0] == os.path.dirname(path)
    assert os.path.basename(path) in synced[1][2]


async def test_fsync_never_syncs_nothing(make_disk: MakeDisk, tmp_path: Path) -> None:
    synced: list[int] = []
    disk = make_disk(tmp_path / "l2", sync_fd=synced.append, config={"fsync": "never"})
    blob = codec.encode("k", FP, os.urandom(4096), CodecOptions())
    assert (await disk.store([("k", blob)]))[0].ok
    assert synced == []
