"""Real Redis for the storage tests: private redis-server processes the tests stop, freeze and
restart, a free port to put one on, and the type of the `make_redis` fixture (conftest)."""

from __future__ import annotations

import signal
import socket
import subprocess
from collections.abc import Callable

from storage.redis_adapter import RedisAdapter

MakeRedis = Callable[..., RedisAdapter]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


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
