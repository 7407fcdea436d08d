"""build_adapter: one L2 adapter from its config, with the executor it needs.

Owns nothing after it returns: each adapter owns its executor (named threads
`kvdepot-l2-<adapter name>`, bounded) and shuts it down in `close()`. Building starts no I/O;
`await adapter.start()` readies it (the disk adapter rebuilds its index then), or the first
operation does.

Where each kind keeps its bytes:
  disk   config.paths, or <data_dir>/l2-disk (<data_dir>/l2-disk-<name> for a name other than
         "disk", so that two disk adapters never share a directory by default);
         io_threads threads for file I/O
  slab   config.paths, or the file <data_dir>/l2-slab (<data_dir>/l2-slab-<name> for a name other
         than "slab"); its index checkpoint <data_dir>/l2-slab[-<name>].index; io_threads threads
  redis  config.url; REDIS_IO_THREADS threads (at most max_connections) for the bulk lane's
         blocking sockets (and, without a lane, for joining large blobs into one value)
  mock   memory; no executor
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from storage.auth import BlobKeys
from storage.base import L2Adapter
from storage.config import (
    AdapterConfig,
    DiskAdapterConfig,
    MockAdapterConfig,
    RedisAdapterConfig,
    SlabAdapterConfig,
)
from storage.disk import DiskAdapter
from storage.mock import MockAdapter
from storage.slab import SlabAdapter

REDIS_IO_THREADS = 4


def default_disk_dir(config: DiskAdapterConfig, data_dir: Path) -> Path:
    return data_dir / ("l2-disk" if config.name == "disk" else f"l2-disk-{config.name}")


def io_threads(config: AdapterConfig) -> int:
    """How many threads move the adapter's bytes at once (stores and loads alike): the disk
    adapter's file I/O threads, the Redis bulk lane's threads; 0 for the mock (no executor)."""
    if isinstance(config, DiskAdapterConfig):
        return config.io_threads
    if isinstance(config, RedisAdapterConfig):
        return min(REDIS_IO_THREADS, config.max_connections)
    return 0


def default_slab_path(config: SlabAdapterConfig, data_dir: Path) -> Path:
    return data_dir / ("l2-slab" if config.name == "slab" else f"l2-slab-{config.name}")


def slab_checkpoint_path(config: SlabAdapterConfig, data_dir: Path) -> Path:
    return data_dir / f"{default_slab_path(config, data_dir).name}.index"


def build_adapter(config: AdapterConfig, data_dir: Path, keys: BlobKeys | None = None) -> L2Adapter:
    """A new adapter for `config`; call `await adapter.close()` to release everything it holds.
    `keys` (the deployment's) seal a Redis adapter's fleet quotas (storage/fleet_quota.py)."""
    if isinstance(config, DiskAdapterConfig):
        executor = ThreadPoolExecutor(io_threads(config), thread_name_prefix=f"kvdepot-l2-{config.name}")
        return DiskAdapter(config, default_disk_dir(config, data_dir), executor, owns_executor=True)
    if isinstance(config, SlabAdapterConfig):
        executor = ThreadPoolExecutor(config.io_threads, thread_name_prefix=f"kvdepot-l2-{config.name}")
        return SlabAdapter(
            config, default_slab_path(config, data_dir), slab_checkpoint_path(config, data_dir), executor,
            owns_executor=True,
        )  # fmt: skip
    if isinstance(config, RedisAdapterConfig):
        from storage.redis_adapter import RedisAdapter  # redis-py is imported where it is used

        threads = io_threads(config)
        executor = ThreadPoolExecutor(threads, thread_name_prefix=f"kvdepot-l2-{config.name}")
        return RedisAdapter(config, executor, owns_executor=True, keys=keys)
    if isinstance(config, MockAdapterConfig):
        return MockAdapter(config)
    raise TypeError(f"unknown adapter config {type(config).__name__}")
