"""Running the KV-event consumer (tests/kv_events_consumer.py) as a process, in the sidecar's
venv or in vLLM's, and what the tests compare its output with."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path
from typing import Any

from tests.integration.tools import VLLM_PYTHON, need_python

ROOT = Path(__file__).resolve().parents[2]
CONSUMER = ROOT / "tests" / "kv_events_consumer.py"


def need_vllm_python() -> Path:
    """vLLM's python; a skip (bare pytest) or a failure (tests/run.sh) when its venv is missing."""
    return need_python(VLLM_PYTHON, "tests/e2e/setup_vllm.sh")


def consumer_cmd(
    endpoint: str, replay: str, count: int, *, vllm: bool, extra: tuple[str, ...] = ()
) -> list[str]:
    python = str(VLLM_PYTHON) if vllm else sys.executable
    return [python, str(CONSUMER), endpoint, replay, str(count), *(("--vllm",) if vllm else ()), *extra]


def consumer_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # vLLM's venv imports nothing of ours
    env.update(extra or {})
    return env


async def start_consumer(
    endpoint: str, replay: str, count: int, *, vllm: bool, env: dict[str, str] | None = None,
    extra: tuple[str, ...] = (),
) -> asyncio.subprocess.Process:  # fmt: skip
    proc = await asyncio.create_subprocess_exec(
        *consumer_cmd(endpoint, replay, count, vllm=vllm, extra=extra), env=consumer_env(env),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    assert proc.stdout is not None
    line = await asyncio.wait_for(proc.stdout.readline(), 120)
    assert line.strip() == b"subscribed", line
    return proc


async def consumer_result(proc: asyncio.subprocess.Process) -> dict[str, Any]:
    out, err = await asyncio.wait_for(proc.communicate(), 120)
    assert proc.returncode == 0, (proc.returncode, out[-2000:], err[-4000:])
    result: dict[str, Any] = json.loads(out.decode().strip().splitlines()[-1])
    return result


def stored(batches: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [e for b in batches for e in b["events"] if e["type"] == "BlockStored"]
