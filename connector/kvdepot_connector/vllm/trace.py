"""A per-request timeline of the connector's work, for finding where a slow request's time went.

Off unless `kvdepot_trace_dir` (kv_connector_extra_config) names a directory: then each vLLM
process that runs the connector (the scheduler, each worker) appends JSON lines to
`<dir>/<side>-<pid>.jsonl`, one per event, with wall-clock `t` (seconds, so the processes' lines
merge into one timeline), the event, the request id where there is one, and `ms`, the time spent
in the connector on it:

  scheduler  lookup (every get_num_new_matched_tokens: `n` tokens answered, null while chunks
             arrive from L2), alloc (`external` tokens to load), step (build_connector_meta: the
             requests new this step, how many run, the tokens scheduled, loads and chunks to
             save planned), finished (`held`: its blocks are kept for a decode save)
  worker     step_start (start_load_kv: the forward begins), load (chunks copied in), step_end
             (wait_for_save: the forward is done), save (chunks stored)

`tests/e2e/trace_timeline.py` turns the files into per-request timelines. Lines are buffered and
written every 64 events and at exit; when off, each hook pays one attribute test.
"""

from __future__ import annotations

import atexit
import json
import os
import time
from pathlib import Path
from typing import Any


class Trace:
    def __init__(self, side: str, where: str = "") -> None:
        self.enabled = bool(where)
        self._lines: list[str] = []
        self._path: Path | None = None
        if self.enabled:
            Path(where).mkdir(parents=True, exist_ok=True)
            self._path = Path(where) / f"{side}-{os.getpid()}.jsonl"
            atexit.register(self.flush)

    def event(self, ev: str, rid: str = "", started: float | None = None, **fields: Any) -> None:
        """Record `ev`; `started` (a time.perf_counter() value) adds the milliseconds since."""
        if not self.enabled:
            return
        row: dict[str, Any] = {"t": round(time.time(), 6), "ev": ev}
        if rid:
            row["rid"] = rid
        if started is not None:
            row["ms"] = round((time.perf_counter() - started) * 1000, 3)
        row.update(fields)
        self._lines.append(json.dumps(row))
        if len(self._lines) >= 64:
            self.flush()

    def flush(self) -> None:
        if not self._lines or self._path is None:
            return
        with open(self._path, "a", encoding="utf-8") as f:
            f.write("\n".join(self._lines) + "\n")
        self._lines = []
