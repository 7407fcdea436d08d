"""The bulk lane's small RESP pieces that need no server: URL parsing and command encoding."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from storage.redis.adapter import RedisAdapter
from storage.redis.config import RedisAdapterConfig
from storage.redis.resp import Target, command, target_from_url

pytestmark = pytest.mark.anyio


def test_urls_give_host_credentials_and_database() -> None:
    assert target_from_url("redis://127.0.0.1:6379/0") == Target("127.0.0.1", 6379)
    assert target_from_url("redis://user:p%40ss@cache:7000/3") == Target(
        "cache", 7000, username="user", password="p@ss", db=3
    )
    assert target_from_url("redis://:secret@cache") == Target("cache", 6379, password="secret")
    assert target_from_url("unix:///run/redis.sock?db=2") == Target(path="/run/redis.sock", db=2)
    assert target_from_url("rediss://cache:6380/0") is None  # TLS stays on redis-py


def test_commands_are_arrays_of_bulk_strings() -> None:
    assert (
        command(b"GETRANGE", b"k", b"0", b"9") == b"*4\r\n$8\r\nGETRANGE\r\n$1\r\nk\r\n$1\r\n0\r\n$1\r\n9\r\n"
    )
    assert command(b"PING") == b"*1\r\n$4\r\nPING\r\n"


async def test_which_adapters_get_a_bulk_lane() -> None:
    def adapter(**fields: object) -> RedisAdapter:
        config = RedisAdapterConfig.model_validate(fields)
        return RedisAdapter(config, ThreadPoolExecutor(1), owns_executor=True)

    made = [adapter(), adapter(url="rediss://cache:6380/0"), adapter(bulk_min_kib=None)]
    assert [a.lane is not None for a in made] == [True, False, False]
    made.append(RedisAdapter(RedisAdapterConfig()))
    assert made[-1].lane is None  # no executor: no threads to run it
    for a in made:
        await a.close()
