"""Real Redis for the storage tests: private redis-server processes the tests stop, freeze and
restart, and the adapters of the `make_redis` / `make_cluster` fixtures."""

from __future__ import annotations

import contextlib
import signal
import subprocess
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from storage.redis.adapter import RedisAdapter
from storage.redis.config import RedisAdapterConfig
from tests.ports import free_port

MakeRedis = Callable[..., RedisAdapter]


@contextlib.asynccontextmanager
async def redis_adapters(default_url: str, prefix: str) -> AsyncIterator[MakeRedis]:
    """`make(url=default_url, **fields)` builds Redis adapters whose keys are under `prefix`; each
    is closed when the block ends (its keys are the prefix owner's to delete)."""
    made: list[RedisAdapter] = []

    def make(url: str = default_url, **fields: Any) -> RedisAdapter:
        config = RedisAdapterConfig.model_validate({"url": url, "key_prefix": prefix, **fields})
        executor = ThreadPoolExecutor(4, thread_name_prefix="test-redis-io")
        adapter = RedisAdapter(config, executor, owns_executor=True)
        made.append(adapter)
        return adapter

    try:
        yield make
    finally:
        for adapter in made:
            await adapter.close()


class RedisServer:
    """A private redis-server on a free port, stopped, frozen and started by the test."""

    def __init__(self, *args: str) -> None:
        self.port = free_port()
        self.args = args
        self.proc: subprocess.Popen[str] | None = None
        self.frozen = False

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.proc = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", *self.args],
            stdout=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        assert self.proc.stdout is not None
        for line in self.proc.stdout:  # the server says when it accepts connections
            if "Ready to accept connections" in line:
                return
        raise RuntimeError("redis-server did not start")

    def freeze(self) -> None:
        """SIGSTOP: the kernel still accepts connections and buffers bytes; nothing answers."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP)
        self.frozen = True

    def thaw(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGCONT)
        self.frozen = False

    def stop(self) -> None:
        if self.proc is not None:
            if self.frozen:
                self.thaw()
            self.proc.terminate()
            self.proc.wait(10)
            assert self.proc.stdout is not None
            self.proc.stdout.close()
            self.proc = None
