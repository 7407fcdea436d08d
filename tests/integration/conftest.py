from __future__ import annotations

import shutil
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from app.bench.sidecar import SidecarProcess, start_sidecar

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


CLUSTER_PORTS = (7101, 7102, 7103)
CLUSTER_URL = "redis://127.0.0.1:7101/0"


@pytest.fixture(scope="session")
def redis_cluster() -> str:
    """The URL of the 3-node Redis Cluster on 127.0.0.1:7101-7103, started by tests/redis_cluster.sh
    when none of its nodes answers (it is left running, like the Redis on 6379)."""
    if shutil.which("redis-server") is None or shutil.which("redis-cli") is None:
        pytest.skip("redis-server is not installed")
    script = Path(__file__).resolve().parent.parent / "redis_cluster.sh"
    subprocess.run([str(script)], check=True, timeout=120)
    return CLUSTER_URL
