from __future__ import annotations

import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from bench.sidecar import SidecarProcess, start_sidecar
from tests.integration.redis_keys import REDIS_URL, delete_prefix, new_prefix
from tests.integration.tools import need_tool

StartSidecar = Callable[..., SidecarProcess]


@pytest.fixture
def sidecar_factory(tmp_path: Path) -> Iterator[StartSidecar]:
    """Start real `kvdepot serve` processes; all are stopped (then killed) at teardown."""
    started: list[SidecarProcess] = []

    def start(
        *args: str, data_dir: Path | None = None, env: dict[str, str] | None = None, **kw: Any
    ) -> SidecarProcess:
        sc = start_sidecar(data_dir or tmp_path / f"sidecar{len(started)}", *args, env=env, **kw)
        started.append(sc)
        return sc

    yield start
    for sc in started:
        sc.stop()


@pytest.fixture
def redis_prefix() -> Iterator[str]:
    """A key prefix of this test's own; its keys are deleted from the shared Redis and from the
    test cluster at teardown (tests/integration/redis_keys.py)."""
    prefix = new_prefix()
    yield prefix
    delete_prefix(prefix)


@pytest.fixture
def attacker() -> Iterator[redis.Redis]:
    """Another writer to the shared Redis: a plain client, no kvdepot key."""
    with redis.Redis.from_url(REDIS_URL) as r:
        yield r


CLUSTER_PORTS = (7101, 7102, 7103)
CLUSTER_URL = "redis://127.0.0.1:7101/0"


@pytest.fixture(scope="session")
def redis_cluster() -> str:
    """The URL of the 3-node Redis Cluster on 127.0.0.1:7101-7103, started by tests/redis_cluster.sh
    when none of its nodes answers (it is left running, like the Redis on 6379)."""
    need_tool("redis-server", "redis-server")
    need_tool("redis-cli", "redis-tools")
    script = Path(__file__).resolve().parent.parent / "redis_cluster.sh"
    subprocess.run([str(script)], check=True, timeout=120)
    return CLUSTER_URL
