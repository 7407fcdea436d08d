"""`kvdepot bench l2 --adapter slab` as a user runs it, at tiny sizes, on the real disk: a JSON
object (its last line) with the slab's figures beside both baselines of the same run, every byte checked."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow


@pytest.fixture
def short_dir() -> Iterator[Path]:
    """A directory on the real disk with a short name (the run's ipc socket path must stay short)."""
    path = Path(tempfile.mkdtemp(prefix="kvd-", dir="/var/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_bench_l2_slab_prints_both_baselines_and_verifies_every_byte(short_dir: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.upper().startswith("KVDEPOT_")}
    done = subprocess.run(
        [sys.executable, "-m", "app.cli", "bench", "l2", "--adapter", "slab", "--requests", "2",
         "--chunks-per-request", "3", "--layers", "2", "--kv-heads", "2", "--head-dim", "64",
         "--chunk-tokens", "16", "--settle-s", "0.2", "--dir", str(short_dir)],
        capture_output=True, text=True, env=env, timeout=180, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])  # after the in-process sidecar's log lines
    assert (got["adapter"], got["chunks"], got["written"], got["hit_chunks"]) == ("slab", 6, 6, 6)
    assert (got["ok"], got["raw_ok"], got["disk_ok"], got["adapter_only"]["ok"]) == (True, True, True, True)
    assert got["chunk_bytes"] == 2 * 2 * 2 * 64 * 16 * 2
    assert got["slot_bytes"] == 4096 + got["chunk_bytes"]
    assert got["filesystem"] not in ("", "unknown")
    for name in ("store_vs_raw", "load_vs_raw", "store_vs_disk", "load_vs_disk"):
        assert got[name] > 0
    for run in ("raw_before", "raw_after"):
        assert set(got[run]) == {"sequential_write_gbps", "sequential_read_gbps", "parallel_write_gbps",
                                 "parallel_read_gbps"}  # fmt: skip
    assert list(short_dir.iterdir()) == [], "the run's files are removed"
