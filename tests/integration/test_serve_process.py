"""`kvdepot serve` as a real process: flags honoured, graceful stop on signals, clean refusals."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest

from bench.sidecar import SidecarProcess
from tests.integration.conftest import StartSidecar
from tests.ports import free_port

SHM = Path("/dev/shm")


@dataclass
class Exited:
    returncode: int
    stdout: str
    stderr: str
    pid: int


def cli_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.upper().startswith("KVDEPOT_")}
    env["KVDEPOT_LOGGING__FORMAT"] = "json"
    return env


def run_serve(cwd: Path, *args: str) -> Exited:
    """Run `python -m app.cli serve ...` to completion (these runs are expected to be refused)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "app.cli", "serve", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=cli_env(),
        cwd=cwd,
    )
    try:
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return Exited(proc.returncode, out, err, proc.pid)


def assert_refused(result: Exited, *names: str) -> str:
    """Non-zero exit, exactly one stderr line naming every one of `names`, no traceback."""
    assert result.returncode == 2, result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    for name in names:
        assert name in lines[0]
    assert "Traceback" not in result.stdout + result.stderr
    return lines[0]


def signal_and_wait(sidecar: SidecarProcess, sig: signal.Signals, timeout: float = 5.0) -> int:
    sidecar.proc.send_signal(sig)
    try:
        returncode = sidecar.proc.wait(timeout)
    except subprocess.TimeoutExpired:
        pytest.fail(f"still running {timeout} s after {sig.name}:\n" + "\n".join(sidecar.lines[-20:]))
    sidecar.stop()  # already exited: only collects the rest of its output
    return returncode


def get(url: str) -> tuple[int, bytes]:
    with urllib.request.urlopen(url, timeout=5) as resp:
        return resp.status, resp.read()


def arenas_of(pid: int) -> list[Path]:
    return [p for p in SHM.glob("kvdepot-*") if p.name.endswith(f"-{pid}")]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_flags_honoured_and_signal_stops_cleanly(
    sidecar_factory: StartSidecar, tmp_path: Path, sig: signal.Signals
) -> None:
    port = free_port()
    data_dir = tmp_path / "data"
    sidecar = sidecar_factory("--http-port", str(port), data_dir=data_dir, l1_size_gb=0.02)

    assert sidecar.http == f"http://127.0.0.1:{port}"
    assert get(f"http://127.0.0.1:{port}/health") == (200, b"OK")
    assert (data_dir / "dataplane.sock").is_socket()
    assert sidecar.url == f"ipc://{data_dir.resolve()}/dataplane.sock"
    arena = SHM / sidecar.started["arena"]
    assert not arena.exists()  # the arena is a sealed memfd: clients get it over their lifeline

    assert signal_and_wait(sidecar, sig) == 0

    events = [json.loads(line) for line in sidecar.lines]  # every line is a JSON log line
    assert events[-1]["event"] == "kvdepot_stopped"
    assert {"event": "signal_received", "signal": sig.name}.items() <= next(
        e for e in events if e["event"] == "signal_received"
    ).items()
    assert not any(e.get("level") == "error" for e in events)
    assert not arena.exists()
    assert not (data_dir / "dataplane.sock").exists()


def test_negative_l1_size_is_refused(tmp_path: Path) -> None:
    result = run_serve(tmp_path, "--data-dir", str(tmp_path / "d"), "--http-port", "0", "--l1-size-gb", "-1")
    assert_refused(result, "l1.size_gb")


def test_port_in_use_is_refused_and_leaves_nothing_behind(tmp_path: Path) -> None:
    data_dir = tmp_path / "d"
    with socket.socket() as blocker:
        blocker.bind(("127.0.0.1", 0))
        blocker.listen()
        port = blocker.getsockname()[1]
        result = run_serve(
            tmp_path, "--data-dir", str(data_dir), "--http-port", str(port), "--l1-size-gb", "0.01"
        )
    assert_refused(result, "http.port", str(port))
    assert arenas_of(result.pid) == []
    assert not (data_dir / "dataplane.sock").exists()


def test_unknown_key_in_config_file_is_refused(tmp_path: Path) -> None:
    config = tmp_path / "kvdepot.toml"
    config.write_text("[l1]\nsize_gb = 0.01\nbogus_knob = 3\n")
    result = run_serve(
        tmp_path, "--config", str(config), "--data-dir", str(tmp_path / "d"), "--http-port", "0"
    )
    assert_refused(result, "l1.bogus_knob")


def test_second_sidecar_on_the_same_data_dir_is_refused(
    sidecar_factory: StartSidecar, tmp_path: Path
) -> None:
    data_dir = tmp_path / "shared"
    first = sidecar_factory(data_dir=data_dir, l1_size_gb=0.02)

    second = run_serve(tmp_path, "--data-dir", str(data_dir), "--http-port", "0", "--l1-size-gb", "0.02")
    line = assert_refused(second, "data_dir", str(first.proc.pid))
    assert "another kvdepot" in line

    # The first one is untouched: still ready, its socket and arena still there.
    assert get(first.http + "/ready")[0] == 200
    assert (data_dir / "dataplane.sock").is_socket()
    assert arenas_of(second.pid) == []


def test_a_running_sidecar_measures_its_event_loops_lag(sidecar_factory: StartSidecar) -> None:
    """`kvdepot_event_loop_lag_seconds` grows by a wake-up every 0.1 s, each in one bucket at most."""
    sc = sidecar_factory(l1_size_gb=0.01)
    first = sc.loop_lag()
    deadline = time.monotonic() + 30
    while (now := sc.loop_lag())["count"] < first["count"] + 3:
        assert time.monotonic() < deadline, now
        time.sleep(0.05)
    assert now["le_+Inf"] == now["count"] and now["sum"] >= 0
    assert now["le_0.001"] <= now["le_0.1"] <= now["le_+Inf"]
