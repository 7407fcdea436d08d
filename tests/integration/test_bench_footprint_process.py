"""`kvdepot bench footprint` as a user runs it, small: one JSON object with the sidecar's start-up
time and memory beyond its arena, from a `kvdepot serve` on the default settings that served a
`bench server` client and never loaded torch."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow


def test_bench_footprint_prints_one_json_object() -> None:
    env = {k: v for k, v in os.environ.items() if not k.upper().startswith("KVDEPOT_")}
    done = subprocess.run(
        [sys.executable, "-m", "app.cli", "bench", "footprint", "--runs", "1", "--l1-size-gb", "0.25",
         "--settle-s", "0.2", "--requests", "1", "--chunks-per-request", "4", "--lookups", "10"],
        capture_output=True, text=True, env=env, timeout=300, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    [line] = done.stdout.strip().splitlines()
    got = json.loads(line)
    assert (got["ok"], got["torch"], got["l1_size_gb"], got["load_chunks"], len(got["runs"])) == (
        True, False, 0.25, 4, 1,
    )  # fmt: skip
    for run in got["runs"]:
        assert run["ready_s"] > 0
        # The interpreter and its libraries, without torch (which alone brings ~200 MB); and not
        # the 128 MiB of arena the sidecar read to write the 4 chunks of 32 MiB behind to disk.
        assert 10 < run["idle_mb"] < 128
        assert run["idle_mb"] * 0.9 <= run["load_mb"] < 128
