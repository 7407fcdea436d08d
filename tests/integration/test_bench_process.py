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
         "--layers", "1", "--kv-heads", "1", "--head-dim", "16", "--chunk-tokens", "16", "--lookups", "20",
         "--retrieve", "ask"],
        capture_output=True, text=True, env=env, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.strip().splitlines()
    assert len(lines) == 1
    got = json.loads(lines[0])
    assert set(got) == {
        "store_gbps", "retrieve_gbps", "memcpy_gbps", "store_vs_memcpy", "retrieve_vs_memcpy",
        "lookup_p50_ms", "lookup_p99_ms", "lookup_chunks", "chunk_bytes", "chunks", "requests", "ok", "url",
        "runs", "loadavg", "sidecar_cpu_s", "commit", "retrieve",
    }  # fmt: skip
    assert (got["ok"], got["url"], got["chunks"], got["requests"], got["lookup_chunks"]) == (
        True,
        "started",
        6,
        2,
        3,
    )
    assert got["chunk_bytes"] == 2 * 1 * 1 * 16 * 16 * 2
    assert [(r["clients"], r["bytes_verified"], r["ok"]) for r in got["runs"]] == [(1, 6 * 1024, True)]
    # --retrieve ask: each retrieve asked the sidecar with a RETRIEVE of its own
    assert got["retrieve"] == "ask" and got["runs"][0]["sidecar_ms"]["retrieve"] > 0


def _bench(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.upper().startswith("KVDEPOT_")}
    return subprocess.run(
        [sys.executable, "-m", "app.cli", "bench", "server", *args],
        capture_output=True, text=True, env=env, timeout=300, check=False,
    )  # fmt: skip


def test_bench_server_runs_chunk_sizes_client_counts_and_a_long_prompt() -> None:
    """Two chunk sizes (1 and 2 MiB, by the number of 1 MiB layers) with 1 and 2 clients at once,
    and a 4096-token prompt: one JSON object; every byte of every client came back."""
    done = _bench(
        "--chunk-mib", "1", "2", "--request-mib", "2", "--requests", "2", "--clients", "1", "2",
        "--lookups", "5", "--prompt-tokens", "4096", "--prompt-samples", "5",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.strip().splitlines()
    assert len(lines) == 1
    got = json.loads(lines[0])
    assert got["ok"] is True and (got["commit"], got["retrieve"]) == ("post", "locate")
    runs = got["runs"]
    assert [(r["chunk_mib"], r["clients"], r["chunks_per_request"]) for r in runs] == [
        (1, 1, 2), (1, 2, 2), (2, 1, 1), (2, 2, 1),
    ]  # fmt: skip
    for r in runs:
        assert r["chunk_bytes"] == r["chunk_mib"] << 20
        assert r["bytes_verified"] == r["clients"] * 2 * r["chunks_per_request"] * r["chunk_bytes"]
        assert r["ok"] is True
        for key in ("store_gbps", "retrieve_gbps", "memcpy_store_gbps", "memcpy_retrieve_gbps",
                    "store_vs_memcpy", "retrieve_vs_memcpy", "store_vs_memcpy_p50",
                    "retrieve_vs_memcpy_p50", "ping_p50_ms", "ping_p99_ms",
                    "ping_after_copy_p50_ms"):  # fmt: skip
            assert r[key] > 0
        # The sidecar's own handling of each call of the run (its /metrics), a part of the round trip;
        # no RETRIEVE: each retrieve copied from the extents its LOOKUP named (`--retrieve locate`).
        assert set(r["sidecar_ms"]) == {"store", "commit", "lookup", "release"}
        # Neither a COMMIT (`--commit post`, the default) nor a RELEASE whose fences held is waited
        # for: the sidecar handles each all the same.
        for op in ("commit", "release"):
            assert r["sidecar_ms"][op] > 0 and r["phases_ms"][op] > 0
        assert r["first_fill_store_vs_memcpy"] > 0
        steps = r["phases_ms"]
        parts = {"reserve", "copy_in", "commit", "extents", "copy_out", "release"}
        # memcpy_cold: the store's baseline; memcpy: the retrieve's
        assert set(steps) == {"memcpy_cold", "memcpy", "store", "retrieve", *parts}
        assert all(v > 0 for v in steps.values())
    # The first run is also what the benchmark always printed at the top.
    assert (got["store_vs_memcpy"], got["chunk_bytes"], got["lookup_chunks"]) == (
        runs[0]["store_vs_memcpy"], 1 << 20, 2,
    )  # fmt: skip
    prompt = got["prompt"]
    assert (prompt["tokens"], prompt["chunks"], prompt["samples"], prompt["ok"]) == (4096, 16, 5, True)
    assert prompt["hash_p50_ms"] > 0 and 0 < prompt["lookup_p50_ms"] <= prompt["lookup_p99_ms"]
    assert prompt["hash_ns_per_token"] == round(prompt["hash_p50_ms"] * 1e6 / 4096, 2)


def test_bench_server_refuses_a_chunk_size_the_layout_cannot_make() -> None:
    done = _bench("--chunk-mib", "1", "--kv-heads", "3")
    assert done.returncode == 2
    assert "--chunk-mib 1: not a whole number of 393216-byte layers" in done.stderr
