"""`kvdepot bench footprint`: the sidecar's own memory and start-up time, one JSON object.

Each run starts `kvdepot serve` as a process on the default settings (disk L2 in a fresh data dir)
with an `--l1-size-gb` arena (default 1 GiB) and measures:
- `ready_s`: from just before the process is spawned to the first `GET /ready` that answers 200
  (polled every 5 ms), interpreter start and imports included;
- `idle_mb`: the resident memory beyond the arena, `--settle-s` after ready;
- `load_mb`: the largest such figure sampled (every 20 ms) while a `bench server` client stores,
  looks up and retrieves `--requests` x `--chunks-per-request` chunks through the data plane (the
  default settings write them behind to the disk tier meanwhile), and right after it.
Resident memory beyond the arena is VmRSS (/proc/PID/status) minus the Rss of the arena's mapping
(the `/memfd:kvdepot-*` entry of /proc/PID/smaps): the interpreter, libraries, heap and buffers.
`anon_mb` (RssAnon) is given beside it. `torch` says whether the sidecar mapped libtorch
(/proc/PID/maps). Figures are per run and their median; this machine is shared, so no ratio here
has a baseline: compare runs of the same command.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

MB = 1 << 20


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--l1-size-gb", type=float, default=1.0)
    p.add_argument("--settle-s", type=float, default=1.0, help="wait after ready before the idle figure")
    p.add_argument("--requests", type=int, default=2, help="bench server requests under load")
    p.add_argument("--chunks-per-request", type=int, default=8)
    p.add_argument("--lookups", type=int, default=500)


def _status_kb(pid: int, field: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def _arena_rss_kb(pid: int) -> int:
    """Rss of the arena's mapping(s) in the process."""
    total = 0
    in_arena = False
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            first = line.split(maxsplit=1)[0]
            if not first.endswith(":"):  # a mapping's header line
                in_arena = "/memfd:kvdepot-" in line
            elif in_arena and first == "Rss:":
                total += int(line.split()[1])
    return total


def beyond_arena_mb(pid: int) -> tuple[float, float]:
    """(VmRSS minus the arena's Rss, RssAnon), in MiB."""
    rss = _status_kb(pid, "VmRSS") - _arena_rss_kb(pid)
    return round(rss / 1024, 1), round(_status_kb(pid, "RssAnon") / 1024, 1)


def maps_torch(pid: int) -> bool:
    with open(f"/proc/{pid}/maps") as f:
        return any("libtorch" in line for line in f)


def _ready_after(proc: subprocess.Popen[str], started: threading.Event, info: dict[str, Any]) -> None:
    """Wait for the `kvdepot_started` line (it names the HTTP address), then poll /ready."""
    if not started.wait(60) or "http" not in info:
        raise RuntimeError("the sidecar did not start")
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(str(info["http"]) + "/ready", timeout=1) as resp:
                if resp.status == 200:
                    return
        except OSError:
            pass
        if proc.poll() is not None:
            raise RuntimeError("the sidecar exited")
        time.sleep(0.005)
    raise RuntimeError("the sidecar never became ready")


def _spawn(data_dir: Path, size_gb: float) -> tuple[subprocess.Popen[str], dict[str, Any], float]:
    """A `kvdepot serve` process on the default settings, ready; its start line and seconds to ready."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVDEPOT_")}
    env["KVDEPOT_LOGGING__FORMAT"] = "json"
    cmd = [sys.executable, "-m", "app.cli", "serve", "--http-port", "0", "--data-dir", str(data_dir),
           "--l1-size-gb", str(size_gb)]  # fmt: skip
    info: dict[str, Any] = {}
    started = threading.Event()
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)

    def drain() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            if '"kvdepot_started"' in line and not started.is_set():
                info.update(json.loads(line))
                started.set()
        started.set()

    threading.Thread(target=drain, daemon=True).start()
    try:
        _ready_after(proc, started, info)
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    return proc, info, time.perf_counter() - t0


def _load(args: argparse.Namespace, url: str, pid: int) -> tuple[float, bool]:
    """Run a `bench server` client against the sidecar; the largest beyond-arena RSS seen meanwhile,
    and whether the client's run was ok."""
    cmd = [sys.executable, "-m", "app.cli", "bench", "server", "--url", url,
           "--requests", str(args.requests), "--chunks-per-request", str(args.chunks_per_request),
           "--lookups", str(args.lookups)]  # fmt: skip
    client = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    peak = 0.0
    while client.poll() is None:
        peak = max(peak, beyond_arena_mb(pid)[0])
        time.sleep(0.02)
    out, err = client.communicate()
    peak = max(peak, beyond_arena_mb(pid)[0])
    if client.returncode != 0:
        print(err, file=sys.stderr)
        return peak, False
    return peak, bool(json.loads(out.strip().splitlines()[-1])["ok"])


def one_run(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="kvdepot-footprint-") as tmp:
        proc, info, ready_s = _spawn(Path(tmp) / "data", args.l1_size_gb)
        try:
            time.sleep(args.settle_s)
            idle, anon_idle = beyond_arena_mb(proc.pid)
            torch_idle = maps_torch(proc.pid)
            load, ok = _load(args, str(info["data_plane"]), proc.pid)
            time.sleep(args.settle_s)
            after, anon_after = beyond_arena_mb(proc.pid)
            torch_after = maps_torch(proc.pid)
        finally:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    return {
        "ready_s": round(ready_s, 3), "idle_mb": idle, "idle_anon_mb": anon_idle, "load_mb": load,
        "after_load_mb": after, "after_load_anon_mb": anon_after, "torch": torch_idle or torch_after,
        "ok": ok,
    }  # fmt: skip


def run(args: argparse.Namespace) -> int:
    runs = [one_run(args) for _ in range(args.runs)]
    result: dict[str, Any] = {
        name: statistics.median(r[name] for r in runs) for name in ("ready_s", "idle_mb", "load_mb")
    }
    result.update(
        l1_size_gb=args.l1_size_gb, runs=runs, torch=any(r["torch"] for r in runs),
        load_chunks=args.requests * args.chunks_per_request, ok=all(r["ok"] for r in runs),
        rss="VmRSS minus the Rss of the arena's mapping (/proc/PID/smaps)",
    )  # fmt: skip
    print(json.dumps(result))
    return 0 if result["ok"] else 1
