"""What `kvdepot bench fuzz` watches while it attacks a surface: a pinger in its own process (so that
the fuzzer's work does not delay it) and the target's resident memory.

The pinger PINGs the data plane through the client library (`--url`) and/or GETs `/health`
(`--health`) every `--ping-interval-ms`, and times each answer; one not answered within
`--hang-s` is a hang. It prints "ready" after its first round, then, on SIGTERM, its figures as
one JSON line.

State: none between calls (the pinger's lists live in its own process).
Primitives: start_pinger(args, url, health) -> stop_pinger(proc) -> figures; pinger(args) (the
pinger process's body); rss_mb(pid); over_budget(args, pid, rss_start, i) (has the target grown
past --max-rss-growth-mb?); get_status(port, path, timeout, token) (a GET's status, 0 when unanswered);
percentile(samples, q).
"""

from __future__ import annotations

import argparse
import http.client
import json
import signal
import subprocess
import sys
import time
import urllib.parse
from pathlib import Path
from typing import Any


def percentile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else 0.0


def rss_mb(pid: int) -> float:
    """The resident set of process `pid`, in MiB (0 when it is gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return round(int(line.split()[1]) / 1024, 1)
    except OSError:
        pass
    return 0.0


class _Health:
    """GET /health on one kept-alive connection (a fresh one after any failure)."""

    def __init__(self, url: str, timeout_s: float) -> None:
        parsed = urllib.parse.urlsplit(url)
        self.host, self.port = parsed.hostname or "127.0.0.1", parsed.port or 80
        self.timeout_s = timeout_s
        self._conn: http.client.HTTPConnection | None = None

    def get(self) -> bool:
        try:
            if self._conn is None:
                self._conn = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout_s)
            self._conn.request("GET", "/health")
            resp = self._conn.getresponse()
            resp.read()
            return resp.status == 200
        except (OSError, http.client.HTTPException):
            if self._conn is not None:
                self._conn.close()
            self._conn = None
            return False


def _figures(name: str, latencies: list[float], hangs: int) -> dict[str, Any]:
    return {
        f"{name}s": len(latencies),
        f"{name}_p50_ms": round(percentile(latencies, 0.5) * 1000, 3),
        f"{name}_p99_ms": round(percentile(latencies, 0.99) * 1000, 3),
        f"{name}_max_ms": round(max(latencies, default=0.0) * 1000, 3),
        f"{name}_hangs": hangs,
    }


def pinger(args: argparse.Namespace) -> dict[str, Any]:
    """PING and/or GET /health until SIGTERM; print "ready" after the first round, then the figures."""
    from bench.fuzz import client_for
    from kvdepot_connector.errors import KVDepotClientError

    stop = False

    def on_term(*_: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, on_term)
    client = client_for(args.url, 16, args.hang_s, "fuzz-pinger", map_arena=False) if args.url else None
    health = _Health(args.health, args.hang_s) if args.health else None
    pings: list[float] = []
    checks: list[float] = []
    ping_hangs = health_hangs = 0
    interval = args.ping_interval_ms / 1000
    next_at = time.monotonic()
    first = True
    while not stop:
        if client is not None:
            start = time.perf_counter()
            try:
                client.ping()
            except KVDepotClientError:
                ping_hangs += 1
            pings.append(time.perf_counter() - start)
        if health is not None:
            start = time.perf_counter()
            if not health.get():
                health_hangs += 1
            checks.append(time.perf_counter() - start)
        if first:
            print("ready", flush=True)
            first = False
        next_at += interval
        time.sleep(max(0.0, next_at - time.monotonic()))
    if client is not None:
        client.close()
    out: dict[str, Any] = {"hangs": ping_hangs + health_hangs}
    if client is not None:
        out |= _figures("ping", pings, ping_hangs)
    if health is not None:
        out |= _figures("health", checks, health_hangs)
    return out


def start_pinger(args: argparse.Namespace, url: str | None, health: str | None) -> subprocess.Popen[str]:
    cmd = [sys.executable, "-m", "app.cli", "bench", "fuzz", "--pinger",
           "--hang-s", str(args.hang_s), "--ping-interval-ms", str(args.ping_interval_ms)]  # fmt: skip
    if url is not None:
        cmd += ["--url", url]
    if health is not None:
        cmd += ["--health", health]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    if proc.stdout.readline().strip() != "ready":
        proc.kill()
        raise RuntimeError("the pinger did not start")
    return proc


def stop_pinger(proc: subprocess.Popen[str]) -> dict[str, Any]:
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=60)
    result: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
    return result


def over_budget(args: argparse.Namespace, pid: int, rss_start: float, i: int) -> bool:
    """Every 256 frames: has the target grown past --max-rss-growth-mb? (The storm stops there.)"""
    return i % 256 == 255 and rss_mb(pid) - rss_start > args.max_rss_growth_mb


def get_status(port: int, path: str, timeout: float, token: str | None = None) -> int:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("GET", path, headers={"Authorization": f"Bearer {token}"} if token else {})
        resp = conn.getresponse()
        resp.read()
        return resp.status
    except (OSError, http.client.HTTPException):
        return 0
    finally:
        conn.close()
