"""`kvdepot bench fuzz` at the fleet's processes: the directory (`kvdepot directory`: registration
over HTTP and its KV-event ingest; bench/fuzz_directory.py) and the router (`kvdepot route`;
bench/fuzz_route.py), each a real process, while the pinger GETs its `/health`.

At the end the process must be alive, answer `/health`, and serve a real request (the
directory's listing with the admin token; a completion through the router); RSS at start and end.
A target that grows past `--max-rss-growth-mb` stops the storm there (`rss_exceeded`, not ok):
the fuzzer never takes the machine's memory with it.

State: none beyond one attack's (in its module).
Primitives: fleet_surface(args, surface) -> one JSON-able result.
"""

from __future__ import annotations

import argparse
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from bench.fuzz_directory import directory_target
from bench.fuzz_route import router_target
from bench.fuzz_watch import get_status


def fleet_surface(args: argparse.Namespace, surface: str) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="kvdepot-fuzz-") as tmp:
        result, proc, port = (directory_target if surface == "directory" else router_target)(args, Path(tmp))
        try:
            alive = result.pop("alive", None)
            if alive is None:
                alive = proc.poll() is None and get_status(port, "/health", 30) == 200
        finally:
            proc.terminate()
            try:
                exit_status: int | None = proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                exit_status = None
    elapsed = result.pop("elapsed_s")
    grown = result["rss_end_mb"] - result["rss_start_mb"]
    ok = alive and result["served"] and result["hangs"] == 0 and result["stalled_sockets"] == 0
    ok = ok and grown <= args.max_rss_growth_mb and not result["rss_exceeded"]
    return {"surface": surface, **result, "frames_per_s": round(result["frames_sent"] / elapsed, 1),
            "elapsed_s": round(elapsed, 2), "crashed": not alive, "exit": exit_status, "seed": args.seed,
            "ok": ok}  # fmt: skip
