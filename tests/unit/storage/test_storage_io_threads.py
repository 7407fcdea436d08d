"""transfer_threads: how many threads move an adapter's bytes, the figure `bench l2` gives its baseline."""

from __future__ import annotations

from storage.disk.config import DiskAdapterConfig
from storage.mock.config import MockAdapterConfig
from storage.redis.config import REDIS_IO_THREADS, RedisAdapterConfig
from storage.slab.config import SlabAdapterConfig


def test_each_kind_moves_its_bytes_with_the_threads_its_config_allows() -> None:
    assert DiskAdapterConfig(io_threads=6).transfer_threads() == 6
    assert SlabAdapterConfig(io_threads=3).transfer_threads() == 3
    assert RedisAdapterConfig().transfer_threads() == REDIS_IO_THREADS
    assert RedisAdapterConfig(max_connections=2).transfer_threads() == 2  # one connection per thread
    assert MockAdapterConfig().transfer_threads() == 0  # no executor
