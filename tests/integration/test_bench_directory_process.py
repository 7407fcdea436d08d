"""`kvdepot bench directory` as a user runs it, at small sizes: one JSON object on stdout with the
documented fields, every instance scored with the prefix the bench placed, every event and every
listed chunk accounted for. Timings are not judged here."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow


def test_bench_directory_prints_one_sane_object() -> None:
    env = {k: v for k, v in os.environ.items() if not k.upper().startswith("KVDEPOT_")}
    done = subprocess.run(
        [sys.executable, "-m", "app.cli", "bench", "directory", "--chunks", "20000", "--instances", "6",
         "--tokens", "4096", "--scores", "50", "--events", "3000"],
        capture_output=True, text=True, env=env, timeout=120, check=False,
    )  # fmt: skip
    lines = done.stdout.strip().splitlines()
    assert done.returncode == 0 and len(lines) == 1, (done.stdout, done.stderr[-2000:])
    got = json.loads(lines[0])
    assert got["ok"] is True
    assert got["chunks_indexed"] == 20000 and got["instances"] == 6 and got["rebuilt_chunks"] == 19998
    for name in ("score_p50_ms", "score_p99_ms", "hashing_p50_ms", "rebuild_s", "rss_mb_per_million_chunks"):
        assert got[name] > 0, name
    assert got["score_p99_ms"] >= got["score_p50_ms"]
    assert 0 < got["score_cpu_p50_ms"] <= got["score_cpu_p99_ms"]
    assert 0 <= got["score_preempted_share"] <= 1
    assert got["ingest_events_per_s"] > 0 and got["full_decode_events_per_s"] > 0
    assert got["ingest_with_match_events_per_s"] > 0
    # i05 put the whole prefix in the shared tier (every instance serves it from there); i03 holds
    # the most of it in its own L1 (10 of 16 chunks): the best score
    assert got["best"] == "i03"
