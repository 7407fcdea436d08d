"""Start a `kvdepot serve` subprocess and wait until it is ready (used by benchmarks and tests).

The sidecar logs JSON lines; the `kvdepot_started` line carries the HTTP address and the data-plane
URL, so port 0 works. Stdout is drained by a thread into `lines` so the child never blocks.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Mapping
from pathlib import Path
from typing import Any


class SidecarProcess:
    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.proc = proc
        self.lines: list[str] = []
        self.started: dict[str, Any] = {}
        self._ready = threading.Event()
        self._reader = threading.Thread(target=self._drain, daemon=True)
        self._reader.start()

    def _drain(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))
            if '"kvdepot_started"' in line and not self._ready.is_set():
                self.started = json.loads(line)
                self._ready.set()
        self._ready.set()

    @property
    def http(self) -> str:
        return str(self.started["http"])

    @property
    def url(self) -> str:
        return str(self.started["data_plane"])

    def wait_ready(self, timeout: float = 60.0) -> None:
        if not self._ready.wait(timeout) or not self.started:
            self.kill()
            raise RuntimeError("sidecar did not start:\n" + "\n".join(self.lines[-30:]))
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(self.http + "/ready", timeout=1) as resp:
                    if resp.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.05)
        raise RuntimeError("sidecar never became ready")

    def get_json(self, path: str, timeout: float = 30) -> Any:
        """GET `path`, JSON. The 30 s default is for a sidecar on a loaded machine (a CI run's
        suites beside it): a test polls /status for what it waits for, and a slow answer is not
        what it asserts."""
        with urllib.request.urlopen(self.http + path, timeout=timeout) as resp:
            return json.loads(resp.read())

    def dataplane_ops(self) -> dict[str, tuple[float, float]]:
        """Per data-plane operation so far: (calls, seconds the sidecar spent handling them), from
        the `kvdepot_dataplane_request_seconds` histogram of its /metrics."""
        with urllib.request.urlopen(self.http + "/metrics", timeout=10) as resp:
            text = resp.read().decode()
        ops: dict[str, list[float]] = {}
        for line in text.splitlines():
            for suffix, i in (("_count{", 0), ("_sum{", 1)):
                head = "kvdepot_dataplane_request_seconds" + suffix
                if line.startswith(head):
                    op = line[len(head) :].split('"')[1]
                    ops.setdefault(op, [0.0, 0.0])[i] = float(line.rsplit(" ", 1)[1])
        return {op: (n, secs) for op, (n, secs) in ops.items()}

    def loop_lag(self) -> dict[str, float]:
        """The sidecar's `kvdepot_event_loop_lag_seconds` so far: wake-ups (`count`), their summed
        lag in seconds (`sum`), and per bucket bound B the wake-ups at most B late (`le_B`)."""
        with urllib.request.urlopen(self.http + "/metrics", timeout=10) as resp:
            text = resp.read().decode()
        out: dict[str, float] = {}
        head = "kvdepot_event_loop_lag_seconds"
        for line in text.splitlines():
            if line.startswith(head + "_bucket{"):
                out["le_" + line.split('le="')[1].split('"')[0]] = float(line.rsplit(" ", 1)[1])
            elif line.startswith((head + "_count ", head + "_sum ")):
                out[line.split(" ")[0][len(head) + 1 :]] = float(line.rsplit(" ", 1)[1])
        return out

    def stop(self, timeout: float = 20.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        finally:
            self.kill()
            self._reader.join(timeout=2)
            if self.proc.stdout is not None:
                self.proc.stdout.close()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


def ops_delta(
    before: Mapping[str, tuple[float, float]], after: Mapping[str, tuple[float, float]]
) -> dict[str, dict[str, float]]:
    """What `dataplane_ops` grew by between two readings: per operation called in between, its
    calls and the mean milliseconds the sidecar spent on one."""
    out = {}
    for op, (n, secs) in after.items():
        n0, s0 = before.get(op, (0.0, 0.0))
        if n > n0:
            out[op] = {"calls": int(n - n0), "mean_ms": round((secs - s0) / (n - n0) * 1000, 3)}
    return out


def start_sidecar(
    data_dir: Path,
    *args: str,
    env: Mapping[str, str] | None = None,
    wait: bool = True,
    l1_size_gb: float = 0.25,
) -> SidecarProcess:
    full_env = dict(os.environ)
    full_env.update(env or {})
    full_env.setdefault("KVDEPOT_LOGGING__FORMAT", "json")
    cmd = [
        sys.executable, "-m", "app.cli", "serve", "--http-port", "0", "--data-dir", str(data_dir),
        "--l1-size-gb", str(l1_size_gb), *args,
    ]  # fmt: skip
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=full_env, bufsize=1
    )
    sidecar = SidecarProcess(proc)
    if wait:
        sidecar.wait_ready()
    return sidecar


def stop_process(proc: subprocess.Popen[Any], grace_s: float = 10.0) -> None:
    """SIGTERM `proc`, and SIGKILL it when it has not exited within `grace_s`."""
    proc.terminate()
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
