"""The slab adapter on a raw block device (a loop device over a file; needs root and losetup):
its size is the device's, a zeroed device is formatted, one with other data is refused, and what
was stored is served after a restart."""

from __future__ import annotations

import os
import random
import shutil
import subprocess
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from app.errors import ConfigError
from storage import codec
from storage.base import Status
from storage.codec import CodecOptions
from storage.slab.adapter import SlabAdapter
from storage.slab.config import SlabAdapterConfig
from tests.integration.storage.slab_helpers import aligned, payload_for

pytestmark = pytest.mark.anyio

SLOT = 64 << 10
FP = b"layoutfp"


@pytest.fixture
def loop_device(tmp_path: Path) -> Iterator[tuple[Path, Path]]:
    """(device, backing file): a loop device over a zeroed file of 4 KiB + 12 slots."""
    if os.geteuid() != 0 or shutil.which("losetup") is None:
        pytest.skip("a loop device needs root and losetup")
    backing = tmp_path / "backing"
    with open(backing, "wb") as f:
        f.truncate(4096 + 12 * SLOT)
    made = subprocess.run(
        ["losetup", "--find", "--show", str(backing)], check=False, capture_output=True, text=True
    )
    if made.returncode != 0:
        pytest.skip(f"losetup: {made.stderr.strip()}")
    device = Path(made.stdout.strip())
    try:
        yield device, backing
    finally:
        subprocess.run(["losetup", "--detach", str(device)], check=False)


def slab_on(device: Path, tmp_path: Path) -> SlabAdapter:
    config = SlabAdapterConfig(paths=[device], slot_bytes=SLOT, fsync="always", io_threads=2)
    executor = ThreadPoolExecutor(2, thread_name_prefix="test-slab-dev")
    return SlabAdapter(config, tmp_path / "unused", tmp_path / "dev.index", executor, owns_executor=True)


async def test_a_block_device_is_formatted_used_and_reopened(
    loop_device: tuple[Path, Path], tmp_path: Path
) -> None:
    device, _ = loop_device
    slab = slab_on(device, tmp_path)  # size_bytes (8 GiB by default) does not apply to a device
    await slab.start()
    assert slab.startup is not None and slab.startup.slots == 12
    assert slab.usage().capacity_bytes == 12 * SLOT
    blobs = [(f"k{i}", codec.encode(f"k{i}", FP, payload_for(f"k{i}"), CodecOptions())) for i in range(14)]
    assert all(r.ok for r in await slab.store(blobs[:12]))
    assert [r.status for r in await slab.store(blobs[12:])] == [Status.OK] * 2  # the two oldest go
    await slab.close()

    again = slab_on(device, tmp_path)
    await again.start()
    assert sorted(again.keys_lru()) == sorted(f"k{i}" for i in range(2, 14))
    out = aligned(48 << 10)
    (result,) = await again.load_into(["k7"], [memoryview(out)])
    assert result.status is Status.OK and result.in_place and result.data is not None
    codec.verify_in_place(result.data, "k7", FP, memoryview(out))
    assert bytes(out) == payload_for("k7")
    await again.close()


@pytest.mark.parametrize("at", [0, 64 << 10, 4096 + 12 * SLOT - 512])
async def test_a_device_with_other_data_is_refused(
    loop_device: tuple[Path, Path], tmp_path: Path, at: int
) -> None:
    """Data at the start (most signatures), at 64 KiB (btrfs: the first 4 KiB are zeros) or at
    the end (a GPT copy): never formatted over."""
    device, backing = loop_device
    data = random.Random(at).randbytes(512)
    fd = os.open(device, os.O_WRONLY)
    try:
        os.pwrite(fd, data, at)
        os.fsync(fd)
    finally:
        os.close(fd)
    before = backing.read_bytes()
    slab = slab_on(device, tmp_path)
    with pytest.raises(ConfigError, match="not a kvdepot slab"):
        await slab.start()
    await slab.close()
    assert backing.read_bytes() == before
