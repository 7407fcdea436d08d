"""io_threads: how many threads move an adapter's bytes, the figure `bench l2` gives its baseline."""

from __future__ import annotations

from storage.config import DiskAdapterConfig, MockAdapterConfig, RedisAdapterConfig
from storage.factory import REDIS_IO_THREADS, io_threads


def test_each_kind_moves_its_bytes_with_the_threads_its_config_allows() -> None:
    assert io_threads(DiskAdapterConfig(io_threads=6)) == 6
    assert io_threads(RedisAdapterConfig()) == REDIS_IO_THREADS
    assert io_threads(RedisAdapterConfig(max_connections=2)) == 2  # one connection per thread
    assert io_threads(MockAdapterConfig()) == 0  # no executor
