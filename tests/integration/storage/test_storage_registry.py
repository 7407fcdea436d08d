"""Every adapter type built through the registry (storage/registry.py) from its config, started,
used and closed; the threads a builder gives an adapter end with it; the default settings build a
disk adapter."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from app.settings import L2Settings
from storage import codec
from storage.codec import CodecOptions
from storage.disk.config import DiskAdapterConfig
from storage.mock.config import MockAdapterConfig
from storage.redis.config import RedisAdapterConfig
from storage.registry import AdapterConfig, build_adapter
from storage.slab.config import SlabAdapterConfig

pytestmark = pytest.mark.anyio


def _io_threads(name: str) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith(f"kvdepot-l2-{name}")]


async def test_every_kind_is_built_started_used_and_closed(tmp_path: Path) -> None:
    configs: list[AdapterConfig] = [
        DiskAdapterConfig(fsync="never", io_threads=2),
        DiskAdapterConfig(name="scratch", fsync="never"),
        SlabAdapterConfig(size_bytes=4096 + 8 * (64 << 10), slot_bytes=64 << 10, io_threads=2),
        SlabAdapterConfig(name="fast", size_bytes=4096 + 8 * (64 << 10), slot_bytes=64 << 10, fsync="never"),
        RedisAdapterConfig(key_prefix="kvdepot-test-factory:"),
        MockAdapterConfig(),
    ]
    blob = codec.encode("k", b"layoutfp", b"x" * 100, CodecOptions())
    for config in configs:
        adapter = build_adapter(config, tmp_path)
        assert (adapter.name, adapter.kind) == (config.name, config.type)
        await adapter.start()
        assert (await adapter.store([("k", blob)]))[0].ok
        assert (await adapter.load(["k"]))[0].data == blob.to_bytes()
        assert (await adapter.delete(["k"]))[0].ok
        await adapter.close()
        assert adapter.health().state == "down"
    assert (tmp_path / "l2-disk").is_dir()
    assert (tmp_path / "l2-disk-scratch").is_dir()
    for name in ("l2-slab", "l2-slab-fast"):  # one file each, its index checkpointed at close beside it
        assert (tmp_path / name).stat().st_size == 4096 + 8 * (64 << 10)
        assert (tmp_path / f"{name}.index").is_file()


async def test_close_releases_the_executor(tmp_path: Path) -> None:
    adapter = build_adapter(DiskAdapterConfig(name="threads", fsync="never", io_threads=3), tmp_path)
    await adapter.start()
    assert 1 <= len(_io_threads("threads")) <= 3
    await adapter.close()
    for thread in _io_threads("threads"):
        thread.join(5)  # they exit on their own once the executor is shut down
    assert _io_threads("threads") == []


def test_default_settings_build_a_disk_adapter(tmp_path: Path) -> None:
    (config,) = L2Settings().adapters
    adapter = build_adapter(config, tmp_path)
    assert adapter.kind == "disk"
