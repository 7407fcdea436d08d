from __future__ import annotations

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
