"""`kvdepot bench l2` as a user runs it, at tiny sizes, against a real directory, the real Redis and
the mock: one JSON object in the documented shape, every byte verified on both sides (the adapter's
loads and the baseline's), nothing left behind. Timings are not judged here."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import redis

from tests.integration.redis_keys import REDIS_URL

pytestmark = pytest.mark.slow

FIGURES = {"reads", "adapter_gbps", "baseline_gbps", "vs_baseline", "hit_chunks"}
VERIFY_FIGURES = {"verify_baseline_gbps", "vs_verify_baseline"}


def bench_l2(adapter: str, workdir: Path, redis_url: str = REDIS_URL) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if not k.upper().startswith("KVDEPOT_")}
    done = subprocess.run(
        [sys.executable, "-m", "app.cli", "bench", "l2", "--adapter", adapter, "--requests", "2",
         "--chunks-per-request", "3", "--layers", "1", "--kv-heads", "1", "--head-dim", "16",
         "--chunk-tokens", "16", "--dir", str(workdir), "--redis-url", redis_url],
        capture_output=True, text=True, env=env, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.strip().splitlines()
    assert len(lines) == 1, done.stdout
    got: dict[str, Any] = json.loads(lines[0])
    return got


@pytest.mark.parametrize("adapter", ["disk", "redis", "mock"])
def test_bench_l2_prints_both_baselines_and_verified_bytes(adapter: str, tmp_path: Path) -> None:
    got = bench_l2(adapter, tmp_path)

    base = {
        "adapter", "threads", "baseline", "store_gbps", "baseline_store_gbps", "store_vs_baseline",
        "load_warm", "load_cold", "chunks", "chunk_bytes", "written", "verified", "ok", "mac",
    }  # fmt: skip
    extra = {"redis": {"redis_cpu_s"}, "disk": {"verify_baseline"}}.get(adapter, set())
    assert set(got) == base | extra
    assert (got["adapter"], got["chunks"], got["written"], got["chunk_bytes"]) == (adapter, 6, 6, 1024)
    verified = {"adapter": True, "baseline": True} | ({"verify_baseline": True} if adapter == "disk" else {})
    assert got["verified"] == verified
    assert got["ok"] is True

    # The baseline runs as many threads as the adapter moves bytes with (the defaults: 4).
    threads = None if adapter == "mock" else 4
    assert got["threads"] == threads
    if threads:
        assert got["baseline"].startswith(f"{threads} ")

    assert set(got["load_warm"]) == FIGURES | (VERIFY_FIGURES if adapter == "disk" else set())
    assert got["load_warm"]["hit_chunks"] == 6
    if adapter == "disk":
        assert set(got["load_cold"]) == FIGURES | VERIFY_FIGURES
        assert got["load_cold"]["hit_chunks"] == 6
        assert "page cache" in got["load_warm"]["reads"]
        assert "posix_fadvise" in got["load_cold"]["reads"]
        # The verify-too baseline runs the check a load runs: the MAC, the disk tier authenticating.
        assert "keyed-BLAKE3 MAC" in got["verify_baseline"]
    else:
        assert set(got["load_cold"]) == {"reads"}
        assert got["load_cold"]["reads"].startswith("not applicable")
    if adapter == "redis":
        assert set(got["redis_cpu_s"]) == {"store", "load", "baseline_store", "baseline_load"}

    assert list(tmp_path.iterdir()) == []  # the adapter's and the baseline's files are gone


def test_bench_l2_against_a_redis_cluster(redis_cluster: str, tmp_path: Path) -> None:
    """The adapter and a slot-aware baseline (RedisCluster clients) against the 3-node cluster:
    every byte verified on both sides, nothing left behind on any node."""
    got = bench_l2("redis", tmp_path, redis_cluster)
    assert got["verified"] == {"adapter": True, "baseline": True}
    assert got["ok"] is True
    assert (got["chunks"], got["written"]) == (6, 6)
    assert "RedisCluster" in got["baseline"]
    assert got["load_warm"]["hit_chunks"] == 6
    assert set(got["redis_cpu_s"]) == {"store", "load", "baseline_store", "baseline_load"}
    for port in (7101, 7102, 7103):
        with redis.Redis(port=port) as node:
            assert not list(node.scan_iter(match="kvdepot-bench*"))
