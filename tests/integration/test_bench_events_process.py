"""`kvdepot bench events` as a user runs it, at tiny sizes: one JSON object on stdout in the
documented shape, and the flood's figures exact (no dispatcher: the queue holds its capacity, the
rest is dropped and counted). Timings are not judged here."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any


def bench_events(*argv: str) -> tuple[int, dict[str, Any]]:
    env = {k: v for k, v in os.environ.items() if not k.upper().startswith("KVDEPOT_")}
    done = subprocess.run(
        [sys.executable, "-m", "app.cli", "bench", "events", *argv],
        capture_output=True, text=True, env=env, timeout=120, check=False,
    )  # fmt: skip
    lines = done.stdout.strip().splitlines()
    assert len(lines) == 1, (done.stdout, done.stderr[-2000:])
    got: dict[str, Any] = json.loads(lines[0])
    return done.returncode, got


def test_bench_events_prints_both_engines_and_an_exact_flood() -> None:
    status, got = bench_events(
        "--cycles", "60", "--rounds", "2", "--chunks", "2", "--flood", "1000", "--capacity", "300",
        "--arena-mb", "1",
    )  # fmt: skip
    assert status == 0 and got["ok"] is True
    assert got["cycles"] == 60 and got["chunks_per_cycle"] == 2
    for side in ("enabled", "disabled"):
        assert {"p50_us", "p99_us", "total_s"} <= set(got[side])
    assert {"ratio_p50", "ratio_p99", "ratio_total"} <= set(got)
    # every cycle announces its 2 stored chunks and its lookup (more once L1 evicts), all delivered
    assert got["enabled"]["events"] >= 60 * 3
    assert got["enabled"]["delivered"] == got["enabled"]["events"] and got["enabled"]["dropped"] == 0
    flood = got["flood"]
    assert (flood["attempted"], flood["capacity"]) == (1000, 300)
    assert flood["queued"] == flood["published"] == 300
    assert flood["dropped"] == flood["expected_dropped"] == 700
    assert flood["max_publish_ns"] > 0 and flood["baseline_max_ns"] > 0
    assert flood["full_queue_engine_dropped"] == got["enabled"]["events"]
