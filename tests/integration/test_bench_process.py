"""`kvdepot bench server` as a user runs it, at tiny sizes: it starts a sidecar, runs its client in
another process, and prints one JSON object that says every byte came back."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow


def test_bench_server_prints_one_verified_json_object() -> None:
    env = {k: v for k, v in os.environ.items() if not k.upper().startswith("KVDEPOT_")}
    done = subprocess.run(
        [sys.executable, "-m", "app.cli", "bench", "server", "--requests", "2", "--chunks-per-request", "3",
         "--layers", "1", "--kv-heads", "1", "--head-dim", "16", "--chunk-tokens", "16", "--lookups", "20"],
        capture_output=True, text=True, env=env, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.strip().splitlines()
    assert len(lines) == 1
    got = json.loads(lines[0])
    assert set(got) == {
        "store_gbps", "retrieve_gbps", "memcpy_gbps", "store_vs_memcpy", "retrieve_vs_memcpy",
        "lookup_p50_ms", "lookup_p99_ms", "lookup_chunks", "chunk_bytes", "chunks", "requests", "ok", "url",
    }  # fmt: skip
    assert (got["ok"], got["url"], got["chunks"], got["requests"], got["lookup_chunks"]) == (
        True,
        "started",
        6,
        2,
        3,
    )
    assert got["chunk_bytes"] == 2 * 1 * 1 * 16 * 16 * 2
